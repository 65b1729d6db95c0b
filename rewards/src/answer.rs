//! Answer scores of one prediction against its reference answers: EM, SM and token F1.
//!
//! All three compare normalised text ([`normalize_answer`]) and take the maximum over the
//! references. A prediction whose normal form is empty (blank, or only punctuation and
//! articles) scores 0 on all three. This differs from the reference evaluation script, which
//! counts an empty prediction as a substring match of every reference (and, when the
//! reference is empty too, as an exact match with F1 1.0). SM otherwise follows that script:
//! either normalised string may contain the other.

use std::collections::HashMap;

use serde::Serialize;

use crate::normalize::{answer_tokens, normalize_answer};

/// EM, SM and F1 of one prediction, each in `[0, 1]`, maximised over the references.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct AnswerScores {
    /// Exact match: the normalised prediction equals a normalised reference.
    pub em: f64,
    /// Substring match, both ways: a non-empty normalised reference occurs in the normalised
    /// prediction, or the prediction occurs in the reference.
    pub sm: f64,
    /// Token F1 with multiset overlap (SQuAD).
    pub f1: f64,
}

impl AnswerScores {
    /// Scores `prediction` against every reference and keeps the best of each metric.
    pub fn best<S: AsRef<str>>(prediction: &str, references: &[S]) -> Self {
        let normal = normalize_answer(prediction);
        if normal.is_empty() {
            return Self::default();
        }
        let tokens = answer_tokens(prediction);
        references
            .iter()
            .map(|reference| Self::against(&normal, &tokens, reference.as_ref()))
            .fold(Self::default(), |best, s| Self {
                em: best.em.max(s.em),
                sm: best.sm.max(s.sm),
                f1: best.f1.max(s.f1),
            })
    }

    /// Scores a non-empty normalised prediction against one reference.
    fn against(normal: &str, tokens: &[String], reference: &str) -> Self {
        let reference_normal = normalize_answer(reference);
        let em = normal == reference_normal;
        let sm = !reference_normal.is_empty()
            && (normal.contains(&reference_normal) || reference_normal.contains(normal));
        Self {
            em: indicator(em),
            sm: indicator(sm),
            f1: token_f1(tokens, &answer_tokens(reference)),
        }
    }
}

fn indicator(holds: bool) -> f64 {
    if holds {
        1.0
    } else {
        0.0
    }
}

/// Maximum token F1 of `prediction` over `references` (the answer reward).
pub fn f1_score<S: AsRef<str>>(prediction: &str, references: &[S]) -> f64 {
    AnswerScores::best(prediction, references).f1
}

/// Token F1 of two token lists with multiset overlap; 0 when either is empty.
fn token_f1(prediction: &[String], reference: &[String]) -> f64 {
    let mut available: HashMap<&str, usize> = HashMap::new();
    for token in reference {
        *available.entry(token.as_str()).or_default() += 1;
    }
    let mut common = 0usize;
    for token in prediction {
        if let Some(count) = available.get_mut(token.as_str()) {
            if *count > 0 {
                *count -= 1;
                common += 1;
            }
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / prediction.len() as f64;
    let recall = common as f64 / reference.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(prediction: &str, references: &[&str]) -> AnswerScores {
        AnswerScores::best(prediction, references)
    }

    #[test]
    fn exact_after_normalisation() {
        let s = scores("The J. Cole!", &["J. Cole"]);
        assert_eq!((s.em, s.sm, s.f1), (1.0, 1.0, 1.0));
    }

    #[test]
    fn partial_overlap_f1_by_hand() {
        // prediction tokens [paris, france] (2), reference [paris] (1): common 1,
        // precision 1/2, recall 1/1, F1 = 2·0.5·1/(0.5+1) = 2/3.
        let s = scores("Paris, France", &["Paris"]);
        assert_eq!(s.em, 0.0);
        assert_eq!(s.sm, 1.0);
        assert!((s.f1 - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn multiset_overlap_counts_repeats_once_each() {
        // prediction [x, x, y] (3), reference [x, y, y] (3): common min(2,1)+min(1,2) = 2,
        // precision 2/3, recall 2/3, F1 = 2/3.
        let s = scores("x x y", &["x y y"]);
        assert!((s.f1 - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.em, 0.0);
        assert_eq!(s.sm, 0.0);
    }

    #[test]
    fn best_over_references() {
        // First reference: no overlap. Second: [new, york, city] vs [new, york]: common 2,
        // precision 2/2, recall 2/3, F1 = 2·1·(2/3)/(1+2/3) = 0.8.
        let s = scores("New York", &["Troy", "New York City"]);
        assert!((s.f1 - 0.8).abs() < 1e-12);
        assert_eq!(s.em, 0.0);
        // "new york" is contained in "new york city": a substring match the other way round.
        assert_eq!(s.sm, 1.0);
        let s = scores("troy", &["Troy", "New York City"]);
        assert_eq!((s.em, s.sm, s.f1), (1.0, 1.0, 1.0));
    }

    #[test]
    fn substring_match_goes_both_ways() {
        // Reference inside prediction: "paris" ⊂ "paris france".
        assert_eq!(scores("Paris, France", &["Paris"]).sm, 1.0);
        // Prediction inside reference: "york" ⊂ "new york city"; EM 0, F1 = 2·1·(1/3)/(1+1/3) = 0.5.
        let s = scores("York", &["New York City"]);
        assert_eq!((s.em, s.sm), (0.0, 1.0));
        assert!((s.f1 - 0.5).abs() < 1e-12);
        // Neither inside the other.
        assert_eq!(scores("Lyon", &["Paris"]).sm, 0.0);
        // Characters, not tokens: "96" ⊂ "1964" either way round.
        assert_eq!(scores("96", &["1964"]).sm, 1.0);
    }

    #[test]
    fn numbers_compare_as_text() {
        assert_eq!(scores("27,629", &["27629"]).em, 1.0);
        // Character substring: "1964" contains "96".
        assert_eq!(scores("1964", &["96"]).sm, 1.0);
        assert_eq!(scores("1964", &["96"]).f1, 0.0);
        assert_eq!(scores("3.0", &["3"]).em, 0.0);
        // "3.0" normalises to "30".
        assert_eq!(scores("3.0", &["30"]).em, 1.0);
    }

    #[test]
    fn unicode_answers() {
        let s = scores("Ça Va", &["ça va"]);
        assert_eq!((s.em, s.sm, s.f1), (1.0, 1.0, 1.0));
        // [北京, 大学] vs [北京]: precision 1/2, recall 1, F1 = 2/3.
        let s = scores("北京 大学", &["北京"]);
        assert!((s.f1 - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.sm, 1.0);
    }

    #[test]
    fn empty_prediction_scores_zero_everywhere() {
        for prediction in ["", "   ", "?!", "the"] {
            assert_eq!(
                scores(prediction, &["", "the", "x"]),
                AnswerScores::default()
            );
        }
    }

    #[test]
    fn empty_reference_matches_nothing() {
        let s = scores("anything", &["", "a"]);
        assert_eq!(s, AnswerScores::default());
        assert_eq!(scores("x", &[] as &[&str]), AnswerScores::default());
    }

    #[test]
    fn f1_score_is_the_f1_field() {
        assert_eq!(f1_score("the cat", &["cat"]), 1.0);
        assert_eq!(f1_score("dog", &["cat"]), 0.0);
    }
}

//! The format terms of each turn, exactly as the reference's `compute_score_format`.
//!
//! - A non-final turn earns [`FormatTerm::WellFormedCall`] when it holds exactly one each of
//!   `<think>`, `</think>`, `<interaction_prompt>`, `</interaction_prompt>`, starts with
//!   `<think>`, has only whitespace between `</think>` and `<interaction_prompt>`, and ends with
//!   `</interaction_prompt>` (one trailing newline allowed, as Python's `$`).
//! - The final turn earns [`FormatTerm::AnswerTag`] and [`FormatTerm::AnswerNonEmpty`] when its
//!   first `<answer>…</answer>` has non-blank content (in the reference both conditions are the
//!   same test, so they fire together), and, only then, [`FormatTerm::ThinkAnswerLayout`] when
//!   the turn starts with `<think>`, has `</think>` then `<answer>`, and ends with `</answer>`
//!   (one trailing newline allowed); any text may sit between `</think>` and `<answer>`.

use chat::tags::{ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN};
use serde::Serialize;

use crate::config::RewardConfig;
use crate::episode::extract_answer;
use crate::normalize::is_py_space;

/// One term of the format score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FormatTerm {
    /// A non-final turn that is exactly a think block and an interaction prompt.
    WellFormedCall,
    /// The final turn has an `<answer>` with non-blank content.
    AnswerTag,
    /// The final answer is non-empty after stripping.
    AnswerNonEmpty,
    /// The final turn is exactly `<think>…</think>…<answer>…</answer>`.
    ThinkAnswerLayout,
}

impl FormatTerm {
    /// The term's name, as serialised: `well_formed_call`, `answer_tag`, …
    pub fn name(self) -> &'static str {
        match self {
            Self::WellFormedCall => "well_formed_call",
            Self::AnswerTag => "answer_tag",
            Self::AnswerNonEmpty => "answer_non_empty",
            Self::ThinkAnswerLayout => "think_answer_layout",
        }
    }

    /// What this term adds to the format score under `config`.
    pub fn value(self, config: &RewardConfig) -> f64 {
        match self {
            Self::WellFormedCall => config.call_turn,
            Self::AnswerTag => config.answer_tag,
            Self::AnswerNonEmpty => config.answer_non_empty,
            Self::ThinkAnswerLayout => config.think_answer_layout,
        }
    }
}

/// Whether a turn was scored as an intermediate (call) turn or as the final turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnRole {
    /// Any turn but the last: only [`FormatTerm::WellFormedCall`] can fire.
    Call,
    /// The last turn: the answer terms can fire.
    Final,
}

impl TurnRole {
    /// The role's name, as serialised: `call` or `final`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Call => "call",
            Self::Final => "final",
        }
    }
}

/// The format terms that fired on one turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnFormat {
    /// How the turn was scored.
    pub role: TurnRole,
    /// The terms that fired, in the order the reference adds them.
    pub terms: Vec<FormatTerm>,
}

impl TurnFormat {
    /// Scores `turn` in the given role.
    pub fn of(turn: &str, role: TurnRole) -> Self {
        let terms = match role {
            TurnRole::Call => {
                if is_well_formed_call(turn) {
                    vec![FormatTerm::WellFormedCall]
                } else {
                    Vec::new()
                }
            }
            TurnRole::Final => final_turn_terms(turn),
        };
        Self { role, terms }
    }
}

/// The text Python's `$` lets a match end at: the whole turn, or the turn minus one final `\n`.
fn before_final_newline(turn: &str) -> &str {
    turn.strip_suffix('\n').unwrap_or(turn)
}

/// The reference's count check plus
/// `^<think>(.*?)</think>(\s*)<interaction_prompt>(.*?)</interaction_prompt>$`.
fn is_well_formed_call(turn: &str) -> bool {
    let once = |tag: &str| turn.matches(tag).count() == 1;
    if !(once(THINK_OPEN) && once(THINK_CLOSE) && once(CALL_OPEN) && once(CALL_CLOSE)) {
        return false;
    }
    let body = before_final_newline(turn);
    if !body.starts_with(THINK_OPEN) || !body.ends_with(CALL_CLOSE) {
        return false;
    }
    let (Some(think_close), Some(prompt_open)) = (body.find(THINK_CLOSE), body.find(CALL_OPEN))
    else {
        return false;
    };
    let between_start = think_close + THINK_CLOSE.len();
    think_close >= THINK_OPEN.len()
        && prompt_open >= between_start
        && body[between_start..prompt_open].chars().all(is_py_space)
        && prompt_open + CALL_OPEN.len() <= body.len() - CALL_CLOSE.len()
}

/// The reference's `^<think>(.*?)</think>(.*?)<answer>(.*?)</answer>$` with DOTALL.
fn is_think_answer_layout(turn: &str) -> bool {
    let body = before_final_newline(turn);
    if !body.starts_with(THINK_OPEN) || !body.ends_with(ANSWER_CLOSE) {
        return false;
    }
    let last_close = body.len() - ANSWER_CLOSE.len();
    let Some(think_close) = find_from(body, THINK_CLOSE, THINK_OPEN.len()) else {
        return false;
    };
    let Some(answer_open) = find_from(body, ANSWER_OPEN, think_close + THINK_CLOSE.len()) else {
        return false;
    };
    answer_open + ANSWER_OPEN.len() <= last_close
}

fn find_from(text: &str, needle: &str, from: usize) -> Option<usize> {
    text.get(from..)?.find(needle).map(|i| i + from)
}

fn final_turn_terms(turn: &str) -> Vec<FormatTerm> {
    if extract_answer(turn).is_none() {
        return Vec::new();
    }
    let mut terms = vec![FormatTerm::AnswerTag, FormatTerm::AnswerNonEmpty];
    if is_think_answer_layout(turn) {
        terms.push(FormatTerm::ThinkAnswerLayout);
    }
    terms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(turn: &str) -> bool {
        is_well_formed_call(turn)
    }

    #[test]
    fn well_formed_calls() {
        assert!(call(
            "<think>a</think><interaction_prompt>p</interaction_prompt>"
        ));
        assert!(call("<think>\na\n</think>\n\n <interaction_prompt>{\"name\": \"prompt\"}</interaction_prompt>"));
        assert!(call(
            "<think></think><interaction_prompt></interaction_prompt>\n"
        ));
    }

    #[test]
    fn malformed_calls() {
        // Leading whitespace: `^<think>` fails.
        assert!(!call(
            " <think>a</think><interaction_prompt>p</interaction_prompt>"
        ));
        // Two trailing newlines: `$` allows only one.
        assert!(!call(
            "<think>a</think><interaction_prompt>p</interaction_prompt>\n\n"
        ));
        // Text between the tags.
        assert!(!call(
            "<think>a</think>so<interaction_prompt>p</interaction_prompt>"
        ));
        // Text after the prompt.
        assert!(!call(
            "<think>a</think><interaction_prompt>p</interaction_prompt>ok"
        ));
        // Missing </think>.
        assert!(!call("<think>a<interaction_prompt>p</interaction_prompt>"));
        // A second think block.
        assert!(!call(
            "<think>a</think><think>b</think><interaction_prompt>p</interaction_prompt>"
        ));
        // Tags in the wrong order.
        assert!(!call(
            "<think></interaction_prompt></think><interaction_prompt>"
        ));
        assert!(!call(
            "<think>a</think></interaction_prompt><interaction_prompt>"
        ));
    }

    #[test]
    fn layout_allows_text_between_think_and_answer_only() {
        assert!(is_think_answer_layout("<think>a</think><answer>x</answer>"));
        assert!(is_think_answer_layout(
            "<think>a</think>\nso: <answer>x</answer>\n"
        ));
        assert!(is_think_answer_layout(
            "<think>a</think><answer>x</answer>y<answer>z</answer>"
        ));
        assert!(!is_think_answer_layout(
            "<think>a</think><answer>x</answer> trailing"
        ));
        assert!(!is_think_answer_layout(
            "pre <think>a</think><answer>x</answer>"
        ));
        assert!(!is_think_answer_layout("<think>a<answer>x</answer>"));
        assert!(!is_think_answer_layout("<think>a</think></answer>"));
    }

    #[test]
    fn final_terms_need_a_non_blank_answer() {
        let full = TurnFormat::of("<think>a</think><answer>x</answer>", TurnRole::Final);
        assert_eq!(
            full.terms,
            vec![
                FormatTerm::AnswerTag,
                FormatTerm::AnswerNonEmpty,
                FormatTerm::ThinkAnswerLayout
            ]
        );
        let blank = TurnFormat::of("<think>a</think><answer> </answer>", TurnRole::Final);
        assert!(blank.terms.is_empty());
        let no_think = TurnFormat::of("<answer>x</answer>", TurnRole::Final);
        assert_eq!(
            no_think.terms,
            vec![FormatTerm::AnswerTag, FormatTerm::AnswerNonEmpty]
        );
    }

    #[test]
    fn names_match_the_serialised_form() {
        for term in [
            FormatTerm::WellFormedCall,
            FormatTerm::AnswerTag,
            FormatTerm::AnswerNonEmpty,
            FormatTerm::ThinkAnswerLayout,
        ] {
            assert_eq!(serde_json::to_value(term).unwrap(), term.name());
        }
        for role in [TurnRole::Call, TurnRole::Final] {
            assert_eq!(serde_json::to_value(role).unwrap(), role.name());
        }
    }

    #[test]
    fn a_call_scored_as_final_earns_nothing() {
        let turn = "<think>a</think><interaction_prompt>p</interaction_prompt>";
        assert!(TurnFormat::of(turn, TurnRole::Final).terms.is_empty());
        assert_eq!(
            TurnFormat::of(turn, TurnRole::Call).terms,
            vec![FormatTerm::WellFormedCall]
        );
    }
}

//! The double-constrained reward of one episode, with its breakdown.

use serde::Serialize;

use crate::answer::AnswerScores;
use crate::config::RewardConfig;
use crate::episode::{agent_turns, extract_answer};
use crate::format::{TurnFormat, TurnRole};

/// How far the capped format score may sit from the gate and still pass it: rounding only, so
/// that constants whose decimal sum is the gate (0.3 + 0.3 + 0.3 + 0.1) reach it. The reference's
/// constants reach it exactly, and no sum of theirs lies this close to 1.0 without being it.
pub const GATE_TOLERANCE: f64 = 1e-9;

/// Everything the reward of one episode is made of.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RewardBreakdown {
    /// The terms that fired on each agent turn, in turn order.
    pub turns: Vec<TurnFormat>,
    /// Sum of the format terms, before the cap.
    pub format_raw: f64,
    /// The format score after the cap.
    pub format: f64,
    /// Whether the capped format score equals the gate (up to [`GATE_TOLERANCE`]), so that the
    /// answer counts.
    pub gate_passed: bool,
    /// The final answer read from the last turn, when it has a non-blank `<answer>`.
    pub answer: Option<String>,
    /// Token F1 of the answer, max over the references (0 without an answer).
    pub f1: f64,
    /// Exact match of the answer, max over the references (0 without an answer).
    pub em: f64,
    /// The reward: `format − 1 + F1` when the gate is passed, else `format − 1`.
    pub reward: f64,
}

impl RewardBreakdown {
    /// Scores an episode given as the agent's turn texts, the final (answer) turn last.
    ///
    /// A turn after an environment reply must include the `<think>\n` the environment put
    /// in the context; a last turn cut by the token limit counts as the final turn, and an
    /// episode that stopped right after a reply has a final turn of just that `<think>\n`
    /// (as [`agent_turns`] reads the decoded text). No turns scores a format of 0 and a
    /// reward of −1.
    pub fn from_turns<T: AsRef<str>, A: AsRef<str>>(
        turns: &[T],
        references: &[A],
        config: &RewardConfig,
    ) -> Self {
        let count = turns.len();
        let formats: Vec<TurnFormat> = turns
            .iter()
            .enumerate()
            .map(|(i, turn)| {
                let role = if i + 1 == count {
                    TurnRole::Final
                } else {
                    TurnRole::Call
                };
                TurnFormat::of(turn.as_ref(), role)
            })
            .collect();
        // Summed in the reference's order (calls, then the final terms) so that the float
        // result, which the gate compares exactly, is the same.
        let format_raw = formats
            .iter()
            .flat_map(|turn| &turn.terms)
            .fold(0.0, |sum, term| sum + term.value(config));
        let format = format_raw.min(config.cap);
        let answer = turns
            .last()
            .and_then(|turn| extract_answer(turn.as_ref()))
            .map(str::to_owned);
        let scores = answer
            .as_deref()
            .map(|answer| AnswerScores::best(answer, references))
            .unwrap_or_default();
        let gate_passed = (format - config.gate).abs() <= GATE_TOLERANCE;
        let reward = if gate_passed {
            -1.0 + format + scores.f1
        } else {
            -1.0 + format
        };
        Self {
            turns: formats,
            format_raw,
            format,
            gate_passed,
            answer,
            f1: scores.f1,
            em: scores.em,
            reward,
        }
    }

    /// Scores a decoded episode text (special tokens kept): its turns are the
    /// `<|im_start|>assistant\n … <|im_end|>` blocks, a last one without `<|im_end|>` included
    /// (see [`agent_turns`]).
    pub fn from_text<A: AsRef<str>>(
        episode_text: &str,
        references: &[A],
        config: &RewardConfig,
    ) -> Self {
        Self::from_turns(&agent_turns(episode_text), references, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::FormatTerm;

    const CALL: &str = "<think>plan</think>\n<interaction_prompt>{\"name\": \"prompt\", \"arguments\": {\"prompt\": \"q\"}}</interaction_prompt>";

    fn score(turns: &[&str], refs: &[&str]) -> RewardBreakdown {
        RewardBreakdown::from_turns(turns, refs, &RewardConfig::default())
    }

    #[test]
    fn call_then_correct_answer_passes_the_gate() {
        let b = score(
            &[CALL, "<think>\nok</think>\n<answer>Paris</answer>"],
            &["paris"],
        );
        // 0.4 (call) + 0.25 + 0.25 + 0.1 = 1.0 → capped 1.0 = gate → R = F1 = 1.
        assert_eq!(b.format_raw, 1.0);
        assert!(b.gate_passed);
        assert_eq!((b.f1, b.em, b.reward), (1.0, 1.0, 1.0));
        assert_eq!(b.turns[0].terms, vec![FormatTerm::WellFormedCall]);
        assert_eq!(b.answer.as_deref(), Some("Paris"));
    }

    /// Constants whose decimal sum is the gate reach it, though their float sum falls short by
    /// rounding; a sum short by a real amount does not.
    #[test]
    fn the_gate_allows_for_rounding_only() {
        let turns = [CALL, "<think>\nok</think>\n<answer>Paris</answer>"];
        let thirds = RewardConfig {
            call_turn: 0.3,
            answer_tag: 0.3,
            answer_non_empty: 0.3,
            think_answer_layout: 0.1,
            ..RewardConfig::default()
        };
        let b = RewardBreakdown::from_turns(&turns, &["Paris"], &thirds);
        assert!(b.format_raw < 1.0 && b.gate_passed && (b.reward - 1.0).abs() < 1e-12, "{b:?}");
        let short = RewardConfig { think_answer_layout: 0.099, ..thirds };
        let b = RewardBreakdown::from_turns(&turns, &["Paris"], &short);
        assert!(!b.gate_passed && b.reward < 0.0, "{b:?}");
    }

    #[test]
    fn no_turns_is_minus_one() {
        let b = score(&[], &["x"]);
        assert_eq!((b.format_raw, b.format, b.reward), (0.0, 0.0, -1.0));
        assert!(b.turns.is_empty());
    }

    #[test]
    fn raw_text_and_turns_agree() {
        let text = format!(
            "<|im_start|>user\nQuestion: q<|im_end|>\n<|im_start|>assistant\n{CALL}<|im_end|>\n\
             <|im_start|>user\n<interaction_response>\n{{\"results\": [\"Paris\"]}}\n</interaction_response><|im_end|>\n\
             <|im_start|>assistant\n<think>\nok</think><answer>Paris, France</answer><|im_end|>\n"
        );
        let from_text = RewardBreakdown::from_text(&text, &["Paris"], &RewardConfig::default());
        let from_turns = score(
            &[CALL, "<think>\nok</think><answer>Paris, France</answer>"],
            &["Paris"],
        );
        assert_eq!(from_text, from_turns);
        // F1 = 2/3 (see answer tests), gate passed.
        assert!((from_text.reward - 2.0 / 3.0).abs() < 1e-12);
    }
}

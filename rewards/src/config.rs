//! The constants of the double-constrained reward.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Coefficients of the format score and the gate (the reference code's constants by default).
///
/// The defaults are the constants of the reference training code
/// (`qa_em_and_format.compute_score_format`): 0.4 per well-formed call turn; on the final
/// turn 0.25 for a non-empty `<answer>`, 0.25 for a non-blank answer and 0.1 for the exact
/// `<think>…</think>…<answer>…</answer>` layout; cap 1.0; gate 1.0. The paper's text lists
/// other coefficient values; any set can be given here (e.g. from a JSON file, every key
/// optional).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// Added for every non-final turn that is exactly a `<think>` then an `<interaction_prompt>`.
    pub call_turn: f64,
    /// Added when the final turn has an `<answer>…</answer>` with non-blank content.
    pub answer_tag: f64,
    /// Added when the extracted answer is non-empty after stripping whitespace.
    pub answer_non_empty: f64,
    /// Added when the final turn is exactly `<think>…</think>…<answer>…</answer>`.
    pub think_answer_layout: f64,
    /// The format score is clipped to at most this value.
    pub cap: f64,
    /// The answer F1 counts only when the capped format score equals this value exactly;
    /// otherwise the reward is `format − 1`.
    pub gate: f64,
}

impl RewardConfig {
    /// The reference code's constants (the default).
    pub const REFERENCE: Self = Self {
        call_turn: 0.4,
        answer_tag: 0.25,
        answer_non_empty: 0.25,
        think_answer_layout: 0.1,
        cap: 1.0,
        gate: 1.0,
    };

    /// Checks that every constant is finite, the terms are non-negative and the gate is
    /// reachable (not above the cap).
    pub fn validate(&self) -> Result<(), RewardConfigError> {
        let named = [
            ("call_turn", self.call_turn),
            ("answer_tag", self.answer_tag),
            ("answer_non_empty", self.answer_non_empty),
            ("think_answer_layout", self.think_answer_layout),
            ("cap", self.cap),
            ("gate", self.gate),
        ];
        for (key, value) in named {
            if !value.is_finite() || value < 0.0 {
                return Err(RewardConfigError::Invalid { key, value });
            }
        }
        if self.gate > self.cap {
            return Err(RewardConfigError::UnreachableGate {
                gate: self.gate,
                cap: self.cap,
            });
        }
        Ok(())
    }
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self::REFERENCE
    }
}

/// A reward configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RewardConfigError {
    /// A constant is negative, infinite or NaN.
    #[error("reward config: `{key}` must be a finite number ≥ 0, got {value}")]
    Invalid { key: &'static str, value: f64 },
    /// The gate can never be reached because the format score is capped below it.
    #[error(
        "reward config: `gate` ({gate}) is above `cap` ({cap}), so the answer would never count"
    )]
    UnreachableGate { gate: f64, cap: f64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_the_reference_code() {
        let c = RewardConfig::default();
        assert_eq!(
            (
                c.call_turn,
                c.answer_tag,
                c.answer_non_empty,
                c.think_answer_layout,
                c.cap,
                c.gate
            ),
            (0.4, 0.25, 0.25, 0.1, 1.0, 1.0)
        );
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn partial_json_keeps_defaults() {
        let c: RewardConfig = serde_json::from_str(r#"{"call_turn": 0.5}"#).unwrap();
        assert_eq!(c.call_turn, 0.5);
        assert_eq!(c.answer_tag, 0.25);
        assert!(serde_json::from_str::<RewardConfig>(r#"{"calls": 0.5}"#).is_err());
    }

    #[test]
    fn rejects_bad_constants() {
        let c = RewardConfig {
            answer_tag: -0.1,
            ..RewardConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(RewardConfigError::Invalid {
                key: "answer_tag",
                ..
            })
        ));
        let c = RewardConfig {
            cap: f64::NAN,
            ..RewardConfig::default()
        };
        assert!(c.validate().is_err());
        let c = RewardConfig {
            gate: 1.5,
            ..RewardConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(RewardConfigError::UnreachableGate { .. })
        ));
    }
}

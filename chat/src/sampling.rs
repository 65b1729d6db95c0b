//! How an LLM chooses its tokens.

use serde::{Deserialize, Serialize};

/// Temperatures below this choose by argmax, as vLLM's do: dividing logits by a much smaller
/// one overflows f32 (every weight NaN), and the distribution is the argmax's to f32 precision
/// long before.
pub const GREEDY_BELOW: f32 = 1e-5;

/// Sampling settings: the agent's in rollouts and inference (`[rollout.sampling]`, `infer
/// --temperature`), `generate`'s, and those `serve` falls back on for requests that leave a
/// parameter out. The default is the plain distribution (temperature 1, no truncation, seed 0),
/// OpenAI's default and the reference run's rollout setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sampling {
    /// 0 (or below [`GREEDY_BELOW`]) = greedy (argmax); otherwise logits are divided by it
    /// before sampling.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (`None` or 0: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches `p` (`None` or 1.0: all).
    pub top_p: Option<f32>,
    /// Seed of the random draws: the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

/// A sampling setting out of range.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingError(pub String);

impl std::fmt::Display for SamplingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SamplingError {}

impl Sampling {
    /// Greedy decoding (argmax; the other settings do not matter).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether tokens are chosen by argmax: at temperature 0, or below [`GREEDY_BELOW`].
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// Temperature finite and at least 0, top-p in (0, 1].
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SamplingError(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(SamplingError(format!("top_p must be in (0, 1], got {p}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_ranges() {
        assert!(Sampling::default().validate().is_ok());
        assert!(Sampling::greedy().validate().is_ok());
        let bad = |s: Sampling| s.validate().unwrap_err().to_string();
        assert!(bad(Sampling { temperature: -1.0, ..Sampling::default() }).contains("temperature"));
        assert!(bad(Sampling { temperature: f32::NAN, ..Sampling::default() }).contains("temperature"));
        assert!(bad(Sampling { top_p: Some(0.0), ..Sampling::default() }).contains("top_p"));
        assert!(bad(Sampling { top_p: Some(1.5), ..Sampling::default() }).contains("top_p"));
    }

    #[test]
    fn a_partial_table_keeps_the_other_defaults() {
        let s: Sampling = serde_json::from_str(r#"{"temperature": 0.7}"#).unwrap();
        assert_eq!(s, Sampling { temperature: 0.7, ..Sampling::default() });
        assert!(serde_json::from_str::<Sampling>(r#"{"temp": 0.7}"#).is_err());
    }
}

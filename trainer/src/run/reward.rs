//! Scoring a finished episode for GRPO. The default is Prompt-R1's double-constrained reward
//! (the `rewards` crate) on the episode's decoded text; tests and experiments plug in others.

use env::Trajectory;
use rewards::{RewardBreakdown, RewardConfig};

/// The reward of one episode with the parts the metrics report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpisodeScore {
    pub reward: f32,
    /// The capped format score (`None` for scorers without one).
    pub format: Option<f32>,
    /// Answer F1 against the references (`None` for scorers without one).
    pub f1: Option<f32>,
}

/// Turns a finished episode into a reward.
pub trait EpisodeScorer: Sync {
    fn score(&self, trajectory: &Trajectory, answers: &[String]) -> EpisodeScore;
}

/// Prompt-R1's double-constrained reward computed on the raw episode text, as the reference does.
#[derive(Debug, Clone, Default)]
pub struct PromptR1Scorer {
    pub config: RewardConfig,
}

impl EpisodeScorer for PromptR1Scorer {
    fn score(&self, trajectory: &Trajectory, answers: &[String]) -> EpisodeScore {
        let text = format!("{}{}", trajectory.prompt_text, trajectory.response_text);
        let breakdown = RewardBreakdown::from_text(&text, answers, &self.config);
        EpisodeScore {
            reward: breakdown.reward as f32,
            format: Some(breakdown.format as f32),
            f1: Some(breakdown.f1 as f32),
        }
    }
}

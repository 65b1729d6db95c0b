//! Rewards and evaluation metrics of Prompt-R1.
//!
//! - [`RewardBreakdown`]: the double-constrained reward of an episode (format terms per turn,
//!   cap, gate, answer F1), from the agent's turns or from a decoded episode text.
//! - [`AnswerScores`]: SQuAD-normalised EM, SM and token F1 against reference answers.
//! - [`metrics`]: per-example metrics (with SSim through a [`metrics::Similarity`] model) and
//!   their aggregation per data source.
//! - [`ssim`]: the all-MiniLM-L6-v2 sentence encoder behind SSim.

#![forbid(unsafe_code)]

pub mod answer;
pub mod config;
pub mod episode;
pub mod format;
pub mod metrics;
pub mod normalize;
pub mod reward;
pub mod ssim;

pub use answer::{f1_score, AnswerScores};
pub use config::{RewardConfig, RewardConfigError};
pub use episode::{agent_turns, extract_answer};
pub use format::{FormatTerm, TurnFormat, TurnRole};
pub use metrics::{ExampleMetrics, MetricsReport, MetricsRow, Similarity};
pub use normalize::{answer_tokens, normalize_answer};
pub use reward::{RewardBreakdown, GATE_TOLERANCE};

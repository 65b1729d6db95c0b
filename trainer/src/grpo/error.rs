//! The error type of the GRPO computations: bad batches, bad settings, model failures.

use model::ModelError;

use crate::optim::OptimError;

/// Why a GRPO computation refused its input.
#[derive(Debug, thiserror::Error)]
pub enum GrpoError {
    /// The sequences, rewards or tensors handed in are inconsistent.
    #[error("invalid GRPO input: {0}")]
    Input(String),
    /// A loss or learning-step setting is out of range.
    #[error("invalid GRPO setting: {0}")]
    Config(String),
    #[error(transparent)]
    Optimizer(#[from] OptimError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

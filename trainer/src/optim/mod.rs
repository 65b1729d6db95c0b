//! The optimiser side of a learning step: AdamW with PyTorch's defaults, clipping by the global
//! gradient norm (burn's built-in clipping is per parameter), and skipping steps whose gradient
//! norm is not finite.

pub mod adamw;
pub mod apply;
pub mod config;
pub mod error;
mod flex;
pub mod grad_norm;

pub use adamw::{AdamW, AdamWState};
pub use apply::{clip_and_step, StepOutcome};
pub use config::{AdamWOptimizer, OptimizerConfig};
pub use error::OptimError;
pub use grad_norm::{clip_grad_norm_global, global_grad_norm, scale_grads};

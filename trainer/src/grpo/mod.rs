//! GRPO, one concern per module (formulas follow verl's `core_algos.py`):
//!
//! - [`advantage`]: group-relative advantages from episode rewards.
//! - [`mod@policy_loss`]: the PPO clipped surrogate with dual clipping.
//! - [`kl`]: the k1/k2/k3 estimators of the KL to the reference policy.
//! - [`entropy`]: the policy's per-token entropy, chunked over positions.
//! - [`aggregate`]: token-mean and sequence-mean reductions under the loss mask.
//! - [`loss`]: the combined objective and its settings.
//! - [`batch`], [`logprobs`], [`step`]: the learner's input, the old/reference log-probs, and
//!   the learning step with mini-batches, micro-batches and the guarded optimiser step.
//! - [`checkpointing`]: the learning step's gradients with one decoder layer's activations
//!   alive at a time (`activation_checkpointing`).
//! - [`head`]: the update's head and loss a chunk of positions at a time, backward included.

pub mod advantage;
pub mod aggregate;
pub mod batch;
pub mod checkpointing;
pub mod entropy;
pub mod error;
pub mod head;
pub mod kl;
pub mod logprobs;
pub mod loss;
pub mod policy_loss;
pub mod step;

pub use advantage::{group_advantages, AdvantageMode};
pub use aggregate::{agg_loss, AggMode};
pub use batch::{PolicyBatch, PolicySequence};
pub use entropy::{
    entropy_from_logits, token_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden, EntropyGrad,
};
pub use error::GrpoError;
pub use kl::{kl_penalty, KlEstimator};
pub use logprobs::sequence_logprobs;
pub use loss::{grpo_loss, GrpoLossConfig, LossInputs, LossStats};
pub use policy_loss::{policy_loss, PolicyLoss, PolicyLossStats, PpoClip, TokenWeighted};
pub use step::{learn, learn_step, learn_step_lora, LearnConfig, StepStats, Trainable};

//! GRPO training of the Prompt-R1 agent.
//!
//! - [`autodiff_lock`]: serialises autodiff work across threads (burn 0.21 loses gradients
//!   when backward passes run concurrently).
//! - [`grpo`]: group-relative advantages, the clipped policy loss with its KL and entropy
//!   terms, loss aggregation, and the learning step on prepared sequences (mini-batches,
//!   micro-batches with gradient accumulation).
//! - [`rollout`]: the engines that generate episodes ([`rollout::RolloutEngine`]): the local
//!   burn model as the episode agent (continuously batched, token-level contexts with loss
//!   masks and log-probs), or OpenAI-compatible rollout workers given token-id prompts.
//! - [`run`]: a training run (TOML config, the GRPO step over rollouts, validation,
//!   metrics.jsonl, atomic checkpoints that resume exactly).
//! - [`optim`]: AdamW with PyTorch's defaults, clipping by the global gradient norm, and the
//!   skipping of steps whose gradient norm is not finite.
//! - [`plan`]: the memory a run will need, phase by phase, from the model's shape and the run's
//!   settings, and whether it fits a device.
//! - [`sft`]: supervised fine-tuning on chat transcripts or saved episodes (assistant tokens
//!   only), with the same optimiser, checkpoints and metrics file as GRPO runs.

#![forbid(unsafe_code)]

pub mod autodiff_lock;
pub mod grpo;
pub mod optim;
pub mod plan;
pub mod rollout;
pub mod run;
pub mod sft;

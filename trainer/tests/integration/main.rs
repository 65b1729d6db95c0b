//! The trainer's integration tests in one test binary: each binary links burn and instantiates
//! the model's and the trainer's generic code anew, so one binary builds in a fraction of the
//! time of one per file. The training runs through burn's portable ops and on its wgpu backend
//! run in the workspace's `tests/gpu_path`.

#[path = "../common/mod.rs"]
mod common;

mod checkpointing;
mod exact_ratio;
mod grpo_logprobs;
mod grpo_step;
mod local_agent;
mod rollout_servers;
mod run_training;
mod sft;
mod validation_and_sampling;

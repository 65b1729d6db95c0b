//! Whole GRPO training runs on the GPU path: rollouts, scoring, the loss, its gradients and
//! AdamW. The tiny model of the trainer's tests (`trainer/tests/common`) learns the behaviour
//! whose reward is known, as it does with the CPU kernels (`trainer/tests/integration/
//! run_training.rs` gives the threshold), over 40 steps with the KL term on.

use burn::backend::{Autodiff, Flex};
use burn_wgpu::Vulkan;
use burn::tensor::backend::AutodiffBackend;

use crate::common::backend_ready;
use crate::training_common::{first_last_gap, setup, train_on};

const STEPS: u64 = 40;

/// Trains on backend `A` and checks that the reward rose and no step was skipped.
fn learns<A: AutodiffBackend>(path: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.grpo.loss.kl_coef = 0.001;
    let (_, records) = train_on::<A>(config, STEPS, false);
    let (first, last) = first_last_gap(&records);
    println!("{path}: first 5 steps {first:.3}, last 5 steps {last:.3}, final kl {:?}", records.last().unwrap().kl);
    assert!(last - first > 0.15, "first {first}, last {last}");
    assert!(records.iter().all(|r| r.skipped_steps == 0 && r.kl.is_some_and(f32::is_finite)));
}

/// Through burn's portable ops on the CPU (the optimiser's CPU loops off too).
#[test]
fn the_policy_learns_through_the_portable_ops() {
    if backend_ready::<Flex>() {
        learns::<Autodiff<Flex>>("portable ops");
    }
}

/// On burn's wgpu backend, f32 (Vulkan through wgpu has no bf16).
#[test]
fn the_policy_learns_on_the_wgpu_backend() {
    if backend_ready::<Vulkan>() {
        learns::<Autodiff<Vulkan>>("wgpu");
    }
}

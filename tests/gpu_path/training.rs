//! Whole GRPO training runs on the GPU path: rollouts, scoring, the loss, its gradients and
//! AdamW. The tiny model of the trainer's tests (`trainer/tests/common`) learns the behaviour
//! whose reward is known, as it does with the CPU kernels (`trainer/tests/integration/
//! run_training.rs` gives the threshold), over 40 steps with the KL term on.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn_wgpu::{Vulkan, WgpuDevice, WgpuRuntime};
use cubecl::Runtime;
use std::sync::Arc;

use trainer::run::{release_unused_device_memory, DeviceMemory, StepRecord, Trainer};

use crate::common::backend_ready;
use crate::training_common::{first_last_gap, setup, train_on, ByteTokens, Scripted};

const STEPS: u64 = 40;

/// Trains on backend `A` and checks that the reward rose and no step was skipped.
fn learns<A: AutodiffBackend>(path: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.grpo.loss.kl_coef = 0.001;
    config.cpu_kernels = model::cpu_kernels::Kernels::off();
    let (_, records) = train_on::<A>(config, STEPS, false);
    let (first, last) = first_last_gap(&records);
    println!("{path}: first 5 steps {first:.3}, last 5 steps {last:.3}, final kl {:?}", records.last().unwrap().kl);
    assert!(last - first > 0.15, "first {first}, last {last}");
    assert!(records.iter().all(|r| r.skipped_steps == 0 && r.kl.is_some_and(f32::is_finite)));
}

/// Through burn's portable ops on the CPU (the CPU kernels off; the optimiser's host loops, which
/// are not the model's, still run).
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

/// Bytes CubeCL's wgpu pool of this thread holds by live tensors and has reserved.
fn wgpu_pool() -> (u64, u64) {
    let usage = WgpuRuntime::client(&WgpuDevice::DefaultDevice).memory_usage().unwrap();
    (usage.bytes_in_use, usage.bytes_reserved)
}

/// A training step gives the device back the pages its rollouts and its update no longer use
/// (as verl empties PyTorch's cache after its rollouts): after a step and after validation no
/// page of CubeCL's pool is left wholly free, so a cleanup then frees nothing. Without the
/// trainer's own cleanups the rollouts' and the update's pages stay reserved (measured on
/// lavapipe: 56 MiB reserved after the two steps, 8 MiB after a cleanup). Each step's record
/// gives what the pool reserved in its phases, read before their pages went back: for the
/// update, more than the pool keeps after a cleanup.
#[test]
fn a_training_step_leaves_no_free_device_page_reserved() {
    if !backend_ready::<Vulkan>() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.data.validation = vec![dir.path().join("train.jsonl")];
    config.run.validate_every = 1;
    // Turns long enough, and micro-batches wide enough, that some of a step's tensors outgrow
    // the pool's smallest pages (on lavapipe, 2 MiB a tensor in pages of 8 MiB).
    config.episode.max_turn_tokens = 64;
    config.grpo.micro_batch_size = 12;
    let mut trainer = Trainer::<Autodiff<Vulkan>>::start(config, WgpuDevice::DefaultDevice, false).unwrap();
    trainer.watch_device_memory(Arc::new(|| {
        let (in_use, reserved) = wgpu_pool();
        Some(DeviceMemory { in_use, reserved })
    }));
    let records: Vec<StepRecord> = (0..2).map(|_| trainer.train_step(&Scripted, &ByteTokens).unwrap()).collect();
    assert!(records.iter().all(|r| r.validation_reward.is_some()), "validation ran after each step");
    let (in_use, reserved) = wgpu_pool();
    release_unused_device_memory::<Vulkan>(&WgpuDevice::DefaultDevice).unwrap();
    let (_, after_cleanup) = wgpu_pool();
    println!("after 2 steps: {in_use} bytes in use, {reserved} reserved; {after_cleanup} reserved after a cleanup");
    assert!(in_use > 0 && in_use <= reserved, "the model's weights are in the pool");
    assert_eq!(after_cleanup, reserved, "a cleanup after the step freed {} bytes of pages", reserved - after_cleanup);
    let bytes = |gib: Option<f32>| (f64::from(gib.expect("the pool was read")) * f64::from(1u32 << 30)).round() as u64;
    for r in &records {
        let (rollouts, update) = (bytes(r.gen_max_memory_reserved_gb), bytes(r.update_max_memory_reserved_gb));
        println!("step {}: {rollouts} bytes reserved at most in the rollouts, {update} in scoring and the update", r.step);
        // The tiny model's rollouts fit the pool's first page; the update takes more.
        assert!(rollouts >= after_cleanup, "the weights' page at least");
        assert!(update > after_cleanup, "read before the update's pages went back");
        assert_eq!(bytes(r.max_memory_reserved_gb), rollouts.max(update));
    }
    drop(trainer);
}

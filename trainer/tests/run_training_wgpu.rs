//! The learning run of `run_training_portable.rs` on burn's wgpu backend (Vulkan; in CI Mesa's
//! lavapipe, a Vulkan driver on the CPU), built with the `wgpu` feature: rollouts, scoring, the
//! GRPO loss, its gradients and AdamW all run through the CUDA backend's CubeCL kernels, fusion
//! and autotune, f32 (Vulkan through wgpu has no bf16). Same setup and threshold as on the CPU
//! (see `run_training.rs`), 40 steps with the KL term on. Without a Vulkan adapter the test
//! prints `skipped` (it fails with `CI=true`), as it does when `PROMPT_R1_CPU_ISA` caps the CPU
//! kernels (none runs here).

mod common;

use burn::backend::{Autodiff, Vulkan};
use common::{first_last_gap, setup, train_on};

/// Keeps CubeCL's autotune results and compiled kernels in the workspace's `target/cubecl`, with
/// those of the model's wgpu tests (CubeCL's default is a `target/` inside the crate's folder).
fn configure_cubecl() {
    use burn::cubecl::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/cubecl");
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.autotune.cache = CacheConfig::File(dir.clone());
    config.compilation.cache = Some(CacheConfig::File(dir));
    CubeClRuntimeConfig::set(config);
}

#[test]
fn the_policy_learns_on_the_wgpu_backend() {
    configure_cubecl();
    if model::cpu_kernels::isa::isa_cap_from_env().is_ok_and(|cap| cap.is_some()) {
        // No CPU kernel runs on this backend: a capped rerun would repeat this test unchanged.
        eprintln!("skipped: PROMPT_R1_CPU_ISA caps the CPU kernels, which this backend never runs");
        return;
    }
    if let Err(cause) = model::probe::probe_device::<Vulkan>(&Default::default()) {
        let reason = format!("the wgpu backend cannot run here: {cause}");
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {reason}");
        eprintln!("skipped: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.grpo.loss.kl_coef = 0.001;
    let (_, records) = train_on::<Autodiff<Vulkan>>(config, 40, false);
    let (first, last) = first_last_gap(&records);
    println!("wgpu: first 5 steps {first:.3}, last 5 steps {last:.3}, final kl {:?}", records[39].kl);
    assert!(last - first > 0.15, "first {first}, last {last}");
    assert!(records.iter().all(|r| r.skipped_steps == 0 && r.kl.is_some_and(f32::is_finite)));
}

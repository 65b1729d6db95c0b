//! The GPU backends' code path, checked without a GPU, in one test binary: the model's parity
//! and gradient cases against the Hugging Face references and a whole GRPO training run, each
//! (a) through burn's portable tensor ops on the CPU (the fused CPU kernels off: the ops the CUDA
//! backend runs) and (b) on burn's wgpu backend (Vulkan; in CI Mesa's lavapipe, a Vulkan driver
//! on the CPU), which runs the CUDA backend's CubeCL kernels and fusion, without autotune as the
//! CUDA build runs; only the final compiler differs (SPIR-V instead of NVRTC).
//!
//! On wgpu, decoding steps attend through the paged-attention kernel of
//! `prompt-r1-device-kernels` (registered for `Vulkan` as the binary registers it for its GPU
//! backends), prefill chunks through burn's ops over the gathered cache, or through the kernel
//! too with `PROMPT_R1_DEVICE_KERNELS=all` (as `--device-kernels all`, which also hands it the
//! passes without a cache: scoring and the training forward; CI runs the parity, attention and
//! gradient cases again so); `paged_attention.rs` and `fresh_attention.rs` check the kernel
//! alone. `cuda_source.rs` compiles every
//! kernel of ours as the CUDA backend would (CubeCL's CUDA C++, then NVRTC where
//! `scripts/nvrtc_check.sh` provides it).
//!
//! One binary, so that burn's wgpu backend and the model's generic code over it are built once:
//! as three binaries (parity, gradients, training) each took 175–212 s of one core to build.
//! Built unoptimised (`opt-level = 0` for this package, the workspace's `Cargo.toml`): 39 s
//! instead of 247 s on 2 cores, for 174 s of tests instead of 145 s.
//! Every test here runs with the CPU kernels off (models loaded with `Kernels::off()`). When
//! `PROMPT_R1_CPU_ISA` caps the CPU kernels (CI's reruns at lower levels) every test prints
//! `skipped`: no CPU kernel runs on this path, so the rerun would repeat it unchanged. Without a
//! Vulkan adapter the wgpu tests print `skipped` (they fail with `CI=true`).

extern crate model as prompt_r1_model;
extern crate trainer as prompt_r1_trainer;

#[path = "../../model/tests/common/mod.rs"]
mod model_common;
#[path = "../../trainer/tests/common/mod.rs"]
mod training_common;

mod attention;
mod cuda_source;
mod decoder_memory;
mod device_threads;
mod fresh_attention;
mod gradients;
mod kernel_choice;
mod paged_attention;
mod parity;
mod rms_norm;
mod sampling;
mod skinny_matmul;
mod swiglu;
mod training;

/// The model tests' helpers, with [`backend_ready`](common::backend_ready) made this binary's.
mod common {
    pub use crate::model_common::*;

    use burn::tensor::backend::Backend;

    /// Whether a test of this binary runs on backend `B` here (see the binary's doc): false,
    /// with `skipped: <reason>`, under a CPU instruction-set cap, or where `B` cannot run. Also
    /// points CubeCL's caches at the workspace's `target/cubecl` before the first kernel
    /// compiles.
    pub fn backend_ready<B: Backend>() -> bool {
        let capped = prompt_r1_model::cpu_kernels::isa::isa_cap_from_env().is_ok_and(|cap| cap.is_some());
        if capped {
            eprintln!("skipped: PROMPT_R1_CPU_ISA caps the CPU kernels, which the GPU path never runs");
            return false;
        }
        configure_cubecl();
        // As the binary does on a GPU; the models run them as their `Compute` says
        // (`common::load_options`: decoding steps, or every pass under
        // `PROMPT_R1_DEVICE_KERNELS=all`; CI runs the parity cases both ways).
        device_kernels::register::<burn_wgpu::Vulkan>();
        crate::model_common::backend_ready::<B>()
    }

    /// Keeps CubeCL's autotune results and compiled kernels in the workspace's `target/cubecl`
    /// (CubeCL's default is a `target/` inside the crate's folder, and no kernels); `CUBECL_*`
    /// variables (e.g. `CUBECL_DEBUG_LOG`) apply. Once per process, before any kernel.
    fn configure_cubecl() {
        use burn::cubecl::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/cubecl");
            let mut config = CubeClRuntimeConfig::default().override_from_env();
            config.autotune.cache = CacheConfig::File(dir.clone());
            config.compilation.cache = Some(CacheConfig::File(dir));
            CubeClRuntimeConfig::set(config);
        });
    }
}

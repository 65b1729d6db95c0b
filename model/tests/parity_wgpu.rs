//! The parity cases of `parity.rs` on burn's wgpu backend (Vulkan; in CI Mesa's lavapipe, a
//! Vulkan driver on the CPU), built with the `wgpu` feature. wgpu runs the CUDA backend's CubeCL
//! kernels, fusion and autotune (matmul, reductions, softmax, fused element-wise ops); only the
//! final compiler differs (SPIR-V instead of NVRTC), so this runs the GPU path's math against
//! transformers on every CI run. f32 only: Vulkan through wgpu has no bf16 (those cases print
//! `skipped`). Tolerances as on the CPU (logits and log-probs atol 1e-4, greedy tokens exactly
//! equal): CubeCL's tiled matmul and tree reductions add in a different order than the
//! reference, which moves f32 results by a few ulps of the largest partial sums, about 1e-6 at
//! these sizes. Without a Vulkan adapter the tests print `skipped` (they fail with `CI=true`).

type B = burn::backend::Vulkan;
const ATOL: f32 = 1e-4;
const PORTABLE: bool = true;

mod common;

include!("common/parity_cases.rs");

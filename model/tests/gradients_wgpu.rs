//! The gradient cases of `gradients.rs` on burn's wgpu backend (Vulkan; in CI Mesa's lavapipe,
//! a Vulkan driver on the CPU), built with the `wgpu` feature: the GRPO loss and every gradient
//! through the CUDA backend's CubeCL kernels under autodiff, against PyTorch with the same
//! tolerances (rtol 1e-3, atol 1e-6). f32 only: Vulkan through wgpu has no bf16 (the bf16 case
//! prints `skipped`). Without a Vulkan adapter the tests print `skipped` (they fail with `CI=true`).

type Inner = burn::backend::Vulkan;
const PORTABLE: bool = true;

mod common;

include!("common/gradient_cases.rs");

//! The memory-efficient attention against HF's eager formula on burn's wgpu backend: outputs and
//! the gradients of q, k and v (`model/tests/common/attention_cases.rs`; its autodiff node
//! registered for `Autodiff<Vulkan>`). f32 only: Vulkan through wgpu has no bf16 (the bf16 case
//! prints `skipped`). The model crate's integration tests run the same cases on burn-flex.

mod wgpu {
    type Inner = burn_wgpu::Vulkan;

    use crate::common::*;

    include!("../../model/tests/common/attention_cases.rs");
}

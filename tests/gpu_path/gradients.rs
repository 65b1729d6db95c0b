//! The model's gradient cases (`model/tests/common/gradient_cases.rs`: the GRPO-style loss of the
//! fixtures and every parameter's gradient under burn-autodiff, against PyTorch) on the GPU path,
//! with the CPU kernels' tolerances (rtol 1e-3, atol 1e-6).

/// Through burn's portable ops on the CPU.
mod portable {
    type Inner = burn::backend::Flex;
    const PORTABLE: bool = true;

    use crate::common;

    include!("../../model/tests/common/gradient_cases.rs");
}

/// On burn's wgpu backend. f32 only: Vulkan through wgpu has no bf16 (the bf16 case prints
/// `skipped`).
mod wgpu {
    type Inner = burn_wgpu::Vulkan;
    const PORTABLE: bool = true;

    use crate::common;

    include!("../../model/tests/common/gradient_cases.rs");
}

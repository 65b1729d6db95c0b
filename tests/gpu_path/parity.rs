//! The model's parity cases (`model/tests/common/parity_cases.rs`: logits, greedy and batched
//! tokens, completion log-probs against transformers) on the GPU path. Tolerances as with the
//! CPU kernels (logits and log-probs atol 1e-4, greedy tokens exactly equal): the portable ops
//! and CubeCL's tiled matmul and tree reductions add in another order than the reference, which
//! moves f32 results by a few ulps of the largest partial sums, about 1e-6 at these sizes.

/// Through burn's portable ops on the CPU.
mod portable {
    type B = burn::backend::Flex;
    const ATOL: f32 = 1e-4;
    const PORTABLE: bool = true;

    use crate::common;

    include!("../../model/tests/common/parity_cases.rs");
}

/// On burn's wgpu backend. f32 only: Vulkan through wgpu has no bf16 (those cases print
/// `skipped`).
mod wgpu {
    type B = burn_wgpu::Vulkan;
    const ATOL: f32 = 1e-4;
    const PORTABLE: bool = true;

    use crate::common;

    include!("../../model/tests/common/parity_cases.rs");
}

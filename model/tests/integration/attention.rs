//! The memory-efficient attention against HF's eager formula on burn-flex: outputs and the
//! gradients of q, k and v (see `../common/attention_cases.rs`). Both run as burn's tensor ops
//! here (the CPU kernel stands in for them only inside the model); the workspace's
//! `tests/gpu_path` runs the same cases on burn's wgpu backend.

type Inner = burn::backend::Flex;

use crate::common::*;

include!("../common/attention_cases.rs");

//! Gradient parity through burn-autodiff: the GRPO-style token-mean loss of the fixtures,
//! `loss = -Σ cm·A·logp / Σ cm`, against PyTorch's loss and gradients (rtol 1e-3, atol 1e-6).
//!
//! This module runs them with the fused CPU kernels; the workspace's `tests/gpu_path` runs the
//! same cases through burn's portable tensor ops and on burn's wgpu backend.

type Inner = burn::backend::Flex;
const PORTABLE: bool = false;

use crate::common;

include!("../common/gradient_cases.rs");

//! Gradient parity through burn-autodiff: the GRPO-style token-mean loss of the fixtures,
//! `loss = -Σ cm·A·logp / Σ cm`, against PyTorch's loss and gradients (rtol 1e-3, atol 1e-6).
//!
//! This file runs them with the fused CPU kernels; `gradients_portable.rs` runs the same cases
//! through burn's portable tensor ops.

type Inner = burn::backend::Flex;
const PORTABLE: bool = false;

mod common;

include!("common/gradient_cases.rs");

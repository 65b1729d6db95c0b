//! Numeric parity with Hugging Face transformers (`Qwen3ForCausalLM`, f32, eager attention) on
//! the tiny fixtures in `shared/fixtures/`. Tolerances: logits and log-probs atol 1e-4 (the
//! fixtures' own f32-vs-f64 spread is ~1e-5); greedy tokens exactly equal.
//!
//! This module runs them with the fused CPU kernels; the workspace's `tests/gpu_path` runs the
//! same cases through burn's portable tensor ops and on burn's wgpu backend.

type B = burn::backend::Flex;
const ATOL: f32 = 1e-4;
const PORTABLE: bool = false;

use crate::common;

include!("../common/parity_cases.rs");

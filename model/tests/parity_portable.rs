//! The parity cases of `parity.rs` with the fused CPU kernels switched off
//! (`prompt_r1_model::cpu_kernels::set_portable_ops`): every op runs through burn's portable tensor ops, the
//! path the CUDA backend takes, so the CPU checks that path's math against transformers. Same
//! tolerances: logits and log-probs atol 1e-4, greedy tokens exactly equal.

type B = burn::backend::Flex;
const ATOL: f32 = 1e-4;
const PORTABLE: bool = true;

mod common;

include!("common/parity_cases.rs");

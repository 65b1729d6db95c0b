//! The gradient cases of `gradients.rs` with the fused CPU kernels switched off
//! (`prompt_r1_model::cpu_kernels::set_portable_ops`): the loss and every gradient through burn's portable
//! ops under autodiff, the path the CUDA backend trains on, against PyTorch (same tolerances).

type Inner = burn::backend::Flex;
const PORTABLE: bool = true;

mod common;

include!("common/gradient_cases.rs");

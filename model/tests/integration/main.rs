//! The model crate's integration tests in one test binary, with the fused CPU kernels on
//! (`lora_parity` also runs through the portable ops): each binary links burn and instantiates
//! the model's generic code anew, so one binary builds in a fraction of the time of one per
//! file. The same parity and gradient cases through burn's portable ops and its wgpu backend run
//! in the workspace's `tests/gpu_path`.

#[path = "../common/mod.rs"]
mod common;

mod attention;
mod gradients;
mod load_errors;
mod lora_parity;
mod parity;
mod tokenizer;

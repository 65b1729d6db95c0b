//! The model crate's integration tests, with the fused CPU kernels on, in one test binary: each
//! binary links burn and instantiates the model's generic code anew, so one binary builds in a
//! fraction of the time of one per file. `lora_parity.rs` lives apart (it switches the kernels
//! off and on, a process-wide setting), and the same parity and gradient cases through burn's
//! portable ops and its wgpu backend run in the workspace's `tests/gpu_path`.

#[path = "../common/mod.rs"]
mod common;

mod attention;
mod gradients;
mod load_errors;
mod parity;
mod tokenizer;

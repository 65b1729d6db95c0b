//! The GPU backends' code path, checked on the CPU, lives in `gpu_path/` (a test target of this
//! package: see its doc). Built without optimisation (the workspace's `Cargo.toml`).

#![forbid(unsafe_code)]

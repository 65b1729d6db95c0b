//! Shared helpers of the model crate's integration tests: locating `../shared` and reading the
//! reference fixtures made by `shared/fixtures/make_fixture.py`, and whether the backend under
//! test can run here.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use burn::tensor::backend::Backend;
use serde_json::Value;

/// How a test's models compute: through burn's portable ops (the CPU kernels off) where
/// `portable`, else with the kernels the environment picks (CI's capped reruns); on a GPU
/// backend with the lent kernels of [`device_kernel_choice`].
pub fn load_options(portable: bool) -> prompt_r1_model::LoadOptions {
    use prompt_r1_model::{cpu_kernels::Kernels, Compute, LoadOptions};
    let cpu_kernels = if portable { Kernels::off() } else { Kernels::default() };
    LoadOptions { compute: Compute::default().with_cpu_kernels(cpu_kernels).with_device_kernels(device_kernel_choice()), ..LoadOptions::default() }
}

/// The GPU kernels a test's models run: the passes `PROMPT_R1_DEVICE_KERNELS` names, as the
/// binary reads it (CI runs the GPU path's parity cases again with `all`), else the default's
/// (decoding steps, the binary's `auto` on wgpu).
pub fn device_kernel_choice() -> prompt_r1_model::DeviceKernelChoice {
    use prompt_r1_model::device_kernels::{DeviceKernelChoice, KernelPasses};
    let passes = std::env::var("PROMPT_R1_DEVICE_KERNELS").ok().and_then(|value| KernelPasses::parse_setting(&value));
    passes.map_or_else(DeviceKernelChoice::default, DeviceKernelChoice::with_passes)
}

/// Prints `skipped: <reason>`; in CI (`CI=true`) fails instead, since there nothing may be
/// skipped.
pub fn skip(reason: &str) {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true but {reason}");
    }
    eprintln!("skipped: {reason}");
}

/// Whether backend `B` runs on its default device: burn's CPU backend always does; another (the
/// wgpu backend of the workspace's `tests/gpu_path`) is probed once per test binary with one
/// small sum (see `prompt_r1_model::probe`) and, where it cannot run (no Vulkan adapter), the test
/// is skipped with the cause, or fails in CI. A test binary checks at most one GPU backend.
pub fn backend_ready<B: Backend>() -> bool {
    if prompt_r1_model::cpu_kernels::is_flex_backend::<B>() {
        return true;
    }
    static READY: OnceLock<Result<(), prompt_r1_model::probe::DeviceUnusable>> = OnceLock::new();
    match READY.get_or_init(|| prompt_r1_model::probe::probe_device::<B>(&Default::default())) {
        Ok(()) => true,
        Err(cause) => {
            // Not `B::name`: asking an unusable device its name panics again.
            skip(&format!("the backend under test cannot run here: {cause}"));
            false
        }
    }
}

/// `<workspace>/../shared`, or `None` (with the reason printed) when it is absent outside CI.
/// In CI (`CI=true`) a missing shared folder fails the test.
pub fn shared_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    if dir.is_dir() {
        return Some(dir);
    }
    skip(&format!("{} not found (it sits beside the checkout in CI)", dir.display()));
    None
}

/// A fixture directory under `shared/fixtures/` with its parsed `fixture.json`.
pub struct Fixture {
    pub dir: PathBuf,
    pub json: Value,
}

pub fn fixture(name: &str) -> Option<Fixture> {
    let dir = shared_dir()?.join("fixtures").join(name);
    let text = std::fs::read_to_string(dir.join("fixture.json")).expect("fixture.json readable");
    Some(Fixture {
        json: serde_json::from_str(&text).expect("fixture.json parses"),
        dir,
    })
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Flattens a nested JSON array of numbers.
pub fn flat(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().unwrap() as f32],
        other => panic!("not a number: {other}"),
    }
}

/// A prompt of `len` token ids below `vocab`, different for each `seed`.
pub fn synthetic_prompt(vocab: u32, seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (seed * 31 + i * 7) % vocab).collect()
}

/// Largest absolute difference; panics if lengths differ.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

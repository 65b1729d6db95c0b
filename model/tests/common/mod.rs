//! Shared helpers of the model crate's integration tests: locating `../shared` and reading the
//! reference fixtures made by `shared/fixtures/make_fixture.py`, and whether the backend under
//! test can run here.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use burn::tensor::backend::Backend;
use serde_json::Value;

/// Prints `skipped: <reason>`; in CI (`CI=true`) fails instead, since there nothing may be
/// skipped.
pub fn skip(reason: &str) {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true but {reason}");
    }
    eprintln!("skipped: {reason}");
}

/// Whether backend `B` runs on its default device (one small sum, see
/// `prompt_r1_model::probe`); when it does not (no Vulkan adapter for the wgpu tests), the
/// test is skipped with the cause, or fails in CI. Probed once per test binary. A GPU backend
/// is also skipped while the CPU kernels' instruction set is capped (see
/// [`gpu_path_unchanged_by_isa_cap`]).
pub fn backend_ready<B: Backend>() -> bool {
    if gpu_path_unchanged_by_isa_cap::<B>() {
        return false;
    }
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let probe = || {
        #[cfg(feature = "wgpu")]
        configure_cubecl();
        prompt_r1_model::probe::probe_device::<B>(&Default::default())
    };
    match READY.get_or_init(probe) {
        Ok(()) => true,
        Err(cause) => {
            // Not `B::name`: asking an unusable device its name panics again.
            skip(&format!("the backend under test cannot run here: {cause}"));
            false
        }
    }
}

/// True (with `skipped: <reason>` printed) when `B` is not the CPU kernels' backend and
/// `PROMPT_R1_CPU_ISA` caps their instruction set: such a run (CI's reruns at lower levels)
/// would repeat the GPU path's tests unchanged, since no CPU kernel runs there.
pub fn gpu_path_unchanged_by_isa_cap<B: Backend>() -> bool {
    let capped = prompt_r1_model::cpu_kernels::isa::isa_cap_from_env().is_ok_and(|cap| cap.is_some());
    let skip = capped && !prompt_r1_model::cpu_kernels::is_flex_backend::<B>();
    if skip {
        eprintln!("skipped: PROMPT_R1_CPU_ISA caps the CPU kernels, which this backend never runs");
    }
    skip
}

/// Keeps CubeCL's autotune results and compiled kernels in the workspace's `target/cubecl`,
/// shared by the wgpu test binaries (CubeCL's default is a `target/` inside the crate's folder,
/// and no kernels); `CUBECL_*` variables (e.g. `CUBECL_AUTOTUNE_LEVEL`) apply.
#[cfg(feature = "wgpu")]
fn configure_cubecl() {
    use burn::cubecl::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/cubecl");
    let mut config = CubeClRuntimeConfig::default().override_from_env();
    config.autotune.cache = CacheConfig::File(dir.clone());
    config.compilation.cache = Some(CacheConfig::File(dir));
    CubeClRuntimeConfig::set(config);
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

/// Largest absolute difference; panics if lengths differ.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

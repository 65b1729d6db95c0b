//! Random initialisation of a Qwen3 checkpoint in HF layout, written straight to disk one tensor
//! at a time (so even the 4B shape needs no more host memory than its largest tensor).
//! Scheme: every linear and the embedding ~ N(0, 0.02²) (HF's `initializer_range`), norms = 1.

use std::path::Path;

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::checkpoint::{write_safetensors_with, StorageDtype};
use crate::config::Qwen3Config;
use crate::error::ModelError;
use crate::weights::{parameter_specs, write_config, ParamKind};

/// Standard deviation of the random weights.
pub const INITIALIZER_RANGE: f32 = 0.02;

/// Writes `config.json` and a random `model.safetensors` into `dir`. Each tensor draws from its
/// own generator seeded by `seed` and the tensor's name, so the file is reproducible.
pub fn write_random_checkpoint(
    config: &Qwen3Config,
    dir: &Path,
    seed: u64,
    dtype: StorageDtype,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let specs = parameter_specs(config);
    let entries: Vec<(String, Vec<usize>)> =
        specs.iter().map(|s| (s.name.clone(), s.shape.clone())).collect();
    write_safetensors_with(dir, &entries, dtype, |name| {
        let spec = specs.iter().find(|s| s.name == name).expect("named above");
        let n: usize = spec.shape.iter().product();
        Ok(match spec.kind {
            ParamKind::Norm => vec![1.0; n],
            ParamKind::Linear | ParamKind::Embedding => {
                let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(name));
                normal_values(&mut rng, n, INITIALIZER_RANGE)
            }
        })
    })?;
    write_config(config, dir, dtype)
}

/// `n` draws from N(0, std²) by the Box–Muller transform.
pub(crate) fn normal_values(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
        let u2: f32 = rng.random();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let theta = std::f32::consts::TAU * u2;
        out.push(r * theta.cos());
        out.push(r * theta.sin());
    }
    out.truncate(n);
    out
}

fn fnv1a(s: &str) -> u64 {
    s.bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::config::Preset;

    #[test]
    fn random_checkpoint_is_reproducible_and_loadable() {
        let config = Preset::Tiny.config(300, vec![299]);
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_random_checkpoint(&config, a.path(), 7, StorageDtype::F32).unwrap();
        write_random_checkpoint(&config, b.path(), 7, StorageDtype::F32).unwrap();
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert_eq!(bytes(a.path()), bytes(b.path()));
        let ckpt = Checkpoint::open(a.path()).unwrap();
        let embed = ckpt.read("model.embed_tokens.weight", &[300, 64]).unwrap();
        let mean = embed.values.iter().sum::<f32>() / embed.values.len() as f32;
        let var = embed.values.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / embed.values.len() as f32;
        assert!(mean.abs() < 0.002 && (var.sqrt() - INITIALIZER_RANGE).abs() < 0.001, "{mean} {var}");
        let norm = ckpt.read("model.norm.weight", &[64]).unwrap();
        assert!(norm.values.iter().all(|&v| v == 1.0));
        assert!(!ckpt.contains("lm_head.weight"), "tiny preset is tied");
        let loaded = Qwen3Config::from_file(&a.path().join("config.json")).unwrap();
        assert_eq!(loaded, config);
    }
}

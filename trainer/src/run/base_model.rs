//! Which model a run trains from, as its checkpoints record it, so that a resume from another
//! model (LoRA adapters on other base weights, a KL reference that changed) is refused.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// A model directory and a fingerprint of what it holds: its `config.json` and the names and
/// sizes of its weight files. A copy of the same model elsewhere has the same fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BaseModel {
    /// The directory, as the run's settings named it.
    pub path: String,
    /// FNV-1a (64-bit, hex) over `config.json` and the weight files' names and sizes.
    pub fingerprint: String,
}

impl BaseModel {
    /// The model in `dir`, or `None` when its `config.json` cannot be read.
    pub fn of(dir: &Path) -> Option<Self> {
        let config = std::fs::read(dir.join("config.json")).ok()?;
        let mut weights: Vec<(String, u64)> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let size = entry.metadata().ok()?.len();
                name.ends_with(".safetensors").then_some((name, size))
            })
            .collect();
        weights.sort();
        let mut hash = Fnv1a::default();
        hash.write(&config);
        for (name, size) in &weights {
            hash.write(name.as_bytes());
            hash.write(&size.to_le_bytes());
        }
        Some(Self {
            path: dir.to_string_lossy().into_owned(),
            fingerprint: format!("{:016x}", hash.0),
        })
    }
}

/// 64-bit FNV-1a: stable across builds and platforms, as a recorded fingerprint must be.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_matches_and_other_weights_or_configs_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let model = |name: &str, config: &str, weights: &[u8]| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::write(path.join("config.json"), config).unwrap();
            std::fs::write(path.join("model.safetensors"), weights).unwrap();
            std::fs::write(path.join("README.md"), name).unwrap();
            BaseModel::of(&path).unwrap()
        };
        let a = model("a", "{\"layers\": 2}", b"0123");
        let copy = model("copy", "{\"layers\": 2}", b"4567");
        assert_eq!(a.fingerprint, copy.fingerprint, "same config, same weight sizes");
        assert_ne!(a.path, copy.path);
        assert_ne!(a.fingerprint, model("b", "{\"layers\": 3}", b"0123").fingerprint);
        assert_ne!(a.fingerprint, model("c", "{\"layers\": 2}", b"01234").fingerprint);
        assert_eq!(BaseModel::of(&dir.path().join("absent")), None);
        let mut known = Fnv1a::default();
        known.write(b"a");
        assert_eq!(known.0, 0xaf63_dc4c_8601_ec8c, "FNV-1a's published value for \"a\"");
    }
}

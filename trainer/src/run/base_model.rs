//! Which model a run trains from, as its checkpoints record it, so that a resume from another
//! model (LoRA adapters on other base weights, a KL reference that changed) is refused.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Slices of each weight file read into the fingerprint, evenly spaced, and their length: enough
/// that two fine-tunes of one model (whose files have the same names, sizes and headers) differ
/// in some slice, at 64 KiB read per file whatever its size.
const SLICES: u64 = 64;
const SLICE_BYTES: u64 = 1024;

/// A model directory and a fingerprint of what it holds: its `config.json`, and its weight
/// files' names, sizes and evenly spaced slices of their bytes. A copy of the same model
/// elsewhere (links followed) has the same fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseModel {
    /// The directory, absolute and with links resolved.
    pub path: String,
    /// FNV-1a (64-bit, hex) over `config.json` and the weight files.
    pub fingerprint: String,
}

impl BaseModel {
    /// The model in `dir` (or LoRA adapters: their `adapter_config.json` in place of
    /// `config.json`), or `None` when its config or a weight file cannot be read.
    pub fn of(dir: &Path) -> Option<Self> {
        let config = std::fs::read(dir.join("config.json")).or_else(|_| std::fs::read(dir.join("adapter_config.json"))).ok()?;
        let mut weights: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
            .collect();
        weights.sort();
        let mut hash = Fnv1a::default();
        hash.write(&config);
        for path in &weights {
            hash.write(path.file_name()?.as_encoded_bytes());
            hash_slices(path, &mut hash).ok()?;
        }
        let path = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        Some(Self {
            path: path.to_string_lossy().into_owned(),
            fingerprint: format!("{:016x}", hash.0),
        })
    }
}

/// The FNV-1a fingerprint (hex) of `bytes`, as [`BaseModel`]'s: for a text an output depends on
/// (a prompt file), recorded to tell whether it changed.
pub fn fingerprint_of(bytes: &[u8]) -> String {
    let mut hash = Fnv1a::default();
    hash.write(bytes);
    format!("{:016x}", hash.0)
}

/// Adds the size of the file at `path` (links followed) and [`SLICES`] evenly spaced slices of
/// its bytes to `hash`.
fn hash_slices(path: &Path, hash: &mut Fnv1a) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    hash.write(&len.to_le_bytes());
    let mut slice = vec![0; SLICE_BYTES as usize];
    for k in 0..SLICES {
        let at = (len.saturating_sub(SLICE_BYTES) * k) / (SLICES - 1);
        file.seek(SeekFrom::Start(at))?;
        let read = file.by_ref().take(SLICE_BYTES).read(&mut slice)?;
        hash.write(&slice[..read]);
    }
    Ok(())
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
        let weights: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let model = |name: &str, config: &str, weights: &[u8]| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::write(path.join("config.json"), config).unwrap();
            std::fs::write(path.join("model.safetensors"), weights).unwrap();
            std::fs::write(path.join("README.md"), name).unwrap();
            BaseModel::of(&path).unwrap()
        };
        let a = model("a", "{\"layers\": 2}", &weights);
        let copy = model("copy", "{\"layers\": 2}", &weights);
        assert_eq!(a.fingerprint, copy.fingerprint, "the same model elsewhere");
        assert_ne!(a.path, copy.path);
        assert_ne!(a.fingerprint, model("b", "{\"layers\": 3}", &weights).fingerprint, "another config");
        // A fine-tune moves weights all through the file: here every 100th byte.
        let tuned: Vec<u8> = weights.iter().enumerate().map(|(i, &b)| if i % 100 == 0 { b ^ 1 } else { b }).collect();
        assert_ne!(a.fingerprint, model("tuned", "{\"layers\": 2}", &tuned).fingerprint, "same size, other bytes");
        assert_ne!(a.fingerprint, model("longer", "{\"layers\": 2}", &[&weights[..], b"x"].concat()).fingerprint);
        assert_eq!(BaseModel::of(&dir.path().join("absent")), None);
        let mut known = Fnv1a::default();
        known.write(b"a");
        assert_eq!(known.0, 0xaf63_dc4c_8601_ec8c, "FNV-1a's published value for \"a\"");
    }

    /// Weights reached through links (a Hugging Face cache snapshot) count as the files they
    /// lead to.
    #[cfg(unix)]
    #[test]
    fn linked_weights_count_as_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::write(blobs.join("0123abcd"), vec![7u8; 50_000]).unwrap();
        let (snapshot, copy) = (dir.path().join("snapshot"), dir.path().join("copy"));
        for path in [&snapshot, &copy] {
            std::fs::create_dir_all(path).unwrap();
            std::fs::write(path.join("config.json"), "{}").unwrap();
        }
        std::os::unix::fs::symlink(blobs.join("0123abcd"), snapshot.join("model.safetensors")).unwrap();
        std::fs::write(copy.join("model.safetensors"), vec![7u8; 50_000]).unwrap();
        assert_eq!(BaseModel::of(&snapshot).unwrap().fingerprint, BaseModel::of(&copy).unwrap().fingerprint);
    }
}

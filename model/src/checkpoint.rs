//! Hugging Face safetensors checkpoints: memory-mapped reading of `model.safetensors` or a
//! sharded set (`model.safetensors.index.json`), and writing a checkpoint back in that layout.
//! This module knows files and bytes, not the model: `load` maps names to model parameters.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, View};

use crate::error::ModelError;

const SINGLE_FILE: &str = "model.safetensors";
const SHARD_INDEX: &str = "model.safetensors.index.json";

/// One memory-mapped safetensors file with its parsed header.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// A tensor read from a checkpoint, converted to f32 on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// A tensor's bytes as stored (little-endian), borrowed from the checkpoint's memory map.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    pub dtype: StorageDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// The storage dtype of a tensor in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageDtype {
    F32,
    BF16,
    F16,
}

/// An opened checkpoint directory. Files are memory-mapped: nothing is read until a tensor is
/// asked for, and then only that tensor's bytes.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join(SHARD_INDEX);
        let single_path = dir.join(SINGLE_FILE);
        let files: Vec<PathBuf> = if index_path.is_file() {
            shard_files(&index_path)?
        } else if single_path.is_file() {
            vec![single_path]
        } else {
            return Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for path in files {
            let shard = open_shard(&path)?;
            for name in shard.metadata.tensors().keys() {
                index.insert(name.clone(), shards.len());
            }
            shards.push(shard);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            index,
        })
    }

    /// Opens one safetensors file on its own (e.g. a PEFT `adapter_model.safetensors`).
    pub fn open_file(path: &Path) -> Result<Self, ModelError> {
        let shard = open_shard(path)?;
        let index = shard.metadata.tensors().keys().map(|name| (name.clone(), 0)).collect();
        Ok(Self {
            dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            shards: vec![shard],
            index,
        })
    }

    /// The directory the checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor of this name exists in any shard.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.index.keys().cloned().collect();
        names.sort();
        names
    }

    /// The storage dtype of a tensor.
    pub fn dtype(&self, name: &str) -> Result<StorageDtype, ModelError> {
        let (shard, info) = self.info(name)?;
        storage_dtype(info.dtype, &shard.path, name)
    }

    /// The shape of a tensor as stored.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        Ok(self.info(name)?.1.shape.clone())
    }

    /// Reads one tensor, checks its shape and converts it to f32.
    pub fn read(&self, name: &str, expected_shape: &[usize]) -> Result<HostTensor, ModelError> {
        self.with_raw(name, expected_shape, |raw| {
            let values = match raw.dtype {
                StorageDtype::F32 => raw
                    .bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                StorageDtype::BF16 => raw
                    .bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                StorageDtype::F16 => raw
                    .bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
            };
            HostTensor {
                shape: raw.shape.to_vec(),
                values,
            }
        })
    }

    /// Checks one tensor's shape and that every value is finite, and hands its stored bytes to
    /// `f`. Afterwards the pages that
    /// hold only this tensor are dropped from the process (they stay in the page cache), so a
    /// load keeps in memory the tensor it converts, not the whole mapped file.
    pub fn with_raw<R>(
        &self,
        name: &str,
        expected_shape: &[usize],
        f: impl FnOnce(RawTensor<'_>) -> R,
    ) -> Result<R, ModelError> {
        let (shard, info) = self.info(name)?;
        if info.shape != expected_shape {
            return Err(ModelError::ShapeMismatch {
                path: shard.path.clone(),
                name: name.to_owned(),
                expected: expected_shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let dtype = storage_dtype(info.dtype, &shard.path, name)?;
        let (start, end) = info.data_offsets;
        let (start, end) = (8 + shard.header_len + start, 8 + shard.header_len + end);
        let bad = |reason: String| ModelError::Safetensors {
            path: shard.path.clone(),
            reason,
        };
        let bytes = shard
            .mmap
            .get(start..end)
            .ok_or_else(|| bad(format!("tensor \"{name}\" lies beyond the end of the file")))?;
        let elem = match dtype {
            StorageDtype::F32 => 4,
            StorageDtype::BF16 | StorageDtype::F16 => 2,
        };
        let count: usize = info.shape.iter().product();
        if bytes.len() != count * elem {
            return Err(bad(format!(
                "tensor \"{name}\" has {} bytes for shape {:?}",
                bytes.len(),
                info.shape
            )));
        }
        if let Some((count, index, value)) = non_finite(dtype, bytes) {
            return Err(ModelError::NonFinite {
                path: shard.path.clone(),
                name: name.to_owned(),
                count,
                index,
                value,
            });
        }
        let out = f(RawTensor {
            dtype,
            shape: &info.shape,
            bytes,
        });
        shard.release(start, end);
        Ok(out)
    }

    fn info(&self, name: &str) -> Result<(&Shard, &safetensors::tensor::TensorInfo), ModelError> {
        let missing = || ModelError::MissingTensor {
            dir: self.dir.clone(),
            name: name.to_owned(),
        };
        let shard = &self.shards[*self.index.get(name).ok_or_else(missing)?];
        let info = shard.metadata.info(name).ok_or_else(missing)?;
        Ok((shard, info))
    }
}

impl Shard {
    /// Drops the whole pages within `start..end` from this process's resident memory. Only a
    /// hint: failure is ignored, and the pages stay in the page cache for any later read.
    fn release(&self, start: usize, end: usize) {
        const PAGE: usize = 4096;
        let (first, last) = (start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
        #[cfg(unix)]
        if first < last {
            // SAFETY: the map is read-only and backed by the file, so a dropped page is read
            // back from it, unchanged, by the next access to it from any thread.
            let _ = unsafe {
                self.mmap
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, last - first)
            };
        }
        #[cfg(not(unix))]
        let _ = (first, last);
    }
}

/// How many of `bytes`' values (stored as `dtype`) are NaN or infinite, with the first one's
/// index and kind; `None` when all are finite. A value is non-finite when its exponent bits are
/// all ones.
fn non_finite(dtype: StorageDtype, bytes: &[u8]) -> Option<(usize, usize, &'static str)> {
    let kind = |nan: bool, negative: bool| match (nan, negative) {
        (true, _) => "NaN",
        (false, false) => "inf",
        (false, true) => "-inf",
    };
    let mut found: Option<(usize, usize, &'static str)> = None;
    let mut note = |index: usize, what: &'static str| match &mut found {
        Some((count, _, _)) => *count += 1,
        None => found = Some((1, index, what)),
    };
    match dtype {
        StorageDtype::F32 => {
            for (i, b) in bytes.chunks_exact(4).enumerate() {
                let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                if bits & 0x7f80_0000 == 0x7f80_0000 {
                    note(i, kind(bits & 0x007f_ffff != 0, bits >> 31 == 1));
                }
            }
        }
        StorageDtype::BF16 | StorageDtype::F16 => {
            let (exponent, mantissa) = if dtype == StorageDtype::BF16 { (0x7f80u16, 0x007fu16) } else { (0x7c00, 0x03ff) };
            for (i, b) in bytes.chunks_exact(2).enumerate() {
                let bits = u16::from_le_bytes([b[0], b[1]]);
                if bits & exponent == exponent {
                    note(i, kind(bits & mantissa != 0, bits >> 15 == 1));
                }
            }
        }
    }
    found
}

fn storage_dtype(dtype: Dtype, path: &Path, name: &str) -> Result<StorageDtype, ModelError> {
    match dtype {
        Dtype::F32 => Ok(StorageDtype::F32),
        Dtype::BF16 => Ok(StorageDtype::BF16),
        Dtype::F16 => Ok(StorageDtype::F16),
        other => Err(ModelError::UnsupportedDtype {
            path: path.to_path_buf(),
            name: name.to_owned(),
            dtype: format!("{other:?}"),
        }),
    }
}

fn open_shard(path: &Path) -> Result<Shard, ModelError> {
    let file = File::open(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the map is read-only; the checkpoint must not be modified while it is loaded,
    // the same contract as every memory-mapped model loader.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (header_len, metadata) =
        safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            reason: describe_safetensors_error(&e, &mmap),
        })?;
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
        header_len,
        metadata,
    })
}

fn describe_safetensors_error(e: &safetensors::SafeTensorError, file: &[u8]) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer | E::InvalidHeaderLength | E::HeaderTooSmall => {
            format!("the file is truncated or its header length is wrong ({e})")
        }
        E::TensorInvalidInfo => inconsistent_tensor(file).unwrap_or_else(|| e.to_string()),
        other => other.to_string(),
    }
}

/// Which tensor of the header of `file` has `data_offsets` that do not span the bytes of its
/// shape and dtype, said as safetensors' `TensorInvalidInfo` (which names none) means it.
fn inconsistent_tensor(file: &[u8]) -> Option<String> {
    let len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(file.get(8..8usize.checked_add(len)?)?).ok()?;
    header.iter().filter(|(name, _)| *name != "__metadata__").find_map(|(name, info)| {
        let dtype: Dtype = serde_json::from_value(info.get("dtype")?.clone()).ok()?;
        let shape: Vec<usize> = serde_json::from_value(info.get("shape")?.clone()).ok()?;
        let [start, end]: [usize; 2] = serde_json::from_value(info.get("data_offsets")?.clone()).ok()?;
        let bytes = shape.iter().try_fold(dtype.bitsize(), |bits, &d| bits.checked_mul(d)).map(|bits| bits / 8);
        let spanned = end.checked_sub(start);
        (bytes != spanned).then(|| {
            let bytes = bytes.map_or("more than can be counted".to_owned(), |b| format!("{b} bytes"));
            format!("tensor `{name}`: shape {shape:?} of {dtype:?} takes {bytes}, but its data_offsets [{start}, {end}] do not span that")
        })
    })
}

/// The distinct shard files named by an index, in first-seen order of their file names.
fn shard_files(index_path: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let bad = |reason: String| ModelError::ShardIndex {
        path: index_path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index_path).map_err(|source| ModelError::Io {
        path: index_path.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("\"{tensor}\" maps to a non-string")))?;
        if file.contains('/') || file.contains('\\') {
            return Err(bad(format!("shard name \"{file}\" must be a plain file name")));
        }
        let path = dir.join(file);
        if !files.contains(&path) {
            if !path.is_file() {
                return Err(bad(format!("shard \"{file}\" (holding \"{tensor}\") is missing")));
            }
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(bad("the weight_map is empty".into()));
    }
    Ok(files)
}

/// A tensor to write, in HF layout, with its values in f32.
pub struct TensorToWrite {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// Writes tensors as a single `model.safetensors` (f32 or bf16), atomically: the file is written
/// under a temporary name in `dir`, synced, then renamed.
pub fn write_safetensors(
    dir: &Path,
    tensors: &[TensorToWrite],
    dtype: StorageDtype,
) -> Result<PathBuf, ModelError> {
    let entries: Vec<(String, Vec<usize>)> =
        tensors.iter().map(|t| (t.name.clone(), t.shape.clone())).collect();
    write_safetensors_with(dir, &entries, dtype, |name| {
        let t = tensors.iter().find(|t| t.name == name).expect("entries come from tensors");
        Ok(t.values.clone())
    })
}

/// Multiplies by `factor` every tensor of the single-file checkpoint in `dir` whose name `which`
/// accepts, and rewrites the file atomically in its dtype (its tensors must share one). For tests
/// and experiments that want a random checkpoint at another scale than its init gives.
pub fn scale_tensors(dir: &Path, which: impl Fn(&str) -> bool, factor: f32) -> Result<(), ModelError> {
    let checkpoint = Checkpoint::open(dir)?;
    let path = dir.join(SINGLE_FILE);
    let bad = |reason: String| ModelError::Safetensors { path: path.clone(), reason };
    if checkpoint.shards.len() != 1 || checkpoint.shards[0].path != path {
        return Err(bad("only a single-file checkpoint can be rescaled".into()));
    }
    let mut dtype = None;
    let mut tensors = Vec::new();
    for name in checkpoint.names() {
        let found = checkpoint.dtype(&name)?;
        if *dtype.get_or_insert(found) != found {
            return Err(bad(format!("tensor \"{name}\" is {found:?}, others {:?}: the tensors must share a dtype", dtype.unwrap())));
        }
        let shape = checkpoint.shape(&name)?;
        let mut values = checkpoint.read(&name, &shape)?.values;
        if which(&name) {
            values.iter_mut().for_each(|v| *v *= factor);
        }
        tensors.push(TensorToWrite { name, shape, values });
    }
    drop(checkpoint);
    write_safetensors(dir, &tensors, dtype.unwrap_or(StorageDtype::F32)).map(drop)
}

/// Streaming form of [`write_safetensors`]: `entries` name every tensor and its shape, and
/// `values(name)` produces one tensor's values at a time, so a checkpoint larger than memory can
/// be written. The file is written by the `safetensors` crate with the `{"format": "pt"}` header
/// metadata that transformers expects, under a temporary name, synced, then renamed.
pub fn write_safetensors_with(
    dir: &Path,
    entries: &[(String, Vec<usize>)],
    dtype: StorageDtype,
    values: impl FnMut(&str) -> Result<Vec<f32>, ModelError>,
) -> Result<PathBuf, ModelError> {
    write_safetensors_file_with(&dir.join(SINGLE_FILE), entries, dtype, values)
}

/// [`write_safetensors_with`] to a file of any name (e.g. a PEFT `adapter_model.safetensors`).
pub fn write_safetensors_file_with(
    path: &Path,
    entries: &[(String, Vec<usize>)],
    dtype: StorageDtype,
    values: impl FnMut(&str) -> Result<Vec<f32>, ModelError>,
) -> Result<PathBuf, ModelError> {
    let path = path.to_path_buf();
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let io = |source| ModelError::Io {
        path: path.clone(),
        source,
    };
    let source = TensorSource {
        values: RefCell::new(values),
        failure: RefCell::new(None),
    };
    let views = entries.iter().map(|(name, shape)| {
        let view = LazyTensor {
            name,
            shape,
            dtype,
            source: &source,
        };
        (name.as_str(), view)
    });
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let written = safetensors::serialize_to_file(views, Some(metadata), &tmp);
    let failure = source.failure.into_inner();
    if let Err(e) = written.map_err(|e| ModelError::Safetensors {
        path: path.clone(),
        reason: e.to_string(),
    }) {
        let _ = std::fs::remove_file(&tmp);
        return Err(failure.unwrap_or(e));
    }
    if let Some(e) = failure {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(io)?;
    // The serializer's temporary file is private (0600); a model is meant to be read by others.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(io)?;
    }
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(path)
}

/// The producer of tensor values shared by the views of one write, and the first error it gave.
struct TensorSource<F> {
    values: RefCell<F>,
    failure: RefCell<Option<ModelError>>,
}

/// One tensor of a write, converted to its storage dtype only when the serializer asks for its
/// bytes (so one tensor at a time is in memory).
struct LazyTensor<'a, F> {
    name: &'a str,
    shape: &'a [usize],
    dtype: StorageDtype,
    source: &'a TensorSource<F>,
}

impl<F: FnMut(&str) -> Result<Vec<f32>, ModelError>> View for LazyTensor<'_, F> {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            StorageDtype::F32 => Dtype::F32,
            StorageDtype::BF16 => Dtype::BF16,
            StorageDtype::F16 => Dtype::F16,
        }
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let count: usize = self.shape.iter().product();
        let values = (self.source.values.borrow_mut())(self.name).and_then(|v| {
            if v.len() == count {
                Ok(v)
            } else {
                Err(ModelError::Input(format!(
                    "tensor \"{}\" has {} values for shape {:?}",
                    self.name,
                    v.len(),
                    self.shape
                )))
            }
        });
        let values = match values {
            Ok(v) => v,
            Err(e) => {
                self.source.failure.borrow_mut().get_or_insert(e);
                // The write is abandoned; these bytes only keep the file's length consistent.
                return Cow::Owned(vec![0; self.data_len()]);
            }
        };
        Cow::Owned(match self.dtype {
            StorageDtype::F32 => bytemuck::cast_slice(&values).to_vec(),
            StorageDtype::BF16 => {
                let halves: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
                bytemuck::cast_slice(&halves).to_vec()
            }
            StorageDtype::F16 => {
                let halves: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
                bytemuck::cast_slice(&halves).to_vec()
            }
        })
    }

    fn data_len(&self) -> usize {
        let elem = match self.dtype {
            StorageDtype::F32 => 4,
            StorageDtype::BF16 | StorageDtype::F16 => 2,
        };
        self.shape.iter().product::<usize>() * elem
    }
}

/// Writes a text file atomically (temporary name, sync, rename).
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut file = File::create(&tmp).map_err(io)?;
    file.write_all(contents).map_err(io)?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<TensorToWrite> {
        vec![
            TensorToWrite {
                name: "b".into(),
                shape: vec![2],
                values: vec![1.0, -2.0],
            },
            TensorToWrite {
                name: "a".into(),
                shape: vec![2, 3],
                values: (0..6).map(|i| i as f32 * 0.5).collect(),
            },
        ]
    }

    #[test]
    fn write_then_read_f32_and_bf16() {
        for dtype in [StorageDtype::F32, StorageDtype::BF16] {
            let dir = tempfile::tempdir().unwrap();
            write_safetensors(dir.path(), &sample(), dtype).unwrap();
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(ckpt.names(), vec!["a".to_string(), "b".to_string()]);
            assert_eq!(ckpt.dtype("a").unwrap(), dtype);
            let a = ckpt.read("a", &[2, 3]).unwrap();
            assert_eq!(a.values, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        }
    }

    #[test]
    fn scaling_multiplies_only_the_chosen_tensors_and_keeps_the_dtype() {
        for dtype in [StorageDtype::F32, StorageDtype::BF16] {
            let dir = tempfile::tempdir().unwrap();
            write_safetensors(dir.path(), &sample(), dtype).unwrap();
            scale_tensors(dir.path(), |name| name == "a", 2.0).unwrap();
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(ckpt.dtype("a").unwrap(), dtype);
            assert_eq!(ckpt.read("a", &[2, 3]).unwrap().values, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
            assert_eq!(ckpt.read("b", &[2]).unwrap().values, vec![1.0, -2.0]);
        }
    }

    /// A header whose offsets do not span a tensor's shape names that tensor (safetensors' own
    /// error names none).
    #[test]
    fn a_tensor_whose_offsets_do_not_fit_its_shape_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[3],"data_offsets":[8,16]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&[0; 16]);
        std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
        let err = Checkpoint::open(dir.path()).err().expect("refused").to_string();
        assert!(err.contains("tensor `b`: shape [3] of F32 takes 12 bytes") && err.contains("[8, 16]"), "{err}");
    }

    #[test]
    fn written_file_carries_the_pytorch_format_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_safetensors(dir.path(), &sample(), StorageDtype::BF16).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let extra = metadata.metadata().as_ref().expect("metadata written");
        assert_eq!(extra.get("format").map(String::as_str), Some("pt"));
    }

    #[test]
    fn a_failed_write_keeps_the_previous_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_safetensors(dir.path(), &sample(), StorageDtype::F32).unwrap();
        let before = std::fs::read(&path).unwrap();
        let entries = vec![("a".to_owned(), vec![2, 3]), ("b".to_owned(), vec![2])];
        let err = write_safetensors_with(dir.path(), &entries, StorageDtype::F32, |name| {
            Ok(if name == "a" { vec![0.0; 6] } else { vec![0.0; 3] })
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("\"b\"") && err.contains("3 values"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(SINGLE_FILE)]);
    }

    #[test]
    fn a_tensor_reads_the_same_after_its_pages_are_released() {
        let dir = tempfile::tempdir().unwrap();
        let big = TensorToWrite {
            name: "big".into(),
            shape: vec![3, 5000],
            values: (0..15_000).map(|i| i as f32 * 0.25).collect(),
        };
        write_safetensors(dir.path(), &[big], StorageDtype::F32).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let len = ckpt.with_raw("big", &[3, 5000], |raw| raw.bytes.len()).unwrap();
        assert_eq!(len, 60_000);
        for _ in 0..2 {
            let t = ckpt.read("big", &[3, 5000]).unwrap();
            assert!(t.values.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.25));
        }
    }

    #[test]
    fn shape_mismatch_and_missing_tensor_are_named() {
        let dir = tempfile::tempdir().unwrap();
        write_safetensors(dir.path(), &sample(), StorageDtype::F32).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let err = ckpt.read("a", &[3, 2]).unwrap_err().to_string();
        assert!(err.contains("\"a\"") && err.contains("[2, 3]"), "{err}");
        let err = ckpt.read("zzz", &[1]).unwrap_err().to_string();
        assert!(err.contains("\"zzz\"") && err.contains("missing"), "{err}");
    }

    #[test]
    fn truncated_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_safetensors(dir.path(), &sample(), StorageDtype::F32).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");
        std::fs::write(&path, b"garbage").unwrap();
        let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
    }

    /// A NaN or an infinity in a stored tensor stops the load, naming the file, the tensor, how
    /// many there are and where the first is, in each storage dtype.
    #[test]
    fn non_finite_weights_are_refused_by_name() {
        for (dtype, value, kind) in [
            (StorageDtype::F32, f32::NAN, "NaN"),
            (StorageDtype::BF16, f32::INFINITY, "inf"),
            (StorageDtype::F16, f32::NEG_INFINITY, "-inf"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut tensors = sample();
            tensors[1].values[4] = value;
            tensors[1].values[5] = f32::NAN;
            let path = write_safetensors(dir.path(), &tensors, dtype).unwrap();
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            assert!(ckpt.read("b", &[2]).is_ok(), "{dtype:?}: a finite tensor still loads");
            let err = ckpt.read("a", &[2, 3]).unwrap_err().to_string();
            let expected = format!("tensor \"a\" holds 2 non-finite value(s), the first ({kind}) at flat index 4");
            assert!(err.contains(&expected) && err.contains(&path.display().to_string()), "{dtype:?}: {err}");
        }
        assert_eq!(non_finite(StorageDtype::F32, &f32::MAX.to_le_bytes()), None);
        assert_eq!(non_finite(StorageDtype::BF16, &half::bf16::MAX.to_le_bytes()), None);
        assert_eq!(non_finite(StorageDtype::F16, &half::f16::MIN.to_le_bytes()), None);
    }

    #[test]
    fn missing_shard_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(SHARD_INDEX),
            r#"{"weight_map": {"x": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
        let empty = tempfile::tempdir().unwrap();
        let err = Checkpoint::open(empty.path()).err().unwrap().to_string();
        assert!(err.contains("no model.safetensors"), "{err}");
    }
}

//! Reading BERT weights from a memory-mapped `model.safetensors` into burn tensors.

use std::fs::File;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::error::SsimError;

/// A memory-mapped safetensors file.
pub struct WeightFile {
    path: PathBuf,
    mmap: Mmap,
}

impl WeightFile {
    /// Memory-maps the file at `path`.
    pub fn open(path: &Path) -> Result<Self, SsimError> {
        let io = |source| SsimError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and lives only while the weights are copied out;
        // model files are not expected to be modified while they are being loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(Self {
            path: path.to_owned(),
            mmap,
        })
    }

    /// Parses the header; the reader borrows the mapped bytes.
    pub fn reader(&self) -> Result<WeightReader<'_>, SsimError> {
        let tensors =
            SafeTensors::deserialize(&self.mmap).map_err(|err| SsimError::Safetensors {
                path: self.path.clone(),
                reason: err.to_string(),
            })?;
        Ok(WeightReader {
            path: &self.path,
            tensors,
        })
    }
}

/// Looks tensors up by their HF name, checks their shape and converts them to f32.
pub struct WeightReader<'a> {
    path: &'a Path,
    tensors: SafeTensors<'a>,
}

impl WeightReader<'_> {
    /// The tensor `name` with shape `shape`, as a burn tensor on `device`.
    pub fn tensor<B: Backend, const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>, SsimError> {
        let values = self.read_f32(name, &shape)?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// A PyTorch `nn.Linear` weight stored `[out, in]`, transposed to burn's `[in, out]`.
    pub fn linear_weight<B: Backend>(
        &self,
        name: &str,
        d_out: usize,
        d_in: usize,
        device: &B::Device,
    ) -> Result<Tensor<B, 2>, SsimError> {
        let values = self.read_f32(name, &[d_out, d_in])?;
        let mut transposed = vec![0.0f32; values.len()];
        for (row, chunk) in values.chunks_exact(d_in).enumerate() {
            for (col, &value) in chunk.iter().enumerate() {
                transposed[col * d_out + row] = value;
            }
        }
        Ok(Tensor::from_data(
            TensorData::new(transposed, [d_in, d_out]),
            device,
        ))
    }

    /// The values of tensor `name` in row-major order, checked against `shape`.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, SsimError> {
        let view = self
            .tensors
            .tensor(name)
            .map_err(|_| SsimError::MissingTensor {
                path: self.path.to_owned(),
                name: name.to_owned(),
            })?;
        if view.shape() != shape {
            return Err(SsimError::WrongShape {
                path: self.path.to_owned(),
                name: name.to_owned(),
                expected: shape.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        let bytes = view.data();
        match view.dtype() {
            Dtype::F32 => Ok(bytemuck::pod_collect_to_vec::<u8, f32>(bytes)),
            Dtype::F16 => Ok(bytemuck::pod_collect_to_vec::<u8, f16>(bytes)
                .into_iter()
                .map(f16::to_f32)
                .collect()),
            Dtype::BF16 => Ok(bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)
                .into_iter()
                .map(bf16::to_f32)
                .collect()),
            other => Err(SsimError::UnsupportedDtype {
                path: self.path.to_owned(),
                name: name.to_owned(),
                dtype: other.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    type B = burn::backend::Flex;

    fn write_file(dir: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                (
                    *name,
                    TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        let path = dir.join("model.safetensors");
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        path
    }

    #[test]
    fn converts_half_precision_to_f32() {
        let dir = tempfile::tempdir().unwrap();
        let halves: Vec<u8> =
            bytemuck::cast_slice(&[f16::from_f32(1.5), f16::from_f32(-2.0)]).to_vec();
        let brains: Vec<u8> =
            bytemuck::cast_slice(&[bf16::from_f32(0.25), bf16::from_f32(3.0)]).to_vec();
        let path = write_file(
            dir.path(),
            &[
                ("a", Dtype::F16, vec![2], halves),
                ("b", Dtype::BF16, vec![2], brains),
            ],
        );
        let file = WeightFile::open(&path).unwrap();
        let reader = file.reader().unwrap();
        assert_eq!(reader.read_f32("a", &[2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(reader.read_f32("b", &[2]).unwrap(), vec![0.25, 3.0]);
    }

    #[test]
    fn transposes_linear_weights() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let path = write_file(
            dir.path(),
            &[(
                "w",
                Dtype::F32,
                vec![2, 3],
                bytemuck::cast_slice(&values).to_vec(),
            )],
        );
        let file = WeightFile::open(&path).unwrap();
        let weight = file
            .reader()
            .unwrap()
            .linear_weight::<B>("w", 2, 3, &Default::default())
            .unwrap();
        assert_eq!(weight.dims(), [3, 2]);
        let data = weight.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        assert_eq!(data, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }

    #[test]
    fn names_missing_and_misshapen_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<f32> = vec![0.0; 6];
        let path = write_file(
            dir.path(),
            &[(
                "w",
                Dtype::F32,
                vec![2, 3],
                bytemuck::cast_slice(&values).to_vec(),
            )],
        );
        let file = WeightFile::open(&path).unwrap();
        let reader = file.reader().unwrap();
        let missing = reader.read_f32("v", &[2, 3]).unwrap_err();
        assert!(matches!(&missing, SsimError::MissingTensor { name, .. } if name == "v"));
        let wrong = reader.read_f32("w", &[3, 2]).unwrap_err();
        assert!(
            matches!(&wrong, SsimError::WrongShape { name, actual, .. } if name == "w" && actual == &[2, 3]),
            "{wrong}"
        );
    }

    #[test]
    fn rejects_integer_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), &[("ids", Dtype::I64, vec![1], vec![0u8; 8])]);
        let file = WeightFile::open(&path).unwrap();
        let err = file.reader().unwrap().read_f32("ids", &[1]).unwrap_err();
        assert!(matches!(err, SsimError::UnsupportedDtype { .. }), "{err}");
    }

    #[test]
    fn rejects_a_file_that_is_not_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        let file = WeightFile::open(&path).unwrap();
        let err = file.reader().err().unwrap();
        assert!(matches!(err, SsimError::Safetensors { .. }), "{err}");
    }
}

//! Reading BERT weights into burn tensors through the workspace's one safetensors reader
//! ([`model::checkpoint::Checkpoint`]: memory-mapped, f32, f16 or bf16 converted to f32).

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use model::checkpoint::Checkpoint;

use super::error::SsimError;

/// Looks tensors up by their HF name in a model folder's `model.safetensors`, checks their
/// shape and converts them to f32.
pub struct WeightReader {
    checkpoint: Checkpoint,
}

impl WeightReader {
    /// Opens (memory-maps) `dir/model.safetensors` and parses its header.
    pub fn open(dir: &Path) -> Result<Self, SsimError> {
        Ok(Self {
            checkpoint: Checkpoint::open(dir)?,
        })
    }

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
        Ok(self.checkpoint.read(name, shape)?.values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::checkpoint::{write_safetensors, StorageDtype, TensorToWrite};
    use model::ModelError;

    type B = burn::backend::Flex;

    fn write(dir: &Path, name: &str, shape: Vec<usize>, values: Vec<f32>, dtype: StorageDtype) {
        let tensor = TensorToWrite {
            name: name.into(),
            shape,
            values,
        };
        write_safetensors(dir, &[tensor], dtype).unwrap();
    }

    #[test]
    fn converts_half_precision_to_f32() {
        for dtype in [StorageDtype::F16, StorageDtype::BF16] {
            let dir = tempfile::tempdir().unwrap();
            write(dir.path(), "a", vec![2], vec![1.5, -2.0], dtype);
            let reader = WeightReader::open(dir.path()).unwrap();
            assert_eq!(reader.read_f32("a", &[2]).unwrap(), vec![1.5, -2.0]);
        }
    }

    #[test]
    fn transposes_linear_weights() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        write(dir.path(), "w", vec![2, 3], values, StorageDtype::F32);
        let weight = WeightReader::open(dir.path())
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
        write(dir.path(), "w", vec![2, 3], vec![0.0; 6], StorageDtype::F32);
        let reader = WeightReader::open(dir.path()).unwrap();
        let missing = reader.read_f32("v", &[2, 3]).unwrap_err();
        assert!(
            matches!(&missing, SsimError::Weights(ModelError::MissingTensor { name, .. }) if name == "v"),
            "{missing}"
        );
        let wrong = reader.read_f32("w", &[3, 2]).unwrap_err();
        assert!(
            matches!(&wrong, SsimError::Weights(ModelError::ShapeMismatch { name, found, .. }) if name == "w" && found == &[2, 3]),
            "{wrong}"
        );
    }

    #[test]
    fn rejects_a_file_that_is_not_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("model.safetensors"),
            b"not a safetensors file",
        )
        .unwrap();
        let err = WeightReader::open(dir.path()).err().unwrap();
        assert!(
            matches!(err, SsimError::Weights(ModelError::Safetensors { .. })),
            "{err}"
        );
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }
}

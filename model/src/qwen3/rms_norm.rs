//! `Qwen3RMSNorm`: `weight * x / sqrt(mean(x²) + eps)`, computed in f32 as HF does.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::cpu_kernels::rms_norm;

/// Root-mean-square layer norm over the last dimension.
#[derive(Module, Debug)]
pub struct Qwen3RMSNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub variance_epsilon: f64,
}

impl<B: Backend> Qwen3RMSNorm<B> {
    /// A norm with the given weight.
    pub fn new(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            variance_epsilon: eps,
        }
    }

    /// Normalises `x` over its last dimension; the statistics are taken in f32.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let weight = self.weight.val();
        if let Some(normed) = rms_norm(&x, &weight, self.variance_epsilon) {
            return normed;
        }
        let dtype = x.dtype();
        let x32 = if dtype == DType::F32 { x } else { x.cast(DType::F32) };
        let variance = x32.clone().square().mean_dim(D - 1);
        let normed = x32 * (variance + self.variance_epsilon).sqrt().recip();
        let normed = if dtype == DType::F32 { normed } else { normed.cast(dtype) };
        normed * weight.unsqueeze()
    }
}

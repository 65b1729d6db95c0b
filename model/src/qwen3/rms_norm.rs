//! `Qwen3RMSNorm`: `weight * x / sqrt(mean(x²) + eps)`, computed in f32 as HF does.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::kernels;

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

    /// Normalises `hidden_states` over its last dimension; the statistics are taken in f32.
    pub fn forward<const D: usize>(&self, hidden_states: Tensor<B, D>) -> Tensor<B, D> {
        let weight = self.weight.val();
        kernels::rms_norm(&hidden_states, &weight, self.variance_epsilon).unwrap_or_else(|| {
            let input_dtype = hidden_states.dtype();
            let hidden_states = hidden_states.cast(DType::F32);
            let variance = hidden_states.clone().square().mean_dim(D - 1);
            let hidden_states = hidden_states * (variance + self.variance_epsilon).sqrt().recip();
            weight.unsqueeze() * hidden_states.cast(input_dtype)
        })
    }
}

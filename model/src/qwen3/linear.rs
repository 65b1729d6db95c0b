//! `nn.Linear` without bias (every Qwen3 projection), with bf16 weights on the burn-flex CPU
//! backend routed to the hand-written kernels (see `cpu_kernels`).

use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor};

use crate::cpu_kernels::{weight_matmul, WeightLayout};

/// `layer.forward(x)`.
pub fn linear<B: Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let fast = match layer.bias {
        None => weight_matmul(&x, &layer.weight.val(), WeightLayout::InOut),
        Some(_) => None,
    };
    fast.unwrap_or_else(|| layer.forward(x))
}

//! `Qwen3MLP`: SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::silu, backend::Backend, Tensor};

use super::linear::{linear, MatmulPrecision};
use crate::kernels;

/// The gated feed-forward block of a decoder layer.
#[derive(Module, Debug)]
pub struct Qwen3MLP<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: Backend> Qwen3MLP<B> {
    /// `[.., hidden] -> [.., hidden]`, the projections at precision `matmul`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, matmul: MatmulPrecision) -> Tensor<B, D> {
        let gate = linear(&self.gate_proj, x.clone(), matmul);
        let up = linear(&self.up_proj, x, matmul);
        let hidden = kernels::silu_mul(&gate, &up).unwrap_or_else(|| silu(gate) * up);
        linear(&self.down_proj, hidden, matmul)
    }
}

//! `Qwen3MLP`: SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::silu, backend::Backend, Tensor};

use super::linear::linear;
use crate::cpu_kernels::silu_mul;

/// The gated feed-forward block of a decoder layer.
#[derive(Module, Debug)]
pub struct Qwen3MLP<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: Backend> Qwen3MLP<B> {
    /// `[.., hidden] -> [.., hidden]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let gate = linear(&self.gate_proj, x.clone());
        let up = linear(&self.up_proj, x);
        let hidden = silu_mul(&gate, &up).unwrap_or_else(|| silu(gate) * up);
        linear(&self.down_proj, hidden)
    }
}

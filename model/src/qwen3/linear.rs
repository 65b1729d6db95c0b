//! `nn.Linear` without bias (every Qwen3 projection), with bf16 weights on the burn-flex CPU
//! backend routed to the hand-written kernels (see `cpu_kernels`).

use burn::nn::Linear;
use burn::tensor::{backend::Backend, module, Tensor};

use crate::cpu_kernels::{weight_matmul, WeightLayout};

/// `layer.forward(x)`.
pub fn linear<B: Backend, const D: usize>(layer: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let weight = layer.weight.val();
    let fast = match layer.bias {
        None => weight_matmul(&x, &weight, WeightLayout::InOut),
        Some(_) => None,
    };
    fast.unwrap_or_else(|| linear_rows(x, weight, layer.bias.as_ref().map(|b| b.val())))
}

/// `x · weight (+ bias)` for a `[in, out]` weight, with every leading dimension of `x` folded
/// into one row dimension first. burn's `linear` on a rank-3 input broadcasts the weight to
/// `[1, in, out]`; its backward then copies the transposed weight for the input gradient (a
/// reshape of a transposed view) and computes one weight gradient per batch element before
/// summing them. On a 2-D input both are a single strided matmul.
pub fn linear_rows<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let mut dims = x.dims();
    let rows = dims[..D - 1].iter().product();
    let y = module::linear(x.reshape([rows, dims[D - 1]]), weight, bias);
    dims[D - 1] = y.dims()[1];
    y.reshape(dims)
}

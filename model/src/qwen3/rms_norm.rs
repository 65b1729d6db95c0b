//! `Qwen3RMSNorm`: `weight * x / sqrt(mean(x²) + eps)`, computed in f32 as HF does.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

use super::compute::PassKernels;
use super::rotary::{apply_rotary_pos_emb, RotaryTables};
use crate::{device_kernels, kernels};

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

    /// Normalises `hidden_states` over its last dimension; the statistics are taken in f32. A
    /// CPU kernel or a GPU backend's ([`device_kernels::NormKernels`]) stands in where the `pass`
    /// allows one.
    pub fn forward<const D: usize>(&self, hidden_states: Tensor<B, D>, pass: PassKernels) -> Tensor<B, D> {
        let weight = self.weight.val();
        let fused = kernels::rms_norm(pass.cpu, &hidden_states, &weight, self.variance_epsilon).or_else(|| {
            let kernels = lent(pass, &[&hidden_states], &weight)?;
            let (rows, dims) = rows(&hidden_states);
            Some((kernels.rms_norm)(hidden_states.clone().reshape(rows), weight.clone(), self.variance_epsilon).reshape(dims))
        });
        fused.unwrap_or_else(|| {
            let input_dtype = hidden_states.dtype();
            let hidden_states = hidden_states.cast(DType::F32);
            let variance = hidden_states.clone().square().mean_dim(D - 1);
            let hidden_states = hidden_states * (variance + self.variance_epsilon).sqrt().recip();
            weight.unsqueeze() * hidden_states.cast(input_dtype)
        })
    }

    /// The residual addition before this norm, then the norm, a token a row (`[tokens,
    /// hidden]`): `(residual + delta, norm(residual + delta))`, or `(residual, norm(residual))`
    /// with no `delta`. Where the `pass` allows a GPU backend's, it may take both in one (vLLM's
    /// `fused_add_rms_norm`).
    pub fn add_and_forward(&self, residual: Tensor<B, 2>, delta: Option<Tensor<B, 2>>, pass: PassKernels) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let Some(delta) = delta else {
            return (residual.clone(), self.forward(residual, pass));
        };
        let weight = self.weight.val();
        if let Some(kernels) = lent(pass, &[&residual, &delta], &weight) {
            return (kernels.add_rms_norm)(residual, delta, weight, self.variance_epsilon);
        }
        let sum = residual + delta;
        (sum.clone(), self.forward(sum, pass))
    }

    /// This norm over each head of `x` (`[b, q, heads, head_dim]`), then RoPE by `tables`
    /// (HF's `apply_rotary_pos_emb(q_norm(q), ..)`). In a pass over a KV cache a GPU backend's
    /// kernel may take both, for the queries and the keys, with the cache's write
    /// (`Qwen3Attention`).
    pub fn forward_rotated(&self, x: Tensor<B, 4>, tables: &RotaryTables<B>, pass: PassKernels) -> Tensor<B, 4> {
        apply_rotary_pos_emb(self.forward(x, pass), tables, pass.cpu)
    }
}

/// The norm kernels a GPU backend lent, for a `pass` that allows them and whose operands share
/// the weight's dtype. `None` where none are registered (autodiff backends included), in a pass
/// that allows none, or with dtypes that differ.
pub(crate) fn lent<B: Backend, const D: usize>(pass: PassKernels, operands: &[&Tensor<B, D>], weight: &Tensor<B, 1>) -> Option<device_kernels::NormKernels<B>> {
    if operands.iter().any(|x| x.dtype() != weight.dtype()) {
        return None;
    }
    pass.device.norms::<B>()
}

/// `x`'s leading axes as one: `[rows, hidden]`, and `x`'s dims to restore.
pub(crate) fn rows<B: Backend, const D: usize>(x: &Tensor<B, D>) -> ([usize; 2], [usize; D]) {
    let dims = x.dims();
    ([dims[..D - 1].iter().product(), dims[D - 1]], dims)
}

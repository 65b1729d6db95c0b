//! `Qwen3RMSNorm`: `weight * x / sqrt(mean(x²) + eps)`, computed in f32 as HF does.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

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

    /// Normalises `hidden_states` over its last dimension; the statistics are taken in f32.
    pub fn forward<const D: usize>(&self, hidden_states: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_over_cache(hidden_states, false)
    }

    /// [`Self::forward`] in a pass that is `over_cache` (generation's prefill and decoding
    /// steps over a KV cache), where a GPU backend's kernel may stand in
    /// ([`device_kernels::rms_norm`]). Passes without a cache (scoring, the update) keep burn's
    /// ops, so that old log-probs and the update's forward agree to the last bit.
    pub fn forward_over_cache<const D: usize>(&self, hidden_states: Tensor<B, D>, over_cache: bool) -> Tensor<B, D> {
        let weight = self.weight.val();
        let fused = kernels::rms_norm(&hidden_states, &weight, self.variance_epsilon).or_else(|| {
            over_cache
                .then(|| on_device(&hidden_states, &weight, self.variance_epsilon))
                .flatten()
        });
        fused.unwrap_or_else(|| {
            let input_dtype = hidden_states.dtype();
            let hidden_states = hidden_states.cast(DType::F32);
            let variance = hidden_states.clone().square().mean_dim(D - 1);
            let hidden_states = hidden_states * (variance + self.variance_epsilon).sqrt().recip();
            weight.unsqueeze() * hidden_states.cast(input_dtype)
        })
    }
}

/// The norm by the kernel a GPU backend lent ([`device_kernels::rms_norm`]): one kernel where
/// burn's ops take a reduction and two element-wise kernels. `None` where none is registered
/// (autodiff backends included) or the weight's dtype differs from the activations'.
fn on_device<B: Backend, const D: usize>(x: &Tensor<B, D>, weight: &Tensor<B, 1>, eps: f64) -> Option<Tensor<B, D>> {
    let kernel = device_kernels::rms_norm::<B>()?;
    if weight.dtype() != x.dtype() {
        return None;
    }
    let dims = x.dims();
    let hidden = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    Some(kernel(x.clone().reshape([rows, hidden]), weight.clone(), eps).reshape(dims))
}

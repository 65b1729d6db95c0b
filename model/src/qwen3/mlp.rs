//! `Qwen3MLP`: SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::silu, backend::Backend, Tensor};

use super::linear::{lora_linear, MatmulPrecision};
use super::rms_norm::rows;
use crate::lora::LoraLayer;
use crate::{device_kernels, kernels};

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
        self.forward_with_adapters(x, matmul, None, false)
    }

    /// [`Self::forward`] with the layer's LoRA adapters on the projections that have one. In a
    /// pass `over_cache` (generation's, over a KV cache) a GPU backend's kernel may compute
    /// `silu(gate) · up` ([`device_kernels::SiluMulFn`]); passes without a cache keep burn's ops,
    /// as the norms do.
    pub fn forward_with_adapters<const D: usize>(
        &self,
        x: Tensor<B, D>,
        matmul: MatmulPrecision,
        adapters: Option<&LoraLayer<B>>,
        over_cache: bool,
    ) -> Tensor<B, D> {
        let gate = lora_linear(&self.gate_proj, adapters.and_then(|a| a.gate_proj.as_ref()), x.clone(), matmul);
        let up = lora_linear(&self.up_proj, adapters.and_then(|a| a.up_proj.as_ref()), x, matmul);
        let lent = over_cache && gate.dtype() == up.dtype();
        let hidden = kernels::silu_mul(&gate, &up)
            .or_else(|| {
                let kernel = lent.then(device_kernels::silu_mul::<B>).flatten()?;
                let (rows, dims) = rows(&gate);
                Some(kernel(gate.clone().reshape(rows), up.clone().reshape(rows)).reshape(dims))
            })
            .unwrap_or_else(|| silu(gate) * up);
        lora_linear(&self.down_proj, adapters.and_then(|a| a.down_proj.as_ref()), hidden, matmul)
    }
}

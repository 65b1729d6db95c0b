//! `Qwen3DecoderLayer`: pre-norm attention and MLP blocks with residual connections.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};

use super::attention::{AttentionInputs, Qwen3Attention};
use super::cache::LayerKvCache;
use super::compute::Compute;
use super::mlp::Qwen3MLP;
use super::rms_norm::Qwen3RMSNorm;
use crate::lora::LoraLayer;

/// One transformer block.
#[derive(Module, Debug)]
pub struct Qwen3DecoderLayer<B: Backend> {
    pub self_attn: Qwen3Attention<B>,
    pub mlp: Qwen3MLP<B>,
    pub input_layernorm: Qwen3RMSNorm<B>,
    pub post_attention_layernorm: Qwen3RMSNorm<B>,
}

impl<B: Backend> Qwen3DecoderLayer<B> {
    /// `[b, q, hidden] -> [b, q, hidden]`.
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        compute: &Compute,
    ) -> Tensor<B, 3> {
        self.forward_with_adapters(hidden_states, inputs, cache, compute, None)
    }

    /// [`Self::forward`] with this layer's LoRA adapters (its slice of
    /// [`crate::lora::LoraAdapters`]) on the projections that have one.
    pub fn forward_with_adapters(
        &self,
        hidden_states: Tensor<B, 3>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        compute: &Compute,
        adapters: Option<&LoraLayer<B>>,
    ) -> Tensor<B, 3> {
        // A pass over a KV cache may normalise through a GPU backend's kernel.
        let over_cache = cache.is_some();
        let residual = hidden_states.clone();
        let hidden_states = self.input_layernorm.forward_over_cache(hidden_states, over_cache);
        let hidden_states = residual
            + self
                .self_attn
                .forward_with_adapters(hidden_states, inputs, cache, compute, adapters);
        let residual = hidden_states.clone();
        let hidden_states = self.post_attention_layernorm.forward_over_cache(hidden_states, over_cache);
        residual
            + self
                .mlp
                .forward_with_adapters(hidden_states, compute.matmul, adapters)
    }
}

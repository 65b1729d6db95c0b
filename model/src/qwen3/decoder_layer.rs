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
        let dims = hidden_states.dims();
        self.forward_stream(ResidualStream::new(hidden_states), inputs, cache, compute, adapters)
            .summed()
            .reshape(dims)
    }

    /// The layer on the residual stream, leaving its MLP's output unadded: the next layer's
    /// `input_layernorm` (or the final norm) adds it, in one kernel where a GPU backend lends
    /// one for a pass over a KV cache ([`Qwen3RMSNorm::add_and_forward`]). The stream's tokens
    /// are rows (`[b · q, hidden]`) from layer to layer, as the products and the GPU's kernels
    /// take them, so no layer reshapes them to `[b, q, hidden]` and back.
    pub fn forward_stream(
        &self,
        stream: ResidualStream<B>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        compute: &Compute,
        adapters: Option<&LoraLayer<B>>,
    ) -> ResidualStream<B> {
        // A pass over a KV cache may normalise through a GPU backend's kernels.
        let pass = compute.pass(cache.is_some());
        let (residual, hidden_states) = self.input_layernorm.add_and_forward(stream.residual, stream.pending, pass);
        let attn_output = self
            .self_attn
            .forward_rows(hidden_states, inputs, cache, compute, adapters);
        let (residual, hidden_states) = self.post_attention_layernorm.add_and_forward(residual, Some(attn_output), pass);
        let mlp_output = self.mlp.forward_with_adapters(hidden_states, compute, adapters, pass);
        ResidualStream { residual, pending: Some(mlp_output) }
    }
}

/// The hidden states between decoder layers, a token a row (`[b · q, hidden]`): the residual
/// stream, and the last block's output not yet added to it (`residual + pending` is HF's
/// `hidden_states`, reshaped).
#[derive(Debug, Clone)]
pub struct ResidualStream<B: Backend> {
    pub residual: Tensor<B, 2>,
    pub pending: Option<Tensor<B, 2>>,
}

impl<B: Backend> ResidualStream<B> {
    /// Hidden states `[b, q, hidden]` with nothing pending.
    pub fn new(hidden_states: Tensor<B, 3>) -> Self {
        let [b, q, hidden] = hidden_states.dims();
        Self::from_rows(hidden_states.reshape([b * q, hidden]))
    }

    /// Hidden states a token a row (`[b · q, hidden]`) with nothing pending.
    pub fn from_rows(hidden_states: Tensor<B, 2>) -> Self {
        Self { residual: hidden_states, pending: None }
    }

    /// HF's `hidden_states` a token a row: the pending output added.
    pub fn summed(self) -> Tensor<B, 2> {
        match self.pending {
            Some(pending) => self.residual + pending,
            None => self.residual,
        }
    }
}

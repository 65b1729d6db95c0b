//! `Qwen3Model` (embeddings → layers → final norm) and `Qwen3ForCausalLM` (+ `lm_head`, tied to
//! the embedding when the config says so).

use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::{backend::Backend, Int, Tensor};

use super::attention::AttentionInputs;
use super::cache::KvCache;
use super::decoder_layer::{Qwen3DecoderLayer, ResidualStream};
use super::compute::Compute;
use super::linear::{project, MatmulPrecision};
use super::mask::AttentionMask;
use super::rms_norm::Qwen3RMSNorm;
use super::rotary::Qwen3RotaryEmbedding;
use crate::config::Qwen3Config;
use crate::kernels::{self, WeightLayout};
use crate::error::ModelError;
use crate::lora::LoraAdapters;

/// The decoder stack without the language-model head.
#[derive(Module, Debug)]
pub struct Qwen3Model<B: Backend> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<Qwen3DecoderLayer<B>>,
    pub norm: Qwen3RMSNorm<B>,
    #[module(skip)]
    pub rotary_emb: Qwen3RotaryEmbedding,
    /// How the model computes: the attention implementation, the precision of every
    /// projection's f32 products (the head's included), the CPU kernels and the GPU kernels
    /// it runs.
    #[module(skip)]
    pub compute: Compute,
}

/// What a forward pass returns besides logits.
#[derive(Debug, Clone)]
pub struct ModelOutput<B: Backend> {
    /// The final-norm output, `[b, q, hidden]`.
    pub last_hidden_state: Tensor<B, 3>,
    /// When asked for: the embeddings and the output of every layer (before the final norm).
    pub hidden_states: Option<Vec<Tensor<B, 3>>>,
}

impl<B: Backend> Qwen3Model<B> {
    /// Runs the decoder on `input_ids` `[b, q]` at `position_ids` `[b, q]`.
    ///
    /// `attention_mask` is `[b, past + q]` (1 = real token, 0 = padding) or `None` for no padding;
    /// `cache`, when given, has its pass's slots set ([`KvCache::set_slots`]): the new positions
    /// are written there and each row attends to `past` positions before them.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
        attention_mask: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut KvCache<B>>,
        output_hidden_states: bool,
    ) -> ModelOutput<B> {
        self.forward_with_adapters(input_ids, position_ids, attention_mask, cache, output_hidden_states, None)
    }

    /// [`Self::forward`] with LoRA adapters beside the weights (`None`: the model alone).
    ///
    /// Panics if `adapters` were made for a model with another number of layers.
    pub fn forward_with_adapters(
        &self,
        input_ids: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
        attention_mask: Option<&Tensor<B, 2, Int>>,
        mut cache: Option<&mut KvCache<B>>,
        output_hidden_states: bool,
        adapters: Option<&LoraAdapters<B>>,
    ) -> ModelOutput<B> {
        if let Some(a) = adapters {
            assert_eq!(a.layers.len(), self.layers.len(), "LoRA adapters for {} layers, the model has {}", a.layers.len(), self.layers.len());
        }
        let [b, q_len] = input_ids.dims();
        let past = cache.as_ref().map_or(0, |c| c.past());
        let pass = self.compute.pass(cache.is_some());
        let device = input_ids.device();
        let hidden_states = kernels::embedding(self.compute.cpu_kernels, &self.embed_tokens.weight.val(), &input_ids)
            .unwrap_or_else(|| self.embed_tokens.forward(input_ids));
        let mask = AttentionMask::new(attention_mask, b, past, q_len, &device);
        let inputs = self.attention_inputs(position_ids, mask, hidden_states.dtype());
        let dims = hidden_states.dims();
        let mut all_hidden = output_hidden_states.then(|| vec![hidden_states.clone()]);
        let mut stream = ResidualStream::new(hidden_states);
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let layer_adapters = adapters.map(|a| &a.layers[i]);
            stream = layer.forward_stream(stream, &inputs, layer_cache, &self.compute, layer_adapters);
            if let Some(all) = all_hidden.as_mut() {
                let hidden_states = stream.summed();
                all.push(hidden_states.clone().reshape(dims));
                stream = ResidualStream::from_rows(hidden_states);
            }
        }
        // Each layer's MLP output is added by the next norm, the last one by this one.
        let (_, last_hidden_state) = self.norm.add_and_forward(stream.residual, stream.pending, pass);
        ModelOutput { last_hidden_state: last_hidden_state.reshape(dims), hidden_states: all_hidden }
    }

    /// What every layer's attention takes from a pass at `position_ids` under `mask` with
    /// activations of `dtype`, built as this model computes (for callers that run layers
    /// themselves, such as activation checkpointing).
    pub fn attention_inputs(&self, position_ids: Tensor<B, 2, Int>, mask: AttentionMask<B>, dtype: burn::tensor::DType) -> AttentionInputs<B> {
        let heads = self
            .layers
            .first()
            .map_or((1, 1), |l| (l.self_attn.num_heads, l.self_attn.num_key_value_heads));
        AttentionInputs::new(&self.rotary_emb, position_ids, mask, dtype, heads, &self.compute)
    }
}

/// Qwen3 with its language-model head.
#[derive(Module, Debug)]
pub struct Qwen3ForCausalLM<B: Backend> {
    pub model: Qwen3Model<B>,
    /// `[hidden, vocab]` (burn layout); `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    #[module(skip)]
    pub config: Qwen3Config,
}

impl<B: Backend> Qwen3ForCausalLM<B> {
    /// Logits `[b, q, vocab]` for every input position.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
        attention_mask: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        self.forward_with_adapters(input_ids, position_ids, attention_mask, cache, None)
    }

    /// [`Self::forward`] with LoRA adapters beside the weights (`None`: the model alone).
    pub fn forward_with_adapters(
        &self,
        input_ids: Tensor<B, 2, Int>,
        position_ids: Tensor<B, 2, Int>,
        attention_mask: Option<&Tensor<B, 2, Int>>,
        cache: Option<&mut KvCache<B>>,
        adapters: Option<&LoraAdapters<B>>,
    ) -> Tensor<B, 3> {
        let out = self
            .model
            .forward_with_adapters(input_ids, position_ids, attention_mask, cache, false, adapters);
        self.logits(out.last_hidden_state)
    }

    /// Applies the language-model head to final hidden states `[b, q, hidden]`.
    pub fn logits(&self, hidden_states: Tensor<B, 3>) -> Tensor<B, 3> {
        let (weight, layout) = match &self.lm_head {
            Some(weight) => (weight.val(), WeightLayout::InOut),
            None => (self.model.embed_tokens.weight.val(), WeightLayout::OutIn),
        };
        project(hidden_states, weight, layout, &self.model.compute)
    }

    /// This model with its f32 products at precision `matmul` (see [`MatmulPrecision`]), the
    /// rest of its [`Compute`] unchanged.
    pub fn with_matmul_precision(mut self, matmul: MatmulPrecision) -> Self {
        self.model.compute.matmul = matmul;
        self
    }

    /// How this model computes (chosen at load).
    pub fn compute(&self) -> &Compute {
        &self.model.compute
    }

    /// Whether this model computes ragged passes over a KV cache
    /// ([`KvCache::set_ragged_slots`]): on a backend whose paged-attention kernel takes
    /// prefills, with the memory-efficient attention and no CPU kernels.
    pub fn takes_ragged_passes(&self) -> bool {
        self.model.compute.device_kernels.paged_attention::<B>(2).is_some()
            && self.model.compute.attn_implementation == super::compute::AttnImplementation::MemoryEfficient
            && !self.model.compute.cpu_kernels.run_on::<B>()
    }

    /// An empty KV cache sized for this model.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.model.layers.len(), self.config.num_key_value_heads)
    }

    /// The device the weights live on.
    pub fn device(&self) -> B::Device {
        self.model.embed_tokens.weight.val().device()
    }

    /// Checks that token ids are inside the vocabulary (an out-of-range id would otherwise
    /// index past the embedding table).
    pub fn check_token_ids(&self, ids: &[u32]) -> Result<(), ModelError> {
        match ids
            .iter()
            .find(|&&id| id as usize >= self.config.vocab_size)
        {
            Some(bad) => Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            ))),
            None => Ok(()),
        }
    }
}

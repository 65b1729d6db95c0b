//! `Qwen3Attention`: grouped-query attention with a per-head RMSNorm on queries and keys
//! (`q_norm`, `k_norm`) applied before RoPE.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, DType, Int, Tensor};

use super::cache::LayerKvCache;
use super::linear::{lora_linear, MatmulPrecision};
use super::rms_norm::Qwen3RMSNorm;
use super::rotary::{apply_rotary_pos_emb, Qwen3RotaryEmbedding, RotaryTables};
use crate::kernels;
use crate::lora::LoraLayer;

/// Self-attention of one decoder layer. Projections have no bias.
#[derive(Module, Debug)]
pub struct Qwen3Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: Qwen3RMSNorm<B>,
    pub k_norm: Qwen3RMSNorm<B>,
    pub num_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
}

/// What every layer's attention takes from one forward pass, built once and shared by all
/// layers: RoPE tables for the query and the key heads, and the additive mask, `[b, 1, q, k]`
/// and repeated to the grouped score layout `[b, kv, groups * q, k]`, so per-layer element-wise
/// work runs on contiguous tensors of equal shape.
#[derive(Debug, Clone)]
pub struct AttentionInputs<B: Backend> {
    pub rotary_q: RotaryTables<B>,
    pub rotary_k: RotaryTables<B>,
    pub bias: Tensor<B, 4>,
    pub grouped_bias: Tensor<B, 4>,
}

impl<B: Backend> AttentionInputs<B> {
    /// `bias` is `[b, 1, q, k]` (see [`super::attention_bias`]).
    pub fn new(
        rotary: &Qwen3RotaryEmbedding,
        position_ids: Tensor<B, 2, Int>,
        bias: Tensor<B, 4>,
        num_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        let dtype = bias.dtype();
        let [b, _, q_len, k_len] = bias.dims();
        let groups = num_heads / num_key_value_heads;
        let grouped_bias = bias
            .clone()
            .reshape([b, 1, q_len * k_len])
            .repeat_dim(1, num_heads)
            .reshape([b, num_key_value_heads, groups * q_len, k_len]);
        let tables = rotary.tables(position_ids, dtype);
        Self {
            rotary_q: tables.repeat_heads(num_heads),
            rotary_k: tables.repeat_heads(num_key_value_heads),
            bias,
            grouped_bias,
        }
    }
}

impl<B: Backend> Qwen3Attention<B> {
    /// `hidden_states` `[b, q, hidden]`; `inputs` built for these positions, with `k` counting
    /// cached plus new positions; projections at precision `matmul`. Returns `[b, q, hidden]`.
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        matmul: MatmulPrecision,
    ) -> Tensor<B, 3> {
        self.forward_with_adapters(hidden_states, inputs, cache, matmul, None)
    }

    /// [`Self::forward`] with the layer's LoRA adapters on the projections that have one.
    pub fn forward_with_adapters(
        &self,
        hidden_states: Tensor<B, 3>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        matmul: MatmulPrecision,
        adapters: Option<&LoraLayer<B>>,
    ) -> Tensor<B, 3> {
        let [b, q_len, _] = hidden_states.dims();
        let (h, kv, d) = (self.num_heads, self.num_key_value_heads, self.head_dim);

        let query_states = self
            .q_norm
            .forward(lora_linear(&self.q_proj, adapters.and_then(|a| a.q_proj.as_ref()), hidden_states.clone(), matmul).reshape([b, q_len, h, d]));
        let key_states = self
            .k_norm
            .forward(lora_linear(&self.k_proj, adapters.and_then(|a| a.k_proj.as_ref()), hidden_states.clone(), matmul).reshape([b, q_len, kv, d]));
        let query_states = apply_rotary_pos_emb(query_states, &inputs.rotary_q);
        let key_states = apply_rotary_pos_emb(key_states, &inputs.rotary_k).swap_dims(1, 2);
        let value_states = lora_linear(&self.v_proj, adapters.and_then(|a| a.v_proj.as_ref()), hidden_states, matmul)
            .reshape([b, q_len, kv, d])
            .swap_dims(1, 2);

        let (key_states, value_states) = match cache {
            Some(cache) => cache.append(key_states, value_states),
            None => (key_states, value_states),
        };

        let scaling = (d as f64).powf(-0.5);
        let fused = kernels::grouped_attention(&query_states, &key_states, &value_states, &inputs.bias, scaling as f32);
        let attn_output = fused.unwrap_or_else(|| {
            let query_states = query_states.swap_dims(1, 2);
            eager_attention_forward(query_states, key_states, value_states, &inputs.grouped_bias, scaling)
                .swap_dims(1, 2)
                .reshape([b, q_len, h * d])
        });
        lora_linear(&self.o_proj, adapters.and_then(|a| a.o_proj.as_ref()), attn_output, matmul)
    }
}

/// `softmax(Q Kᵀ / sqrt(d) + bias) V` for `h` query heads sharing `kv` key/value heads.
///
/// Equivalent to HF's `repeat_kv` followed by plain attention, without materialising the repeated
/// heads: the `h / kv` query heads of a group are stacked along the query axis, so each group does
/// one matmul against its own keys. `bias` is in that stacked layout, `[b, kv, groups * q, k]`.
/// The softmax runs in f32 as in HF's eager attention.
fn eager_attention_forward<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    bias: &Tensor<B, 4>,
    scaling: f64,
) -> Tensor<B, 4> {
    let [b, h, q_len, d] = query.dims();
    let kv = key.dims()[1];
    let groups = h / kv;
    let dtype = query.dtype();

    let query = query.reshape([b, kv, groups * q_len, d]);
    let scores = query.matmul(key.swap_dims(2, 3)).mul_scalar(scaling) + bias.clone();
    let probs = softmax(scores.cast(DType::F32), 3).cast(dtype);
    probs.matmul(value).reshape([b, h, q_len, d])
}

/// `softmax(x)` along `dim`, written out as burn's default (and autodiff's) decomposition:
/// `exp(x − max) / Σ exp(x − max)`. burn-flex's fused softmax multiplies by the reciprocal of
/// the sum instead and so differs in the last bits; written out, scoring (plain backend) and the
/// update (autodiff) give the same probabilities on every backend.
fn softmax<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    let max = x.clone().detach().max_dim(dim);
    let exp = (x - max).exp();
    let sum = exp.clone().sum_dim(dim);
    exp / sum
}

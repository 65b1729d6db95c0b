//! `Qwen3Attention`: grouped-query attention with a per-head RMSNorm on queries and keys
//! (`q_norm`, `k_norm`) applied before RoPE.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::softmax, backend::Backend, DType, Tensor};

use super::cache::LayerKvCache;
use super::rms_norm::Qwen3RMSNorm;
use super::rotary::apply_rotary_pos_emb;

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

impl<B: Backend> Qwen3Attention<B> {
    /// `hidden_states` `[b, q, hidden]`; `cos`/`sin` `[b, 1, q, head_dim]`; `bias` `[b, 1, q, k]`
    /// where `k` counts cached plus new positions. Returns `[b, q, hidden]`.
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        bias: &Tensor<B, 4>,
        cache: Option<&mut LayerKvCache<B>>,
    ) -> Tensor<B, 3> {
        let [b, q_len, _] = hidden_states.dims();
        let (h, kv, d) = (self.num_heads, self.num_key_value_heads, self.head_dim);

        let query_states = self
            .q_norm
            .forward(self.q_proj.forward(hidden_states.clone()).reshape([b, q_len, h, d]))
            .swap_dims(1, 2);
        let key_states = self
            .k_norm
            .forward(self.k_proj.forward(hidden_states.clone()).reshape([b, q_len, kv, d]))
            .swap_dims(1, 2);
        let value_states = self
            .v_proj
            .forward(hidden_states)
            .reshape([b, q_len, kv, d])
            .swap_dims(1, 2);

        let (query_states, key_states) = apply_rotary_pos_emb(query_states, key_states, cos, sin);
        let (key_states, value_states) = match cache {
            Some(cache) => cache.append(key_states, value_states),
            None => (key_states, value_states),
        };

        let attn_output = grouped_attention(query_states, key_states, value_states, bias, d);
        let attn_output = attn_output.swap_dims(1, 2).reshape([b, q_len, h * d]);
        self.o_proj.forward(attn_output)
    }
}

/// `softmax(Q Kᵀ / sqrt(d) + bias) V` for `h` query heads sharing `kv` key/value heads.
///
/// Equivalent to HF's `repeat_kv` followed by plain attention, without materialising the repeated
/// heads: the `h / kv` query heads of a group are stacked along the query axis, so each group does
/// one matmul against its own keys. The softmax runs in f32 as in HF's eager attention.
fn grouped_attention<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    bias: &Tensor<B, 4>,
    head_dim: usize,
) -> Tensor<B, 4> {
    let [b, h, q_len, d] = query.dims();
    let [_, kv, k_len, _] = key.dims();
    let groups = h / kv;
    let dtype = query.dtype();
    let scaling = (head_dim as f64).powf(-0.5);

    let query = query.reshape([b, kv, groups * q_len, d]);
    let scores = query.matmul(key.swap_dims(2, 3)).mul_scalar(scaling);
    let scores = scores.reshape([b, kv, groups, q_len, k_len]) + bias.clone().unsqueeze_dim::<5>(2);
    let probs = if dtype == DType::F32 {
        softmax(scores, 4)
    } else {
        softmax(scores.cast(DType::F32), 4).cast(dtype)
    };
    let out = probs.reshape([b, kv, groups * q_len, k_len]).matmul(value);
    out.reshape([b, h, q_len, d])
}

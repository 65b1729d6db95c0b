//! HF's eager attention (`eager_attention_forward` in `modeling_qwen3.py`): the reference the
//! other implementations are checked against.

use burn::tensor::{backend::Backend, DType, Tensor};

/// `softmax(Q Kᵀ / sqrt(d) + bias) V` for `h` query heads sharing `kv` key/value heads, `query`
/// `[b, h, q, d]`, `key` and `value` `[b, kv, k, d]`; returns `[b, h, q, d]`.
///
/// Equivalent to HF's `repeat_kv` followed by plain attention, without materialising the repeated
/// heads: the `h / kv` query heads of a group are stacked along the query axis, so each group does
/// one matmul against its own keys. `bias` is in that stacked layout, `[b, kv, groups * q, k]`
/// (see [`grouped_bias`]). The softmax runs in f32 as in HF's eager attention.
pub fn eager_attention_forward<B: Backend>(
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

/// The bias `[b, 1, q, k]` repeated to the grouped score layout `[b, kv, groups * q, k]` of
/// [`eager_attention_forward`], so its element-wise work runs on tensors of equal shape.
pub fn grouped_bias<B: Backend>(bias: &Tensor<B, 4>, num_heads: usize, num_key_value_heads: usize) -> Tensor<B, 4> {
    let [b, _, q_len, k_len] = bias.dims();
    let groups = num_heads / num_key_value_heads;
    bias.clone()
        .reshape([b, 1, q_len * k_len])
        .repeat_dim(1, num_heads)
        .reshape([b, num_key_value_heads, groups * q_len, k_len])
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

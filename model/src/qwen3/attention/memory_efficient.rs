//! Memory-efficient attention (FlashAttention-2's algorithm) in burn's tensor ops, so that it
//! runs on every backend: keys are visited a block at a time with an online softmax, and only
//! the output and each query row's log-sum-exp are kept. The backward recomputes each block's
//! probabilities from them instead of keeping `[b, heads, q, k]` scores.
//!
//! Forward, per block `j` of keys (`s` the scale): `S = s·Q·K_jᵀ + mask`; `m' = max(m, rowmax S)`;
//! `l = l·e^(m−m') + rowsum e^(S−m')`; `O = O·e^(m−m') + e^(S−m')·V_j`; at the end `O /= l` and
//! `LSE = m + log l`.
//!
//! Backward: `D = rowsum(dO ∘ O)`; per block `P_j = e^(S_j − LSE)`, `dV_j += P_jᵀ·dO`,
//! `dP_j = dO·V_jᵀ`, `dS_j = P_j ∘ (dP_j − D)`, `dQ += s·dS_j·K_j`, `dK_j += s·dS_jᵀ·Q`.
//!
//! Queries are visited in blocks too, so the scores of one block pair, `[b, kv_heads, groups ·
//! query block, key block]`, are the largest temporary, and key blocks that lie wholly after a
//! query block's last position are skipped (causal). Key blocks grow past the query block while
//! one block pair's scores stay within [`SCORE_BLOCK_ELEMENTS`]: a decoding step sees its whole
//! cache in one block. Grouped-query attention runs without repeating keys and values: the
//! `groups` query heads that share a key/value head are stacked along the query axis, as HF's
//! `repeat_kv` pairs them (query head `h` reads key/value head `h / groups`). The mask is built
//! per block from positions and the key padding ([`AttentionMask::block_bias`]).
//!
//! The scores are formed in the operands' dtype (as the eager formula does) and the softmax runs
//! in f32; the backward computes in f32 and returns the gradients in the operands' dtypes.

use burn::tensor::{backend::Backend, DType, Tensor};

use crate::qwen3::compute::SCORE_BLOCK_ELEMENTS;
use crate::qwen3::mask::AttentionMask;

/// Attention's operands as this path takes them: `query` `[b, heads, q, d]` (the heads of a
/// group adjacent), `key` and `value` `[b, kv_heads, k, d]`, RoPE applied.
#[derive(Debug, Clone)]
pub struct Operands<B: Backend> {
    pub query: Tensor<B, 4>,
    pub key: Tensor<B, 4>,
    pub value: Tensor<B, 4>,
}

/// How one call is cut into blocks, and the scores' scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Blocks {
    /// Queries per block.
    pub queries: usize,
    /// Keys per block.
    pub keys: usize,
    /// The scores' factor, `1 / sqrt(head_dim)`.
    pub scale: f32,
}

impl Blocks {
    /// Blocks of `size` queries, and keys in multiples of `size` while a block pair's scores stay
    /// within [`SCORE_BLOCK_ELEMENTS`], for operands `x`.
    pub fn new<B: Backend>(x: &Operands<B>, size: usize, scale: f32) -> Self {
        let s = Shape::of(x);
        let queries = size.clamp(1, s.queries.max(1));
        let rows = s.batch * s.kv_heads * s.groups * queries;
        let budget = SCORE_BLOCK_ELEMENTS / rows.max(1);
        let keys = (budget / size.max(1)).max(1) * size.max(1);
        Self { queries, keys: keys.min(s.keys.max(1)), scale }
    }
}

/// The forward pass's result: the output `[b, heads, q, d]` in the operands' dtype, and each
/// query row's log-sum-exp of its scores (f32), one `[b, kv_heads, groups · rows, 1]` tensor per
/// query block, kept for the backward.
#[derive(Debug, Clone)]
pub struct Forward<B: Backend> {
    pub output: Tensor<B, 4>,
    pub lse: Vec<Tensor<B, 4>>,
}

/// The gradients of the three operands, in their dtypes and layouts.
#[derive(Debug, Clone)]
pub struct Gradients<B: Backend> {
    pub query: Tensor<B, 4>,
    pub key: Tensor<B, 4>,
    pub value: Tensor<B, 4>,
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Shape {
    batch: usize,
    kv_heads: usize,
    groups: usize,
    queries: usize,
    keys: usize,
    head_dim: usize,
}

impl Shape {
    fn of<B: Backend>(x: &Operands<B>) -> Self {
        let [batch, heads, queries, head_dim] = x.query.dims();
        let [_, kv_heads, keys, _] = x.key.dims();
        assert!(
            kv_heads > 0 && heads % kv_heads == 0,
            "{heads} query heads cannot share {kv_heads} key/value heads evenly"
        );
        Self { batch, kv_heads, groups: heads / kv_heads, queries, keys, head_dim }
    }

    /// The query blocks `(q0, q1)`.
    fn query_blocks(self, blocks: Blocks) -> impl Iterator<Item = (usize, usize)> {
        (0..self.queries).step_by(blocks.queries).map(move |q0| (q0, (q0 + blocks.queries).min(self.queries)))
    }

    /// The key blocks `(k0, k1)` that queries before `q1` (exclusive) may see, after `past`
    /// cached keys.
    fn key_blocks(self, blocks: Blocks, past: usize, q1: usize) -> impl Iterator<Item = (usize, usize)> {
        let visible = (past + q1).min(self.keys);
        (0..visible).step_by(blocks.keys).map(move |k0| (k0, (k0 + blocks.keys).min(self.keys)))
    }
}

/// Queries `q0..q1` of every head, grouped by key/value head: `[b, kv_heads, groups · rows, d]`
/// (a copy: one group's rows are not adjacent in `[b, heads, q, d]`).
fn query_rows<B: Backend>(query: &Tensor<B, 4>, s: Shape, (q0, q1): (usize, usize)) -> Tensor<B, 4> {
    query
        .clone()
        .reshape([s.batch, s.kv_heads, s.groups, s.queries, s.head_dim])
        .narrow(3, q0, q1 - q0)
        .reshape([s.batch, s.kv_heads, s.groups * (q1 - q0), s.head_dim])
}

/// The inverse of [`query_rows`] over all blocks: `[b, kv_heads, groups · rows, d]` pieces in
/// query order back to `[b, heads, q, d]`.
fn from_query_rows<B: Backend>(pieces: Vec<Tensor<B, 4>>, s: Shape) -> Tensor<B, 4> {
    let pieces: Vec<Tensor<B, 5>> = pieces
        .into_iter()
        .map(|p| {
            let rows = p.dims()[2] / s.groups;
            p.reshape([s.batch, s.kv_heads, s.groups, rows, s.head_dim])
        })
        .collect();
    Tensor::cat(pieces, 3).reshape([s.batch, s.kv_heads * s.groups, s.queries, s.head_dim])
}

/// `s·Q·Kᵀ + mask` in f32 for one block pair: `q` `[b, kv, rows, d]` and `k` `[b, kv, c, d]` in
/// the operands' dtype, multiplied in that dtype as the eager formula does.
fn scores<B: Backend>(q: &Tensor<B, 4>, k: Tensor<B, 4>, bias: Option<Tensor<B, 4>>, scale: f32) -> Tensor<B, 4> {
    let s = q.clone().matmul(k.swap_dims(2, 3)).cast(DType::F32).mul_scalar(scale);
    match bias {
        Some(bias) => s + bias,
        None => s,
    }
}

/// The running state of one query block: the row maxima `m`, the sums `l` and the unnormalised
/// output `O`, all f32.
struct Running<B: Backend> {
    max: Tensor<B, 4>,
    sum: Tensor<B, 4>,
    out: Tensor<B, 4>,
}

/// The forward pass (see the module docs).
pub fn forward<B: Backend>(x: &Operands<B>, mask: &AttentionMask<B>, blocks: Blocks) -> Forward<B> {
    let s = Shape::of(x);
    let dtype = x.query.dtype();
    let mut outputs = Vec::new();
    let mut lse = Vec::new();
    for (q0, q1) in s.query_blocks(blocks) {
        let q = query_rows(&x.query, s, (q0, q1));
        let mut running: Option<Running<B>> = None;
        for (k0, k1) in s.key_blocks(blocks, mask.past(), q1) {
            let k = x.key.clone().narrow(2, k0, k1 - k0);
            let v = x.value.clone().narrow(2, k0, k1 - k0);
            let scores = scores(&q, k, mask.block_bias(s.groups, (q0, q1), (k0, k1)), blocks.scale);
            let block_max = scores.clone().max_dim(3);
            running = Some(match running {
                None => {
                    let p = (scores - block_max.clone()).exp();
                    let sum = p.clone().sum_dim(3);
                    let out = p.cast(dtype).matmul(v).cast(DType::F32);
                    Running { max: block_max, sum, out }
                }
                Some(Running { max, sum, out }) => {
                    let new_max = max.clone().max_pair(block_max);
                    let alpha = (max - new_max.clone()).exp();
                    let p = (scores - new_max.clone()).exp();
                    let sum = sum * alpha.clone() + p.clone().sum_dim(3);
                    let out = out * alpha + p.cast(dtype).matmul(v).cast(DType::F32);
                    Running { max: new_max, sum, out }
                }
            });
        }
        let Running { max, sum, out } = running.expect("every query sees at least the first key");
        outputs.push((out / sum.clone()).cast(dtype));
        lse.push(max + sum.log());
    }
    Forward { output: from_query_rows(outputs, s), lse }
}

/// The backward pass (see the module docs): the gradients of `x` given the output's gradient
/// `grad` `[b, heads, q, d]` and the forward pass's result, computed in f32.
pub fn backward<B: Backend>(
    x: &Operands<B>,
    mask: &AttentionMask<B>,
    blocks: Blocks,
    forward: &Forward<B>,
    grad: Tensor<B, 4>,
) -> Gradients<B> {
    let s = Shape::of(x);
    let f32 = |t: Tensor<B, 4>| t.cast(DType::F32);
    let key_blocks: Vec<(usize, usize)> = s.key_blocks(blocks, mask.past(), s.queries).collect();
    let mut dk: Vec<Option<Tensor<B, 4>>> = vec![None; key_blocks.len()];
    let mut dv: Vec<Option<Tensor<B, 4>>> = vec![None; key_blocks.len()];
    let mut dq = Vec::new();
    for ((q0, q1), lse) in s.query_blocks(blocks).zip(&forward.lse) {
        let q = query_rows(&x.query, s, (q0, q1));
        let q32 = f32(q.clone());
        let d_out = f32(query_rows(&grad, s, (q0, q1)));
        let out = f32(query_rows(&forward.output, s, (q0, q1)));
        let delta = (d_out.clone() * out).sum_dim(3);
        let mut dq_block: Option<Tensor<B, 4>> = None;
        for (j, (k0, k1)) in s.key_blocks(blocks, mask.past(), q1).enumerate() {
            let k = x.key.clone().narrow(2, k0, k1 - k0);
            let v = f32(x.value.clone().narrow(2, k0, k1 - k0));
            let bias = mask.block_bias(s.groups, (q0, q1), (k0, k1));
            let p = (scores(&q, k.clone(), bias, blocks.scale) - lse.clone()).exp();
            add_to(&mut dv[j], p.clone().swap_dims(2, 3).matmul(d_out.clone()));
            let dp = d_out.clone().matmul(v.swap_dims(2, 3));
            let ds = (p * (dp - delta.clone())).mul_scalar(blocks.scale);
            add_to(&mut dq_block, ds.clone().matmul(f32(k)));
            add_to(&mut dk[j], ds.swap_dims(2, 3).matmul(q32.clone()));
        }
        dq.push(dq_block.expect("every query block sees the first key block"));
    }
    let device = x.key.device();
    let whole = |parts: Vec<Option<Tensor<B, 4>>>, dtype: DType| {
        let zeros = |k0: usize, k1: usize| Tensor::<B, 4>::zeros([s.batch, s.kv_heads, k1 - k0, s.head_dim], (&device, DType::F32));
        let mut parts: Vec<Tensor<B, 4>> = parts
            .into_iter()
            .zip(&key_blocks)
            .map(|(part, &(k0, k1))| part.unwrap_or_else(|| zeros(k0, k1)))
            .collect();
        let seen = key_blocks.last().map_or(0, |&(_, k1)| k1);
        if seen < s.keys {
            parts.push(zeros(seen, s.keys));
        }
        Tensor::cat(parts, 2).cast(dtype)
    };
    Gradients {
        query: from_query_rows(dq, s).cast(x.query.dtype()),
        key: whole(dk, x.key.dtype()),
        value: whole(dv, x.value.dtype()),
    }
}

/// `*acc += term` (`term` itself the first time).
fn add_to<B: Backend>(acc: &mut Option<Tensor<B, 4>>, term: Tensor<B, 4>) {
    *acc = Some(match acc.take() {
        Some(sum) => sum + term,
        None => term,
    });
}

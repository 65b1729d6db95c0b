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
//! `dP_j = dO·V_jᵀ`, `dS_j = P_j ∘ (dP_j − D)`, `dQ += s·dS_j·K_j`, `dK_j += s·dS_jᵀ·Q`. A pass
//! that is one block pair (a short prefill or update) keeps its `P` instead of recomputing it:
//! no more than that block's scores, and the recomputation would cost one product in five.
//!
//! Queries are visited in blocks too, so the scores of one block pair, `[b, kv_heads, groups ·
//! query block, key block]`, are the largest temporary. The key axis is cut where the query blocks
//! are: the new keys of a query block's own positions form one chunk, its causal diagonal, the
//! only block that needs a causal mask (a triangle, the same for every query block, so one is
//! built per pass); the keys before it (the cache, earlier query blocks) are wholly visible and
//! are visited in spans as wide as one block pair's scores allow within
//! [`SCORE_BLOCK_ELEMENTS`] (a decoding step sees its whole cache in one span), and the keys after
//! it are skipped. Grouped-query attention runs without repeating keys and values: the
//! `groups` query heads that share a key/value head are stacked along the query axis, as HF's
//! `repeat_kv` pairs them (query head `h` reads key/value head `h / groups`). The key padding is
//! added per block (`AttentionMask::block_bias`).
//!
//! The scores are formed in the operands' dtype (as the eager formula does) and the softmax runs
//! in f32; the backward computes in f32 and returns the gradients in the operands' dtypes.
//!
//! Where a GPU backend lends a kernel for it ([`crate::device_kernels::FreshAttention`],
//! `--device-kernels all`), the forward is that kernel, every block in one launch, the scores
//! rounded to the operands' dtype as here; it gives the output and the log-sum-exp, and the
//! backward above recomputes the probabilities from them. Scoring and a training step's forward
//! both come through [`forward`] or [`forward_for_backward`], so they take it alike.

use burn::tensor::{backend::Backend, DType, Tensor};

use crate::device_kernels::{self, DeviceKernelChoice};
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
    /// The widest span of wholly visible keys visited at once, a multiple of `queries` (a query
    /// block's causal diagonal is visited apart).
    pub keys: usize,
    /// The scores' factor, `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Whether the forward runs on the [`device_kernels::FreshAttention`] kernel a GPU backend
    /// lends, where it lends one ([`DeviceKernelChoice::fresh_attention`]).
    pub device_kernels: DeviceKernelChoice,
}

impl Blocks {
    /// Blocks of `size` queries, and keys in multiples of `size` while a block pair's scores stay
    /// within [`SCORE_BLOCK_ELEMENTS`], for operands `x`.
    pub fn new<B: Backend>(x: &Operands<B>, size: usize, scale: f32, device_kernels: DeviceKernelChoice) -> Self {
        let s = Shape::of(x);
        let (queries, keys) = block_sizes(s.batch, s.kv_heads * s.groups, s.queries, s.keys, size);
        Self { queries, keys, scale, device_kernels }
    }
}

/// Queries per block and the widest span of keys for `batch` sequences of `heads` query heads,
/// `queries` queries over `keys` keys, in blocks of `size` queries: the sizes [`Blocks::new`]
/// chooses (the memory plan counts with them). One block pair's scores are at most
/// `batch · heads · queries · keys`.
pub fn block_sizes(batch: usize, heads: usize, queries: usize, keys: usize, size: usize) -> (usize, usize) {
    let size = size.max(1);
    let query_block = size.min(queries.max(1));
    let rows = (batch * heads * query_block).max(1);
    let key_block = (SCORE_BLOCK_ELEMENTS / rows / size).max(1) * size;
    (query_block, key_block.min(keys.max(1)))
}

/// The forward pass's result: the output `[b, heads, q, d]` in the operands' dtype, and each
/// query row's log-sum-exp of its scores (f32), one `[b, kv_heads, groups · rows, 1]` tensor per
/// query block, kept for the backward.
#[derive(Debug, Clone)]
pub struct Forward<B: Backend> {
    pub output: Tensor<B, 4>,
    pub lse: Vec<Tensor<B, 4>>,
    /// The probabilities `[b, kv_heads, groups · q, k]` (f32) of a pass that is one block pair,
    /// kept for the backward by [`forward_for_backward`]: no larger than the block's scores, and
    /// the backward then need not recompute them.
    pub probs: Option<Tensor<B, 4>>,
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

    /// The key axis in chunks: the `past` cached keys in chunks of at most `blocks.keys`, then
    /// the new keys cut where the query blocks are (chunk `cached + i` is query block `i`'s
    /// causal diagonal). Keys after the last query are in no chunk: no query sees them.
    fn key_chunks(self, blocks: Blocks, past: usize) -> KeyChunks {
        let past = past.min(self.keys);
        let mut chunks: Vec<(usize, usize)> = (0..past).step_by(blocks.keys).map(|k0| (k0, (k0 + blocks.keys).min(past))).collect();
        let cached = chunks.len();
        chunks.extend(
            self.query_blocks(blocks)
                .map(|(q0, q1)| (past + q0, (past + q1).min(self.keys)))
                .filter(|(k0, k1)| k0 < k1),
        );
        KeyChunks { chunks, cached, width: blocks.keys }
    }
}

/// The key axis of one call in chunks (see [`Shape::key_chunks`]).
struct KeyChunks {
    chunks: Vec<(usize, usize)>,
    /// How many chunks hold cached keys.
    cached: usize,
    /// The widest span of wholly visible chunks visited at once.
    width: usize,
}

impl KeyChunks {
    /// The chunks query block `block` sees, in spans visited as one block: adjacent wholly
    /// visible chunks while a span stays within `width` keys, then the block's causal diagonal
    /// alone (or within the last span when it is one query wide, so nothing to mask). Each span
    /// is a range of chunk indices.
    fn spans(&self, block: usize) -> Vec<std::ops::Range<usize>> {
        let diagonal = self.cached + block;
        let visible = (diagonal + 1).min(self.chunks.len());
        let masked = |i: usize| i == diagonal && self.chunks[i].1 - self.chunks[i].0 > 1;
        let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
        for i in 0..visible {
            let k1 = self.chunks[i].1;
            match spans.last_mut() {
                Some(span) if !masked(i) && k1 - self.chunks[span.start].0 <= self.width => span.end = i + 1,
                _ => spans.push(i..i + 1),
            }
        }
        spans
    }

    /// The keys `(k0, k1)` of a span.
    fn keys(&self, span: &std::ops::Range<usize>) -> (usize, usize) {
        (self.chunks[span.start].0, self.chunks[span.end - 1].1)
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
fn from_query_rows<B: Backend>(mut pieces: Vec<Tensor<B, 4>>, s: Shape) -> Tensor<B, 4> {
    let heads = [s.batch, s.kv_heads * s.groups, s.queries, s.head_dim];
    if pieces.len() == 1 {
        // One block: its rows are already in query order, no copy needed.
        return pieces.remove(0).reshape(heads);
    }
    let pieces: Vec<Tensor<B, 5>> = pieces
        .into_iter()
        .map(|p| {
            let rows = p.dims()[2] / s.groups;
            p.reshape([s.batch, s.kv_heads, s.groups, rows, s.head_dim])
        })
        .collect();
    Tensor::cat(pieces, 3).reshape(heads)
}

/// `s·Q·Kᵀ + mask` in f32 for one block pair: `q` `[b, kv, rows, d]` and `k` `[b, kv, c, d]` in
/// the operands' dtype, multiplied in that dtype as the eager formula does; `bias` comes at the
/// scores' shape ([`AttentionMask::block_bias`]).
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
    run_forward(x, mask, blocks, false)
}

/// [`forward`] for a pass whose backward will follow: where the pass is one block pair (one
/// query block, one span of keys) its probabilities are kept ([`Forward::probs`]), which spares
/// the backward FlashAttention-2's recomputation of the scores at the cost of one block's
/// scores, as eager attention would keep.
pub fn forward_for_backward<B: Backend>(x: &Operands<B>, mask: &AttentionMask<B>, blocks: Blocks) -> Forward<B> {
    run_forward(x, mask, blocks, true)
}

fn run_forward<B: Backend>(x: &Operands<B>, mask: &AttentionMask<B>, blocks: Blocks, keep_probs: bool) -> Forward<B> {
    if let Some(kernel) = blocks.device_kernels.fresh_attention::<B>() {
        return kernel_forward(kernel, x, mask, blocks);
    }
    let s = Shape::of(x);
    let dtype = x.query.dtype();
    let mut outputs = Vec::new();
    let mut lse = Vec::new();
    let chunks = s.key_chunks(blocks, mask.past());
    let one_pair = keep_probs && s.queries <= blocks.queries && chunks.spans(0).len() == 1;
    let mut probs = None;
    for (block, (q0, q1)) in s.query_blocks(blocks).enumerate() {
        let q = query_rows(&x.query, s, (q0, q1));
        let mut running: Option<Running<B>> = None;
        for span in chunks.spans(block) {
            let (k0, k1) = chunks.keys(&span);
            let k = x.key.clone().narrow(2, k0, k1 - k0);
            let v = x.value.clone().narrow(2, k0, k1 - k0);
            let scores = scores(&q, k, mask.block_bias(s.kv_heads, s.groups, (q0, q1), (k0, k1)), blocks.scale);
            let block_max = scores.clone().max_dim(3);
            running = Some(match running {
                None => {
                    let p = (scores - block_max.clone()).exp();
                    let sum = p.clone().sum_dim(3);
                    if one_pair {
                        probs = Some(p.clone() / sum.clone());
                    }
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
    Forward { output: from_query_rows(outputs, s), lse, probs }
}

/// The forward pass by a GPU backend's kernel ([`device_kernels::FreshAttention`]): every block
/// in one launch, the log-sum-exp cut into the query blocks the backward takes, and no
/// probabilities kept (the backward recomputes them). Scoring and a training step's forward
/// both come here, so they give the same values.
fn kernel_forward<B: Backend>(kernel: device_kernels::FreshAttentionFn<B>, x: &Operands<B>, mask: &AttentionMask<B>, blocks: Blocks) -> Forward<B> {
    let s = Shape::of(x);
    let (output, lse) = kernel(device_kernels::FreshAttention {
        query: super::heads_last(x.query.clone()),
        key: super::heads_last(x.key.clone()),
        value: super::heads_last(x.value.clone()),
        valid: mask.valid_keys(),
        scale: blocks.scale,
        tensor_cores: blocks.device_kernels.tensor_cores,
    });
    // `[b, q, heads]` as `[b, kv_heads, groups, q]`: for one query a reshape alone (its swapped
    // view, reshaped, came out wrong on wgpu: the gradients of `attention::wgpu`'s one-query case).
    let lse = match s.queries {
        1 => lse,
        _ => lse.swap_dims(1, 2),
    };
    let lse = lse.reshape([s.batch, s.kv_heads, s.groups, s.queries]);
    let lse = s
        .query_blocks(blocks)
        .map(|(q0, q1)| {
            let rows = if q1 - q0 == s.queries { lse.clone() } else { lse.clone().narrow(3, q0, q1 - q0) };
            rows.reshape([s.batch, s.kv_heads, s.groups * (q1 - q0), 1])
        })
        .collect();
    Forward { output: super::heads_first(output), lse, probs: None }
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
    let chunks = s.key_chunks(blocks, mask.past());
    let mut dk: Vec<Option<Tensor<B, 4>>> = vec![None; chunks.chunks.len()];
    let mut dv: Vec<Option<Tensor<B, 4>>> = vec![None; chunks.chunks.len()];
    let mut dq = Vec::new();
    for (block, ((q0, q1), lse)) in s.query_blocks(blocks).zip(&forward.lse).enumerate() {
        let q = query_rows(&x.query, s, (q0, q1));
        let q32 = f32(q.clone());
        let d_out = f32(query_rows(&grad, s, (q0, q1)));
        let out = f32(query_rows(&forward.output, s, (q0, q1)));
        let delta = (d_out.clone() * out).sum_dim(3);
        let mut dq_block: Option<Tensor<B, 4>> = None;
        for span in chunks.spans(block) {
            let (k0, k1) = chunks.keys(&span);
            let k = x.key.clone().narrow(2, k0, k1 - k0);
            let v = f32(x.value.clone().narrow(2, k0, k1 - k0));
            let p = match &forward.probs {
                Some(p) => p.clone(),
                None => {
                    let bias = mask.block_bias(s.kv_heads, s.groups, (q0, q1), (k0, k1));
                    (scores(&q, k.clone(), bias, blocks.scale) - lse.clone()).exp()
                }
            };
            let dp = d_out.clone().matmul(v.swap_dims(2, 3));
            let ds = (p.clone() * (dp - delta.clone())).mul_scalar(blocks.scale);
            add_to(&mut dq_block, ds.clone().matmul(f32(k)));
            // Each chunk's key and value gradients from its columns of the span's P and dS (a
            // narrowed product result added up across query blocks came out wrong on wgpu).
            for i in span {
                let (c0, c1) = chunks.chunks[i];
                let columns = |t: &Tensor<B, 4>| if c1 - c0 == k1 - k0 { t.clone() } else { t.clone().narrow(3, c0 - k0, c1 - c0) };
                add_to(&mut dv[i], columns(&p).swap_dims(2, 3).matmul(d_out.clone()));
                add_to(&mut dk[i], columns(&ds).swap_dims(2, 3).matmul(q32.clone()));
            }
        }
        dq.push(dq_block.expect("every query block sees the first key block"));
    }
    let device = x.key.device();
    let whole = |parts: Vec<Option<Tensor<B, 4>>>, dtype: DType| {
        let zeros = |k0: usize, k1: usize| Tensor::<B, 4>::zeros([s.batch, s.kv_heads, k1 - k0, s.head_dim], (&device, DType::F32));
        let mut parts: Vec<Tensor<B, 4>> = parts
            .into_iter()
            .zip(&chunks.chunks)
            .map(|(part, &(k0, k1))| part.unwrap_or_else(|| zeros(k0, k1)))
            .collect();
        let seen = chunks.chunks.last().map_or(0, |&(_, k1)| k1);
        if seen < s.keys {
            parts.push(zeros(seen, s.keys));
        }
        let whole = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(parts, 2) };
        whole.cast(dtype)
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Distribution, Int, TensorData};

    /// Query block `i` sees the cached chunks and the new chunks up to its own; its diagonal is a
    /// span of its own unless it is one query wide; wholly visible chunks merge while a span
    /// stays within the width.
    #[test]
    fn spans_merge_visible_chunks_and_keep_the_diagonal_apart() {
        let chunks = KeyChunks { chunks: vec![(0, 8), (8, 10), (10, 14), (14, 18), (18, 19)], cached: 2, width: 8 };
        assert_eq!(chunks.spans(0), vec![0..1, 1..2, 2..3]);
        assert_eq!(chunks.spans(1), vec![0..1, 1..3, 3..4]);
        // The last query block is one query wide: nothing to mask, it joins the span before it.
        assert_eq!(chunks.spans(2), vec![0..1, 1..3, 3..5]);
        let wide = KeyChunks { width: 64, ..chunks };
        assert_eq!(wide.spans(1), vec![0..3, 3..4]);
        assert_eq!(wide.spans(2), vec![0..5]);
    }

    /// A pass that is one block pair keeps its probabilities for the backward (and only then);
    /// the gradients from them equal the recomputed ones.
    #[test]
    fn a_one_block_pass_keeps_its_probabilities_for_the_backward() {
        let device = Default::default();
        let (batch, heads, kv_heads, queries, dim) = (2, 4, 2, 9, 8);
        let random = |shape: [usize; 4]| Tensor::<Flex, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let x = Operands { query: random([batch, heads, queries, dim]), key: random([batch, kv_heads, queries, dim]), value: random([batch, kv_heads, queries, dim]) };
        // A padded key that leaves every query something to see (a fully masked row's
        // recomputed probabilities are not normalised: its pad query's gradient is never used).
        let mut valid = vec![1i64; batch * queries];
        valid[queries + 1] = 0;
        let key_mask = Tensor::<Flex, 2, Int>::from_data(TensorData::new(valid, [batch, queries]), &device);
        let mask = AttentionMask::new(Some(&key_mask), batch, 0, queries, &device);
        let grad = random([batch, heads, queries, dim]);
        let one_pair = Blocks { queries: 16, keys: 64, scale: 0.35, device_kernels: DeviceKernelChoice::OFF };
        let kept = forward_for_backward(&x, &mask, one_pair);
        let recomputed = forward(&x, &mask, one_pair);
        assert!(kept.probs.is_some() && recomputed.probs.is_none());
        assert!(forward_for_backward(&x, &mask, Blocks { queries: 4, ..one_pair }).probs.is_none(), "several query blocks keep nothing");
        let grads = |f: &Forward<Flex>| {
            let g = backward(&x, &mask, one_pair, f, grad.clone());
            [g.query, g.key, g.value].map(|t| t.into_data().to_vec::<f32>().unwrap())
        };
        for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(grads(&kept).iter().zip(&grads(&recomputed))) {
            let largest = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(diff <= 1e-5 * largest.max(1.0), "{name}: {diff} apart (largest {largest})");
        }
    }

    /// Narrow key spans (each chunk alone, cached keys in several chunks) give what one wide span
    /// gives: the forward output and the three gradients, with cached keys, grouped heads and
    /// left padding.
    #[test]
    fn narrow_and_wide_key_spans_agree() {
        let device = Default::default();
        let (batch, heads, kv_heads, past, queries, dim) = (2, 4, 2, 10, 13, 8);
        let keys = past + queries;
        let random = |shape: [usize; 4]| Tensor::<Flex, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let x = Operands { query: random([batch, heads, queries, dim]), key: random([batch, kv_heads, keys, dim]), value: random([batch, kv_heads, keys, dim]) };
        let mut valid = vec![1i64; batch * keys];
        valid[keys..keys + 3].fill(0);
        let key_mask = Tensor::<Flex, 2, Int>::from_data(TensorData::new(valid, [batch, keys]), &device);
        let mask = AttentionMask::new(Some(&key_mask), batch, past, queries, &device);
        let grad = random([batch, heads, queries, dim]);
        let scale = 0.35;
        let run = |blocks: Blocks| {
            let f = forward(&x, &mask, blocks);
            let g = backward(&x, &mask, blocks, &f, grad.clone());
            [f.output, g.query, g.key, g.value].map(|t| t.into_data().to_vec::<f32>().unwrap())
        };
        let narrow = run(Blocks { queries: 4, keys: 4, scale, device_kernels: DeviceKernelChoice::OFF });
        let wide = run(Blocks { queries: 4, keys: 64, scale, device_kernels: DeviceKernelChoice::OFF });
        for (name, (a, b)) in ["output", "dq", "dk", "dv"].iter().zip(narrow.iter().zip(&wide)) {
            let largest = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(diff <= 1e-5 * largest.max(1.0), "{name}: {diff} apart (largest {largest})");
        }
    }
}

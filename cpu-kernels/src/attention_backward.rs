//! The backward pass of [`attention::grouped_attention`] in f32, for training on the CPU.
//!
//! With `P = softmax(S)`, `S = Q Kᵀ · scale + bias` and `O = P V`, the gradients for an output
//! gradient `dO` are, per query row `i`:
//! - `dV = Pᵀ dO` and `dP = dO Vᵀ`;
//! - `dS = P ⊙ (dP − Dᵢ)` with `Dᵢ = dOᵢ · Oᵢ` (the softmax's backward, since `Σⱼ Pᵢⱼ dPᵢⱼ = Dᵢ`);
//! - `dQ = dS K · scale` and `dK = dSᵀ Q · scale`.
//!
//! `P` is not kept from the forward pass: each task recomputes it from the scores and the row's
//! softmax maximum and sum, as FlashAttention does, so the forward keeps two floats per row
//! instead of the `[b, heads, q, k]` probabilities. Tasks are those of the forward (batch row, key/value group,
//! block of queries); each returns its rows of `dQ` and its share of `dK` and `dV`, which are
//! then summed per group.

use rayon::prelude::*;

use crate::Kernels;

use super::attention::{self, tiles, AttentionShape, Bias, Heads, SoftmaxStats, Task};

/// Gradients for the three operands: `query` in `[batch, queries, heads, d]`, `key` and `value`
/// in `[batch, kv_heads, keys, d]`, all contiguous.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGrads {
    pub query: Vec<f32>,
    pub key: Vec<f32>,
    pub value: Vec<f32>,
}

/// The gradients of `softmax(Q Kᵀ · scale + bias) V` for the output gradient `grad`, from the
/// forward's operands, its output `out` and its rows' softmax `stats` (both from
/// [`attention::grouped_attention_with_stats`]; `out` and `grad` are `[batch, queries, heads, d]`,
/// `stats` is `[batch, heads, queries]`). The bias takes no gradient.
#[allow(clippy::too_many_arguments)]
pub fn grouped_attention_backward(
    kernels: Kernels,
    query: Heads<'_, f32>,
    key: Heads<'_, f32>,
    value: Heads<'_, f32>,
    bias: Bias<'_, f32>,
    out: &[f32],
    stats: &[SoftmaxStats],
    grad: &[f32],
    shape: AttentionShape,
    scale: f32,
) -> AttentionGrads {
    let AttentionShape { batch, queries, keys, heads, kv_heads, head_dim: d } = shape;
    assert_eq!(out.len(), batch * queries * heads * d, "attention output");
    assert_eq!(grad.len(), out.len(), "attention output gradient");
    assert_eq!(stats.len(), batch * heads * queries, "attention softmax statistics");
    let output_heads = |data| Heads {
        data,
        offset: 0,
        batch_stride: queries * heads * d,
        head_stride: d,
        position_stride: heads * d,
        pages: None,
    };
    let operands = Operands {
        query,
        key,
        value,
        bias,
        out: output_heads(out),
        grad: output_heads(grad),
        stats,
        shape,
        scale,
    };
    let tasks = Task::all(shape);
    let parts: Vec<TaskGrads> = tasks.par_iter().map(|t| wide_simd!(kernels, task(kernels, &operands, t))).collect();

    let mut dq = vec![0.0f32; batch * queries * heads * d];
    for (t, part) in tasks.iter().zip(&parts) {
        for (r, row) in part.query.chunks_exact(d).enumerate() {
            let (head, i) = t.head_and_query(r, shape);
            dq[((t.batch * queries + i) * heads + head) * d..][..d].copy_from_slice(row);
        }
    }
    // Tasks are ordered batch row by group by block, so each group's parts are consecutive.
    let blocks = tasks.len() / (batch * kv_heads).max(1);
    let sum_parts = |pick: fn(&TaskGrads) -> &[f32]| {
        let mut total = vec![0.0f32; batch * kv_heads * keys * d];
        total
            .par_chunks_mut((keys * d).max(1))
            .zip(parts.par_chunks(blocks.max(1)))
            .for_each(|(total, parts)| {
                for part in parts {
                    for (t, &x) in total.iter_mut().zip(pick(part)) {
                        *t += x;
                    }
                }
            });
        total
    };
    AttentionGrads {
        key: sum_parts(|p| &p.key),
        value: sum_parts(|p| &p.value),
        query: dq,
    }
}

/// Everything a task reads.
struct Operands<'a> {
    query: Heads<'a, f32>,
    key: Heads<'a, f32>,
    value: Heads<'a, f32>,
    bias: Bias<'a, f32>,
    out: Heads<'a, f32>,
    grad: Heads<'a, f32>,
    stats: &'a [SoftmaxStats],
    shape: AttentionShape,
    scale: f32,
}

/// One task's rows of `dQ` (`[groups * rows, d]`, head-major) and its share of its group's `dK`
/// and `dV` (`[columns, d]`: keys past the last one its rows attend to get nothing).
struct TaskGrads {
    query: Vec<f32>,
    key: Vec<f32>,
    value: Vec<f32>,
}

#[inline(always)]
fn task(kernels: Kernels, ops: &Operands<'_>, t: &Task) -> TaskGrads {
    let shape = ops.shape;
    let (d, keys) = (shape.head_dim, shape.keys);
    let columns = t.columns(&ops.bias, keys);
    let padded = attention::padded(columns);
    let q = t.gather_rows(&ops.query, shape);
    let out = t.gather_rows(&ops.out, shape);
    let grad = t.gather_rows(&ops.grad, shape);
    let m = q.len() / d;
    let kt = attention::pack_transposed(&ops.key, t.batch, t.group, columns, padded, d);
    let vt = attention::pack_transposed(&ops.value, t.batch, t.group, columns, padded, d);
    let k = attention::pack_rows(&ops.key, t.batch, t.group, columns, d);

    let mut probs = vec![0.0f32; m * padded];
    tiles::scores(kernels, &q, m, d, &kt, padded, &mut probs);
    let mut dscores = vec![0.0f32; m * padded];
    tiles::scores(kernels, &grad, m, d, &vt, padded, &mut dscores);
    let biases = t.biases(&ops.bias, columns);
    let block = t.rows.len();
    for (r, (p, ds)) in probs.chunks_exact_mut(padded).zip(dscores.chunks_exact_mut(padded)).enumerate() {
        let (head, i) = t.head_and_query(r, shape);
        let SoftmaxStats { max, sum } = ops.stats[(t.batch * shape.heads + head) * shape.queries + i];
        let biases = &biases[(r % block) * columns..][..columns];
        let (p, ds) = (&mut p[..columns], &mut ds[..columns]);
        for (s, &bias) in p.iter_mut().zip(biases) {
            *s = super::fused::exp(*s * ops.scale + bias - max) / sum;
        }
        let row_dot: f32 = grad[r * d..][..d].iter().zip(&out[r * d..][..d]).map(|(g, o)| g * o).sum();
        for (ds, &p) in ds.iter_mut().zip(p.iter()) {
            *ds = p * (*ds - row_dot) * ops.scale;
        }
    }

    let mut dq = vec![0.0f32; m * d];
    tiles::weighted_values(kernels, &dscores, padded, m, columns, &k, d, &mut dq);
    let (dscores_t, probs_t) = (transpose(&dscores, m, padded, columns), transpose(&probs, m, padded, columns));
    let mut dk = vec![0.0f32; columns * d];
    tiles::weighted_values(kernels, &dscores_t, m, columns, m, &q, d, &mut dk);
    let mut dv = vec![0.0f32; columns * d];
    tiles::weighted_values(kernels, &probs_t, m, columns, m, &grad, d, &mut dv);
    TaskGrads { query: dq, key: dk, value: dv }
}

/// The first `columns` columns of `rows × stride` matrix `a`, transposed: `[columns, rows]`.
#[inline(always)]
fn transpose(a: &[f32], rows: usize, stride: usize, columns: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; columns * rows];
    for (r, row) in a.chunks_exact(stride).take(rows).enumerate() {
        for (j, &x) in row[..columns].iter().enumerate() {
            out[j * rows + r] = x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::grouped_attention_with_stats;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        attention::tests::values::<f32>(n, seed).iter().map(|x| x * 0.5).collect()
    }

    /// The loss `Σ out ⊙ cotangent` of attention in f64, element by element, for finite
    /// differences: plain softmax attention with `repeat_kv`.
    fn loss(q: &[f32], k: &[f32], v: &[f32], bias: &[f32], cot: &[f32], s: AttentionShape, scale: f32) -> f64 {
        let AttentionShape { batch, queries, keys, heads, kv_heads, head_dim: d } = s;
        let mut total = 0.0f64;
        for b in 0..batch {
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                for i in 0..queries {
                    let qr = &q[((b * queries + i) * heads + h) * d..][..d];
                    let scores: Vec<f64> = (0..keys)
                        .map(|j| {
                            let kr = &k[((b * kv_heads + g) * keys + j) * d..][..d];
                            let dot: f64 = qr.iter().zip(kr).map(|(a, c)| *a as f64 * *c as f64).sum();
                            dot * scale as f64 + bias[(b * queries + i) * keys + j] as f64
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = weights.iter().sum();
                    for c in 0..d {
                        let o: f64 = (0..keys)
                            .map(|j| weights[j] / sum * v[((b * kv_heads + g) * keys + j) * d + c] as f64)
                            .sum();
                        total += o * cot[((b * queries + i) * heads + h) * d + c] as f64;
                    }
                }
            }
        }
        total
    }

    /// Each gradient equals a central finite difference of the f64 loss at sampled elements,
    /// for a causal mask with a left-padded batch row, two query blocks, and SIMD-sized and odd
    /// head dims. Padding queries (which attend to nothing) get a zero cotangent, as the
    /// training loss gives them: in f32 their scores vanish under the -1e9 bias, so finite
    /// differences see no dependence on them while the softmax's backward formula does.
    #[test]
    fn gradients_match_finite_differences() {
        for (queries, d) in [(37, 16), (5, 12)] {
            let s = AttentionShape { batch: 2, queries, keys: queries, heads: 4, kv_heads: 2, head_dim: d };
            let q = values(s.batch * queries * s.heads * d, 1);
            let k = values(s.batch * s.kv_heads * queries * d, 2);
            let v = values(s.batch * s.kv_heads * queries * d, 3);
            let pad = 3;
            let mut cot = values(q.len(), 4);
            for i in 0..pad {
                cot[((queries + i) * s.heads) * d..][..s.heads * d].fill(0.0);
            }
            let bias: Vec<f32> = (0..s.batch * queries * queries)
                .map(|x| {
                    let (b, i, j) = (x / (queries * queries), x / queries % queries, x % queries);
                    if j > i || (b == 1 && j < pad) { -1.0e9 } else { 0.0 }
                })
                .collect();
            let scale = (d as f32).powf(-0.5);
            let query = |data| Heads { data, offset: 0, batch_stride: queries * s.heads * d, head_stride: d, position_stride: s.heads * d, pages: None };
            let kv = |data| Heads { data, offset: 0, batch_stride: s.kv_heads * queries * d, head_stride: queries * d, position_stride: d, pages: None };
            let bias_view = Bias { data: &bias[..], offset: 0, batch_stride: queries * queries, query_stride: queries, key_stride: 1 };
            let (out, stats) = grouped_attention_with_stats(Kernels::default(), query(&q[..]), kv(&k[..]), kv(&v[..]), bias_view, s, scale);
            let grads = grouped_attention_backward(Kernels::default(), query(&q[..]), kv(&k[..]), kv(&v[..]), bias_view, &out, &stats, &cot, s, scale);

            let h = 1e-2f32;
            for (name, which, grad) in [("query", 0, &grads.query), ("key", 1, &grads.key), ("value", 2, &grads.value)] {
                let len = grad.len();
                for idx in (0..len).step_by(len / 29 + 1) {
                    let at = |delta: f32| {
                        let mut ops = [q.clone(), k.clone(), v.clone()];
                        ops[which][idx] += delta;
                        loss(&ops[0], &ops[1], &ops[2], &bias, &cot, s, scale)
                    };
                    let numeric = ((at(h) - at(-h)) / (2.0 * h as f64)) as f32;
                    let diff = (grad[idx] - numeric).abs();
                    assert!(diff < 2e-3 * numeric.abs().max(1.0), "{name}[{idx}] d={d}: {} vs {numeric}", grad[idx]);
                }
            }
        }
    }
}

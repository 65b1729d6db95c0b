//! Grouped-query attention on the CPU in one parallel pass: `softmax(Q Kᵀ · scale + bias) V`
//! for `heads` query heads sharing `kv_heads` key/value heads, without materialising the score
//! tensor, the repeated keys or any transposed copy.
//!
//! Work is split into tasks of (batch row, key/value head, block of query positions). A task
//! packs the keys it needs transposed (`Kᵀ`, `[d, columns]`) and the values (`[columns, d]`) in
//! f32 once, then serves every query head of its group: scores, softmax and `P V` for
//! `groups × block` rows at a time. Keys past the last one any row of the block may attend to
//! (the causal future) are never read: their softmax weight would be exactly zero.
//!
//! Training reuses this forward pass (see `tracked`): it also returns each query row's softmax
//! maximum and sum, from which `attention_backward` recomputes the probabilities.
//!
//! Rounding follows HF's eager attention in the operands' dtype: for bf16 the product `Q Kᵀ`, the
//! scaled scores and the biased scores are each rounded to bf16, the softmax runs in f32 and its
//! probabilities are rounded to bf16 before `P V`, whose f32 sums are rounded once.

use half::bf16;
use rayon::prelude::*;

use super::bf16_bits;
use super::fused::{lanes, row_max};

/// A bias at or below this marks a key a query does not attend to. The masks this crate builds
/// use -1e9; any score that low gives a softmax weight of exactly zero next to an attended key.
const MASKED_BELOW: f32 = -1.0e7;

/// Query positions per task.
const QUERY_BLOCK: usize = 32;

/// Key columns are packed in multiples of this (one 4 × 16-lane tile of scores).
const COLUMN_TILE: usize = 64;

/// An element type the kernel reads and writes.
pub trait Element: Copy + Send + Sync + 'static {
    /// The value as f32 (exact).
    fn widen(self) -> f32;
    /// `x` rounded to this type's precision, as f32.
    fn round(x: f32) -> f32;
    /// `x` rounded to this type.
    fn narrow(x: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        x
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_bits::widen(self)
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        bf16_bits::round(x)
    }
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        bf16_bits::narrow(x)
    }
}

/// A `[batch, heads, positions, d]` operand read through strides (in elements); each row of `d`
/// values is contiguous. The axes may be stored in any order (e.g. queries as `[b, q, h, d]`).
#[derive(Debug, Clone, Copy)]
pub struct Heads<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub batch_stride: usize,
    pub head_stride: usize,
    pub position_stride: usize,
}

impl<T> Heads<'_, T> {
    pub(super) fn row(&self, batch: usize, head: usize, position: usize, d: usize) -> &[T] {
        let start = self.offset
            + batch * self.batch_stride
            + head * self.head_stride
            + position * self.position_stride;
        &self.data[start..start + d]
    }
}

/// The additive bias `[batch, queries, keys]`, shared by all heads, read through strides.
#[derive(Debug, Clone, Copy)]
pub struct Bias<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub batch_stride: usize,
    pub query_stride: usize,
    pub key_stride: usize,
}

impl<T: Element> Bias<'_, T> {
    #[inline(always)]
    fn at(&self, batch: usize, query: usize, key: usize) -> f32 {
        self.data[self.offset + batch * self.batch_stride + query * self.query_stride + key * self.key_stride]
            .widen()
    }

    /// The first `keys` biases of one query, widened into `row`.
    #[inline(always)]
    fn read_row(&self, batch: usize, query: usize, row: &mut [f32]) {
        let start = self.offset + batch * self.batch_stride + query * self.query_stride;
        let len = row.len();
        if self.key_stride == 1 {
            for (dst, x) in row.iter_mut().zip(&self.data[start..start + len]) {
                *dst = x.widen();
            }
        } else {
            for (j, dst) in row.iter_mut().enumerate() {
                *dst = self.data[start + j * self.key_stride].widen();
            }
        }
    }

    /// One past the last key `query` attends to; every key when it attends to none (such a row,
    /// e.g. a left-padding query, then gets the same softmax over all keys as unfused attention).
    #[inline(always)]
    fn attended_end(&self, batch: usize, query: usize, keys: usize) -> usize {
        (0..keys)
            .rev()
            .find(|&j| self.at(batch, query, j) > MASKED_BELOW)
            .map_or(keys, |j| j + 1)
    }
}

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub queries: usize,
    pub keys: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `softmax(Q Kᵀ · scale + bias) V`, returned as `[batch, queries, heads, head_dim]` (contiguous),
/// the layout the output projection reads. Query head `h` uses key/value head
/// `h / (heads / kv_heads)`, as HF's `repeat_kv` does.
pub fn grouped_attention<T: Element>(
    query: Heads<'_, T>,
    key: Heads<'_, T>,
    value: Heads<'_, T>,
    bias: Bias<'_, T>,
    shape: AttentionShape,
    scale: f32,
) -> Vec<T> {
    grouped_attention_with_stats(query, key, value, bias, shape, scale).0
}

/// The softmax of one query row: the maximum of its biased, scaled scores and the sum of their
/// exponentials after subtracting it. The probability of score `s` is `exp(s - max) / sum`.
///
/// Kept as two numbers, not as `max + ln(sum)`: a query that attends to nothing has scores near
/// the mask's -1e9, where f32 cannot hold `ln(sum)` next to `max`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SoftmaxStats {
    pub max: f32,
    pub sum: f32,
}

/// [`grouped_attention`] and each query row's [`SoftmaxStats`] (`[batch, heads, queries]`),
/// from which the backward pass recomputes the probabilities.
pub fn grouped_attention_with_stats<T: Element>(
    query: Heads<'_, T>,
    key: Heads<'_, T>,
    value: Heads<'_, T>,
    bias: Bias<'_, T>,
    shape: AttentionShape,
    scale: f32,
) -> (Vec<T>, Vec<SoftmaxStats>) {
    let AttentionShape { queries, heads, head_dim: d, .. } = shape;
    let tasks = Task::all(shape);
    let results: Vec<(Vec<f32>, Vec<SoftmaxStats>)> = tasks
        .par_iter()
        .map(|t| wide_simd!(task(&query, &key, &value, &bias, shape, scale, t)))
        .collect();

    let mut out = vec![T::narrow(0.0); shape.batch * queries * heads * d];
    let mut stats = vec![SoftmaxStats::default(); shape.batch * heads * queries];
    for (t, (result, row_stats)) in tasks.iter().zip(&results) {
        for (r, (row, &st)) in result.chunks_exact(d).zip(row_stats).enumerate() {
            let (head, i) = t.head_and_query(r, shape);
            let start = ((t.batch * queries + i) * heads + head) * d;
            for (o, &x) in out[start..start + d].iter_mut().zip(row) {
                *o = T::narrow(x);
            }
            stats[(t.batch * heads + head) * queries + i] = st;
        }
    }
    (out, stats)
}

/// One unit of parallel work: query positions `rows` of every head in key/value group `group`
/// of batch row `batch`.
#[derive(Debug, Clone)]
pub(super) struct Task {
    pub batch: usize,
    pub group: usize,
    pub rows: std::ops::Range<usize>,
}

impl Task {
    /// Every task of a call, batch row by group by block of [`QUERY_BLOCK`] queries.
    pub fn all(shape: AttentionShape) -> Vec<Task> {
        let AttentionShape { batch, queries, heads, kv_heads, .. } = shape;
        assert!(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
        let blocks = queries.div_ceil(QUERY_BLOCK);
        (0..batch)
            .flat_map(|b| (0..kv_heads).flat_map(move |g| (0..blocks).map(move |blk| (b, g, blk))))
            .map(|(batch, group, blk)| Task {
                batch,
                group,
                rows: blk * QUERY_BLOCK..((blk + 1) * QUERY_BLOCK).min(queries),
            })
            .collect()
    }

    /// The query head and position of row `r` of this task's head-major rows.
    pub fn head_and_query(&self, r: usize, shape: AttentionShape) -> (usize, usize) {
        let (groups, block) = (shape.heads / shape.kv_heads, self.rows.len());
        (self.group * groups + r / block, self.rows.start + r % block)
    }

    /// One past the last key any row of the task attends to (see [`Bias::attended_end`]).
    #[inline(always)]
    pub fn columns<T: Element>(&self, bias: &Bias<'_, T>, keys: usize) -> usize {
        self.rows.clone().map(|i| bias.attended_end(self.batch, i, keys)).max().unwrap_or(0)
    }

    /// The task's query rows of `heads` (every head of the group, head-major), in f32:
    /// `[groups * rows.len(), d]`.
    #[inline(always)]
    pub fn gather_rows<T: Element>(&self, heads: &Heads<'_, T>, shape: AttentionShape) -> Vec<f32> {
        let (d, groups) = (shape.head_dim, shape.heads / shape.kv_heads);
        let mut out = Vec::with_capacity(groups * self.rows.len() * d);
        for head in self.group * groups..(self.group + 1) * groups {
            for i in self.rows.clone() {
                out.extend(heads.row(self.batch, head, i, d).iter().map(|x| x.widen()));
            }
        }
        out
    }

    /// The biases of the task's queries against its first `columns` keys, `[rows.len(), columns]`.
    #[inline(always)]
    pub fn biases<T: Element>(&self, bias: &Bias<'_, T>, columns: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows.len() * columns];
        for (i, row) in self.rows.clone().zip(out.chunks_exact_mut(columns.max(1))) {
            bias.read_row(self.batch, i, &mut row[..columns]);
        }
        out
    }
}

/// Keys `0..columns` of head `g` of batch row `b`, transposed into `[d, padded]` f32 (zeros past
/// `columns`). Rows are widened 16 at a time into a tile, then written 16 contiguous columns per
/// row of the result.
#[inline(always)]
pub(super) fn pack_transposed<T: Element>(
    heads: &Heads<'_, T>,
    b: usize,
    g: usize,
    columns: usize,
    padded: usize,
    d: usize,
) -> Vec<f32> {
    let mut kt = vec![0.0f32; d * padded];
    let mut tile = vec![0.0f32; 16 * d];
    for j0 in (0..columns).step_by(16) {
        let n = 16.min(columns - j0);
        for (jj, dst) in tile.chunks_exact_mut(d).take(n).enumerate() {
            for (dst, x) in dst.iter_mut().zip(heads.row(b, g, j0 + jj, d)) {
                *dst = x.widen();
            }
        }
        for (dd, dst) in kt.chunks_exact_mut(padded).enumerate() {
            for (jj, dst) in dst[j0..j0 + n].iter_mut().enumerate() {
                *dst = tile[jj * d + dd];
            }
        }
    }
    kt
}

/// Rows `0..columns` of head `g` of batch row `b`, as `[columns, d]` f32.
#[inline(always)]
pub(super) fn pack_rows<T: Element>(heads: &Heads<'_, T>, b: usize, g: usize, columns: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; columns * d];
    for (j, dst) in out.chunks_exact_mut(d).enumerate() {
        for (dst, x) in dst.iter_mut().zip(heads.row(b, g, j, d)) {
            *dst = x.widen();
        }
    }
    out
}

/// Key columns padded up to a whole number of score tiles.
pub(super) fn padded(columns: usize) -> usize {
    columns.div_ceil(COLUMN_TILE) * COLUMN_TILE
}

/// One task's output rows `[groups * rows.len(), d]` (head-major), rounded to `T`'s precision,
/// in f32, and each row's [`SoftmaxStats`]. Inlined into a `wide_simd!` call, so its packing and
/// softmax loops also get an AVX-512 copy.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn task<T: Element>(
    query: &Heads<'_, T>,
    key: &Heads<'_, T>,
    value: &Heads<'_, T>,
    bias: &Bias<'_, T>,
    shape: AttentionShape,
    scale: f32,
    t: &Task,
) -> (Vec<f32>, Vec<SoftmaxStats>) {
    let d = shape.head_dim;
    let columns = t.columns(bias, shape.keys);
    let padded = padded(columns);
    let kt = pack_transposed(key, t.batch, t.group, columns, padded, d);
    let v = pack_rows(value, t.batch, t.group, columns, d);
    let q = t.gather_rows(query, shape);
    let m = q.len() / d;

    let mut scores = vec![0.0f32; m * padded];
    kernels::scores(&q, m, d, &kt, padded, &mut scores);
    let biases = t.biases(bias, columns);
    let block = t.rows.len();
    // A loop, not `map(..).collect()`: the closure would run in `Map::fold`, a function of its
    // own that is compiled without the caller's AVX-512.
    let mut stats = Vec::with_capacity(m);
    for (r, row) in scores.chunks_exact_mut(padded).enumerate() {
        let biases = &biases[(r % block) * columns..][..columns];
        stats.push(softmax_row::<T>(&mut row[..columns], biases, scale));
    }
    let mut out = vec![0.0f32; m * d];
    kernels::weighted_values(&scores, padded, m, columns, &v, d, &mut out);
    (out, stats)
}

/// Turns raw dot products into attention probabilities in place, with `T`'s rounding at each
/// step HF rounds (see the module docs); returns the row's [`SoftmaxStats`].
#[inline(always)]
fn softmax_row<T: Element>(row: &mut [f32], bias: &[f32], scale: f32) -> SoftmaxStats {
    for (s, &bias) in row.iter_mut().zip(bias) {
        *s = T::round(T::round(T::round(*s) * scale) + bias);
    }
    let max = row_max(row, |s| s);
    for s in row.iter_mut() {
        *s = super::fused::exp(*s - max);
    }
    let sum: f32 = lanes(row, 0.0, |lane, s| lane + s).iter().sum();
    for s in row.iter_mut() {
        *s = T::round(*s / sum);
    }
    SoftmaxStats { max, sum }
}

/// The two matrix products, with an AVX-512 path and a portable one.
pub(super) mod kernels {
    /// `scores[r, j] = q[r, :] · kt[:, j]` for `m` rows of `q` (`[m, d]`) and the `padded`
    /// columns of `kt` (`[d, padded]`, `padded` a multiple of 64).
    pub fn scores(q: &[f32], m: usize, d: usize, kt: &[f32], padded: usize, scores: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            // SAFETY: the CPU has AVX-512F; the slices have the sizes documented above.
            unsafe { avx512::scores(q, m, d, kt, padded, scores) };
            return;
        }
        for (qr, sr) in q.chunks_exact(d).zip(scores.chunks_exact_mut(padded)) {
            for (&x, ktr) in qr.iter().zip(kt.chunks_exact(padded)) {
                for (s, &k) in sr.iter_mut().zip(ktr) {
                    *s += x * k;
                }
            }
        }
    }

    /// `out[r, :] = Σ_{j < columns} p[r, j] · v[j, :]` for `m` rows of `p` (row stride
    /// `padded`) and `v` `[columns, d]`.
    pub fn weighted_values(
        p: &[f32],
        padded: usize,
        m: usize,
        columns: usize,
        v: &[f32],
        d: usize,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if d % 16 == 0 && avx512::available() {
            // SAFETY: the CPU has AVX-512F; `d` is a multiple of 16 and the sizes are as above.
            unsafe { avx512::weighted_values(p, padded, m, columns, v, d, out) };
            return;
        }
        for (pr, or) in p.chunks_exact(padded).zip(out.chunks_exact_mut(d)).take(m) {
            for (&w, vr) in pr[..columns].iter().zip(v.chunks_exact(d)) {
                for (o, &x) in or.iter_mut().zip(vr) {
                    *o += w * x;
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use std::arch::x86_64::*;

        /// Whether the kernels run at the AVX-512 level (see [`mod@crate::isa`]).
        pub fn available() -> bool {
            crate::isa::avx512()
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn scores(q: &[f32], m: usize, d: usize, kt: &[f32], padded: usize, s: &mut [f32]) {
            assert!(q.len() >= m * d && kt.len() >= d * padded && s.len() >= m * padded);
            for c in (0..padded).step_by(64) {
                let (k, mut r) = (kt.as_ptr().add(c), 0);
                while r + 4 <= m {
                    tile::<4, 4>(q.as_ptr().add(r * d), d, k, padded, d, s.as_mut_ptr().add(r * padded + c), padded);
                    r += 4;
                }
                while r < m {
                    tile::<1, 4>(q.as_ptr().add(r * d), d, k, padded, d, s.as_mut_ptr().add(r * padded + c), padded);
                    r += 1;
                }
            }
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn weighted_values(
            p: &[f32],
            padded: usize,
            m: usize,
            columns: usize,
            v: &[f32],
            d: usize,
            out: &mut [f32],
        ) {
            assert!(p.len() >= m * padded && v.len() >= columns * d && out.len() >= m * d);
            let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), out.as_mut_ptr());
            let mut c = 0;
            while c < d {
                let wide = d - c >= 64;
                let mut r = 0;
                while r + 4 <= m {
                    let (pr, or) = (pp.add(r * padded), op.add(r * d + c));
                    if wide {
                        tile::<4, 4>(pr, padded, vp.add(c), d, columns, or, d);
                    } else {
                        tile::<4, 1>(pr, padded, vp.add(c), d, columns, or, d);
                    }
                    r += 4;
                }
                while r < m {
                    let (pr, or) = (pp.add(r * padded), op.add(r * d + c));
                    if wide {
                        tile::<1, 4>(pr, padded, vp.add(c), d, columns, or, d);
                    } else {
                        tile::<1, 1>(pr, padded, vp.add(c), d, columns, or, d);
                    }
                    r += 1;
                }
                c += if wide { 64 } else { 16 };
            }
        }

        /// `out[r, 16u + i] = Σ_t a[r, t] · b[t, 16u + i]` for `r < R`, `u < NV`, `t < steps`:
        /// `R × NV` accumulators, one broadcast of `a` and `NV` loads of `b` per step. Row
        /// strides (in elements) are `a_stride`, `b_stride` and `out_stride`. Serves both
        /// `Q · Kᵀ` (`b` = packed `Kᵀ`) and `P · V`.
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        unsafe fn tile<const R: usize, const NV: usize>(
            a: *const f32,
            a_stride: usize,
            b: *const f32,
            b_stride: usize,
            steps: usize,
            out: *mut f32,
            out_stride: usize,
        ) {
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            for t in 0..steps {
                let row = b.add(t * b_stride);
                let mut x = [_mm512_setzero_ps(); NV];
                for (u, x) in x.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(row.add(16 * u));
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*a.add(r * a_stride + t));
                    for (a, x) in acc.iter_mut().zip(x) {
                        *a = _mm512_fmadd_ps(w, x, *a);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (u, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out.add(r * out_stride + 16 * u), *a);
                }
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Plain attention with HF's repeat_kv and rounding, element by element in f64 sums.
    fn reference<T: Element>(
        q: &[T],
        k: &[T],
        v: &[T],
        bias: &[T],
        s: AttentionShape,
        scale: f32,
    ) -> Vec<f32> {
        let AttentionShape { batch, queries, keys, heads, kv_heads, head_dim: d } = s;
        let mut out = vec![0.0f32; batch * queries * heads * d];
        for b in 0..batch {
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                for i in 0..queries {
                    let qr = &q[((b * queries + i) * heads + h) * d..][..d];
                    let mut row: Vec<f32> = (0..keys)
                        .map(|j| {
                            let kr = &k[((b * kv_heads + g) * keys + j) * d..][..d];
                            let dot: f64 = qr.iter().zip(kr).map(|(a, c)| a.widen() as f64 * c.widen() as f64).sum();
                            let biased = T::round(T::round(dot as f32) * scale)
                                + bias[(b * queries + i) * keys + j].widen();
                            T::round(biased)
                        })
                        .collect();
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f32 = row.iter_mut().map(|x| {
                        *x = (*x - max).exp();
                        *x
                    }).sum();
                    for x in &mut row {
                        *x = T::round(*x / sum);
                    }
                    for c in 0..d {
                        let acc: f64 = (0..keys)
                            .map(|j| row[j] as f64 * v[((b * kv_heads + g) * keys + j) * d + c].widen() as f64)
                            .sum();
                        out[((b * queries + i) * heads + h) * d + c] = T::round(acc as f32);
                    }
                }
            }
        }
        out
    }

    /// Deterministic values in [-2, 2).
    pub(crate) fn values<T: Element>(n: usize, seed: u64) -> Vec<T> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                T::narrow((state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
            })
            .collect()
    }

    /// A causal mask after `past` cached keys, with the first `pad` keys of batch row 1 masked
    /// (left padding: its first `pad - past` queries attend to nothing).
    fn causal_bias<T: Element>(s: AttentionShape, past: usize, pad: usize) -> Vec<T> {
        let mut bias = Vec::new();
        for b in 0..s.batch {
            for i in 0..s.queries {
                for j in 0..s.keys {
                    let masked = j > past + i || (b == 1 && j < pad);
                    bias.push(T::narrow(if masked { -1.0e9 } else { 0.0 }));
                }
            }
        }
        bias
    }

    fn run<T: Element>(s: AttentionShape, past: usize, pad: usize) -> (Vec<f32>, Vec<f32>) {
        let d = s.head_dim;
        let q = values::<T>(s.batch * s.queries * s.heads * d, 1);
        let k = values::<T>(s.batch * s.kv_heads * s.keys * d, 2);
        let v = values::<T>(s.batch * s.kv_heads * s.keys * d, 3);
        let bias = causal_bias::<T>(s, past, pad);
        let scale = (d as f32).powf(-0.5);
        let heads = |data, outer, inner, rows| Heads {
            data,
            offset: 0,
            batch_stride: outer * inner * rows * d,
            head_stride: rows * d,
            position_stride: d,
        };
        let query = Heads {
            data: &q[..],
            offset: 0,
            batch_stride: s.queries * s.heads * d,
            head_stride: d,
            position_stride: s.heads * d,
        };
        let bias_view = Bias {
            data: &bias[..],
            offset: 0,
            batch_stride: s.queries * s.keys,
            query_stride: s.keys,
            key_stride: 1,
        };
        let got = grouped_attention(
            query,
            heads(&k[..], s.kv_heads, 1, s.keys),
            heads(&v[..], s.kv_heads, 1, s.keys),
            bias_view,
            s,
            scale,
        );
        let got = got.iter().map(|x| x.widen()).collect();
        (got, reference(&q, &k, &v, &bias, s, scale))
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    fn shapes() -> Vec<(AttentionShape, usize, usize)> {
        let shape = |queries, keys, head_dim| AttentionShape {
            batch: 2,
            queries,
            keys,
            heads: 6,
            kv_heads: 2,
            head_dim,
        };
        vec![
            (shape(37, 37, 32), 0, 5),
            (shape(70, 70, 128), 0, 3),
            (shape(1, 81, 128), 80, 4),
            (shape(3, 9, 16), 6, 8),
            (shape(5, 5, 24), 0, 0),
        ]
    }

    /// f32: equal to plain attention up to summation order, causal skipping and padded
    /// (fully masked) query rows included, for SIMD-sized and odd head dims. Values lie in
    /// [-2, 2]; the largest difference measured was 1.4e-6 with the portable loops and 2.0e-6
    /// with the AVX-512 tiles (they sum in different orders), so 1e-5 leaves a margin of 5.
    #[test]
    fn f32_matches_plain_attention() {
        for (s, past, pad) in shapes() {
            let (got, want) = run::<f32>(s, past, pad);
            assert!(max_diff(&got, &want) < 1e-5, "{s:?}: {}", max_diff(&got, &want));
        }
    }

    /// bf16: the same rounding steps as HF, so results differ by at most a bf16 rounding of
    /// values of size ~2 where f32 summation order flips a rounded score or probability.
    #[test]
    fn bf16_matches_plain_attention() {
        for (s, past, pad) in shapes() {
            let (got, want) = run::<bf16>(s, past, pad);
            let diff = max_diff(&got, &want);
            assert!(diff <= 0.05, "{s:?}: {diff}");
            let exact = got.iter().zip(&want).filter(|(a, b)| a == b).count();
            assert!(exact * 10 >= got.len() * 9, "{s:?}: only {exact} of {} equal", got.len());
        }
    }

    /// The two products, at whatever level the kernels run, against an f64 reference: within
    /// the bound of f32 arithmetic on `n` products summed in any order, `(n + 1) · 2⁻²⁴ ·
    /// Σ|products|` (the AVX-512 and portable variants sum in different orders).
    #[test]
    fn kernels_match_an_f64_reference() {
        let (m, d, columns) = (7, 48, 70usize);
        let padded = columns.div_ceil(COLUMN_TILE) * COLUMN_TILE;
        let q = values::<f32>(m * d, 4);
        let kt = values::<f32>(d * padded, 5);
        let v = values::<f32>(columns * d, 6);
        let check = |got: &[f32], terms: usize, exact: &dyn Fn(usize) -> (f64, f64), what: &str| {
            for (i, &g) in got.iter().enumerate() {
                let (want, abs_sum) = exact(i);
                let bound = (terms + 1) as f64 * f64::powi(2.0, -24) * abs_sum + 1e-30;
                assert!((g as f64 - want).abs() <= bound, "{what} at {i}: {g} vs {want} (bound {bound})");
            }
        };
        let mut scores = vec![0.0; m * padded];
        kernels::scores(&q, m, d, &kt, padded, &mut scores);
        let score = |i: usize| {
            let (r, j) = (i / padded, i % padded);
            (0..d).map(|dd| f64::from(q[r * d + dd]) * f64::from(kt[dd * padded + j])).fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs()))
        };
        check(&scores, d, &score, "scores");
        let mut out = vec![0.0; m * d];
        kernels::weighted_values(&scores, padded, m, columns, &v, d, &mut out);
        let weighted = |i: usize| {
            let (r, c) = (i / d, i % d);
            (0..columns)
                .map(|j| f64::from(scores[r * padded + j]) * f64::from(v[j * d + c]))
                .fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs()))
        };
        check(&out, columns, &weighted, "weighted values");
    }
}

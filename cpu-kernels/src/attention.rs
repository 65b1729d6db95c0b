//! Grouped-query attention on the CPU in one parallel pass: `softmax(Q Kᵀ · scale + bias) V`
//! for `heads` query heads sharing `kv_heads` key/value heads, without materialising the score
//! tensor, the repeated keys or any transposed copy.
//!
//! Work is split into tasks of (batch row, key/value head, block of query positions). A task
//! packs the keys it needs transposed (`Kᵀ`, `[d, columns]`) and the values (`[columns, d]`) in
//! f32 once, then serves every query head of its group: scores, softmax and `P V` for
//! `groups × block` rows at a time. A task of few rows (a decode step: one position, `groups`
//! rows) packs nothing: it reads each key and value row where it lies (see `reads_in_place`).
//! Keys past the last one any row of the block may attend to (the causal future) are never
//! read: their softmax weight would be exactly zero.
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
use crate::Kernels;

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
    /// Whether the type is bf16 (else f32): how the AVX-512 kernels load it.
    const BF16: bool;
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
    const BF16: bool = false;
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
    const BF16: bool = true;
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
    /// A paged KV cache's table: position `p` of batch row `b` is the row of slot `slot(b, p)`.
    pub pages: Option<Pages<'a>>,
}

/// Where the positions of a paged operand lie: position `p` of batch row `b` is slot
/// `slots[b * width + p]`, its row at `slot * position_stride` (`batch_stride` unused).
#[derive(Debug, Clone, Copy)]
pub struct Pages<'a> {
    pub slots: &'a [usize],
    pub width: usize,
    /// A slot whose positions are never read (masked padding): the in-place path skips them.
    pub skip: Option<usize>,
}

impl<T> Heads<'_, T> {
    pub(super) fn row(&self, batch: usize, head: usize, position: usize, d: usize) -> &[T] {
        let start = match self.pages {
            Some(pages) => self.offset + head * self.head_stride + pages.slots[batch * pages.width + position] * self.position_stride,
            None => self.offset + batch * self.batch_stride + head * self.head_stride + position * self.position_stride,
        };
        &self.data[start..start + d]
    }

    /// Rows `0..columns` of head `head` of batch row `batch` as runs of rows that lie one
    /// after the other, each with its first position: one run unless the operand is paged
    /// (then a run per stretch of consecutive slots, the `skip` slot's positions left out).
    pub(super) fn runs(&self, batch: usize, head: usize, columns: usize, d: usize) -> impl Iterator<Item = (usize, Rows<'_, T>)> + '_ {
        let (mut c, mut whole) = (0, self.pages.is_none());
        std::iter::from_fn(move || {
            if whole {
                whole = false;
                return Some((0, self.rows(batch, head, columns, d)));
            }
            let pages = self.pages?;
            let slots = &pages.slots[batch * pages.width..][..columns];
            while c < columns {
                let (start, first) = (c, slots[c]);
                if Some(first) == pages.skip {
                    c += 1;
                    continue;
                }
                let len = 1 + slots[c + 1..].iter().zip(first + 1..).take_while(|&(&s, next)| s == next && Some(s) != pages.skip).count();
                c += len;
                let from = self.offset + head * self.head_stride + first * self.position_stride;
                let end = from + (len - 1) * self.position_stride + d;
                return Some((start, Rows { data: &self.data[from..end], stride: self.position_stride, len }));
            }
            None
        })
    }

    /// Rows `0..columns` of head `head` of batch row `batch`, each `d` long, read in place.
    #[inline(always)]
    pub(super) fn rows(&self, batch: usize, head: usize, columns: usize, d: usize) -> Rows<'_, T> {
        let start = self.offset + batch * self.batch_stride + head * self.head_stride;
        let len = if columns == 0 { 0 } else { (columns - 1) * self.position_stride + d };
        Rows { data: &self.data[start..start + len], stride: self.position_stride, len: columns }
    }
}

/// `len` rows of `d` elements in place, row `j` starting at `j * stride` of `data` (which holds
/// the last row's end: every row is in bounds).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rows<'a, T> {
    pub data: &'a [T],
    pub stride: usize,
    pub len: usize,
}

impl<'a, T> Rows<'a, T> {
    #[inline(always)]
    pub fn row(&self, j: usize, d: usize) -> &[T] {
        &self.data[j * self.stride..][..d]
    }

    /// Rows `start..start + len` (within `0..self.len`).
    #[inline(always)]
    pub fn sub(&self, start: usize, len: usize) -> Rows<'a, T> {
        assert!(start + len <= self.len);
        let data = if len == 0 { &self.data[..0] } else { &self.data[start * self.stride..] };
        Rows { data, stride: self.stride, len }
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
    kernels: Kernels,
    query: Heads<'_, T>,
    key: Heads<'_, T>,
    value: Heads<'_, T>,
    bias: Bias<'_, T>,
    shape: AttentionShape,
    scale: f32,
) -> Vec<T> {
    grouped_attention_with_stats(kernels, query, key, value, bias, shape, scale).0
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
    kernels: Kernels,
    query: Heads<'_, T>,
    key: Heads<'_, T>,
    value: Heads<'_, T>,
    bias: Bias<'_, T>,
    shape: AttentionShape,
    scale: f32,
) -> (Vec<T>, Vec<SoftmaxStats>) {
    attention_via(kernels, query, key, value, bias, shape, scale, |m| reads_in_place(kernels, m))
}

/// Query rows per task (`groups × block`) up to which a task reads keys and values in place
/// instead of packing them (see [`reads_in_place`]), at the AVX-512 level and below it. Measured
/// on a Zen 4 (`decode_timing`, 3,000 bf16 keys, head dims 64 and 128): in place was 4-9 times as
/// fast with 2 rows, 1.4-1.9 with 16 and 1.0-1.3 with 32 at the AVX-512 level; with the portable
/// loops 1.8-2.0 times with 2 rows, 1.3-1.5 with 4, even with 8 and slower with 16.
const IN_PLACE_ROWS: [usize; 2] = [16, 4];

/// Whether a task of `m` query rows (`groups × block`) takes the in-place path: scores as dot
/// products of each query row with each key row where it lies, and `P V` summed straight from
/// the value rows. Packing `Kᵀ` and `V` costs two passes over `2 · d · columns` values whatever
/// `m`, which the tiled products only repay with many rows; a decode step has `m = groups`.
pub(super) fn reads_in_place(kernels: Kernels, m: usize) -> bool {
    m <= IN_PLACE_ROWS[usize::from(!kernels.avx512())]
}

/// [`grouped_attention_with_stats`] with the path of each task chosen by `in_place` (given the
/// task's query rows): the tests and benchmarks force either path through it.
pub(super) fn attention_via<T: Element>(
    kernels: Kernels,
    query: Heads<'_, T>,
    key: Heads<'_, T>,
    value: Heads<'_, T>,
    bias: Bias<'_, T>,
    shape: AttentionShape,
    scale: f32,
    in_place: impl Fn(usize) -> bool + Sync,
) -> (Vec<T>, Vec<SoftmaxStats>) {
    let AttentionShape { queries, heads, kv_heads, head_dim: d, .. } = shape;
    let tasks = Task::all(shape);
    let results: Vec<(Vec<f32>, Vec<SoftmaxStats>)> = tasks
        .par_iter()
        .map(|t| {
            if in_place(heads / kv_heads * t.rows.len()) {
                wide_simd!(kernels, task_in_place(kernels, &query, &key, &value, &bias, shape, scale, t))
            } else {
                wide_simd!(kernels, task(kernels, &query, &key, &value, &bias, shape, scale, t))
            }
        })
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
    kernels: Kernels,
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
    tiles::scores(kernels, &q, m, d, &kt, padded, &mut scores);
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
    tiles::weighted_values(kernels, &scores, padded, m, columns, &v, d, &mut out);
    (out, stats)
}

/// [`task`] without packing (see [`reads_in_place`]): each score is the dot product of a query
/// row with a key row read where it lies (bf16 widened on the fly), and `P V` adds each value
/// row, read where it lies, into the output rows. Same softmax, rounding and statistics.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn task_in_place<T: Element>(
    kernels: Kernels,
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
    let q = t.gather_rows(query, shape);
    let m = q.len() / d;
    // A run of keys at a time (one unless paged; skipped columns keep 0 and are masked).
    let mut scores = vec![0.0f32; m * columns];
    for (start, keys) in key.runs(t.batch, t.group, columns, d) {
        tiles::scores_in_place(kernels, &q, m, d, keys, &mut scores[start..], columns);
    }
    let biases = t.biases(bias, columns);
    let block = t.rows.len();
    let mut stats = Vec::with_capacity(m);
    for r in 0..m {
        let biases = &biases[(r % block) * columns..][..columns];
        stats.push(softmax_row::<T>(&mut scores[r * columns..][..columns], biases, scale));
    }
    // Each run's products added to `out` (skipped columns have none: their probabilities are 0).
    let mut out = vec![0.0f32; m * d];
    for (start, values) in value.runs(t.batch, t.group, columns, d) {
        tiles::weighted_values_in_place(kernels, &scores[start..], columns, m, values, d, &mut out);
    }
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

/// The two matrix products, on packed operands and on rows read in place, with an AVX-512 path
/// and a portable one.
pub(super) mod tiles {
    // Off x86-64 only the portable paths exist, so the kernels' level is not read.
    #![cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]

    use super::{Element, Rows};
    use crate::Kernels;

    /// `s[r * stride + j] = q[r, :] · keys[j]` for `m` rows of `q` (`[m, d]`) and the
    /// `columns = keys.len` key rows where they lie (`columns <= stride`), widened on the fly.
    pub fn scores_in_place<T: Element>(kernels: Kernels, q: &[f32], m: usize, d: usize, keys: Rows<'_, T>, s: &mut [f32], stride: usize) {
        let columns = keys.len;
        assert!(columns <= stride && q.len() >= m * d && (m == 0 || s.len() >= (m - 1) * stride + columns));
        #[cfg(target_arch = "x86_64")]
        if d.is_multiple_of(16) && kernels.avx512() {
            // SAFETY: the CPU has AVX-512F; `d` is a multiple of 16 and the sizes are as above.
            unsafe { avx512::scores_in_place(q, m, d, keys, s, stride) };
            return;
        }
        let mut k = vec![0.0f32; d];
        for j in 0..columns {
            for (dst, x) in k.iter_mut().zip(keys.row(j, d)) {
                *dst = x.widen();
            }
            for (r, qr) in q.chunks_exact(d).take(m).enumerate() {
                s[r * stride + j] = dot(qr, &k);
            }
        }
    }

    /// `a · b` over 16 running sums added pairwise at the end, so that it vectorises.
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0.0f32; 16];
        let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
        let (ta, tb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for ((acc, &x), &y) in acc.iter_mut().zip(x).zip(y) {
                *acc += x * y;
            }
        }
        for ((acc, &x), &y) in acc.iter_mut().zip(ta).zip(tb) {
            *acc += x * y;
        }
        let mut width = 8;
        while width > 0 {
            for i in 0..width {
                acc[i] += acc[i + width];
            }
            width /= 2;
        }
        acc[0]
    }

    /// `out[r, :] += Σ_{j < columns} p[r * stride + j] · values[j]` for `m` rows of `p` and the
    /// `columns = values.len` value rows where they lie (`columns <= stride`), widened on the
    /// fly: the sums of [`weighted_values`], in the same order.
    pub fn weighted_values_in_place<T: Element>(
        kernels: Kernels,
        p: &[f32],
        stride: usize,
        m: usize,
        values: Rows<'_, T>,
        d: usize,
        out: &mut [f32],
    ) {
        let columns = values.len;
        assert!(columns <= stride && (m == 0 || p.len() >= (m - 1) * stride + columns) && out.len() >= m * d);
        #[cfg(target_arch = "x86_64")]
        if d.is_multiple_of(16) && kernels.avx512() {
            // SAFETY: the CPU has AVX-512F; `d` is a multiple of 16 and the sizes are as above.
            unsafe { avx512::weighted_values_in_place(p, stride, m, values, d, out) };
            return;
        }
        let mut v = vec![0.0f32; d];
        for j in 0..columns {
            for (dst, x) in v.iter_mut().zip(values.row(j, d)) {
                *dst = x.widen();
            }
            for (r, or) in out.chunks_exact_mut(d).take(m).enumerate() {
                let w = p[r * stride + j];
                for (o, &x) in or.iter_mut().zip(&v) {
                    *o += w * x;
                }
            }
        }
    }

    /// `scores[r, j] = q[r, :] · kt[:, j]` for `m` rows of `q` (`[m, d]`) and the `padded`
    /// columns of `kt` (`[d, padded]`, `padded` a multiple of 64).
    pub fn scores(kernels: Kernels, q: &[f32], m: usize, d: usize, kt: &[f32], padded: usize, scores: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if kernels.avx512() {
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
        kernels: Kernels,
        p: &[f32],
        padded: usize,
        m: usize,
        columns: usize,
        v: &[f32],
        d: usize,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if d % 16 == 0 && kernels.avx512() {
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

        use super::{Element, Rows};

        /// Key or value rows per block of the in-place kernels: 64 KiB of f32 rows of 128.
        const KEY_BLOCK: usize = 128;

        /// 16 elements of `T` from `p`, as f32 (bf16 widened).
        #[inline(always)]
        unsafe fn load<T: Element>(p: *const T) -> __m512 {
            if T::BF16 {
                let h = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_loadu_ps(p.cast())
            }
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn scores_in_place<T: Element>(q: &[f32], m: usize, d: usize, keys: Rows<'_, T>, s: &mut [f32], stride: usize) {
            let columns = keys.len;
            assert!(d.is_multiple_of(16) && columns <= stride && q.len() >= m * d && (m == 0 || s.len() >= (m - 1) * stride + columns));
            let (qp, sp) = (q.as_ptr(), s.as_mut_ptr());
            // Keys a block at a time, which stays in cache while every query row reads it; query
            // rows a few at a time, held in registers where `d` is one of these sizes.
            for j0 in (0..columns).step_by(KEY_BLOCK) {
                let keys = keys.sub(j0, KEY_BLOCK.min(columns - j0));
                let mut r = 0;
                while r < m {
                    let (q, s, left) = (qp.add(r * d), sp.add(r * stride + j0), m - r);
                    r += match d {
                        64 if left >= 4 => dots_held::<T, 4, 4>(q, keys, s, stride),
                        64 if left >= 2 => dots_held::<T, 2, 4>(q, keys, s, stride),
                        64 => dots_held::<T, 1, 4>(q, keys, s, stride),
                        128 if left >= 2 => dots_held::<T, 2, 8>(q, keys, s, stride),
                        128 => dots_held::<T, 1, 8>(q, keys, s, stride),
                        _ if left >= 4 => dots::<T, 4>(q, d, keys, s, stride),
                        _ if left >= 2 => dots::<T, 2>(q, d, keys, s, stride),
                        _ => dots::<T, 1>(q, d, keys, s, stride),
                    };
                }
            }
        }

        /// Scores of `R` query rows of `d = 16 · NV` (held in registers) against every key:
        /// `s[r * s_stride + j]`, two running sums per row. Returns `R`.
        #[inline(always)]
        unsafe fn dots_held<T: Element, const R: usize, const NV: usize>(
            q: *const f32,
            keys: Rows<'_, T>,
            s: *mut f32,
            s_stride: usize,
        ) -> usize {
            let d = 16 * NV;
            let mut qr = [[_mm512_setzero_ps(); NV]; R];
            for (r, qr) in qr.iter_mut().enumerate() {
                for (u, x) in qr.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(q.add(r * d + 16 * u));
                }
            }
            let kp = keys.data.as_ptr();
            for j in 0..keys.len {
                let k = kp.add(j * keys.stride);
                let mut acc = [[_mm512_setzero_ps(); 2]; R];
                for u in 0..NV {
                    let x = load(k.add(16 * u));
                    for (acc, qr) in acc.iter_mut().zip(&qr) {
                        acc[u % 2] = _mm512_fmadd_ps(qr[u], x, acc[u % 2]);
                    }
                }
                for (r, acc) in acc.iter().enumerate() {
                    *s.add(r * s_stride + j) = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                }
            }
            R
        }

        /// [`dots_held`] for any `d` (a multiple of 16), the query rows read from memory.
        #[inline(always)]
        unsafe fn dots<T: Element, const R: usize>(
            q: *const f32,
            d: usize,
            keys: Rows<'_, T>,
            s: *mut f32,
            s_stride: usize,
        ) -> usize {
            let kp = keys.data.as_ptr();
            for j in 0..keys.len {
                let k = kp.add(j * keys.stride);
                let mut acc = [_mm512_setzero_ps(); R];
                for c in (0..d).step_by(16) {
                    let x = load(k.add(c));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(r * d + c)), x, *acc);
                    }
                }
                for (r, acc) in acc.iter().enumerate() {
                    *s.add(r * s_stride + j) = _mm512_reduce_add_ps(*acc);
                }
            }
            R
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn weighted_values_in_place<T: Element>(
            p: &[f32],
            stride: usize,
            m: usize,
            values: Rows<'_, T>,
            d: usize,
            out: &mut [f32],
        ) {
            let columns = values.len;
            assert!(d.is_multiple_of(16) && columns <= stride && (m == 0 || p.len() >= (m - 1) * stride + columns) && out.len() >= m * d);
            let (pp, op) = (p.as_ptr(), out.as_mut_ptr());
            // A block of value rows at a time (see `scores_in_place`), each block's sums added to
            // the previous blocks' in `out`, so that each output element sums over `j` in order.
            for j0 in (0..columns).step_by(KEY_BLOCK) {
                let values = values.sub(j0, KEY_BLOCK.min(columns - j0));
                let pp = pp.add(j0);
                let mut c = 0;
                while c < d {
                    // Columns `c..c + 16 · NV` of `R` rows at a time: at most 16 accumulators.
                    let width = if d - c >= 128 && m <= 2 {
                        8
                    } else if d - c >= 64 {
                        4
                    } else {
                        1
                    };
                    let mut r = 0;
                    while r < m {
                        let (p, o, left) = (pp.add(r * stride), op.add(r * d + c), m - r);
                        r += match width {
                            8 if left >= 2 => axpys::<T, 2, 8>(p, stride, values, c, o, d),
                            8 => axpys::<T, 1, 8>(p, stride, values, c, o, d),
                            4 if left >= 4 => axpys::<T, 4, 4>(p, stride, values, c, o, d),
                            4 if left >= 2 => axpys::<T, 2, 4>(p, stride, values, c, o, d),
                            4 => axpys::<T, 1, 4>(p, stride, values, c, o, d),
                            _ if left >= 4 => axpys::<T, 4, 1>(p, stride, values, c, o, d),
                            _ if left >= 2 => axpys::<T, 2, 1>(p, stride, values, c, o, d),
                            _ => axpys::<T, 1, 1>(p, stride, values, c, o, d),
                        };
                    }
                    c += 16 * width;
                }
            }
        }

        /// `out[r * out_stride + i] += Σ_j p[r * p_stride + j] · values[j][c + i]` for `r < R`,
        /// `i < 16 · NV`: `R × NV` accumulators, summed over `j` in order. Returns `R`.
        #[inline(always)]
        unsafe fn axpys<T: Element, const R: usize, const NV: usize>(
            p: *const f32,
            p_stride: usize,
            values: Rows<'_, T>,
            c: usize,
            out: *mut f32,
            out_stride: usize,
        ) -> usize {
            let vp = values.data.as_ptr().add(c);
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            for (r, acc) in acc.iter_mut().enumerate() {
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(out.add(r * out_stride + 16 * u));
                }
            }
            for j in 0..values.len {
                let v = vp.add(j * values.stride);
                let mut x = [_mm512_setzero_ps(); NV];
                for (u, x) in x.iter_mut().enumerate() {
                    *x = load(v.add(16 * u));
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*p.add(r * p_stride + j));
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
            R
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
        let (got, _, want) = run_via::<T>(s, past, pad, |m| reads_in_place(Kernels::default(), m));
        (got, want)
    }

    /// The kernel's output with each task's path chosen by `in_place`, its statistics, and the
    /// reference output.
    fn run_via<T: Element>(
        s: AttentionShape,
        past: usize,
        pad: usize,
        in_place: fn(usize) -> bool,
    ) -> (Vec<f32>, Vec<SoftmaxStats>, Vec<f32>) {
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
            pages: None,
        };
        let query = Heads {
            data: &q[..],
            offset: 0,
            batch_stride: s.queries * s.heads * d,
            head_stride: d,
            position_stride: s.heads * d,
            pages: None,
        };
        let bias_view = Bias {
            data: &bias[..],
            offset: 0,
            batch_stride: s.queries * s.keys,
            query_stride: s.keys,
            key_stride: 1,
        };
        let (got, stats) = attention_via(
            Kernels::default(),
            query,
            heads(&k[..], s.kv_heads, 1, s.keys),
            heads(&v[..], s.kv_heads, 1, s.keys),
            bias_view,
            s,
            scale,
            in_place,
        );
        let got = got.iter().map(|x| x.widen()).collect();
        (got, stats, reference(&q, &k, &v, &bias, s, scale))
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

    /// Decode steps (one query position after `keys - 1` cached keys): 1, 63, 64, 65 and 3000
    /// keys, 1, 3 and 4 query heads per key/value head, head dims held in registers (64, 128),
    /// other multiples of 16 (48) and odd (24), with batch row 1's leading keys masked
    /// (padding; with one key, a row that attends to nothing).
    fn decode_shapes() -> Vec<(AttentionShape, usize, usize)> {
        let mut out = Vec::new();
        for keys in [1, 63, 64, 65, 3000] {
            for (heads, kv_heads, head_dim) in [(6, 2, 64), (8, 2, 128), (2, 2, 48), (3, 1, 24)] {
                let s = AttentionShape { batch: 2, queries: 1, keys, heads, kv_heads, head_dim };
                out.push((s, keys - 1, keys.div_ceil(3)));
            }
        }
        out
    }

    #[test]
    fn decode_steps_read_keys_in_place() {
        for (s, _, _) in decode_shapes() {
            for t in Task::all(s) {
                assert!(reads_in_place(Kernels::default(), s.heads / s.kv_heads * t.rows.len()), "{s:?}");
            }
        }
        // Prefill blocks pack.
        let kernels = Kernels::default();
        assert!(!reads_in_place(kernels, 2 * QUERY_BLOCK));
        let most = IN_PLACE_ROWS[usize::from(!kernels.avx512())];
        assert!(reads_in_place(kernels, 1) && reads_in_place(kernels, most) && !reads_in_place(kernels, most + 1));
    }

    /// The in-place path at the same tolerances as the packed one (see the tests above).
    #[test]
    fn decode_f32_matches_plain_attention() {
        for (s, past, pad) in decode_shapes() {
            let (got, _, want) = run_via::<f32>(s, past, pad, |_| true);
            assert!(max_diff(&got, &want) < 1e-5, "{s:?}: {}", max_diff(&got, &want));
        }
    }

    #[test]
    fn decode_bf16_matches_plain_attention() {
        for (s, past, pad) in decode_shapes() {
            let (got, _, want) = run_via::<bf16>(s, past, pad, |_| true);
            let diff = max_diff(&got, &want);
            assert!(diff <= 0.05, "{s:?}: {diff}");
            let exact = got.iter().zip(&want).filter(|(a, b)| a == b).count();
            assert!(exact * 10 >= got.len() * 9, "{s:?}: only {exact} of {} equal", got.len());
        }
    }

    /// Both paths, forced, on decode steps and on blocks of many rows: the same outputs and
    /// softmax statistics (which training's backward pass reads) up to f32 summation order.
    #[test]
    fn in_place_and_packed_paths_agree() {
        let mut cases = decode_shapes();
        cases.extend(shapes());
        for (s, past, pad) in cases {
            let (a, sa, want) = run_via::<f32>(s, past, pad, |_| true);
            let (b, sb, _) = run_via::<f32>(s, past, pad, |_| false);
            assert!(max_diff(&a, &b) < 1e-5 && max_diff(&b, &want) < 1e-5, "{s:?}: {}", max_diff(&a, &b));
            for (x, y) in sa.iter().zip(&sb) {
                let close = |u: f32, v: f32| (u - v).abs() <= 1e-5 * u.abs().max(v.abs()).max(1.0);
                assert!(close(x.max, y.max) && close(x.sum, y.sum), "{s:?}: {x:?} vs {y:?}");
            }
        }
    }

    /// One batch row's output and statistics through either path, alone (its `n` keys filling
    /// the key dimension) and as row 1 of 3 beside rows of other contents and lengths, in a key
    /// dimension 37 longer than its `n` keys (the rest masked): bit for bit the same, so that a
    /// row's answer does not depend on the rows batched beside it or the cache's capacity.
    fn row_beside_others<T: Element + std::fmt::Debug + PartialEq>() {
        for (heads, kv_heads, d) in [(6, 2, 64), (8, 2, 128), (4, 2, 16), (2, 2, 48), (3, 1, 24)] {
            for (n, queries) in [(1, 1), (63, 1), (65, 1), (300, 1), (300, 4), (3000, 1)] {
                let (q, k, v) = (
                    values::<T>(queries * heads * d, 1),
                    values::<T>(kv_heads * n * d, 2),
                    values::<T>(kv_heads * n * d, 3),
                );
                // `[batch, queries, keys]` causal biases: row b's query i sees keys
                // `..ends[b] - queries + i + 1`.
                let run = |batch: usize, keys: usize, ends: &[usize], row: usize, in_place: fn(usize) -> bool| {
                    let s = AttentionShape { batch, queries, keys, heads, kv_heads, head_dim: d };
                    let mut qs = values::<T>(batch * queries * heads * d, 4);
                    let mut ks = values::<T>(batch * kv_heads * keys * d, 5);
                    let mut vs = values::<T>(batch * kv_heads * keys * d, 6);
                    qs[row * queries * heads * d..][..queries * heads * d].copy_from_slice(&q);
                    for g in 0..kv_heads {
                        let at = (row * kv_heads + g) * keys * d;
                        ks[at..at + n * d].copy_from_slice(&k[g * n * d..][..n * d]);
                        vs[at..at + n * d].copy_from_slice(&v[g * n * d..][..n * d]);
                    }
                    let mut bias = Vec::new();
                    for &end in ends {
                        for i in 0..queries {
                            let seen = end - queries + i + 1;
                            bias.extend((0..keys).map(|j| T::narrow(if j < seen { 0.0 } else { -1.0e9 })));
                        }
                    }
                    let kv = |data| Heads {
                        data,
                        offset: 0,
                        batch_stride: kv_heads * keys * d,
                        head_stride: keys * d,
                        position_stride: d,
                        pages: None,
                    };
                    let query = Heads {
                        data: &qs[..],
                        offset: 0,
                        batch_stride: queries * heads * d,
                        head_stride: d,
                        position_stride: heads * d,
                        pages: None,
                    };
                    let bias = Bias {
                        data: &bias[..],
                        offset: 0,
                        batch_stride: queries * keys,
                        query_stride: keys,
                        key_stride: 1,
                    };
                    let (out, stats) = attention_via(Kernels::default(), query, kv(&ks[..]), kv(&vs[..]), bias, s, 0.125, in_place);
                    let out = out[row * queries * heads * d..][..queries * heads * d].to_vec();
                    let stats: Vec<_> = stats[row * heads * queries..][..heads * queries]
                        .iter()
                        .map(|st| (st.max.to_bits(), st.sum.to_bits()))
                        .collect();
                    (out, stats)
                };
                for in_place in [(|_| true) as fn(usize) -> bool, |_| false] {
                    let alone = run(1, n, &[n], 0, in_place);
                    let beside = run(3, n + 37, &[n + 37, n, n.div_ceil(2).max(queries)], 1, in_place);
                    let path = if in_place(0) { "in place" } else { "packed" };
                    assert!(alone == beside, "{path}, heads {heads}/{kv_heads}, d {d}, {n} keys, {queries} queries");
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_rows_beside_it_f32() {
        row_beside_others::<f32>();
    }

    #[test]
    fn a_row_does_not_depend_on_the_rows_beside_it_bf16() {
        row_beside_others::<bf16>();
    }

    /// Times the packed and in-place paths on decode steps over 3,000 keys (8 batch rows, 2
    /// key/value heads of 2 query heads each, head dim 64 and 128, bf16):
    /// `cargo test --release -p prompt-r1-cpu-kernels decode_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn decode_timing() {
        for (head_dim, heads) in [(64, 4), (128, 4), (128, 8)] {
            for block in [1, 2, 4, 16] {
                let s = AttentionShape { batch: 8, queries: block, keys: 3000, heads, kv_heads: 2, head_dim };
                let d = head_dim;
                let q = values::<bf16>(s.batch * s.queries * s.heads * d, 1);
                let k = values::<bf16>(s.batch * s.kv_heads * s.keys * d, 2);
                let v = values::<bf16>(s.batch * s.kv_heads * s.keys * d, 3);
                let bias = causal_bias::<bf16>(s, s.keys - block, 10);
                let kv = |data| {
                    let batch_stride = s.kv_heads * s.keys * d;
                    Heads { data, offset: 0, batch_stride, head_stride: s.keys * d, position_stride: d, pages: None }
                };
                let (batch_stride, position_stride) = (s.queries * s.heads * d, s.heads * d);
                let query = Heads { data: &q[..], offset: 0, batch_stride, head_stride: d, position_stride, pages: None };
                let batch_stride = s.queries * s.keys;
                let bias = Bias { data: &bias[..], offset: 0, batch_stride, query_stride: s.keys, key_stride: 1 };
                let time = |in_place: fn(usize) -> bool| {
                    let runs = 50;
                    (0..3)
                        .map(|_| {
                            let start = std::time::Instant::now();
                            for _ in 0..runs {
                                let (k, v) = (kv(&k[..]), kv(&v[..]));
                                std::hint::black_box(attention_via(Kernels::default(), query, k, v, bias, s, 0.125, in_place));
                            }
                            start.elapsed().as_secs_f64() * 1e6 / runs as f64
                        })
                        .fold(f64::INFINITY, f64::min)
                };
                let (packed, in_place) = (time(|_| false), time(|_| true));
                println!(
                    "d {d}, groups {}, block {block} (m {}): packed {packed:.0} us, in place {in_place:.0} us ({:.2}x)",
                    heads / 2,
                    heads / 2 * block,
                    packed / in_place
                );
            }
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
        tiles::scores(Kernels::default(), &q, m, d, &kt, padded, &mut scores);
        let score = |i: usize| {
            let (r, j) = (i / padded, i % padded);
            (0..d).map(|dd| f64::from(q[r * d + dd]) * f64::from(kt[dd * padded + j])).fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs()))
        };
        check(&scores, d, &score, "scores");
        let mut out = vec![0.0; m * d];
        tiles::weighted_values(Kernels::default(), &scores, padded, m, columns, &v, d, &mut out);
        let weighted = |i: usize| {
            let (r, c) = (i / d, i % d);
            (0..columns)
                .map(|j| f64::from(scores[r * padded + j]) * f64::from(v[j * d + c]))
                .fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs()))
        };
        check(&out, columns, &weighted, "weighted values");
    }
}

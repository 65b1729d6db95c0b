//! One pass's attention over the paged KV cache (see [`model::device_kernels::PagedAttention`]),
//! a prefill chunk's many queries a row, or a ragged pass's rows of different lengths (a decoding
//! step's rows beside prefill chunks), as one CubeCL kernel (rows of a single query, a decoding
//! step's or a ragged pass's, go to [`crate::paged_decode`]'s where its cut fits, and come here
//! otherwise): one cube
//! of [`UNITS`] units per (query heads sharing a key-value head, row, block of queries), so that
//! each key and value it stages serves all of them (grouped-query attention). The cube takes the
//! row's columns a tile at a time ([`blocks_for`]), up to the last one its queries may see
//! (causal):
//! 1. the first units look up their column's slot and whether it is a key;
//! 2. all units copy the tile's keys into shared memory in vectors of up to 16 bytes,
//!    consecutive units reading consecutive vectors of one key (coalesced; a masked column gets
//!    zeros), each unit's loads of a round issued before any is stored (`LOADS_IN_FLIGHT`
//!    elements in a pass of one query a row, `BLOCK_LOADS_IN_FLIGHT` vectors in a block of
//!    several);
//! 3. the units score the cube's ((head, query), column) pairs from shared memory (key rows
//!    padded by one element, so that units reading one element of different keys touch
//!    distinct banks); a column after the query's own position, or padding, is masked;
//! 4. one unit a (head, query) updates its running maximum and sum (FlashAttention's online
//!    softmax) and turns the tile's scores into probabilities;
//! 5. the units copy the tile's values into the same shared memory (coalesced) and each adds
//!    them to the output elements it owns.
//!
//! A cube of one query a head (a decoding step's) gives each unit one score, then one output
//! element, at a time, its outputs in shared memory. A cube of a block of several queries a head
//! (a prefill chunk's, a scoring pass's) gives each unit a small tile of each ([`Tiling`]: two
//! entries' scores over up to 4 columns, then up to 4 entries' outputs over a share of the
//! head's elements), its outputs in registers from the first tile to the last, so that each
//! element it reads from shared memory serves several products: a score took two shared loads
//! and an output element's product two, which bounded the kernel by shared memory's bandwidth
//! (the sixth lease's H200: 2.9 ms a layer of a prefill step, half the 0.6B rollout's GPU time).
//!
//! Each key and value is read from the pools once per (cube's heads, block of queries), where it
//! lies; scores, probabilities and sums are f32 whatever the pools' dtype.
//!
//! A pass without a cache ([`fresh_attention`]: scoring, a training step's forward) takes the
//! same kernel laid out for it (`fresh`): its keys and values are its tokens' rows as the
//! projections leave them, a row's columns its own tokens; the scores are rounded to the
//! operands' dtype as burn's product is, and each (token, head)'s log-sum-exp is written for the
//! backward.
//!
//! A decoding step on a GPU whose multiprocessors its cubes would leave idle is split
//! (FlashDecoding): each row's columns are cut into spans ([`splits_for`]), a cube each, which
//! write their unnormalised sums, maximum and total, and a second kernel
//! (`combine_splits_kernel`) joins them as the online softmax joins tiles.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

pub use model::device_kernels::RowLens;

use crate::rms_norm::{cube_row, grid};

/// Units per cube.
pub const UNITS: u32 = 64;

/// Bytes of shared memory a cube may take: within the 32 KiB that every CubeCL target offers a
/// cube (lavapipe's limit; CUDA's default is 48 KiB).
const SHARED_BYTES: usize = 28 * 1024;

/// (head, query) pairs a cube takes at most: each key and value it copies into shared memory
/// serves that many of them.
const MOST_QUERIES: usize = 16;

/// f32 words of shared memory a cube of `entries` (head, query) pairs, `block` queries a head,
/// and tiles of `tile` columns takes: the queries, a tile of keys (then values) in rows of
/// `head_dim + 1`, the tile's scores, three statistics an entry and two words a column; with
/// one query a head the outputs too, which a block of several keeps in registers (one word
/// standing in; its queries and scores in rows padded by one word: see [`Tiling`]).
const fn shared_words(head_dim: usize, entries: usize, block: usize, tile: usize) -> usize {
    let stats = tile * (head_dim + 1) + 3 * entries + 2 * tile;
    match block {
        1 => 2 * entries * head_dim + entries * tile + stats,
        _ => entries * (head_dim + 1) + 1 + entries * (tile + 1) + stats,
    }
}

/// Columns of a tile one unit scores for a pair of entries, at most: each query element it reads
/// from shared memory serves this many products, each key element two.
const MOST_SCORED_COLUMNS: usize = 4;

/// How a cube of a block of several queries a head shares its work among its [`UNITS`] units
/// (a decoding step's cube, one query a head, gives each unit one score or output element at a
/// time instead). Each unit keeps a small tile of products in registers, so that every element it
/// reads from shared memory serves several of them: where one score took two shared loads, a
/// unit's `2 × columns` scores take `2 + columns` loads an element, and its `entries × dims`
/// output elements `entries + dims` loads a column of values. Shared memory's bandwidth, not
/// arithmetic, bounded the kernel (the sixth lease's H200: 2.9 ms a layer of a prefill step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Tiling {
    /// Columns a unit scores for each of its two entries, `tile / columns` apart.
    columns: u32,
    /// Entries whose output elements a unit owns.
    entries: u32,
    /// Units a group of `entries` entries shares out its elements of the head among,
    /// `head_dim / lanes` (rounded up) each.
    lanes: u32,
}

impl Tiling {
    /// The tiling of a cube of `entries` (head, query) pairs, an even number, over tiles of
    /// `tile` columns: the most columns a unit, up to [`MOST_SCORED_COLUMNS`], that still give
    /// each of the [`UNITS`] units its pair of entries' columns; four entries a unit's outputs
    /// where they divide the cube's, else two.
    const fn new(entries: u32, tile: u32) -> Tiling {
        let mut columns = MOST_SCORED_COLUMNS as u32;
        while columns > 1 && (columns > tile || entries / 2 * (tile / columns) < UNITS) {
            columns /= 2;
        }
        let owned = if entries.is_multiple_of(4) { 4 } else { 2 };
        Tiling { columns, entries: owned, lanes: UNITS / (entries / owned) }
    }

    /// Elements of each of its entries a unit owns, for heads of `head_dim` (the last lanes
    /// may own one fewer: see [`Tiling::whole`]).
    const fn dims(self, head_dim: u32) -> u32 {
        head_dim.div_ceil(self.lanes)
    }

    /// Whether every lane owns [`Tiling::dims`] elements of a head of `head_dim`.
    const fn whole(self, head_dim: u32) -> bool {
        head_dim.is_multiple_of(self.lanes)
    }

    /// Output elements (f32 registers) each unit keeps, for heads of `head_dim`.
    const fn owned(self, head_dim: u32) -> u32 {
        self.entries * self.dims(head_dim)
    }

    /// Units that own output elements in a cube of `entries` (head, query) pairs: the first
    /// ones, `lanes` a group of [`Tiling::entries`] entries.
    const fn owners(self, entries: u32) -> u32 {
        entries / self.entries * self.lanes
    }
}

/// How a pass is cut into cubes and tiles ([`blocks_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    /// Query heads a cube takes, all of one key-value head.
    pub heads: u32,
    /// Queries of a row a cube takes (for each of its heads).
    pub queries: u32,
    /// Columns per tile.
    pub tile: u32,
}

/// The cubes and tiles of a pass of `queries` queries a row over heads of `head_dim`, `groups`
/// query heads to a key-value head: a cube takes the most of a group's heads that divide it
/// (up to `MOST_QUERIES`), then as many queries as the pass has, a power of two, up to
/// `MOST_QUERIES` (head, query) pairs in all (fewer where tiles of 16 columns would not fit),
/// and the most columns a tile, a power of two up to [`UNITS`], that fit `SHARED_BYTES`.
/// Qwen3-4B's heads of 128, 4 to a group: a decoding step takes cubes of 4 heads and tiles of
/// 32 columns, a prefill 4 heads × 4 queries and tiles of 32.
pub fn blocks_for(head_dim: usize, groups: usize, queries: usize) -> Blocks {
    let fits = |heads: usize, block: usize, tile: usize| 4 * shared_words(head_dim, heads * block, block, tile) <= SHARED_BYTES;
    let heads = (1..=groups.clamp(1, MOST_QUERIES)).rev().find(|&h| groups % h == 0 && fits(h, 1, 16)).unwrap_or(1);
    let most = 1 << (MOST_QUERIES / heads).max(1).ilog2();
    let mut block = queries.max(1).next_power_of_two().min(most);
    while block > 1 && !fits(heads, block, 16) {
        block /= 2;
    }
    let mut tile = 1;
    while tile * 2 <= UNITS as usize && fits(heads, block, tile * 2) {
        tile *= 2;
    }
    Blocks { heads: heads as u32, queries: block as u32, tile: tile as u32 }
}

/// A hash of this file, one of the kernel's compile-time arguments: CubeCL's persistent cache
/// of compiled kernels (`--kernel-cache`) keys a kernel by its name and those arguments only,
/// so an edited kernel would otherwise run as cached by an earlier build.
pub(crate) const REVISION: u32 = crate::source_revision(include_bytes!("paged_attention.rs"));

#[cube(launch)]
fn paged_attention_kernel<F: Float, N: Size, I: Numeric, V: Float>(
    query: &Tensor<F>,
    keys: &Tensor<Vector<F, N>>,
    values: &Tensor<Vector<F, N>>,
    read: &Tensor<I>,
    valid: &Tensor<V>,
    row_starts: &Tensor<I>,
    output: &mut Tensor<F>,
    partial: &mut Tensor<f32>,
    scale: f32,
    splits: u32,
    span: u32,
    fewest: u32,
    #[comptime] ragged: bool,
    #[comptime] split: bool,
    #[comptime] fresh: bool,
    #[comptime] head_dim: u32,
    #[comptime] cube_heads: u32,
    #[comptime] block: u32,
    #[comptime] tile: u32,
    #[comptime] _revision: u32,
    #[define(F, I, V)] _dtypes: [StorageType; 3],
) {
    let row = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let d = head_dim as usize;
    // Entry b of the cube is query b % block of head first_head + b / block.
    let block_len = block as usize;
    let entries = cube_heads as usize * block_len;
    let first_head = CUBE_POS_X as usize * cube_heads as usize;
    let tile_len = tile as usize;
    // Keys and values sit in shared memory in rows of d + 1: units reading element e of
    // different keys touch distinct banks. A block of several queries a head (`tiled`) keeps
    // its queries in such rows too, its scores in rows of tile + 1, and its outputs in the
    // units' registers (see `Tiling`).
    let kv_stride = d + 1;
    let tiled = comptime!(block > 1);
    let q_stride = comptime!(if block > 1 { head_dim + 1 } else { head_dim }) as usize;
    let score_stride = comptime!(if block > 1 { tile + 1 } else { tile }) as usize;
    let tiling = comptime!(Tiling::new(if block > 1 { cube_heads * block } else { 2 }, tile));
    let owned = comptime!(if block > 1 { tiling.owned(head_dim) } else { 1 }) as usize;
    // A unit of such a block owns entries `(unit / lanes) · owned_entries ..` and their elements
    // `unit % lanes + k · lanes` (the first `owners` units do).
    let owned_entries = comptime!(tiling.entries as usize);
    let lanes = comptime!(tiling.lanes as usize);
    let dims = comptime!(tiling.dims(head_dim) as usize);
    let whole_dims = comptime!(tiling.whole(head_dim));
    let owners = comptime!(tiling.owners(cube_heads * block) as usize);
    let n = N::value();
    let in_flight = comptime!(if block == 1 { (LOADS_IN_FLIGHT / n as u32).max(1) } else { BLOCK_LOADS_IN_FLIGHT });

    let heads = query.shape(2);
    // Pools `[kv_heads, slots, d]`, or a fresh pass's keys and values `[tokens, kv_heads, d]`
    // (both packed, the values laid out as the keys). The pools' variants compile as they did
    // before the fresh one existed: their strides stay compile-time `d` (at runtime ones, the
    // split decoding step's f16 and bf16 variants spilled registers on sm_70).
    let kv_heads = if fresh { keys.shape(1) } else { keys.shape(0) };
    let width = valid.shape(1);
    // The row's queries: `queries` from token `token0` of the pass (rows of equal length, or
    // a ragged pass's `row_starts[row]..row_starts[row + 1]`).
    let mut token0 = row * query.shape(1);
    let mut queries = query.shape(1);
    if ragged {
        token0 = usize::cast_from(row_starts[row]);
        queries = usize::cast_from(row_starts[row + 1]) - token0;
        if queries < fewest as usize {
            // A row that the decoding kernel takes (every unit of the cube returns here).
            terminate!();
        }
    }
    // z: the block of queries, and in a split pass which of the row's spans of columns.
    let mut z = CUBE_POS_Z as usize;
    let mut part = 0usize;
    if split {
        part = z % splits as usize;
        z /= splits as usize;
    }
    let first = z * block_len;
    if first >= queries {
        // A ragged pass's grid covers its longest row; shorter rows leave cubes with nothing
        // to do (every unit of the cube returns here, before any barrier).
        terminate!();
    }
    // The row's queries are its last columns: query i sees columns up to past + i.
    let past = width - queries;
    let mut count = queries - first;
    if count > block_len {
        count = block_len;
    }
    let end = past + first + count;
    // The columns this cube walks: all it may see, or its span of them.
    let mut start = 0usize;
    let mut stop = end;
    if split {
        start = part * span as usize;
        if start + (span as usize) < stop {
            stop = start + span as usize;
        }
    }
    let kv_head = first_head / (heads / kv_heads);
    let pool_base = if fresh { kv_head * d } else { kv_head * keys.shape(1) * d };

    // A masked column's score: below any real score, finite (as the model's mask value).
    let masked = f32::new(-1.0e30);
    let mut q = SharedMemory::<f32>::new(entries * q_stride);
    let mut acc = SharedMemory::<f32>::new(comptime!(if block > 1 { 1 } else { (cube_heads * block * head_dim) as usize }));
    let mut owned_acc = Array::<f32>::new(owned);
    #[unroll]
    for k in 0..owned {
        owned_acc[k] = 0.0;
    }
    let mut kv_tile = SharedMemory::<f32>::new(tile_len * kv_stride);
    let mut scores = SharedMemory::<f32>::new(entries * score_stride);
    let mut running_max = SharedMemory::<f32>::new(entries);
    let mut total = SharedMemory::<f32>::new(entries);
    let mut rescale = SharedMemory::<f32>::new(entries);
    let mut slot_of = SharedMemory::<u32>::new(tile_len);
    let mut is_key = SharedMemory::<u32>::new(tile_len);

    let mut i = unit;
    while i < entries * d {
        let b = i / d;
        let qi = b % block_len;
        let mut x = 0.0f32;
        if qi < count {
            x = f32::cast_from(query[pair_index(b, token0 + first, first_head, heads, block) * d + i % d]);
            if comptime!(!fresh) {
                x *= scale;
            }
        }
        q[b * q_stride + i % d] = x;
        if !tiled {
            acc[i] = 0.0;
        }
        i += units;
    }
    if unit < entries {
        running_max[unit] = masked;
        total[unit] = 0.0;
    }

    while start < stop {
        // 1. The tile's slots.
        if unit < tile_len {
            let found = if fresh { fresh_key_slot(valid, row, start + unit, stop) } else { key_slot(read, valid, row, start + unit, stop) };
            slot_of[unit] = found.saturating_sub(1);
            is_key[unit] = u32::min(found, 1);
        }
        sync_cube();

        // 2. The tile's keys.
        stage_tile::<F, N, f32>(keys, pool_base, &slot_of, &is_key, &mut kv_tile, head_dim, tile, head_dim + 1, UNITS, in_flight, fresh);
        sync_cube();

        // 3. Scores: a column is seen by the queries at or after its position.
        if tiled {
            score_tile::<F>(&q, &kv_tile, &is_key, &mut scores, start, past + first, count, scale, head_dim, block, tile, cube_heads * block, tiling.columns, fresh);
        } else {
            let mut p = unit;
            while p < entries * tile_len {
                let b = p / tile_len;
                let qi = b % block_len;
                let j = p % tile_len;
                let mut score = masked;
                if sees(&is_key, j, start, past + first, qi, count) {
                    let q_base = b * q_stride;
                    let k_base = j * kv_stride;
                    let mut dot = 0.0f32;
                    for e in 0..d {
                        dot += q[q_base + e] * kv_tile[k_base + e];
                    }
                    score = dot;
                    if fresh {
                        // Rounded to the operands' dtype before the scale, as burn's product in
                        // that dtype is (`memory_efficient`'s scores), so that the backward's
                        // recomputed probabilities agree with this log-sum-exp.
                        score = f32::cast_from(F::cast_from(dot)) * scale;
                    }
                }
                scores[p] = score;
                p += units;
            }
        }
        sync_cube();

        // 4. The online softmax, one unit an entry.
        if unit < entries {
            let base = unit * score_stride;
            let old_max = running_max[unit];
            let mut new_max = old_max;
            for j in 0..tile_len {
                let s = scores[base + j];
                if s > new_max {
                    new_max = s;
                }
            }
            let mut tile_sum = 0.0f32;
            for j in 0..tile_len {
                let s = scores[base + j];
                // A masked column gets no weight; a NaN score (a fault upstream) stays NaN.
                let mut prob = 0.0f32;
                if s != masked {
                    prob = (s - new_max).exp();
                }
                scores[base + j] = prob;
                tile_sum += prob;
            }
            let factor = (old_max - new_max).exp();
            rescale[unit] = factor;
            total[unit] = total[unit] * factor + tile_sum;
            running_max[unit] = new_max;
        }

        // 5. The tile's values, into the keys' place, and the outputs.
        stage_tile::<F, N, f32>(values, pool_base, &slot_of, &is_key, &mut kv_tile, head_dim, tile, head_dim + 1, UNITS, in_flight, fresh);
        sync_cube();

        if tiled {
            add_values(&mut owned_acc, &scores, &kv_tile, &rescale, head_dim, tile, cube_heads * block, tiling);
        } else {
            let mut i = unit;
            while i < entries * d {
                let b = i / d;
                let e = i % d;
                let base = b * tile_len;
                let mut sum = acc[i] * rescale[b];
                for j in 0..tile_len {
                    sum += scores[base + j] * kv_tile[j * kv_stride + e];
                }
                acc[i] = sum;
                i += units;
            }
        }
        sync_cube();
        start += tile_len;
    }

    if split {
        // The span's unnormalised sums, maximum and total, for `combine_splits_kernel`:
        // `partial` is `[splits, tokens, heads, d + 2]`. A barrier first: a span past the
        // cube's last column ran no tile, so none since the statistics were first set.
        sync_cube();
        let tokens = query.shape(0) * query.shape(1);
        if tiled {
            if unit < owners {
                #[unroll]
                for r in 0..owned_entries {
                    let b = (unit / lanes) * owned_entries + r;
                    if b % block_len < count {
                        let base = (part * tokens * heads + pair_index(b, token0 + first, first_head, heads, block)) * (d + 2);
                        #[unroll]
                        for k in 0..dims {
                            let e = unit % lanes + k * lanes;
                            if whole_dims || e < d {
                                partial[base + e] = owned_acc[r * dims + k];
                            }
                        }
                    }
                }
            }
        } else {
            let mut i = unit;
            while i < entries * d {
                let b = i / d;
                let qi = b % block_len;
                if qi < count {
                    let base = (part * tokens * heads + pair_index(b, token0 + first, first_head, heads, block)) * (d + 2);
                    partial[base + i % d] = acc[i];
                }
                i += units;
            }
        }
        if unit < entries && unit % block_len < count {
            let base = (part * tokens * heads + pair_index(unit, token0 + first, first_head, heads, block)) * (d + 2);
            partial[base + d] = running_max[unit];
            partial[base + d + 1] = total[unit];
        }
        terminate!();
    }
    if fresh {
        // Each (token, head)'s log-sum-exp of its scores, for the backward: `partial` is
        // `[tokens, heads]`. A query that sees no key (its output zeros) gets 0: its masked
        // scores' recomputed probabilities stay 0, not infinite.
        if unit < entries && unit % block_len < count {
            let mut lse = 0.0f32;
            if total[unit] > 0.0 {
                lse = running_max[unit] + total[unit].ln();
            }
            partial[pair_index(unit, token0 + first, first_head, heads, block)] = lse;
        }
    }
    if tiled {
        if unit < owners {
            #[unroll]
            for r in 0..owned_entries {
                let b = (unit / lanes) * owned_entries + r;
                if b % block_len < count {
                    let base = pair_index(b, token0 + first, first_head, heads, block) * d;
                    let sum = total[b];
                    #[unroll]
                    for k in 0..dims {
                        let e = unit % lanes + k * lanes;
                        if whole_dims || e < d {
                            let mut out = 0.0f32;
                            if sum > 0.0 {
                                out = owned_acc[r * dims + k] / sum;
                            }
                            output[base + e] = F::cast_from(out);
                        }
                    }
                }
            }
        }
    } else {
        let mut i = unit;
        while i < entries * d {
            let b = i / d;
            let qi = b % block_len;
            if qi < count {
                let mut out = 0.0f32;
                if total[b] > 0.0 {
                    out = acc[i] / total[b];
                }
                output[pair_index(b, token0 + first, first_head, heads, block) * d + i % d] = F::cast_from(out);
            }
            i += units;
        }
    }
}

/// Scores of a tile (step 3 of the kernel) in a cube of a block of several queries a head: each
/// unit takes two entries (consecutive queries of one head) and `columns` columns `tile /
/// columns` apart, their `2 × columns` dot products in registers, reading each query element
/// once for `columns` products and each key element once for two (rows of `head_dim + 1` in
/// `q` and `kv_tile`: units reading element e of different rows touch distinct banks). A
/// column is seen by the queries at or after its position (the cube's first query at `seen`,
/// `count` of them); a masked one, or padding, scores below any real score. Scores go to rows
/// of `tile + 1` (one unit an entry reads them next).
#[cube]
#[allow(clippy::too_many_arguments)]
fn score_tile<F: Float>(
    q: &SharedMemory<f32>,
    kv_tile: &SharedMemory<f32>,
    is_key: &SharedMemory<u32>,
    scores: &mut SharedMemory<f32>,
    start: usize,
    seen: usize,
    count: usize,
    scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] block: u32,
    #[comptime] tile: u32,
    #[comptime] entries: u32,
    #[comptime] columns: u32,
    #[comptime] fresh: bool,
) {
    let d = head_dim as usize;
    let stride = d + 1;
    let columns_apart = comptime!(tile / columns) as usize;
    let cols = comptime!(columns as usize);
    let groups = comptime!((entries / 2 * (tile / columns)) as usize);
    let mut g = UNIT_POS_X as usize;
    while g < groups {
        let b0 = (g / columns_apart) * 2;
        let j0 = g % columns_apart;
        let mut dots = Array::<f32>::new(comptime!(2 * columns as usize));
        #[unroll]
        for c in 0..2 * cols {
            dots[c] = 0.0;
        }
        let q0 = b0 * stride;
        for e in 0..d {
            let x0 = q[q0 + e];
            let x1 = q[q0 + stride + e];
            #[unroll]
            for c in 0..cols {
                let k = kv_tile[(j0 + c * columns_apart) * stride + e];
                dots[c] += x0 * k;
                dots[cols + c] += x1 * k;
            }
        }
        #[unroll]
        for r in 0..2usize {
            let b = b0 + r;
            let qi = b % block as usize;
            #[unroll]
            for c in 0..cols {
                let j = j0 + c * columns_apart;
                let mut score = f32::new(-1.0e30);
                if sees(is_key, j, start, seen, qi, count) {
                    let dot = dots[r * cols + c];
                    score = dot;
                    if fresh {
                        // Rounded to the operands' dtype before the scale, as in the kernel's
                        // other scoring.
                        score = f32::cast_from(F::cast_from(dot)) * scale;
                    }
                }
                scores[b * comptime!(tile as usize + 1) + j] = score;
            }
        }
        g += CUBE_DIM_X as usize;
    }
}

/// Adds a tile's values, weighed by its probabilities (`scores`, rows of `tile + 1`), to the
/// output elements a unit of a block of several queries a head keeps in `owned` (step 5 of the
/// kernel), after rescaling them by `rescale` (the online softmax's change of maximum): of a
/// cube of `entries`, unit u owns the tiling's `entries` from `(u / lanes) · entries` and their
/// elements `u % lanes + k · lanes`, so that each probability it reads serves its elements and
/// each value element its entries (see [`Tiling`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_values(
    owned: &mut Array<f32>,
    scores: &SharedMemory<f32>,
    kv_tile: &SharedMemory<f32>,
    rescale: &SharedMemory<f32>,
    #[comptime] head_dim: u32,
    #[comptime] tile: u32,
    #[comptime] entries: u32,
    #[comptime] tiling: Tiling,
) {
    let d = head_dim as usize;
    let unit = UNIT_POS_X as usize;
    let lanes_n = comptime!(tiling.lanes as usize);
    let rows = comptime!(tiling.entries as usize);
    let dims = comptime!(tiling.dims(head_dim) as usize);
    let whole_dims = comptime!(tiling.whole(head_dim));
    let score_stride = comptime!(tile as usize + 1);
    if unit < comptime!(tiling.owners(entries) as usize) {
        let b0 = (unit / lanes_n) * rows;
        let lane = unit % lanes_n;
        #[unroll]
        for r in 0..rows {
            let factor = rescale[b0 + r];
            #[unroll]
            for k in 0..dims {
                owned[r * dims + k] *= factor;
            }
        }
        let mut p = Array::<f32>::new(rows);
        for j in 0..tile as usize {
            #[unroll]
            for r in 0..rows {
                p[r] = scores[(b0 + r) * score_stride + j];
            }
            let v_base = j * (d + 1) + lane;
            #[unroll]
            for k in 0..dims {
                if whole_dims || lane + k * lanes_n < d {
                    let v = kv_tile[v_base + k * lanes_n];
                    #[unroll]
                    for r in 0..rows {
                        owned[r * dims + k] += p[r] * v;
                    }
                }
            }
        }
    }
}

/// Whether query `qi` of a block of `count` (its first at column `seen`) sees column `j` of the
/// tile from column `start`: a key (`is_key`), at or before the query's own position (causal),
/// of a query the block has.
#[cube]
pub(crate) fn sees(is_key: &SharedMemory<u32>, j: usize, start: usize, seen: usize, qi: usize, count: usize) -> bool {
    is_key[j] == 1 && qi < count && start + j <= seen + qi
}

/// Column `column` of `row` in the read table `read` (`[rows, width]`) and the mask `valid`: 1 +
/// the slot of the key it names, or 0 where it is padding or not before `stop`.
#[cube]
pub(crate) fn key_slot<I: Numeric, V: Float>(read: &Tensor<I>, valid: &Tensor<V>, row: usize, column: usize, stop: usize) -> u32 {
    let mut found = 0u32;
    if column < stop {
        if f32::cast_from(valid[row * valid.stride(0) + column * valid.stride(1)]) > 0.5 {
            found = u32::cast_from(read[row * valid.shape(1) + column]) + 1;
        }
    }
    found
}

/// Column `column` of `row` in a fresh pass (see [`fresh_attention`]), whose keys are its own
/// tokens (`row · width + column`, `width` the mask's columns): 1 + that token, or 0 where it is
/// padding or not before `stop`.
#[cube]
pub(crate) fn fresh_key_slot<V: Float>(valid: &Tensor<V>, row: usize, column: usize, stop: usize) -> u32 {
    let mut found = 0u32;
    if column < stop {
        if f32::cast_from(valid[row * valid.stride(0) + column * valid.stride(1)]) > 0.5 {
            found = u32::cast_from(row * valid.shape(1) + column) + 1;
        }
    }
    found
}

/// The pass's (token, head) pair, as `token · heads + head`, that entry `b` of a cube stands for:
/// query `b % block` of the cube's block, which begins at token `first_token`, of head
/// `first_head + b / block`.
#[cube]
pub(crate) fn pair_index(b: usize, first_token: usize, first_head: usize, heads: usize, #[comptime] block: u32) -> usize {
    (first_token + b % block as usize) * heads + first_head + b / block as usize
}

/// Elements of a tile a unit of a decoding step's cube loads before it stores any of them into
/// shared memory (in one vector or several: at least one): the loads are independent, so all of
/// them are in flight at once. One after the other, each waiting for the last, a tile of 32 keys
/// of 128 elements took 64 round trips to memory a unit: about 50 µs a tile on an H200, most of
/// a long context's decoding step (BENCHMARKS.md, fifth GPU lease). More would not fit the
/// registers ptxas gives such a unit (f32 vectors of 4, four in flight, spilled 28 bytes on
/// sm_100).
const LOADS_IN_FLIGHT: u32 = 4;

/// Vectors of a tile a unit of a cube of a block of several queries a head has in flight. Its
/// tiles were staged an element at a time, each load waiting for the last: 64 round trips a
/// unit a tile of keys and 64 of values, and 45% of the prefill variant's stalls waited on them
/// (NVIDIA's profiler, seventh lease's H200). In 16-byte vectors, two at a time, a tile of 32
/// bf16 keys of 128 takes four (f32, eight).
const BLOCK_LOADS_IN_FLIGHT: u32 = 1;

/// Copies a tile's keys or values (`pool`'s rows of `head_dim` from element `pool_base`, at the
/// slots `slot_of` names: `head_dim` elements apart in the pools, a token's row apart in a
/// `fresh` pass's keys and values) into `staged` (of dtype `S`) in rows of `stride` elements, in
/// vectors of `N` elements, consecutive units of the cube's `units` reading consecutive vectors
/// of a row (coalesced), `in_flight` loads a unit before any is stored; a column that is not a
/// key gets zeros (its load reads the first row instead, so that every load is issued
/// unconditionally).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_tile<F: Float, N: Size, S: Float>(
    pool: &Tensor<Vector<F, N>>,
    pool_base: usize,
    slot_of: &SharedMemory<u32>,
    is_key: &SharedMemory<u32>,
    staged: &mut SharedMemory<S>,
    #[comptime] head_dim: u32,
    #[comptime] tile: u32,
    #[comptime] stride: u32,
    #[comptime] units: u32,
    #[comptime] in_flight: u32,
    #[comptime] fresh: bool,
) {
    let n = N::value();
    let unit = UNIT_POS_X as usize;
    let row_vectors = comptime!(head_dim as usize / n);
    let vectors = comptime!(tile as usize * head_dim as usize / n);
    let round_vectors = comptime!((units * in_flight) as usize);
    let rounds = comptime!((tile as usize * head_dim as usize / n).div_ceil((units * in_flight) as usize));
    // Whether every round's vectors lie in the tile (no test needed).
    let whole = comptime!((tile as usize * head_dim as usize / n).is_multiple_of((units * in_flight) as usize));
    let in_flight = comptime!(in_flight as usize);
    let base = pool_base / n;
    let mut loaded = Array::<Vector<F, N>>::new(in_flight);
    for round in 0..rounds {
        let first = round * round_vectors + unit;
        #[unroll]
        for k in 0..in_flight {
            let mut i = first + k * comptime!(units as usize);
            if !whole && i >= vectors {
                i = 0;
            }
            let j = i / row_vectors;
            // A row of the pools is `head_dim` elements after the last, of a fresh pass's keys
            // and values a token's.
            let at = if fresh { base + slot_of[j] as usize * (pool.stride(0) / n) + i % row_vectors } else { base + slot_of[j] as usize * row_vectors + i % row_vectors };
            loaded[k] = pool[at];
        }
        #[unroll]
        for k in 0..in_flight {
            let i = first + k * comptime!(units as usize);
            if whole || i < vectors {
                let j = i / row_vectors;
                let at = j * comptime!(stride as usize) + (i % row_vectors) * n;
                let x = Vector::<S, N>::cast_from(loaded[k]);
                let key = is_key[j] == 1;
                #[unroll]
                for e in 0..n {
                    let mut value = S::new(0.0);
                    if key {
                        value = x[e];
                    }
                    staged[at + e] = value;
                }
            }
        }
    }
}

/// Joins a split pass's spans (see [`splits_for`]): each output element of `output`
/// (`[rows, queries, heads, head_dim]`, packed) from its (token, head)'s spans in `partial`
/// (`[splits, tokens, heads, head_dim + 2]`: a span's sums of values weighed by
/// `exp(score − its maximum)`, then that maximum and the weights' total), rescaled to the largest
/// maximum as FlashAttention's online softmax rescales a tile. A (token, head) that saw no key
/// gets zeros, as in an unsplit pass.
#[cube(launch)]
fn combine_splits_kernel<F: Float>(partial: &Tensor<f32>, output: &mut Tensor<F>, #[comptime] head_dim: u32, #[comptime] _revision: u32, #[define(F)] _dtype: StorageType) {
    let i = cube_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if i < output.len() {
        let d = head_dim as usize;
        let pairs = output.len() / d;
        let (pair, e) = (i / d, i % d);
        let splits = partial.shape(0);
        let mut most = f32::new(-1.0e30);
        for s in 0..splits {
            let m = partial[(s * pairs + pair) * (d + 2) + d];
            if m > most {
                most = m;
            }
        }
        let mut sum = 0.0f32;
        let mut total = 0.0f32;
        for s in 0..splits {
            let base = (s * pairs + pair) * (d + 2);
            let weight = (partial[base + d] - most).exp();
            sum += partial[base + e] * weight;
            total += partial[base + d + 1] * weight;
        }
        let mut out = 0.0f32;
        if total > 0.0 {
            out = sum / total;
        }
        output[i] = F::cast_from(out);
    }
}

/// Units a cube of [`combine_splits_kernel`] (one output element a unit).
const COMBINE_UNITS: u32 = 256;

/// Cubes a streaming multiprocessor holds at once, about: the general kernel's cube of a decoding
/// step takes 19-21 KiB of shared memory at Qwen3's heads of 128 (an H100's or H200's SM has
/// 228 KiB) and 64 units; [`crate::paged_decode`]'s takes 5-8 KiB and 128 units (16 of them fill
/// an SM's 2,048 threads), so 8 leaves it spans to spare.
const RESIDENT_CUBES_PER_SM: usize = 8;

/// The fewest tiles a span of a split pass takes: each span costs a partial result written and
/// read again, and its cube's setup.
const FEWEST_TILES_A_SPAN: usize = 4;

/// The fewest tiles a row has before its step is split (512 columns at Qwen3's tiles of 32):
/// the join is one more kernel a layer, and below about 500 positions the fifth lease's
/// decoding step was bound by the host's cost per kernel (the GPU 38% busy at a short context),
/// not by the attention's tiles (about 50 µs each, one after another).
const FEWEST_TILES_SPLIT: usize = 16;

/// Spans a pass's columns are cut into, one cube each (`combine_splits_kernel` joins them;
/// FlashDecoding's split of the keys): a decoding step launches a cube per (group of heads,
/// row), 64 at batch 8 on Qwen3-0.6B, which leaves most of a GPU's multiprocessors idle while
/// each cube walks a long context's tiles one after another (BENCHMARKS.md, fifth GPU lease: at
/// batch 64, a step over 2,048 positions took 157 ms, one at a short context 44). Enough spans
/// that `cubes` (the unsplit pass's) fill `multiprocessors` (about `RESIDENT_CUBES_PER_SM`
/// each), each of at least `FEWEST_TILES_A_SPAN` of the row's `tiles`; 1 (no split, no second
/// kernel) where the runtime does not say how many multiprocessors it has (wgpu), where the
/// unsplit cubes fill them already, or below `FEWEST_TILES_SPLIT` tiles.
pub fn splits_for(cubes: usize, tiles: usize, multiprocessors: Option<u32>) -> usize {
    let Some(multiprocessors) = multiprocessors else { return 1 };
    if tiles < FEWEST_TILES_SPLIT {
        return 1;
    }
    let wanted = (multiprocessors as usize * RESIDENT_CUBES_PER_SM).div_ceil(cubes.max(1));
    wanted.min(tiles / FEWEST_TILES_A_SPAN).max(1)
}

/// The rows of a ragged pass (see [`model::device_kernels::RaggedRows`]): row `r`'s queries are
/// the pass's tokens `starts[r]..starts[r + 1]` (`starts` `[rows + 1]`), as long as `lens` says.
#[derive(Debug, Clone)]
pub struct Ragged<R: CubeRuntime> {
    pub starts: CubeTensor<R>,
    pub lens: RowLens,
}

/// Which kernel takes a pass's rows of one query (a decoding step's, or a ragged pass's
/// decoding rows): `Own` is [`crate::paged_decode`]'s, where its cut fits.
pub use model::device_kernels::DecodingKernel;

/// How a pass's columns are cut among cubes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spans {
    /// A decoding step (a uniform pass of one query a row) as [`splits_for`] says for the
    /// device; other passes, whose blocks of queries give a cube each, whole.
    Auto,
    /// Each row's columns in this many spans, fewer where the row has fewer tiles (1: whole).
    Exactly(std::num::NonZeroUsize),
}

impl Spans {
    /// Every pass whole: one cube walks all of a row's columns, no second kernel.
    pub const WHOLE: Spans = Spans::Exactly(std::num::NonZeroUsize::MIN);

    /// The spans of whole pieces (tiles or chunks) a row of `pieces` is cut into, `auto` where
    /// [`Spans::Auto`] (the caller's reckoning): as few as spans of `pieces.div_ceil(spans)`
    /// pieces take, so that none is empty. A kernel with longer or shorter pieces cuts the
    /// same columns into as many spans of its own pieces (some of them empty).
    fn count(self, pieces: usize, auto: usize) -> usize {
        let splits = match self {
            Spans::Exactly(splits) => splits.get().min(pieces),
            Spans::Auto => auto.max(1),
        };
        pieces.div_ceil(pieces.div_ceil(splits))
    }
}

/// How a pass's blocks of several queries a head (prefill chunks, scoring, a training step's
/// forward) are multiplied by their keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Products {
    /// On the CUDA cores, a few products a unit: this module's kernel.
    Units,
    /// On the tensor cores ([`crate::tensor_core_attention`]), where the device has them for the
    /// pass's dtype and that kernel takes its heads; else as `Units`.
    TensorCores,
    /// [`crate::tensor_core_attention`]'s kernel with its products a unit at a time, where it
    /// takes the pass's dtype and heads (else as `Units`): its layout, walks and masks on a
    /// device without tensor cores, for the tests.
    TensorCoreLayout,
}

impl Products {
    /// Whether a pass of `dtype` with heads of `head_dim` goes to the tensor-core kernel on
    /// `client`'s device, and if so with its products on the tensor cores.
    fn tensor_cores<R: Runtime>(self, client: &ComputeClient<R>, dtype: DType, head_dim: usize) -> Option<bool> {
        let takes = crate::tensor_core_attention::takes(dtype, head_dim);
        match self {
            Products::Units => None,
            Products::TensorCores => (takes && crate::tensor_core_attention::has_tensor_cores(client, dtype.into())).then_some(true),
            Products::TensorCoreLayout => takes.then_some(false),
        }
    }
}

/// Launches the kernel on CubeCL runtime `R`; see [`model::device_kernels::PagedAttention`].
/// `query` is `[rows, queries, heads, head_dim]`, or `[1, tokens, heads, head_dim]` in a
/// `ragged` pass. Each row's columns are cut into `spans`, joined by `combine_splits_kernel`
/// where there are several; rows of one query go to the kernel `decoding` says.
///
/// Panics on operands whose shapes or dtypes disagree.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<R: CubeRuntime>(
    query: CubeTensor<R>,
    keys: CubeTensor<R>,
    values: CubeTensor<R>,
    read: CubeTensor<R>,
    valid: CubeTensor<R>,
    ragged: Option<Ragged<R>>,
    scale: f32,
    spans: Spans,
    decoding: DecodingKernel,
    products: Products,
) -> CubeTensor<R> {
    let [batch, tokens, heads, head_dim] = query.shape().dims::<4>();
    let [kv_heads, slots, pool_dim] = keys.shape().dims::<3>();
    let [rows, width] = valid.shape().dims::<2>();
    assert_eq!(values.shape().dims::<3>(), [kv_heads, slots, head_dim], "values pool of another shape than the keys'");
    assert_eq!(pool_dim, head_dim, "paged attention: pools of head_dim {pool_dim}, queries of {head_dim}");
    // The most queries a row has.
    let queries = match &ragged {
        None => {
            assert_eq!(batch, rows, "paged attention: {batch} rows of queries, a mask of {rows}");
            tokens
        }
        Some(ragged) => {
            assert_eq!(batch, 1, "paged attention: a ragged pass's queries are [1, tokens, heads, d]");
            assert_eq!(ragged.starts.shape().num_elements(), rows + 1, "paged attention: row starts for {rows} rows");
            let RowLens { longest, single } = ragged.lens;
            assert!(single <= rows && (single == rows) == (longest == 1), "paged attention: a ragged pass of {rows} rows, {single} of one query, the longest of {longest}");
            longest
        }
    };
    assert!(queries >= 1 && width >= queries, "paged attention: {queries} queries a row over {width} columns");
    assert_eq!(read.shape().num_elements(), rows * width, "paged attention: a read table of rows × width slots");
    assert!(kv_heads > 0 && heads % kv_heads == 0, "{heads} query heads over {kv_heads} key-value heads");
    assert!(query.dtype == keys.dtype && keys.dtype == values.dtype, "paged attention: query and pools of one dtype");
    assert!(matches!(query.dtype, DType::F32 | DType::F16 | DType::BF16), "paged attention: no kernel for {:?}", query.dtype);

    // The kernel indexes these as packed row-major tensors (a no-op where they are; the mask,
    // one per pass, is read through its strides instead, not copied at every layer), and its
    // output is allocated packed: CUDA's default layout may pad rows.
    let [query, keys, values, read] = [query, keys, values, read].map(into_contiguous);
    // A pass of rows of equal length never reads the row starts: the read table stands in.
    let starts = match &ragged {
        Some(ragged) => {
            assert_eq!(ragged.starts.dtype, read.dtype, "paged attention: row starts of the read table's dtype");
            into_contiguous(ragged.starts.clone())
        }
        None => read.clone(),
    };
    let client = query.client.clone();
    let dtypes = [query.dtype.into(), read.dtype.into(), valid.dtype.into()];
    let output = empty_device_contiguous_dtype(client.clone(), query.device.clone(), Shape::new([batch, tokens, heads, head_dim]), query.dtype);
    let multiprocessors = client.properties().hardware.num_streaming_multiprocessors;
    // The rows of one query (a decoding step's, or those a ragged pass has beside its prefill
    // chunks) go to the kernel made for them, where its cut fits; the general kernel takes the
    // others.
    let single = match &ragged {
        Some(ragged) => ragged.lens.single,
        None if queries == 1 => rows,
        None => 0,
    };
    let most_vector = client.io_optimized_vector_sizes(query.dtype.size()).max().unwrap_or(1);
    let decode_cut = (single > 0 && decoding == DecodingKernel::Own).then(|| crate::paged_decode::cut_for(head_dim, heads / kv_heads, most_vector)).flatten();
    let general_rows = rows - decode_cut.map_or(0, |_| single);
    let chunk = crate::paged_decode::UNITS as usize;
    let chunks = width.div_ceil(chunk);
    let blocks = blocks_for(head_dim, heads / kv_heads, queries);
    let cubes = [heads / blocks.heads as usize, rows, queries.div_ceil(blocks.queries as usize)];
    let tiles = width.div_ceil(blocks.tile as usize);
    // Spans: a decoding step's as `splits_for` says for the device; a ragged pass's and a
    // prefill's whole, unless `spans` says how many. Both kernels of a ragged pass cut its
    // columns into as many spans (of their own pieces) and share one join.
    let splits = match decode_cut {
        Some(cut) => {
            let auto = match ragged {
                None => splits_for(heads / cut.heads as usize * rows, chunks * chunk / DECODE_TILE, multiprocessors),
                Some(_) => 1,
            };
            spans.count(chunks, auto)
        }
        None => {
            let auto = match queries == 1 && ragged.is_none() {
                true => splits_for(cubes.iter().product(), tiles, multiprocessors),
                false => 1,
            };
            spans.count(tiles, auto)
        }
    };
    let partial = partial_for(&query, splits, batch * tokens, heads, head_dim);
    if let Some(cut) = decode_cut {
        let columns = chunks.div_ceil(splits) * chunk;
        let pass = crate::paged_decode::Pass { cut, splits, span: columns, ragged: ragged.is_some() };
        crate::paged_decode::launch(query.clone(), keys.clone(), values.clone(), read.clone(), valid.clone(), starts.clone(), output.clone(), partial.clone(), scale, pass);
    }
    // In a ragged pass whose rows of one query the decoding kernel took, the other kernel's
    // cubes of such rows return at once.
    let fewest = if decode_cut.is_some() { 2 } else { 1 };
    let vector = vector_for(head_dim, &[&keys, &values], most_vector);
    let tensor_cores = products.tensor_cores(&client, query.dtype, head_dim).filter(|_| splits == 1 && queries > 1);
    if let (true, Some(tensor_cores)) = (general_rows > 0, tensor_cores) {
        let operands = [query, keys, values, read, valid, starts, output.clone(), partial.clone()].map(|t| t.into_tensor_arg());
        crate::tensor_core_attention::launch(&client, operands, dtypes, vector, [rows, queries, heads, head_dim, heads / kv_heads], scale, fewest, [ragged.is_some(), false, tensor_cores]);
    } else if general_rows > 0 {
        let span = tiles.div_ceil(splits) * blocks.tile as usize;
        paged_attention_kernel::launch::<R>(
            &client,
            CubeCount::Static(cubes[0] as u32, cubes[1] as u32, (cubes[2] * splits) as u32),
            CubeDim::new_1d(UNITS),
            vector,
            query.into_tensor_arg(),
            keys.into_tensor_arg(),
            values.into_tensor_arg(),
            read.into_tensor_arg(),
            valid.into_tensor_arg(),
            starts.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            scale,
            splits as u32,
            span as u32,
            fewest,
            ragged.is_some(),
            splits > 1,
            false,
            head_dim as u32,
            blocks.heads,
            blocks.queries,
            blocks.tile,
            REVISION,
            dtypes,
        );
    }
    if splits > 1 {
        combine_splits(partial, output.clone(), head_dim);
    }
    output
}

/// The attention of a pass without a KV cache (scoring, a training step's forward; the model's
/// `memory_efficient` forward hands it here where a GPU backend lends it): each row's queries
/// over its own tokens' keys and values, causal, padded keys masked, by the general kernel laid
/// out for them (`fresh`): `keys` and `values` are `[rows · width, kv_heads, head_dim]` (a row's
/// `width` tokens one after another: `[rows, width, kv_heads, head_dim]`, as the projections
/// leave them, reshaped), its read table the identity, no slot gathered or copied. The scores
/// are rounded to the operands' dtype before the scale as burn's product of that dtype is.
/// `query` is `[rows, queries, heads, head_dim]` (a row's queries its last columns) and `valid`
/// `[rows, width]` (f32, 1 for a key). Returns the output `[rows, queries, heads, head_dim]` and
/// each (token, head)'s log-sum-exp of its scores, `[rows · queries, heads]` f32, that the
/// backward recomputes the probabilities from.
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn fresh_attention<R: CubeRuntime>(
    query: CubeTensor<R>,
    keys: CubeTensor<R>,
    values: CubeTensor<R>,
    valid: CubeTensor<R>,
    scale: f32,
    products: Products,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [rows, queries, heads, head_dim] = query.shape().dims::<4>();
    let [tokens, kv_heads, key_dim] = keys.shape().dims::<3>();
    let [mask_rows, width] = valid.shape().dims::<2>();
    assert_eq!(values.shape().dims::<3>(), [tokens, kv_heads, key_dim], "fresh attention: values of another shape than the keys'");
    assert_eq!(key_dim, head_dim, "fresh attention: keys of head_dim {key_dim}, queries of {head_dim}");
    assert_eq!((mask_rows, tokens), (rows, rows * width), "fresh attention: {rows} rows of queries, a mask of {mask_rows} × {width} over {tokens} keys");
    assert!(queries >= 1 && width >= queries, "fresh attention: {queries} queries a row over {width} keys");
    assert!(kv_heads > 0 && heads % kv_heads == 0, "{heads} query heads over {kv_heads} key-value heads");
    assert!(query.dtype == keys.dtype && keys.dtype == values.dtype, "fresh attention: query, keys and values of one dtype");
    assert!(matches!(query.dtype, DType::F32 | DType::F16 | DType::BF16), "fresh attention: no kernel for {:?}", query.dtype);
    let [query, keys, values] = [query, keys, values].map(into_contiguous);
    let client = query.client.clone();
    let output = empty_device_contiguous_dtype(client.clone(), query.device.clone(), Shape::new([rows, queries, heads, head_dim]), query.dtype);
    let lse = empty_device_contiguous_dtype(client.clone(), query.device.clone(), Shape::new([rows * queries, heads]), DType::F32);
    let blocks = blocks_for(head_dim, heads / kv_heads, queries);
    let cubes = [heads / blocks.heads as usize, rows, queries.div_ceil(blocks.queries as usize)];
    let span = width.div_ceil(blocks.tile as usize) * blocks.tile as usize;
    // The read table and the row starts are never read in a fresh pass: the mask takes their
    // places (and the read table's dtype).
    let dtypes = [query.dtype.into(), valid.dtype.into(), valid.dtype.into()];
    let most_vector = client.io_optimized_vector_sizes(query.dtype.size()).max().unwrap_or(1);
    let vector = vector_for(head_dim, &[&keys, &values], most_vector);
    if let Some(tensor_cores) = products.tensor_cores(&client, query.dtype, head_dim).filter(|_| queries > 1) {
        let operands = [query, keys, values, valid.clone(), valid.clone(), valid, output.clone(), lse.clone()].map(|t| t.into_tensor_arg());
        crate::tensor_core_attention::launch(&client, operands, dtypes, vector, [rows, queries, heads, head_dim, heads / kv_heads], scale, 1, [false, true, tensor_cores]);
        return (output, lse);
    }
    paged_attention_kernel::launch::<R>(
        &client,
        CubeCount::Static(cubes[0] as u32, cubes[1] as u32, cubes[2] as u32),
        CubeDim::new_1d(UNITS),
        vector,
        query.into_tensor_arg(),
        keys.into_tensor_arg(),
        values.into_tensor_arg(),
        valid.clone().into_tensor_arg(),
        valid.clone().into_tensor_arg(),
        valid.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        scale,
        1,
        span as u32,
        1,
        false,
        false,
        true,
        head_dim as u32,
        blocks.heads,
        blocks.queries,
        blocks.tile,
        REVISION,
        dtypes,
    );
    (output, lse)
}

/// Elements a vector of the kernel's loads of keys and values: the widest of 8, 4, 2 and 1, at
/// most `most_vector`, that divides `head_dim` and each of `pools`' strides and offsets (packed
/// pools, or a fresh pass's keys and values, whose rows may start inside their buffer).
fn vector_for<R: CubeRuntime>(head_dim: usize, pools: &[&CubeTensor<R>], most_vector: usize) -> usize {
    let fits = |v: usize| {
        pools.iter().all(|pool| {
            let offset = pool.handle.offset_start.unwrap_or(0) as usize / pool.dtype.size();
            offset.is_multiple_of(v) && pool.meta.strides().iter().all(|&stride| stride == 1 || stride.is_multiple_of(v))
        })
    };
    [8, 4, 2, 1].into_iter().find(|&v| v <= most_vector.max(1) && head_dim.is_multiple_of(v) && fits(v)).unwrap_or(1)
}

/// Columns a tile of a decoding step's cube in [`splits_for`]'s reckoning (Qwen3's heads of 128
/// take tiles of 32 in the general kernel): the decoding kernel's chunks count as so many.
const DECODE_TILE: usize = 32;

/// The spans' partial results of a pass of `tokens` queries cut into `splits` spans
/// (`[splits, tokens, heads, head_dim + 2]`, f32), or (unsplit) one unused word.
fn partial_for<R: CubeRuntime>(query: &CubeTensor<R>, splits: usize, tokens: usize, heads: usize, head_dim: usize) -> CubeTensor<R> {
    let shape = match splits > 1 {
        true => Shape::new([splits, tokens, heads, head_dim + 2]),
        false => Shape::new([1]),
    };
    empty_device_contiguous_dtype(query.client.clone(), query.device.clone(), shape, DType::F32)
}

/// Joins the spans in `partial` into `output` ([`combine_splits_kernel`]).
fn combine_splits<R: CubeRuntime>(partial: CubeTensor<R>, output: CubeTensor<R>, head_dim: usize) {
    let client = output.client.clone();
    let dtype = output.dtype.into();
    let cubes = output.meta.num_elements().div_ceil(COMBINE_UNITS as usize);
    combine_splits_kernel::launch::<R>(&client, grid(cubes), CubeDim::new_1d(COMBINE_UNITS), partial.into_tensor_arg(), output.into_tensor_arg(), head_dim as u32, REVISION, dtype);
}

/// [`paged_attention_kernel`] over `dtypes` (the query's and pools', the read table's, the mask's)
/// as CubeCL defines it for compilation, for heads of `head_dim` in groups of `groups` and passes
/// of `queries` a row (`ragged`: a ragged pass's; `split`: cut into spans of columns; `fresh`:
/// [`fresh_attention`]'s, whose read table is the mask's dtype), keys and values read in vectors
/// of `vector`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn definition<R: Runtime>(
    client: &ComputeClient<R>,
    dtypes: [StorageType; 3],
    vector: usize,
    head_dim: usize,
    groups: usize,
    queries: usize,
    ragged: bool,
    split: bool,
    fresh: bool,
) -> KernelDefinition {
    let arg = crate::definitions::arg;
    let blocks = blocks_for(head_dim, groups, queries);
    paged_attention_kernel::PagedAttentionKernel::<R>::new(
        crate::definitions::settings(UNITS),
        client.clone(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        (),
        (),
        (),
        (),
        vector,
        ragged,
        split,
        fresh,
        head_dim as u32,
        blocks.heads,
        blocks.queries,
        blocks.tile,
        REVISION,
        dtypes,
    )
    .define()
}

/// [`combine_splits_kernel`] in `dtype` for heads of `head_dim` as CubeCL defines it for
/// compilation.
pub(crate) fn combine_definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, head_dim: usize) -> KernelDefinition {
    let arg = crate::definitions::arg;
    combine_splits_kernel::CombineSplitsKernel::<R>::new(crate::definitions::settings(COMBINE_UNITS), client.clone(), arg(), arg(), head_dim as u32, REVISION, dtype).define()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-0.6B's decoding step on an H200 (132 multiprocessors; 8 cubes a row) at 2,048
    /// positions (64 tiles): batch 8 is cut into 16 spans of 4 tiles, batch 64 into 3; contexts
    /// under 16 tiles, passes whose cubes fill the GPU, and runtimes that give no count are not
    /// split.
    #[test]
    fn splits_fill_the_multiprocessors() {
        let h200 = Some(132);
        assert_eq!(splits_for(8 * 8, 64, h200), 16);
        assert_eq!(splits_for(8 * 64, 64, h200), 3);
        assert_eq!(splits_for(8, 64, h200), 16);
        assert_eq!(splits_for(8 * 8, 15, h200), 1);
        assert_eq!(splits_for(8 * 8, 16, h200), 4);
        assert_eq!(splits_for(8 * 64, 19, h200), 3);
        assert_eq!(splits_for(8 * 64 * 512, 64, h200), 1);
        assert_eq!(splits_for(8 * 8, 64, None), 1);
        for cubes in [1, 7, 64, 1000, 100_000] {
            for tiles in [1, 3, 4, 63, 64, 65, 1000] {
                let splits = splits_for(cubes, tiles, h200);
                assert!(splits >= 1 && (splits == 1 || (tiles >= FEWEST_TILES_SPLIT && tiles / splits >= FEWEST_TILES_A_SPAN)), "{cubes} cubes, {tiles} tiles: {splits}");
            }
        }
    }

    /// A block of Qwen3's prefill (16 entries, tiles of 32) gives each unit two entries' scores
    /// over 4 columns and 4 entries' outputs over 8 elements of the head; smaller blocks fewer
    /// columns, so that every unit has scores to take.
    #[test]
    fn tilings_give_every_unit_its_share() {
        let tiling = |columns, entries, lanes| Tiling { columns, entries, lanes };
        assert_eq!(Tiling::new(16, 32), tiling(4, 4, 16));
        assert_eq!(Tiling::new(16, 32).owned(128), 32);
        assert_eq!(Tiling::new(8, 32), tiling(2, 4, 32));
        assert_eq!(Tiling::new(4, 32), tiling(1, 4, 64));
        assert_eq!(Tiling::new(6, 64), tiling(2, 2, 21));
        assert_eq!(Tiling::new(6, 64).owned(72), 8);
        assert_eq!(Tiling::new(2, 2), tiling(1, 2, 64));
    }

    /// Every choice fits the shared memory and takes whole groups' worth of heads where they
    /// fit; Qwen3's heads of 128 keep tiles of 32 in a decoding step, and a prefill takes 16
    /// (head, query) pairs a cube.
    #[test]
    fn blocks_fit_the_shared_memory() {
        let blocks = |heads, queries, tile| Blocks { heads, queries, tile };
        assert_eq!(blocks_for(128, 1, 1), blocks(1, 1, 32));
        assert_eq!(blocks_for(128, 4, 1), blocks(4, 1, 32));
        assert_eq!(blocks_for(128, 2, 300), blocks(2, 8, 32));
        assert_eq!(blocks_for(128, 4, 300), blocks(4, 4, 32));
        assert_eq!(blocks_for(128, 1, 3), blocks(1, 4, 32));
        assert_eq!(blocks_for(72, 3, 40), blocks(3, 4, 64));
        for d in [8, 24, 64, 72, 128, 256, 512] {
            for groups in [1, 2, 3, 4, 5, 8, 20, 64] {
                for queries in [1, 2, 5, 16, 17, 1000] {
                    let b = blocks_for(d, groups, queries);
                    let entries = (b.heads * b.queries) as usize;
                    assert!(4 * shared_words(d, entries, b.queries as usize, b.tile as usize) <= SHARED_BYTES, "head_dim {d}, {groups} groups, {queries} queries");
                    assert!(groups % b.heads as usize == 0 && entries <= MOST_QUERIES && b.tile >= 1, "{b:?}");
                    assert!(b.queries as usize <= queries.next_power_of_two(), "{b:?}");
                    if b.queries > 1 {
                        let t = Tiling::new(b.heads * b.queries, b.tile);
                        assert!(b.tile % t.columns == 0 && (b.heads * b.queries) % t.entries == 0, "{b:?}: {t:?}");
                        assert!(t.owners(b.heads * b.queries) <= UNITS && t.owned(d as u32) <= 128, "{b:?}: {t:?}");
                    }
                }
            }
        }
    }
}

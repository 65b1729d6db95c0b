//! The attention of a pass's blocks of many queries (prefill chunks, a ragged pass's chunks,
//! scoring and a training step's forward) with its two products on the GPU's tensor cores:
//! `q · Kᵀ` and `P · V` as 16 × 16 × 16 products of 16-bit operands summed in f32 (CubeCL's
//! `cmma`, CUDA's `wmma`), where [`crate::paged_attention`]'s general kernel multiplies on the
//! CUDA cores, a few products a unit. The seventh lease's H200 spent 60% of a 2,048-token
//! prefill's GPU time in that kernel at about 2-4 × 10¹² multiply-adds a second, a few percent
//! of what the tensor cores take (BENCHMARKS.md).
//!
//! A cube of [`WARPS`] warps takes 16 (head, query) entries a warp (the heads of one key-value
//! head, as many of a row's queries as fill the cube) and walks the columns its queries may see a
//! tile of [`TILE`] at a time, twice:
//! 1. its first walk stages each tile's keys in shared memory (16-bit, rows padded by 8
//!    elements), scores the warp's entries against them (one product a warp per 16 elements of
//!    the head) and keeps each entry's largest score and its sum of `exp(score − largest)`;
//! 2. its second walk stages the keys and values, scores again, weighs each column by
//!    `exp(score − largest)` (rounded to 16 bits, as FlashAttention rounds them), and adds those
//!    weights times the values to the warp's outputs, which stay in its accumulators from the
//!    first tile to the last, then divides them by the sum (in f32) as it writes them.
//!
//! Scoring twice costs a third more products than FlashAttention-2's one walk, which rescales
//! the outputs at each tile instead; CubeCL's accumulators cannot be rescaled a row at a time
//! without a round trip through shared memory, and the tensor cores' products are cheap next to
//! the tile's loads and barriers.
//!
//! Which columns a query sees, masked columns, padded queries, a ragged pass's rows, a pass
//! without a cache (`fresh`: its scores rounded to the operands' dtype before the scale, its
//! log-sum-exp written) and the output are as in the general kernel. Scores, maxima and sums are
//! f32.
//!
//! The same kernel with `tensor_cores` off computes both products a unit at a time into the same
//! shared memory (its outputs in the units' registers): the layout, the walks and the masks
//! run on a device without tensor cores (lavapipe, in the tests), at two warps a cube so that
//! its shared memory fits there.

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::paged_attention::{fresh_key_slot, key_slot, pair_index, sees, stage_tile};

/// Entries a warp (the rows of a 16 × 16 × 16 product), columns a product of scores, and
/// elements of the head a step of one.
const FRAGMENT: usize = 16;

/// Units a warp (CUDA's).
const WARP: u32 = 32;

/// Warps a cube on a GPU with tensor cores: 64 entries a cube, each key and value staged serving
/// all of them.
pub const WARPS: u32 = 4;

/// Warps a cube where the products run a unit at a time: its 32 entries' queries, tiles, scores
/// and probabilities take 22 KiB of shared memory at heads of 128 (lavapipe offers 32).
pub const UNIT_WARPS: u32 = 2;

/// Columns a tile: at heads of 128 and four warps a cube, the queries (17 KiB), a tile of keys
/// and one of values (8.5 KiB), the scores (5 KiB) and the probabilities (3 KiB) take 34 KiB of
/// shared memory, within the 48 KiB a CUDA cube gets without asking; tiles of 32 would take 49.
pub const TILE: u32 = 16;

/// Elements that pad each row of 16-bit operands in shared memory: rows stay 16-byte aligned
/// (what `wmma`'s loads ask) and consecutive rows start in different banks.
const PAD: usize = 8;

/// Words that pad each row of scores (f32) in shared memory, for the same reasons.
const SCORE_PAD: usize = 4;

/// Elements of a head the kernel takes: its shared memory grows with the head.
pub const MOST_HEAD_DIM: usize = 128;

/// How a pass is cut into cubes: query heads a cube (all of one key-value head) and queries of a
/// row, `warps × 16` entries in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    /// Query heads a cube takes.
    pub heads: u32,
    /// Queries of a row a cube takes (for each of its heads).
    pub queries: u32,
    /// Warps a cube.
    pub warps: u32,
}

/// The cubes of a pass over heads in groups of `groups` query heads to a key-value head, at
/// `warps` warps a cube: the most of 4, 2 and 1 heads that divides a group, and as many queries
/// as fill the cube's entries (Qwen3-0.6B's groups of 2 at four warps: 2 heads × 32 queries;
/// 4B's groups of 4: 4 × 16).
pub fn blocks_for(groups: usize, warps: u32) -> Blocks {
    let entries = warps as usize * FRAGMENT;
    let heads = [4, 2, 1].into_iter().find(|&h| groups.is_multiple_of(h) && h <= entries).unwrap_or(1);
    Blocks { heads: heads as u32, queries: (entries / heads) as u32, warps }
}

/// Whether the kernel takes operands of `dtype` with heads of `head_dim`: 16-bit floats, heads a
/// whole number of 16 elements up to [`MOST_HEAD_DIM`].
pub fn takes(dtype: DType, head_dim: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) && head_dim.is_multiple_of(FRAGMENT) && (FRAGMENT..=MOST_HEAD_DIM).contains(&head_dim)
}

/// Whether `client`'s device multiplies 16 × 16 × 16 products of `dtype` into f32 on its tensor
/// cores (CubeCL's `cmma`: CUDA from compute capability 7.0 for f16, 8.0 for bf16) in warps of
/// 32 units, as the kernel lays out its cubes. CubeCL 0.10's CUDA runtime lists bf16's `cmma`
/// from 7.0, but CUDA's `mma.h` declares bf16 fragments from 8.0 only: bf16 also asks for the
/// 16 × 8 × 16 bf16 `mma` that CubeCL lists from 8.0.
pub fn has_tensor_cores<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    use cubecl::ir::{ElemType, FloatKind};
    let f32 = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let config = |m: usize, n: usize, k: usize| cubecl::features::MmaConfig { a_type: dtype, b_type: dtype, cd_type: f32, m: m as u32, n: n as u32, k: k as u32 };
    let properties = client.properties();
    let warps_of_32 = properties.hardware.plane_size_min == WARP && properties.hardware.plane_size_max == WARP;
    let bf16 = dtype == StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let cmma = properties.features.matmul.cmma.contains(&config(FRAGMENT, FRAGMENT, FRAGMENT));
    warps_of_32 && cmma && (!bf16 || properties.features.matmul.mma.contains(&config(16, 8, 16)))
}

/// A hash of this file, one of the kernel's compile-time arguments (see
/// [`crate::paged_attention`]'s).
pub(crate) const REVISION: u32 = crate::source_revision(include_bytes!("tensor_core_attention.rs"));

/// The kernel: operands as [`crate::paged_attention`]'s general kernel takes them, unsplit
/// (`lse`: a fresh pass's log-sum-exp `[tokens, heads]`, else one unused word). A cube of
/// `warps` warps per (block of `cube_heads` heads, row, block of queries).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn tensor_core_attention_kernel<F: Float, N: Size, I: Numeric, V: Float>(
    query: &Tensor<F>,
    keys: &Tensor<Vector<F, N>>,
    values: &Tensor<Vector<F, N>>,
    read: &Tensor<I>,
    valid: &Tensor<V>,
    row_starts: &Tensor<I>,
    output: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    fewest: u32,
    #[comptime] ragged: bool,
    #[comptime] fresh: bool,
    #[comptime] head_dim: u32,
    #[comptime] cube_heads: u32,
    #[comptime] warps: u32,
    #[comptime] tensor_cores: bool,
    #[comptime] _revision: u32,
    #[define(F, I, V)] _dtypes: [StorageType; 3],
) {
    let row = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let warp = unit / comptime!(WARP as usize);
    let d = head_dim as usize;
    let entries = comptime!(warps as usize * FRAGMENT);
    let units = comptime!((warps * WARP) as usize);
    // Entry b of the cube is query b % block of head first_head + b / block.
    let block = comptime!(warps as usize * FRAGMENT / cube_heads as usize);
    let first_head = CUBE_POS_X as usize * cube_heads as usize;
    let tile = comptime!(TILE as usize);
    let q_stride = comptime!(head_dim as usize + PAD);
    let s_stride = comptime!(TILE as usize + SCORE_PAD);
    let p_stride = comptime!(TILE as usize + PAD);
    let steps = comptime!(head_dim as usize / FRAGMENT);
    let n = N::value();
    let in_flight = comptime!((TILE as usize * head_dim as usize / n).div_ceil(warps as usize * WARP as usize).min(4) as u32);

    let heads = query.shape(2);
    let kv_heads = if fresh { keys.shape(1) } else { keys.shape(0) };
    let width = valid.shape(1);
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
    let first = CUBE_POS_Z as usize * block;
    if first >= queries {
        terminate!();
    }
    let past = width - queries;
    let mut count = queries - first;
    if count > block {
        count = block;
    }
    let end = past + first + count;
    let kv_head = first_head / (heads / kv_heads);
    let pool_base = if fresh { kv_head * d } else { kv_head * keys.shape(1) * d };
    let masked = f32::new(-1.0e30);

    let mut q = SharedMemory::<F>::new_aligned(entries * q_stride, 32usize);
    let mut staged_keys = SharedMemory::<F>::new_aligned(tile * q_stride, 32usize);
    let mut staged_values = SharedMemory::<F>::new_aligned(tile * q_stride, 32usize);
    let mut scores = SharedMemory::<f32>::new_aligned(entries * s_stride, 32usize);
    let mut probs = SharedMemory::<F>::new_aligned(entries * p_stride, 32usize);
    let mut largest = SharedMemory::<f32>::new(entries);
    let mut sums = SharedMemory::<f32>::new(entries);
    let mut slot_of = SharedMemory::<u32>::new(tile);
    let mut is_key = SharedMemory::<u32>::new(tile);

    // The queries, zeros past the block's last.
    let mut i = unit;
    while i < entries * d {
        let b = i / d;
        let mut x = F::new(0.0);
        if b % block < count {
            x = query[pair_index(b, token0 + first, first_head, heads, block as u32) * d + i % d];
        }
        q[b * q_stride + i % d] = x;
        i += units;
    }

    // 1. Each entry's largest score and its sum of exp(score − largest), unit b's for entry b.
    let mut most = masked;
    let mut sum = 0.0f32;
    let mut start = 0usize;
    while start < end {
        find_slots(read, valid, &mut slot_of, &mut is_key, row, start, end, fresh);
        sync_cube();
        stage_tile::<F, N, F>(keys, pool_base, &slot_of, &is_key, &mut staged_keys, head_dim, TILE, q_stride as u32, units as u32, in_flight, fresh);
        sync_cube();
        score_tile::<F>(&q, &staged_keys, &mut scores, head_dim, warps, tensor_cores);
        sync_cube();
        if unit < entries {
            let base = unit * s_stride;
            let mut tile_most = most;
            for j in 0..tile {
                if sees(&is_key, j, start, past + first, unit % block, count) {
                    let s = scaled::<F>(scores[base + j], scale, fresh);
                    if s > tile_most {
                        tile_most = s;
                    }
                }
            }
            let mut tile_sum = 0.0f32;
            for j in 0..tile {
                if sees(&is_key, j, start, past + first, unit % block, count) {
                    tile_sum += (scaled::<F>(scores[base + j], scale, fresh) - tile_most).exp();
                }
            }
            sum = sum * (most - tile_most).exp() + tile_sum;
            most = tile_most;
        }
        sync_cube();
        start += tile;
    }
    if unit < entries {
        largest[unit] = most;
        sums[unit] = sum;
    }

    // 2. The outputs: a warp's in its accumulators (one a 16 elements of the head), or a unit's
    // half of an entry's head in its registers.
    let mut fragments = Sequence::<cmma::Matrix<f32>>::new();
    if comptime!(tensor_cores) {
        #[unroll]
        for _ in 0..steps {
            fragments.push(cmma::Matrix::<f32>::from_value(cmma::MatrixIdent::Accumulator, FRAGMENT, FRAGMENT, FRAGMENT, cmma::MatrixLayout::Undefined, 0.0));
        }
    }
    let halves = comptime!(if tensor_cores { 1 } else { head_dim as usize / 2 });
    let mut owned = Array::<f32>::new(halves);
    #[unroll]
    for k in 0..halves {
        owned[k] = 0.0;
    }
    start = 0usize;
    while start < end {
        find_slots(read, valid, &mut slot_of, &mut is_key, row, start, end, fresh);
        sync_cube();
        stage_tile::<F, N, F>(keys, pool_base, &slot_of, &is_key, &mut staged_keys, head_dim, TILE, q_stride as u32, units as u32, in_flight, fresh);
        stage_tile::<F, N, F>(values, pool_base, &slot_of, &is_key, &mut staged_values, head_dim, TILE, q_stride as u32, units as u32, in_flight, fresh);
        sync_cube();
        score_tile::<F>(&q, &staged_keys, &mut scores, head_dim, warps, tensor_cores);
        sync_cube();
        let mut p = unit;
        while p < entries * tile {
            let b = p / tile;
            let j = p % tile;
            // exp(s − largest), in (0, 1]: rounded to 16 bits before its division by the sum
            // (at the output, in f32), as FlashAttention rounds it, so that f16 keeps a long
            // context's small weights normal.
            let mut prob = 0.0f32;
            if sees(&is_key, j, start, past + first, b % block, count) {
                prob = (scaled::<F>(scores[b * s_stride + j], scale, fresh) - largest[b]).exp();
            }
            probs[b * p_stride + j] = F::cast_from(prob);
            p += units;
        }
        sync_cube();
        if comptime!(tensor_cores) {
            let weights = cmma::Matrix::<F>::from_slice(cmma::MatrixIdent::A, FRAGMENT, FRAGMENT, FRAGMENT, cmma::MatrixLayout::RowMajor, &probs.slice(warp * FRAGMENT * p_stride, (warp + 1) * FRAGMENT * p_stride), p_stride as u32);
            #[unroll]
            for f in 0..steps {
                let v = cmma::Matrix::<F>::from_slice(cmma::MatrixIdent::B, FRAGMENT, FRAGMENT, FRAGMENT, cmma::MatrixLayout::RowMajor, &staged_values.slice(f * FRAGMENT, tile * q_stride), q_stride as u32);
                let out = fragments.index(f);
                cmma::execute::<F, F, f32, f32>(&weights, &v, out, out);
            }
        } else {
            let b = unit / 2;
            let e0 = (unit % 2) * halves;
            #[unroll]
            for k in 0..halves {
                let mut acc = owned[k];
                for j in 0..tile {
                    acc += f32::cast_from(probs[b * p_stride + j]) * f32::cast_from(staged_values[j * q_stride + e0 + k]);
                }
                owned[k] = acc;
            }
        }
        start += tile;
    }

    // The outputs of the block's queries: through the warp's rows of scores, a product at a time.
    if comptime!(tensor_cores) {
        #[unroll]
        for f in 0..steps {
            sync_cube();
            cmma::store(&mut scores.slice_mut(warp * FRAGMENT * s_stride, (warp + 1) * FRAGMENT * s_stride), fragments.index(f), s_stride as u32, cmma::MatrixLayout::RowMajor);
            sync_cube();
            let lane = unit % comptime!(WARP as usize);
            #[unroll]
            for r in 0..comptime!(FRAGMENT * FRAGMENT / WARP as usize) {
                let at = r * comptime!(WARP as usize) + lane;
                let b = warp * FRAGMENT + at / FRAGMENT;
                if b % block < count {
                    let out = pair_index(b, token0 + first, first_head, heads, block as u32) * d + f * FRAGMENT + at % FRAGMENT;
                    output[out] = F::cast_from(normalised(scores[b * s_stride + at % FRAGMENT], sums[b]));
                }
            }
        }
    } else {
        let b = unit / 2;
        if b % block < count {
            let base = pair_index(b, token0 + first, first_head, heads, block as u32) * d + (unit % 2) * halves;
            #[unroll]
            for k in 0..halves {
                output[base + k] = F::cast_from(normalised(owned[k], sums[b]));
            }
        }
    }
    if fresh {
        // Each (token, head)'s log-sum-exp of its scores, for the backward (0 for a query that
        // sees no key, as in the general kernel).
        if unit < entries && unit % block < count {
            let mut value = 0.0f32;
            if sum > 0.0 {
                value = most + sum.ln();
            }
            lse[pair_index(unit, token0 + first, first_head, heads, block as u32)] = value;
        }
    }
}

/// The tile's slots from column `start`: 1 + the slot (or the fresh pass's token) of each of the
/// first [`TILE`] units' columns, 0 where it is no key or not before `stop`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn find_slots<I: Numeric, V: Float>(read: &Tensor<I>, valid: &Tensor<V>, slot_of: &mut SharedMemory<u32>, is_key: &mut SharedMemory<u32>, row: usize, start: usize, stop: usize, #[comptime] fresh: bool) {
    let unit = UNIT_POS_X as usize;
    if unit < comptime!(TILE as usize) {
        let found = if fresh { fresh_key_slot(valid, row, start + unit, stop) } else { key_slot(read, valid, row, start + unit, stop) };
        slot_of[unit] = found.saturating_sub(1);
        is_key[unit] = u32::min(found, 1);
    }
}

/// A score as the softmax takes it: `q · k` times `scale`, in a `fresh` pass first rounded to
/// the operands' dtype (as burn's product in that dtype, which the backward recomputes).
#[cube]
fn scaled<F: Float>(dot: f32, scale: f32, #[comptime] fresh: bool) -> f32 {
    if comptime!(fresh) {
        f32::cast_from(F::cast_from(dot)) * scale
    } else {
        dot * scale
    }
}

/// An output element from its sum of values weighed by `exp(s − largest)`: divided by the
/// weights' `total`, or zero for a query that sees no key (a total of 0).
#[cube]
fn normalised(weighed: f32, total: f32) -> f32 {
    let mut out = 0.0f32;
    if total > 0.0 {
        out = weighed / total;
    }
    out
}

/// The cube's entries' `q · k` against a staged tile (rows of `head_dim + PAD`) into `scores`
/// (rows of `TILE + SCORE_PAD`): each warp its 16 entries' with one product a step of 16
/// elements of the head, or (without tensor cores) each unit some of them.
#[cube]
fn score_tile<F: Float>(q: &SharedMemory<F>, staged_keys: &SharedMemory<F>, scores: &mut SharedMemory<f32>, #[comptime] head_dim: u32, #[comptime] warps: u32, #[comptime] tensor_cores: bool) {
    let unit = UNIT_POS_X as usize;
    let q_stride = comptime!(head_dim as usize + PAD);
    let s_stride = comptime!(TILE as usize + SCORE_PAD);
    let tile = comptime!(TILE as usize);
    if comptime!(tensor_cores) {
        let warp = unit / comptime!(WARP as usize);
        let acc = cmma::Matrix::<f32>::from_value(cmma::MatrixIdent::Accumulator, FRAGMENT, FRAGMENT, FRAGMENT, cmma::MatrixLayout::Undefined, 0.0);
        #[unroll]
        for k in 0..comptime!(head_dim as usize / FRAGMENT) {
            let a = cmma::Matrix::<F>::from_slice(cmma::MatrixIdent::A, FRAGMENT, FRAGMENT, FRAGMENT, cmma::MatrixLayout::RowMajor, &q.slice(warp * FRAGMENT * q_stride + k * FRAGMENT, (warp + 1) * FRAGMENT * q_stride), q_stride as u32);
            // Keys as the product's columns: row j of the tile is column j of Kᵀ.
            let b = cmma::Matrix::<F>::from_slice(cmma::MatrixIdent::B, FRAGMENT, FRAGMENT, FRAGMENT, cmma::MatrixLayout::ColMajor, &staged_keys.slice(k * FRAGMENT, tile * q_stride), q_stride as u32);
            cmma::execute::<F, F, f32, f32>(&a, &b, &acc, &acc);
        }
        cmma::store(&mut scores.slice_mut(warp * FRAGMENT * s_stride, (warp + 1) * FRAGMENT * s_stride), &acc, s_stride as u32, cmma::MatrixLayout::RowMajor);
    } else {
        let entries = comptime!(warps as usize * FRAGMENT);
        let mut p = unit;
        while p < entries * tile {
            let b = p / tile;
            let j = p % tile;
            let mut dot = 0.0f32;
            for e in 0..head_dim as usize {
                dot += f32::cast_from(q[b * q_stride + e]) * f32::cast_from(staged_keys[j * q_stride + e]);
            }
            scores[b * s_stride + j] = dot;
            p += comptime!((warps * WARP) as usize);
        }
    }
}

/// Launches the kernel over a pass: operands as [`crate::paged_attention::paged_attention`] (a
/// pass over the cache: `read` and `valid`, and `starts` where `ragged`) or
/// [`crate::paged_attention::fresh_attention`] (`fresh`: `read` and `starts` stand in by the
/// mask, `lse` takes the log-sum-exp) hand them, packed; `fewest`: the fewest queries a row this
/// kernel takes in a ragged pass (the decoding kernel takes the rows of one). `tensor_cores`
/// off computes the products a unit at a time (see the module's docs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: cubecl::Runtime>(
    client: &ComputeClient<R>,
    operands: [TensorArg<R>; 8],
    dtypes: [StorageType; 3],
    vector: usize,
    [rows, queries, heads, head_dim, groups]: [usize; 5],
    scale: f32,
    fewest: u32,
    [ragged, fresh, tensor_cores]: [bool; 3],
) {
    let warps = if tensor_cores { WARPS } else { UNIT_WARPS };
    let blocks = blocks_for(groups, warps);
    let [query, keys, values, read, valid, starts, output, lse] = operands;
    tensor_core_attention_kernel::launch::<R>(
        client,
        CubeCount::Static((heads / blocks.heads as usize) as u32, rows as u32, queries.div_ceil(blocks.queries as usize) as u32),
        CubeDim::new_1d(warps * WARP),
        vector,
        query,
        keys,
        values,
        read,
        valid,
        starts,
        output,
        lse,
        scale,
        fewest,
        ragged,
        fresh,
        head_dim as u32,
        blocks.heads,
        warps,
        tensor_cores,
        REVISION,
        dtypes,
    );
}

/// The kernel over `dtypes` (as [`launch`]'s) as CubeCL defines it for compilation, with tensor
/// cores, for heads of `head_dim` in groups of `groups`, keys and values read in vectors of
/// `vector`.
pub(crate) fn definition<R: Runtime>(client: &ComputeClient<R>, dtypes: [StorageType; 3], vector: usize, head_dim: usize, groups: usize, ragged: bool, fresh: bool) -> KernelDefinition {
    let arg = crate::definitions::arg;
    let blocks = blocks_for(groups, WARPS);
    tensor_core_attention_kernel::TensorCoreAttentionKernel::<R>::new(
        crate::definitions::settings(WARPS * WARP),
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
        vector,
        ragged,
        fresh,
        head_dim as u32,
        blocks.heads,
        WARPS,
        true,
        REVISION,
        dtypes,
    )
    .define()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's groups (2 query heads a key-value head for 0.6B and 1.7B, 4 for 4B and 8B) fill a
    /// cube's entries with whole groups; other groups take the most heads that divide them.
    #[test]
    fn blocks_fill_the_cube() {
        let blocks = |heads, queries, warps| Blocks { heads, queries, warps };
        assert_eq!(blocks_for(2, WARPS), blocks(2, 32, 4));
        assert_eq!(blocks_for(4, WARPS), blocks(4, 16, 4));
        assert_eq!(blocks_for(8, WARPS), blocks(4, 16, 4));
        assert_eq!(blocks_for(3, WARPS), blocks(1, 64, 4));
        assert_eq!(blocks_for(6, UNIT_WARPS), blocks(2, 16, 2));
        for groups in 1..=16 {
            for warps in [UNIT_WARPS, WARPS] {
                let b = blocks_for(groups, warps);
                assert!(groups % b.heads as usize == 0 && (b.heads * b.queries) as usize == warps as usize * FRAGMENT, "{groups}: {b:?}");
            }
        }
    }

    /// 16-bit operands with heads of whole fragments, up to the shared memory's bound.
    #[test]
    fn takes_half_precision_heads_of_whole_fragments() {
        assert!(takes(DType::BF16, 128) && takes(DType::F16, 64) && takes(DType::F16, 16));
        assert!(!takes(DType::F32, 128) && !takes(DType::BF16, 72) && !takes(DType::BF16, 256) && !takes(DType::F16, 8));
    }

    /// The shared memory of a cube at heads of [`MOST_HEAD_DIM`]: within CUDA's 48 KiB at
    /// [`WARPS`], lavapipe's 32 at [`UNIT_WARPS`].
    #[test]
    fn shared_memory_fits() {
        let bytes = |warps: usize| {
            let entries = warps * FRAGMENT;
            let (tile, d) = (TILE as usize, MOST_HEAD_DIM);
            2 * (entries * (d + PAD) + 2 * tile * (d + PAD) + entries * (tile + PAD)) + 4 * (entries * (tile + SCORE_PAD) + 2 * entries + 2 * tile)
        };
        assert!(bytes(WARPS as usize) <= 48 * 1024, "{}", bytes(WARPS as usize));
        assert!(bytes(UNIT_WARPS as usize) <= 28 * 1024, "{}", bytes(UNIT_WARPS as usize));
    }
}

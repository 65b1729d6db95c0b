//! One pass's attention over the paged KV cache (see [`model::device_kernels::PagedAttention`]),
//! a decoding step's single query a row or a prefill chunk's many, as one CubeCL kernel: one cube
//! of [`UNITS`] units per (query head, row, block of queries), a row's heads side by side (those
//! sharing a key-value head then find its keys and values in L2). The cube takes the row's
//! columns a tile at a time ([`blocks_for`]), up to the last one its queries may see (causal):
//! 1. the first units look up their column's slot and whether it is a key;
//! 2. all units copy the tile's keys into shared memory, consecutive units reading consecutive
//!    elements of one key (coalesced; a masked column's key is not read);
//! 3. the units score the block's (query, column) pairs from shared memory (key rows padded by
//!    one element, so that units reading one element of different keys touch distinct banks);
//!    a column after the query's own position, or padding, is masked;
//! 4. one unit a query updates its running maximum and sum (FlashAttention's online softmax)
//!    and turns the tile's scores into probabilities;
//! 5. the units copy the tile's values into the same shared memory (coalesced) and each adds
//!    them to the output elements it owns.
//!
//! Each key and value is read from the pools once per (query head, block of queries), where it
//! lies; scores, probabilities and sums are f32 whatever the pools' dtype.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::DeviceKernels;

/// Units per cube.
pub const UNITS: u32 = 64;

/// Bytes of shared memory a cube may take: within the 32 KiB that every CubeCL target offers a
/// cube (lavapipe's limit; CUDA's default is 48 KiB).
const SHARED_BYTES: usize = 28 * 1024;

/// Queries a cube takes at most: each key and value it copies into shared memory serves that
/// many of them.
const MOST_QUERIES: usize = 16;

/// f32 words of shared memory a cube of `queries` queries and tiles of `tile` columns takes:
/// the queries and their outputs, a tile of keys (then values) in rows of `head_dim + 1`, the
/// tile's scores, three statistics a query and two words a column.
const fn shared_words(head_dim: usize, queries: usize, tile: usize) -> usize {
    2 * queries * head_dim + tile * (head_dim + 1) + queries * tile + 3 * queries + 2 * tile
}

/// Queries per cube and columns per tile for a pass of `queries` queries a row over heads of
/// `head_dim`: as many queries as the pass has, rounded up to a power of two, up to
/// [`MOST_QUERIES`] (fewer where even tiles of 16 columns would not fit), and then the most
/// columns, a power of two up to [`UNITS`], that fit [`SHARED_BYTES`]. A decoding step (one
/// query) of Qwen3's heads of 128 takes tiles of 32; a prefill 16 queries and tiles of 16.
pub fn blocks_for(head_dim: usize, queries: usize) -> (u32, u32) {
    let fits = |q: usize, t: usize| 4 * shared_words(head_dim, q, t) <= SHARED_BYTES;
    let mut block = queries.clamp(1, MOST_QUERIES).next_power_of_two();
    while block > 1 && !fits(block, 16) {
        block /= 2;
    }
    let mut tile = 1;
    while tile * 2 <= UNITS as usize && fits(block, tile * 2) {
        tile *= 2;
    }
    (block as u32, tile as u32)
}

/// A hash of this file, one of the kernel's compile-time arguments: CubeCL's persistent cache
/// of compiled kernels (`--kernel-cache`) keys a kernel by its name and those arguments only,
/// so an edited kernel would otherwise run as cached by an earlier build.
const REVISION: u32 = crate::source_revision(include_bytes!("paged_attention.rs"));

#[cube(launch)]
fn paged_attention_kernel<F: Float, I: Numeric, V: Float>(
    query: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    read: &Tensor<I>,
    valid: &Tensor<V>,
    output: &mut Tensor<F>,
    scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] block: u32,
    #[comptime] tile: u32,
    #[comptime] _revision: u32,
    #[define(F, I, V)] _dtypes: [StorageType; 3],
) {
    let head = CUBE_POS_X as usize;
    let row = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let d = head_dim as usize;
    let block_len = block as usize;
    let tile_len = tile as usize;
    // Keys and values sit in shared memory in rows of d + 1: units reading element e of
    // different keys touch distinct banks.
    let kv_stride = d + 1;

    let queries = query.shape(1);
    let heads = query.shape(2);
    let kv_heads = keys.shape(0);
    let slots = keys.shape(1);
    let width = valid.shape(1);
    // The pass's queries are its rows' last columns: query i sees columns up to past + i.
    let past = width - queries;
    let first = CUBE_POS_Z as usize * block_len;
    let mut count = queries - first;
    if count > block_len {
        count = block_len;
    }
    let end = past + first + count;
    let pool_base = (head / (heads / kv_heads)) * slots * d;

    // A masked column's score: below any real score, finite (as the model's mask value).
    let masked = f32::new(-1.0e30);
    let mut q = SharedMemory::<f32>::new(block_len * d);
    let mut acc = SharedMemory::<f32>::new(block_len * d);
    let mut kv_tile = SharedMemory::<f32>::new(tile_len * kv_stride);
    let mut scores = SharedMemory::<f32>::new(block_len * tile_len);
    let mut running_max = SharedMemory::<f32>::new(block_len);
    let mut total = SharedMemory::<f32>::new(block_len);
    let mut rescale = SharedMemory::<f32>::new(block_len);
    let mut slot_of = SharedMemory::<u32>::new(tile_len);
    let mut is_key = SharedMemory::<u32>::new(tile_len);

    let mut i = unit;
    while i < block_len * d {
        let qi = i / d;
        let mut x = 0.0f32;
        if qi < count {
            x = f32::cast_from(query[((row * queries + first + qi) * heads + head) * d + i % d]) * scale;
        }
        q[i] = x;
        acc[i] = 0.0;
        i += units;
    }
    if unit < block_len {
        running_max[unit] = masked;
        total[unit] = 0.0;
    }

    let mut start = 0usize;
    while start < end {
        // 1. The tile's slots.
        if unit < tile_len {
            let column = start + unit;
            let mut slot = 0u32;
            let mut key = 0u32;
            if column < end {
                if f32::cast_from(valid[row * valid.stride(0) + column * valid.stride(1)]) > 0.5 {
                    slot = u32::cast_from(read[row * width + column]);
                    key = 1;
                }
            }
            slot_of[unit] = slot;
            is_key[unit] = key;
        }
        sync_cube();

        // 2. The tile's keys, coalesced.
        let mut i = unit;
        while i < tile_len * d {
            let j = i / d;
            let e = i % d;
            let mut k = 0.0f32;
            if is_key[j] == 1 {
                k = f32::cast_from(keys[pool_base + slot_of[j] as usize * d + e]);
            }
            kv_tile[j * kv_stride + e] = k;
            i += units;
        }
        sync_cube();

        // 3. Scores: a column is seen by the queries at or after its position.
        let mut p = unit;
        while p < block_len * tile_len {
            let qi = p / tile_len;
            let j = p % tile_len;
            let mut score = masked;
            if is_key[j] == 1 && qi < count && start + j <= past + first + qi {
                let q_base = qi * d;
                let k_base = j * kv_stride;
                let mut dot = 0.0f32;
                for e in 0..d {
                    dot += q[q_base + e] * kv_tile[k_base + e];
                }
                score = dot;
            }
            scores[p] = score;
            p += units;
        }
        sync_cube();

        // 4. The online softmax, one unit a query.
        if unit < block_len {
            let base = unit * tile_len;
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
                let mut prob = 0.0f32;
                if s > masked {
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

        // 5. The tile's values, coalesced, into the keys' place, and the outputs.
        let mut i = unit;
        while i < tile_len * d {
            let j = i / d;
            let e = i % d;
            let mut v = 0.0f32;
            if is_key[j] == 1 {
                v = f32::cast_from(values[pool_base + slot_of[j] as usize * d + e]);
            }
            kv_tile[j * kv_stride + e] = v;
            i += units;
        }
        sync_cube();

        let mut i = unit;
        while i < block_len * d {
            let qi = i / d;
            let e = i % d;
            let base = qi * tile_len;
            let mut sum = acc[i] * rescale[qi];
            for j in 0..tile_len {
                sum += scores[base + j] * kv_tile[j * kv_stride + e];
            }
            acc[i] = sum;
            i += units;
        }
        sync_cube();
        start += tile_len;
    }

    let mut i = unit;
    while i < count * d {
        let qi = i / d;
        let mut out = 0.0f32;
        if total[qi] > 0.0 {
            out = acc[i] / total[qi];
        }
        output[((row * queries + first + qi) * heads + head) * d + i % d] = F::cast_from(out);
        i += units;
    }
}

/// Launches the kernel on CubeCL runtime `R`; see [`model::device_kernels::PagedAttention`].
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn paged_attention<R: CubeRuntime>(
    query: CubeTensor<R>,
    keys: CubeTensor<R>,
    values: CubeTensor<R>,
    read: CubeTensor<R>,
    valid: CubeTensor<R>,
    scale: f32,
) -> CubeTensor<R> {
    let [rows, queries, heads, head_dim] = query.shape().dims::<4>();
    let [kv_heads, slots, pool_dim] = keys.shape().dims::<3>();
    let [valid_rows, width] = valid.shape().dims::<2>();
    assert_eq!(values.shape().dims::<3>(), [kv_heads, slots, head_dim], "values pool of another shape than the keys'");
    assert_eq!((pool_dim, valid_rows), (head_dim, rows), "paged attention: pools of head_dim {pool_dim}, mask of {valid_rows} rows");
    assert!(queries >= 1 && width >= queries, "paged attention: {queries} queries a row over {width} columns");
    assert_eq!(read.shape().num_elements(), rows * width, "paged attention: a read table of rows × width slots");
    assert!(kv_heads > 0 && heads % kv_heads == 0, "{heads} query heads over {kv_heads} key-value heads");
    assert!(query.dtype == keys.dtype && keys.dtype == values.dtype, "paged attention: query and pools of one dtype");
    assert!(matches!(query.dtype, DType::F32 | DType::F16 | DType::BF16), "paged attention: no kernel for {:?}", query.dtype);

    // The kernel indexes these as packed row-major tensors (a no-op where they are; the mask,
    // one per pass, is read through its strides instead, not copied at every layer), and its
    // output is allocated packed: CUDA's default layout may pad rows.
    let [query, keys, values, read] = [query, keys, values, read].map(into_contiguous);
    let client = query.client.clone();
    let dtypes = [query.dtype.into(), read.dtype.into(), valid.dtype.into()];
    let output = empty_device_contiguous_dtype(client.clone(), query.device.clone(), Shape::new([rows, queries, heads, head_dim]), query.dtype);
    let (block, tile) = blocks_for(head_dim, queries);
    paged_attention_kernel::launch::<R>(
        &client,
        // A row's heads side by side: those that share a key-value head run together, so its
        // keys and values come from L2 for all but the first.
        CubeCount::Static(heads as u32, rows as u32, queries.div_ceil(block as usize) as u32),
        CubeDim::new_1d(UNITS),
        query.into_tensor_arg(),
        keys.into_tensor_arg(),
        values.into_tensor_arg(),
        read.into_tensor_arg(),
        valid.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        scale,
        head_dim as u32,
        block,
        tile,
        REVISION,
        dtypes,
    );
    output
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DeviceKernels for CubeBackend<R, F, I, BT> {
    fn paged_attention(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        paged_attention(query, keys, values, read, valid, scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every choice fits the shared memory, a decoding step of Qwen3's heads keeps its tiles of
    /// 32, and a prefill takes blocks of 16 queries where they fit.
    #[test]
    fn blocks_fit_the_shared_memory() {
        assert_eq!(blocks_for(128, 1), (1, 32));
        assert_eq!(blocks_for(128, 300), (16, 16));
        assert_eq!(blocks_for(128, 3), (4, 32));
        assert_eq!(blocks_for(24, 40), (16, 64));
        for d in [8, 24, 64, 72, 128, 256, 512] {
            for queries in [1, 2, 5, 16, 17, 1000] {
                let (block, tile) = blocks_for(d, queries);
                assert!(4 * shared_words(d, block as usize, tile as usize) <= SHARED_BYTES, "head_dim {d}, {queries} queries");
                assert!(block as usize <= queries.next_power_of_two() && tile >= 1);
            }
        }
    }
}

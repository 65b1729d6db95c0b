//! One decoding step's attention over the paged KV cache (see
//! [`model::device_kernels::PagedDecode`]), as a CubeCL kernel: one cube of [`UNITS`] units per
//! (query head, row), a row's heads side by side (those sharing a key-value head then find its
//! keys and values in L2). The cube takes the row's columns a tile at a time ([`tile_for`]):
//! 1. the first units look up their column's slot and whether it is a key;
//! 2. all units copy the tile's keys into shared memory, consecutive units reading consecutive
//!    elements of one key (coalesced; a masked column's key is not read);
//! 3. each of the first units scores its column's key from shared memory (rows padded by one
//!    element, so that the units read distinct banks);
//! 4. the cube updates a running maximum and sum (FlashAttention's online softmax), and each
//!    unit adds the tile's values to the output dimensions it owns (coalesced too).
//!
//! Scores, probabilities and sums are f32 whatever the pools' dtype; each key and value is read
//! from the pools once per query head, where it lies.

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

/// Bytes of shared memory the tile of keys may take: well within the 32 KiB that every CubeCL
/// target offers a cube (lavapipe's limit; CUDA's default is 48 KiB).
const KEY_TILE_BYTES: usize = 16 * 1024 + 512;

/// Columns per tile for heads of `head_dim`: the most, up to [`UNITS`] and a power of two,
/// whose keys (f32, rows of `head_dim + 1`) fit [`KEY_TILE_BYTES`]: 32 for Qwen3's 128.
pub fn tile_for(head_dim: usize) -> u32 {
    let fit = KEY_TILE_BYTES / (4 * (head_dim + 1));
    let mut tile = 1;
    while tile * 2 <= fit.min(UNITS as usize) {
        tile *= 2;
    }
    tile as u32
}

/// A hash of this file, one of the kernel's compile-time arguments: CubeCL's persistent cache
/// of compiled kernels (`--kernel-cache`) keys a kernel by its name and those arguments only,
/// so an edited kernel would otherwise run as cached by an earlier build.
const REVISION: u32 = crate::source_revision(include_bytes!("paged_decode.rs"));

#[cube(launch)]
fn paged_decode_kernel<F: Float, I: Numeric, V: Float>(
    query: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    read: &Tensor<I>,
    valid: &Tensor<V>,
    output: &mut Tensor<F>,
    scale: f32,
    #[comptime] head_dim: u32,
    #[comptime] tile: u32,
    #[comptime] _revision: u32,
    #[define(F, I, V)] _dtypes: [StorageType; 3],
) {
    let head = CUBE_POS_X as usize;
    let row = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let d = head_dim as usize;
    let tile_len = tile as usize;
    // Keys sit in shared memory in rows of d + 1: unit j reading element e of key j then
    // touches bank (j + e) mod 32, no two units the same.
    let key_stride = d + 1;

    let heads = query.shape(1);
    let kv_heads = keys.shape(0);
    let slots = keys.shape(1);
    let width = valid.shape(1);
    let query_base = (row * heads + head) * d;
    let pool_base = (head / (heads / kv_heads)) * slots * d;

    // A masked column's score: below any real score, finite (as the model's mask value).
    let masked = f32::new(-1.0e30);
    let mut q = SharedMemory::<f32>::new(d);
    let mut acc = SharedMemory::<f32>::new(d);
    let mut key_tile = SharedMemory::<f32>::new(tile_len * key_stride);
    let mut scores = SharedMemory::<f32>::new(tile_len);
    let mut probs = SharedMemory::<f32>::new(tile_len);
    let mut slot_of = SharedMemory::<u32>::new(tile_len);
    let mut is_key = SharedMemory::<u32>::new(tile_len);

    let mut e = unit;
    while e < d {
        q[e] = f32::cast_from(query[query_base + e]) * scale;
        acc[e] = 0.0;
        e += units;
    }

    let mut running_max = masked;
    let mut total = 0.0f32;
    let mut start = 0usize;
    while start < width {
        // 1. The tile's slots.
        if unit < tile_len {
            let column = start + unit;
            let mut slot = 0u32;
            let mut key = 0u32;
            if column < width {
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
            key_tile[j * key_stride + e] = k;
            i += units;
        }
        sync_cube();

        // 3. Scores.
        if unit < tile_len {
            let mut score = masked;
            if is_key[unit] == 1 {
                let base = unit * key_stride;
                let mut dot = 0.0f32;
                for e in 0..d {
                    dot += q[e] * key_tile[base + e];
                }
                score = dot;
            }
            scores[unit] = score;
        }
        sync_cube();

        // 4. The online softmax and the values.
        let mut new_max = running_max;
        for j in 0..tile_len {
            let s = scores[j];
            if s > new_max {
                new_max = s;
            }
        }
        if unit < tile_len {
            let mut p = 0.0f32;
            if is_key[unit] == 1 {
                p = (scores[unit] - new_max).exp();
            }
            probs[unit] = p;
        }
        sync_cube();

        let rescale = (running_max - new_max).exp();
        let mut tile_sum = 0.0f32;
        for j in 0..tile_len {
            tile_sum += probs[j];
        }
        total = total * rescale + tile_sum;
        let mut e = unit;
        while e < d {
            let mut sum = acc[e] * rescale;
            for j in 0..tile_len {
                if is_key[j] == 1 {
                    sum += probs[j] * f32::cast_from(values[pool_base + slot_of[j] as usize * d + e]);
                }
            }
            acc[e] = sum;
            e += units;
        }
        running_max = new_max;
        sync_cube();
        start += tile_len;
    }

    let mut e = unit;
    while e < d {
        let mut out = 0.0f32;
        if total > 0.0 {
            out = acc[e] / total;
        }
        output[query_base + e] = F::cast_from(out);
        e += units;
    }
}

/// Launches the kernel on CubeCL runtime `R`; see [`model::device_kernels::PagedDecode`].
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn paged_decode<R: CubeRuntime>(
    query: CubeTensor<R>,
    keys: CubeTensor<R>,
    values: CubeTensor<R>,
    read: CubeTensor<R>,
    valid: CubeTensor<R>,
    scale: f32,
) -> CubeTensor<R> {
    let [rows, heads, head_dim] = query.shape().dims::<3>();
    let [kv_heads, slots, pool_dim] = keys.shape().dims::<3>();
    let [valid_rows, width] = valid.shape().dims::<2>();
    assert_eq!(values.shape().dims::<3>(), [kv_heads, slots, head_dim], "values pool of another shape than the keys'");
    assert_eq!((pool_dim, valid_rows), (head_dim, rows), "paged decode: pools of head_dim {pool_dim}, mask of {valid_rows} rows");
    assert_eq!(read.shape().num_elements(), rows * width, "paged decode: a read table of rows × width slots");
    assert!(kv_heads > 0 && heads % kv_heads == 0, "{heads} query heads over {kv_heads} key-value heads");
    assert!(query.dtype == keys.dtype && keys.dtype == values.dtype, "paged decode: query and pools of one dtype");
    assert!(matches!(query.dtype, DType::F32 | DType::F16 | DType::BF16), "paged decode: no kernel for {:?}", query.dtype);

    // The kernel indexes these as packed row-major tensors (a no-op where they are; the mask,
    // one per pass, is read through its strides instead, not copied at every layer), and its
    // output is allocated packed: CUDA's default layout may pad rows.
    let [query, keys, values, read] = [query, keys, values, read].map(into_contiguous);
    let client = query.client.clone();
    let dtypes = [query.dtype.into(), read.dtype.into(), valid.dtype.into()];
    let output = empty_device_contiguous_dtype(client.clone(), query.device.clone(), Shape::new([rows, heads, head_dim]), query.dtype);
    paged_decode_kernel::launch::<R>(
        &client,
        // A row's heads side by side: those that share a key-value head run together, so its
        // keys and values come from L2 for all but the first.
        CubeCount::Static(heads as u32, rows as u32, 1),
        CubeDim::new_1d(UNITS),
        query.into_tensor_arg(),
        keys.into_tensor_arg(),
        values.into_tensor_arg(),
        read.into_tensor_arg(),
        valid.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        scale,
        head_dim as u32,
        tile_for(head_dim),
        REVISION,
        dtypes,
    );
    output
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DeviceKernels for CubeBackend<R, F, I, BT> {
    fn paged_decode(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        paged_decode(query, keys, values, read, valid, scale)
    }
}

//! One decoding step's attention over the paged KV cache (see
//! [`model::device_kernels::PagedDecode`]), as a CubeCL kernel: one cube per (row, query head),
//! [`TILE`] units. The units take the row's columns [`TILE`] at a time: each unit looks up its
//! column's slot and scores its key (masked columns are not read), the cube updates a running
//! maximum and sum (FlashAttention's online softmax), and each unit adds the tile's values to
//! the output dimensions it owns. Scores, probabilities and sums are f32 whatever the pools'
//! dtype; the keys and values are read once, where they lie in the pools.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::DeviceKernels;

/// Units per cube, and columns per tile.
pub const TILE: u32 = 64;

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
    let row = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let d = head_dim as usize;
    let tile_len = tile as usize;

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
    let mut scores = SharedMemory::<f32>::new(tile_len);
    let mut probs = SharedMemory::<f32>::new(tile_len);
    let mut slot_of = SharedMemory::<u32>::new(tile_len);

    let mut e = unit;
    while e < d {
        q[e] = f32::cast_from(query[query_base + e]) * scale;
        acc[e] = 0.0;
        e += tile_len;
    }
    sync_cube();

    let mut running_max = masked;
    let mut total = 0.0f32;
    let mut start = 0usize;
    while start < width {
        let column = start + unit;
        let mut score = masked;
        let mut slot = 0u32;
        if column < width {
            if f32::cast_from(valid[row * width + column]) > 0.5 {
                slot = u32::cast_from(read[row * width + column]);
                let key_base = pool_base + slot as usize * d;
                let mut dot = 0.0f32;
                for i in 0..d {
                    dot += q[i] * f32::cast_from(keys[key_base + i]);
                }
                score = dot;
            }
        }
        scores[unit] = score;
        slot_of[unit] = slot;
        sync_cube();

        let mut new_max = running_max;
        for i in 0..tile_len {
            let s = scores[i];
            if s > new_max {
                new_max = s;
            }
        }
        let mut p = 0.0f32;
        if score > masked {
            p = (score - new_max).exp();
        }
        probs[unit] = p;
        sync_cube();

        let rescale = (running_max - new_max).exp();
        let mut tile_sum = 0.0f32;
        for i in 0..tile_len {
            tile_sum += probs[i];
        }
        total = total * rescale + tile_sum;
        let mut e = unit;
        while e < d {
            let mut sum = acc[e] * rescale;
            for i in 0..tile_len {
                let weight = probs[i];
                if weight > 0.0 {
                    sum += weight * f32::cast_from(values[pool_base + slot_of[i] as usize * d + e]);
                }
            }
            acc[e] = sum;
            e += tile_len;
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
        e += tile_len;
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

    let [query, keys, values, read, valid] = [query, keys, values, read, valid].map(into_contiguous);
    let client = query.client.clone();
    let dtypes = [query.dtype.into(), read.dtype.into(), valid.dtype.into()];
    let output = empty_device_dtype(client.clone(), query.device.clone(), Shape::new([rows, heads, head_dim]), query.dtype);
    paged_decode_kernel::launch::<R>(
        &client,
        CubeCount::Static(rows as u32, heads as u32, 1),
        CubeDim::new_1d(TILE),
        query.into_tensor_arg(),
        keys.into_tensor_arg(),
        values.into_tensor_arg(),
        read.into_tensor_arg(),
        valid.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        scale,
        head_dim as u32,
        TILE,
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

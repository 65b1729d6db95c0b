//! A projection of few rows, `x · w` (`[rows, k] · [k, columns]`), as decoding steps run it (see
//! [`model::device_kernels::SkinnyMatmulFn`]): vLLM's skinny GEMM. burn's matmul without
//! autotune (the CUDA build's) takes CubeCL's default tiling, 64 × 64 outputs a cube walking
//! all of `k`: at 64 rows that is 16 cubes for Qwen3-0.6B's `down_proj` on an H200's 132
//! multiprocessors, 205 µs where reading its weights takes about 1.5 (NVIDIA's profiler, seventh
//! lease: the four products of a layer held 12.5 of a decoding step's 14.7 ms of GPU time).
//!
//! Here a cube takes a tile of up to [`TILE_ROWS`] rows by 32 vectors of columns (16 bytes a
//! vector on CUDA: 256 bf16 columns), its 256 units in 8 parts that each walk every eighth `k`
//! of the cube's span, four weight vectors in flight a unit: each unit reads one vector of a
//! weight row (a warp reads 512 contiguous bytes) and multiplies it by each of the tile's rows,
//! the sums in f32 registers. The parts' sums meet in shared memory. Where these cubes would
//! leave the multiprocessors idle, `k` is cut into spans, a cube each, whose sums a second
//! kernel adds (split-K); the result is rounded to the operands' dtype once, at the end.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use crate::rms_norm::{cube_row, grid, packed_rows};

/// Units a cube: [`PARTS`] parts of [`LANES`].
const UNITS: u32 = 256;

/// Units of a part, one vector of columns each: a warp on CUDA.
const LANES: usize = 32;

/// Parts a cube's span of `k` is dealt to, one `k` each in turn.
const PARTS: usize = UNITS as usize / LANES;

/// Rows a cube takes at most (its sums: this many vectors a unit, in registers).
pub const TILE_ROWS: usize = 8;

/// Cubes a multiprocessor holds at once here (256 units, about 100 registers each).
const RESIDENT_CUBES_PER_SM: usize = 2;

/// The fewest `k` a span takes: a part's four loads in flight, twice.
const FEWEST_K_A_SPAN: usize = PARTS * 8;

/// A hash of this file (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("skinny_matmul.rs"));

/// Cube `(x, y, z)`: columns `[x · LANES · n, (x + 1) · LANES · n)`, `k` in
/// `[y · span, (y + 1) · span)`, rows `[z · tile_rows, (z + 1) · tile_rows)`. `weight` is read
/// in vectors of `n`, a row of them `weight_stride` vectors after the last. Split, the cube's
/// sums go to `partial` (`[splits, rows, columns]`, f32), else rounded to `output`.
#[cube(launch)]
fn skinny_matmul_kernel<F: Float, N: Size>(
    x: &Tensor<F>,
    weight: &Tensor<Vector<F, N>>,
    output: &mut Tensor<F>,
    partial: &mut Tensor<f32>,
    span: u32,
    weight_stride: u32,
    #[comptime] tile_rows: u32,
    #[comptime] split: bool,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS_X as usize;
    let lane = unit % LANES;
    let part = unit / LANES;
    let n = N::value();
    let tr = comptime!(tile_rows as usize);
    let rows = output.shape(0);
    let columns = output.shape(1);
    let k_len = x.shape(1);
    let x_stride = x.stride(0);
    let ws = weight_stride as usize;
    // This unit's vector of columns (the last one where the tile runs past them: its sums are
    // not written), and the cube's rows (the last row where the tile runs past them).
    let column_vectors = columns / n;
    let mut vector = CUBE_POS_X as usize * LANES + lane;
    if vector >= column_vectors {
        vector = column_vectors - 1;
    }
    let first_row = CUBE_POS_Z as usize * tr;
    let mut row_base = Array::<usize>::new(tr);
    #[unroll]
    for i in 0..tr {
        let mut row = first_row + i;
        if row >= rows {
            row = rows - 1;
        }
        row_base[i] = row * x_stride;
    }
    let k_start = CUBE_POS_Y as usize * span as usize;
    let mut k_stop = k_start + span as usize;
    if k_stop > k_len {
        k_stop = k_len;
    }

    let mut sums = Array::<f32>::new(comptime!(tr * n));
    #[unroll]
    for i in 0..comptime!(tr * n) {
        sums[i] = 0.0;
    }
    // Four of the part's `k` at a time: their weight loads are independent.
    let step = comptime!(PARTS);
    let mut k = k_start + part;
    while k + 3 * step < k_stop {
        let mut w = Array::<Vector<f32, N>>::new(4usize);
        #[unroll]
        for j in 0..4usize {
            w[j] = Vector::<f32, N>::cast_from(weight[(k + j * step) * ws + vector]);
        }
        #[unroll]
        for j in 0..4usize {
            let wj = w[j];
            #[unroll]
            for i in 0..tr {
                let xi = f32::cast_from(x[row_base[i] + k + j * step]);
                #[unroll]
                for e in 0..n {
                    sums[i * n + e] += xi * wj[e];
                }
            }
        }
        k += 4 * step;
    }
    while k < k_stop {
        let wk = Vector::<f32, N>::cast_from(weight[k * ws + vector]);
        #[unroll]
        for i in 0..tr {
            let xi = f32::cast_from(x[row_base[i] + k]);
            #[unroll]
            for e in 0..n {
                sums[i * n + e] += xi * wk[e];
            }
        }
        k += step;
    }

    // The parts' sums added in shared memory, one part after another: element `(i, e)` of lane
    // `l` at `(i · n + e) · LANES + l`.
    let tile = comptime!(tr * n * LANES);
    let mut shared = SharedMemory::<f32>::new(tile);
    for p in 0..PARTS {
        if part == p {
            #[unroll]
            for i in 0..comptime!(tr * n) {
                let at = i * LANES + lane;
                if p == 0 {
                    shared[at] = sums[i];
                } else {
                    shared[at] = shared[at] + sums[i];
                }
            }
        }
        sync_cube();
    }

    // The tile written by every unit, consecutive units to consecutive columns.
    let tile_columns = LANES * n;
    let first_column = CUBE_POS_X as usize * tile_columns;
    let mut f = unit;
    while f < tile {
        let i = f / tile_columns;
        let c = f % tile_columns;
        let row = first_row + i;
        let column = first_column + c;
        if row < rows && column < columns {
            let sum = shared[(i * n + c % n) * LANES + c / n];
            if split {
                partial[(CUBE_POS_Y as usize * rows + row) * columns + column] = sum;
            } else {
                output[row * columns + column] = F::cast_from(sum);
            }
        }
        f += comptime!(UNITS as usize);
    }
}

/// `output[i] = Σ_s partial[s · len + i]`, rounded once to `F`.
#[cube(launch)]
fn sum_spans_kernel<F: Float>(partial: &Tensor<f32>, output: &mut Tensor<F>, spans: u32, #[comptime] _revision: u32, #[define(F)] _dtype: StorageType) {
    let i = cube_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let len = output.len();
    if i < len {
        let mut sum = 0.0f32;
        for s in 0..spans as usize {
            sum += partial[s * len + i];
        }
        output[i] = F::cast_from(sum);
    }
}

/// How a product goes to [`skinny_matmul_kernel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// Elements a vector load of the weight takes.
    pub vector: usize,
    /// Rows a cube.
    pub tile_rows: usize,
    /// Spans `k` is cut into (1: one kernel, no partial sums).
    pub spans: usize,
    /// `k` a span.
    pub span: usize,
}

/// The cut of a `[rows, k] · [k, columns]` product whose weight rows lie `weight_stride`
/// elements apart from an offset of `offset` elements, with vectors of up to `most_vector`:
/// the longest vector that divides the columns, the stride and the offset; tiles of up to
/// [`TILE_ROWS`] rows (fewer for fewer rows); and enough spans of `k` that the cubes fill
/// `multiprocessors` (each span at least [`FEWEST_K_A_SPAN`]), or `spans` where given.
pub fn cut_for(rows: usize, k: usize, columns: usize, weight_stride: usize, offset: usize, most_vector: usize, multiprocessors: Option<u32>, spans: Option<usize>) -> Cut {
    let vector = [8, 4, 2, 1].into_iter().find(|&v| v <= most_vector.max(1) && columns % v == 0 && weight_stride % v == 0 && offset % v == 0).unwrap_or(1);
    let tile_rows = rows.clamp(1, TILE_ROWS).next_power_of_two();
    let cubes = columns.div_ceil(vector * LANES) * rows.div_ceil(tile_rows);
    let spans = spans.unwrap_or_else(|| match multiprocessors {
        Some(sm) => (sm as usize * RESIDENT_CUBES_PER_SM).div_ceil(cubes).min(k / FEWEST_K_A_SPAN).max(1),
        None => 1,
    });
    let spans = spans.clamp(1, k.max(1));
    let span = k.div_ceil(spans);
    Cut { vector, tile_rows, spans: k.div_ceil(span.max(1)).max(1), span: span.max(1) }
}

/// `x · weight` (`[rows, k] · [k, columns]`, one float dtype) through [`skinny_matmul_kernel`],
/// `[rows, columns]` packed: `x`'s rows may lie apart, the weight's columns are read where they
/// lie (a view of a stacked weight's columns included), copied only where its columns do not
/// lie side by side. `spans` overrides the cut of `k` (see [`cut_for`]).
///
/// Panics on operands whose shapes or dtypes disagree, or a dtype without a kernel.
pub fn skinny_matmul<R: CubeRuntime>(x: CubeTensor<R>, weight: CubeTensor<R>, spans: Option<usize>) -> CubeTensor<R> {
    let [rows, k] = x.shape().dims::<2>();
    let [weight_k, columns] = weight.shape().dims::<2>();
    assert_eq!(k, weight_k, "skinny matmul: x's width is the weight's rows");
    assert_eq!(x.dtype, weight.dtype, "skinny matmul: operands of one dtype");
    assert!(matches!(x.dtype, DType::F32 | DType::F16 | DType::BF16), "skinny matmul: no kernel for {:?}", x.dtype);
    let x = packed_rows(x);
    let weight = if weight.meta.strides()[1] == 1 || columns <= 1 { weight } else { into_contiguous(weight) };
    let client = x.client.clone();
    let output = empty_device_contiguous_dtype(client.clone(), x.device.clone(), Shape::new([rows, columns]), x.dtype);
    if rows == 0 || columns == 0 {
        return output;
    }
    let element = x.dtype.size();
    let offset = weight.handle.offset_start.unwrap_or(0) as usize / element;
    let weight_stride = if k > 1 { weight.meta.strides()[0] } else { columns };
    let most_vector = client.io_optimized_vector_sizes(element).max().unwrap_or(1);
    let multiprocessors = client.properties().hardware.num_streaming_multiprocessors;
    let cut = cut_for(rows, k, columns, weight_stride, offset, most_vector, multiprocessors, spans);
    let split = cut.spans > 1;
    let partial_dims = if split { [cut.spans, rows, columns] } else { [1, 1, 1] };
    let partial = empty_device_contiguous_dtype(client.clone(), x.device.clone(), Shape::new(partial_dims), DType::F32);
    let dtype = x.dtype.into();
    let cubes = CubeCount::Static(columns.div_ceil(cut.vector * LANES) as u32, cut.spans as u32, rows.div_ceil(cut.tile_rows) as u32);
    skinny_matmul_kernel::launch::<R>(
        &client,
        cubes,
        CubeDim::new_1d(UNITS),
        cut.vector,
        x.into_tensor_arg(),
        weight.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        cut.span as u32,
        (weight_stride / cut.vector) as u32,
        cut.tile_rows as u32,
        split,
        REVISION,
        dtype,
    );
    if split {
        sum_spans_kernel::launch::<R>(&client, grid((rows * columns).div_ceil(UNITS as usize)), CubeDim::new_1d(UNITS), partial.into_tensor_arg(), output.clone().into_tensor_arg(), cut.spans as u32, REVISION, dtype);
    }
    output
}

/// [`skinny_matmul_kernel`] in `dtype` as CubeCL defines it for compilation: vectors of `vector`,
/// tiles of `tile_rows`, split or not; and [`sum_spans_kernel`].
pub(crate) fn definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, vector: usize, tile_rows: usize, split: bool) -> KernelDefinition {
    let arg = crate::definitions::arg;
    skinny_matmul_kernel::SkinnyMatmulKernel::<R>::new(crate::definitions::settings(UNITS), client.clone(), arg(), arg(), arg(), arg(), (), (), vector, tile_rows as u32, split, REVISION, dtype).define()
}

/// [`sum_spans_kernel`] in `dtype` as CubeCL defines it for compilation.
pub(crate) fn sum_definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> KernelDefinition {
    let arg = crate::definitions::arg;
    sum_spans_kernel::SumSpansKernel::<R>::new(crate::definitions::settings(UNITS), client.clone(), arg(), arg(), (), REVISION, dtype).define()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 16-byte vectors where the columns, the stride and the offset allow them; tiles of the
    /// rows up to 8; spans that fill an H200's 132 multiprocessors, none where the runtime does
    /// not say how many it has.
    #[test]
    fn cuts_fill_the_multiprocessors() {
        // Qwen3-0.6B's down_proj at 64 rows: 4 × 8 cubes, 9 spans of 342 k.
        let cut = cut_for(64, 3072, 1024, 1024, 0, 8, Some(132), None);
        assert_eq!(cut, Cut { vector: 8, tile_rows: 8, spans: 9, span: 342 });
        // One row: 4 cubes, as many spans as k allows (48 of 64).
        let cut = cut_for(1, 3072, 1024, 1024, 0, 8, Some(132), None);
        assert_eq!((cut.tile_rows, cut.spans, cut.span), (1, 48, 64));
        assert_eq!(cut_for(3, 1024, 4096, 4096, 0, 8, None, None), Cut { vector: 8, tile_rows: 4, spans: 1, span: 1024 });
        // A view of up_proj's columns in a stacked gate_up_proj, and odd shapes.
        assert_eq!(cut_for(8, 1024, 3072, 6144, 3072, 8, None, None).vector, 8);
        assert_eq!(cut_for(8, 1024, 3072, 6144, 3074, 8, None, None).vector, 2);
        assert_eq!(cut_for(8, 1024, 3071, 3071, 0, 4, None, None).vector, 1);
        assert_eq!(cut_for(8, 10, 64, 64, 0, 4, None, Some(4)), Cut { vector: 4, tile_rows: 8, spans: 4, span: 3 });
        assert_eq!(cut_for(8, 10, 64, 64, 0, 4, None, Some(7)).spans, 5, "no empty span");
        for rows in [1, 2, 3, 5, 8, 9, 33, 64] {
            for k in [1, 7, 64, 1000, 3072] {
                for sm in [None, Some(1), Some(132)] {
                    let cut = cut_for(rows, k, 1024, 1024, 0, 8, sm, None);
                    assert!(cut.tile_rows <= TILE_ROWS && cut.tile_rows.is_power_of_two() && (cut.tile_rows >= rows || cut.tile_rows == TILE_ROWS), "{rows} {k}: {cut:?}");
                    assert!(cut.spans * cut.span >= k && (cut.spans - 1) * cut.span < k, "{rows} {k}: {cut:?}");
                }
            }
        }
    }
}

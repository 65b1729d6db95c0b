//! `Qwen3RMSNorm` as one CubeCL kernel (see [`model::device_kernels::RmsNormFn`]): one cube of
//! [`UNITS`] units a row; each unit sums the squares of its strided elements in f32, the cube
//! adds the partial sums in shared memory, and each unit writes its elements as
//! `weight · cast(x / sqrt(mean(x²) + eps))`. burn's ops take a reduction and two element-wise
//! kernels for the same (the fusion cannot join a reduction to the scaling after it without
//! autotune), and a decoding step runs four norms a layer.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

/// Units per cube (one cube a row).
pub const UNITS: u32 = 64;

/// Cubes along the grid's first axis at most (wgpu allows 65,535 a dimension): more rows take
/// the second axis too.
const GRID_X: usize = 32_768;

/// A hash of this file (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("rms_norm.rs"));

#[cube(launch)]
fn rms_norm_kernel<F: Float>(
    input: &Tensor<F>,
    weight: &Tensor<F>,
    output: &mut Tensor<F>,
    eps: f32,
    #[comptime] hidden: u32,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let n = hidden as usize;
    let mut partial = SharedMemory::<f32>::new(UNITS as usize);
    // Every unit of a cube takes the same branch, so the syncs inside are reached by all.
    if row < input.shape(0) {
        let base = row * n;
        let mut sum = 0.0f32;
        let mut i = unit;
        while i < n {
            let x = f32::cast_from(input[base + i]);
            sum += x * x;
            i += units;
        }
        partial[unit] = sum;
        sync_cube();
        if unit == 0 {
            let mut total = 0.0f32;
            for j in 0..units {
                total += partial[j];
            }
            partial[0] = total;
        }
        sync_cube();
        let scale = 1.0f32 / (partial[0] / f32::cast_from(hidden) + eps).sqrt();
        let mut i = unit;
        while i < n {
            let normed = F::cast_from(f32::cast_from(input[base + i]) * scale);
            output[base + i] = F::cast_from(f32::cast_from(weight[i]) * f32::cast_from(normed));
            i += units;
        }
    }
}

/// Launches the kernel on CubeCL runtime `R` for `input` `[rows, hidden]` and `weight`
/// `[hidden]` of one dtype.
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn rms_norm<R: CubeRuntime>(input: CubeTensor<R>, weight: CubeTensor<R>, eps: f64) -> CubeTensor<R> {
    let [rows, hidden] = input.shape().dims::<2>();
    assert_eq!(weight.shape().dims::<1>(), [hidden], "rms norm: a weight of the rows' width");
    assert_eq!(input.dtype, weight.dtype, "rms norm: input and weight of one dtype");
    assert!(matches!(input.dtype, DType::F32 | DType::F16 | DType::BF16), "rms norm: no kernel for {:?}", input.dtype);
    let [input, weight] = [input, weight].map(into_contiguous);
    let client = input.client.clone();
    let dtype = input.dtype.into();
    let output = empty_device_contiguous_dtype(client.clone(), input.device.clone(), Shape::new([rows, hidden]), input.dtype);
    if rows == 0 {
        return output;
    }
    let (x, y) = (rows.min(GRID_X), rows.div_ceil(GRID_X));
    rms_norm_kernel::launch::<R>(
        &client,
        CubeCount::Static(x as u32, y as u32, 1),
        CubeDim::new_1d(UNITS),
        input.into_tensor_arg(),
        weight.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        eps as f32,
        hidden as u32,
        REVISION,
        dtype,
    );
    output
}

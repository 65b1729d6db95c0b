//! SwiGLU's element-wise step, `silu(gate) · up`, as one CubeCL kernel (see
//! [`model::device_kernels::SiluMulFn`]): CubeCL's fusion joins burn's ops for it into one kernel
//! too, but not where a custom operation (the residual addition and norm before the MLP) stands
//! before the projections; it then ran as eight kernels a layer.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use crate::rms_norm::{cube_row, grid, packed_rows};

/// Units per cube (one element a unit).
const UNITS: u32 = 256;

/// A hash of this file (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("swiglu.rs"));

/// `silu(gate) · up` for each element of `output` (`[rows, width]`, packed), as HF computes it
/// in a dtype of 16 bits: `silu` in f32, rounded to `F`, then the product rounded to `F`. The
/// operands' rows lie `stride(0)` apart (columns of one stacked `gate_up_proj` output, or
/// packed).
#[cube(launch)]
fn silu_mul_kernel<F: Float>(gate: &Tensor<F>, up: &Tensor<F>, output: &mut Tensor<F>, #[comptime] _revision: u32, #[define(F)] _dtype: StorageType) {
    let i = cube_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if i < output.len() {
        let width = output.shape(1);
        let (row, column) = (i / width, i % width);
        let g = f32::cast_from(gate[row * gate.stride(0) + column]);
        let silu = F::cast_from(g / (1.0f32 + (-g).exp()));
        output[i] = silu * up[row * up.stride(0) + column];
    }
}

/// Launches [`silu_mul_kernel`] for `gate` and `up` of one shape and dtype, `[rows, width]`
/// each: packed, or ranges of columns of wider tensors (a stacked product's halves, read where
/// they lie).
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn silu_mul<R: CubeRuntime>(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
    let dims = gate.shape().dims::<2>();
    assert_eq!(up.shape().dims::<2>(), dims, "silu mul: gate and up of one shape");
    assert_eq!(gate.dtype, up.dtype, "silu mul: gate and up of one dtype");
    assert!(matches!(gate.dtype, DType::F32 | DType::F16 | DType::BF16), "silu mul: no kernel for {:?}", gate.dtype);
    let [gate, up] = [gate, up].map(packed_rows);
    let client = gate.client.clone();
    let dtype = gate.dtype.into();
    let output = empty_device_contiguous_dtype(client.clone(), gate.device.clone(), Shape::new(dims), gate.dtype);
    let cubes = (dims[0] * dims[1]).div_ceil(UNITS as usize);
    if cubes > 0 {
        silu_mul_kernel::launch::<R>(&client, grid(cubes), CubeDim::new_1d(UNITS), gate.into_tensor_arg(), up.into_tensor_arg(), output.clone().into_tensor_arg(), REVISION, dtype);
    }
    output
}

/// [`silu_mul_kernel`] in `dtype` as CubeCL defines it for compilation.
pub(crate) fn definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> KernelDefinition {
    let arg = crate::definitions::arg;
    silu_mul_kernel::SiluMulKernel::<R>::new(crate::definitions::settings(UNITS), client.clone(), arg(), arg(), arg(), REVISION, dtype).define()
}

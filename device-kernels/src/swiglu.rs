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
/// in a dtype of 16 bits: `silu` in f32, rounded to `F`, then the product rounded to `F`. A row
/// of `gate_up` holds the row's gate, then its up (`gate_up_proj`'s output); its rows lie
/// `stride(0)` apart.
#[cube(launch)]
fn silu_mul_kernel<F: Float>(gate_up: &Tensor<F>, output: &mut Tensor<F>, #[comptime] _revision: u32, #[define(F)] _dtype: StorageType) {
    let i = cube_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if i < output.len() {
        let width = output.shape(1);
        let gate = (i / width) * gate_up.stride(0) + i % width;
        let g = f32::cast_from(gate_up[gate]);
        let silu = F::cast_from(g / (1.0f32 + (-g).exp()));
        output[i] = silu * gate_up[gate + width];
    }
}

/// Launches [`silu_mul_kernel`] for `gate_up` `[rows, 2 · width]`: each row's gate, then its up
/// (packed, or a range of columns of a wider tensor, read where it lies). `[rows, width]`.
///
/// Panics on an odd width or a dtype without a kernel.
pub fn silu_mul<R: CubeRuntime>(gate_up: CubeTensor<R>) -> CubeTensor<R> {
    let [rows, both] = gate_up.shape().dims::<2>();
    assert!(both % 2 == 0, "silu mul: a gate and an up of one width, not {both} columns");
    assert!(matches!(gate_up.dtype, DType::F32 | DType::F16 | DType::BF16), "silu mul: no kernel for {:?}", gate_up.dtype);
    let gate_up = packed_rows(gate_up);
    let client = gate_up.client.clone();
    let dtype = gate_up.dtype.into();
    let output = empty_device_contiguous_dtype(client.clone(), gate_up.device.clone(), Shape::new([rows, both / 2]), gate_up.dtype);
    let cubes = (rows * both / 2).div_ceil(UNITS as usize);
    if cubes > 0 {
        silu_mul_kernel::launch::<R>(&client, grid(cubes), CubeDim::new_1d(UNITS), gate_up.into_tensor_arg(), output.clone().into_tensor_arg(), REVISION, dtype);
    }
    output
}

/// [`silu_mul_kernel`] in `dtype` as CubeCL defines it for compilation.
pub(crate) fn definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> KernelDefinition {
    let arg = crate::definitions::arg;
    silu_mul_kernel::SiluMulKernel::<R>::new(crate::definitions::settings(UNITS), client.clone(), arg(), arg(), REVISION, dtype).define()
}

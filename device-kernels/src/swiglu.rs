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
/// in a dtype of 16 bits: `silu` in f32, rounded to `F`, then the product rounded to `F`. A row's
/// gate starts its row of `gate`, its up `up_column` into its row of `up`, rows `stride(0)`
/// apart: two projections, or one stacked product (`gate_up_proj`'s) passed as both.
#[cube(launch)]
fn silu_mul_kernel<F: Float>(gate: &Tensor<F>, up: &Tensor<F>, output: &mut Tensor<F>, up_column: u32, #[comptime] _revision: u32, #[define(F)] _dtype: StorageType) {
    let i = cube_row() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if i < output.len() {
        let width = output.shape(1);
        let (row, column) = (i / width, i % width);
        let g = f32::cast_from(gate[row * gate.stride(0) + column]);
        let silu = F::cast_from(g / (1.0f32 + (-g).exp()));
        output[i] = silu * up[row * up.stride(0) + up_column as usize + column];
    }
}

/// SwiGLU's operands, a row each (rows may lie further apart than their width): the gate and
/// the up side by side in one stacked product `[rows, 2 · width]` (`gate_up_proj`'s), or one
/// each, `[rows, width]`.
#[derive(Debug)]
pub enum GateUp<F> {
    Stacked(F),
    Separate(F, F),
}

/// Launches `silu_mul_kernel`: `[rows, width]`. A stacked product is read where it lies, as
/// both operands.
///
/// Panics on operands whose shapes or dtypes disagree, or a dtype without a kernel.
pub fn silu_mul<R: CubeRuntime>(operands: GateUp<CubeTensor<R>>) -> CubeTensor<R> {
    let (gate, up, up_column) = match operands {
        GateUp::Stacked(gate_up) => {
            let both = gate_up.shape().dims::<2>()[1];
            assert!(both % 2 == 0, "silu mul: a gate and an up of one width, not {both} columns");
            let gate_up = packed_rows(gate_up);
            (gate_up.clone(), gate_up, both / 2)
        }
        GateUp::Separate(gate, up) => {
            assert_eq!(up.shape().dims::<2>(), gate.shape().dims::<2>(), "silu mul: gate and up of one shape");
            (packed_rows(gate), packed_rows(up), 0)
        }
    };
    let [rows, _] = gate.shape().dims::<2>();
    let dims = [rows, up.shape().dims::<2>()[1] - up_column];
    assert_eq!(gate.dtype, up.dtype, "silu mul: gate and up of one dtype");
    assert!(matches!(gate.dtype, DType::F32 | DType::F16 | DType::BF16), "silu mul: no kernel for {:?}", gate.dtype);
    let client = gate.client.clone();
    let dtype = gate.dtype.into();
    let output = empty_device_contiguous_dtype(client.clone(), gate.device.clone(), Shape::new(dims), gate.dtype);
    let cubes = (dims[0] * dims[1]).div_ceil(UNITS as usize);
    if cubes > 0 {
        silu_mul_kernel::launch::<R>(&client, grid(cubes), CubeDim::new_1d(UNITS), gate.into_tensor_arg(), up.into_tensor_arg(), output.clone().into_tensor_arg(), up_column as u32, REVISION, dtype);
    }
    output
}

/// [`silu_mul_kernel`] in `dtype` as CubeCL defines it for compilation.
pub(crate) fn definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> KernelDefinition {
    let arg = crate::definitions::arg;
    silu_mul_kernel::SiluMulKernel::<R>::new(crate::definitions::settings(UNITS), client.clone(), arg(), arg(), arg(), (), REVISION, dtype).define()
}

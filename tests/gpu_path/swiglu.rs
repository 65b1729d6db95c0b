//! SwiGLU's `silu(gate) · up` kernel of `prompt-r1-device-kernels` against burn's ops on wgpu
//! (fused and unfused), as the model finds it through the registry: one row and many (more
//! elements than the grid's first axis takes at 256 a cube), widths that are not a multiple of
//! the cube, gates from −12 to 12 (where `silu` saturates either way); f32 and f16; the gate
//! and the up one each, and side by side (`gate_up_proj`'s output), packed and as columns inside
//! a wider tensor, read where they lie.

use burn::tensor::activation::silu;
use burn::tensor::{DType, Distribution, Tensor};
use device_kernels::DeviceKernels;
use prompt_r1_model::device_kernels::GateUp;

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

/// Each element within `atol + rtol · |burn's ops|` of burn's ops, over each shape.
fn check<B: DeviceKernels>(dtype: DType, atol: f32, rtol: f32) {
    device_kernels::register::<B>();
    let kernel = prompt_r1_model::DeviceKernelChoice::default().silu_mul::<B>().expect("registered just now");
    let device = Default::default();
    for [rows, width] in [[1, 3072], [7, 130], [33, 1000], [9000, 1024]] {
        let gate = Tensor::<B, 2>::random([rows, width], Distribution::Uniform(-12.0, 12.0), &device).cast(dtype);
        let up = Tensor::<B, 2>::random([rows, width], Distribution::Normal(0.0, 2.0), &device).cast(dtype);
        let expected = silu(gate.clone()) * up.clone();
        let output = kernel(GateUp::Separate(gate.clone(), up.clone()));
        assert_eq!((output.dims(), output.dtype()), ([rows, width], dtype));
        // The same operands side by side, packed and as columns 128 to 128 + 2 · width of a
        // wider tensor (rows further apart than their width, starting 512 bytes into the buffer
        // in f32: a view, not a copy): the same arithmetic, so the same bits.
        let extra = || Tensor::<B, 2>::zeros([rows, 128], &device).cast(dtype);
        let wide = Tensor::cat(vec![extra(), gate.clone(), up.clone(), extra()], 1);
        for (layout, stacked) in [("stacked", Tensor::cat(vec![gate, up], 1)), ("a view", wide.narrow(1, 128, 2 * width))] {
            let differ = (kernel(GateUp::Stacked(stacked)).cast(DType::F32) - output.clone().cast(DType::F32)).abs().max();
            let differ: f32 = differ.into_scalar().to_string().parse().expect("a float");
            assert_eq!(differ, 0.0, "silu_mul, {rows} × {width}, {dtype:?}: {layout} gives other values than separate operands");
        }
        let expected = expected.cast(DType::F32);
        let error = (output.cast(DType::F32) - expected.clone()).abs();
        let scalar = |t: Tensor<B, 1>| -> f32 { t.into_scalar().to_string().parse().expect("a float") };
        let worst = scalar(error.clone().max());
        // The largest error as a fraction of its allowance: at most 1.
        let worst_share = scalar((error / (expected.abs() * rtol + atol)).max());
        println!("silu_mul on {}, {dtype:?}, {rows} × {width}: worst |Δ| {worst:.2e}, {worst_share:.2} of the allowance", std::any::type_name::<B>());
        assert!(worst_share <= 1.0, "silu_mul, {rows} × {width}, {dtype:?}: an error past {atol} + {rtol} · |expected| (|Δ| up to {worst})");
    }
}

/// f32: `silu` as `g / (1 + e^−g)` against burn's `g · sigmoid(g)`, a few roundings apart
/// (2⁻²⁴ relative each): 1e-6 relative, 1e-6 absolute near 0.
#[test]
fn the_swiglu_kernel_matches_burns_ops_in_f32() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F32, 1e-6, 1e-6);
    check::<Unfused>(DType::F32, 1e-6, 1e-6);
}

/// f16: the kernel rounds `silu` to f16 before the product, as HF does; burn's ops round
/// otherwise. Each side is within about two f16 roundings (2⁻¹¹ relative each) of the exact
/// product: 2⁻⁸ relative, 1e-3 absolute near 0.
#[test]
fn the_swiglu_kernel_matches_burns_ops_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F16, 1e-3, 1.0 / 256.0);
    check::<Unfused>(DType::F16, 1e-3, 1.0 / 256.0);
}

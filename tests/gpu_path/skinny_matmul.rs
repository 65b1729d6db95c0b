//! The skinny-matmul kernel of `prompt-r1-device-kernels` (a decoding step's projections) against
//! burn's matmul on wgpu, fused and unfused, as the model finds it through the registry and
//! with each cut of `k` forced: one row to 64 (a tile of 8 and partial tiles), widths that
//! are not a multiple of a cube's 32 vectors nor of 16 bytes (scalar loads), `k` not a multiple
//! of the cube's parts or its four loads in flight; weights packed, as a view of a stacked
//! weight's columns (rows further apart than their width, read where they lie) and as the
//! input's rows a view too; f32 and f16.

use burn::tensor::{DType, Distribution, Tensor};
use burn_wgpu::CubeTensor;
use device_kernels::skinny_matmul::skinny_matmul;
use device_kernels::DeviceKernels;
use prompt_r1_model::device_kernels::SKINNY_MATMUL_ROWS;

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

fn scalar<B: burn::tensor::backend::Backend>(t: Tensor<B, 1>) -> f32 {
    t.into_scalar().to_string().parse().expect("a float")
}

/// The worst `|kernel − reference|` as a share of `atol + rtol · Σ|x · w|` (the products' sum of
/// magnitudes: the rounding of a sum scales with it, not with the sum), at most 1.
fn check_close<B: burn::tensor::backend::Backend>(what: &str, got: Tensor<B, 2>, x: &Tensor<B, 2>, w: &Tensor<B, 2>, atol: f32, rtol: f32) {
    let (x, w) = (x.clone().cast(DType::F32), w.clone().cast(DType::F32));
    let expected = x.clone().matmul(w.clone());
    let magnitude = x.abs().matmul(w.abs());
    let error = (got.cast(DType::F32) - expected).abs();
    let worst = scalar(error.clone().max());
    let share = scalar((error / (magnitude * rtol + atol)).max());
    println!("{what}: worst |Δ| {worst:.2e}, {share:.2} of the allowance");
    assert!(share <= 1.0, "{what}: an error past {atol} + {rtol} · Σ|x·w| (|Δ| up to {worst})");
}

/// The registered kernel (as the model calls it, the backend's own cut of `k`) and the unfused
/// kernel with `k` cut into 1, 3 and 7 spans, each against the product in f32 of the same
/// operands.
fn check<B: DeviceKernels>(dtype: DType, atol: f32, rtol: f32) {
    device_kernels::register::<B>();
    let device = Default::default();
    for (rows, k, columns) in [(1, 64, 256), (3, 1000, 520), (8, 1024, 1536), (13, 77, 1000), (SKINNY_MATMUL_ROWS, 512, 300), (5, 96, 7)] {
        let kernel = prompt_r1_model::DeviceKernelChoice::default().skinny_matmul::<B>(rows).expect("registered just now");
        let x = Tensor::<B, 2>::random([rows, k], Distribution::Uniform(-1.0, 1.0), &device).cast(dtype);
        let w = Tensor::<B, 2>::random([k, columns], Distribution::Uniform(-0.1, 0.1), &device).cast(dtype);
        let name = std::any::type_name::<B>().rsplit("::").next().unwrap_or("backend").to_string();
        let what = format!("{name} {dtype:?}, {rows} x {k} x {columns}");
        let output = kernel(x.clone(), w.clone());
        assert_eq!((output.dims(), output.dtype()), ([rows, columns], dtype), "{what}");
        check_close(&format!("{what}, registered"), output, &x, &w, atol, rtol);
        // The weight as columns 24 to 24 + columns of a stacked weight (rows 48 elements
        // further apart than their width, 96 bytes into the buffer in f32), the input as
        // columns 8.. of a wider one.
        let side = |width| Tensor::<B, 2>::random([k, width], Distribution::Uniform(-0.1, 0.1), &device).cast(dtype);
        let stacked = Tensor::cat(vec![side(24), w.clone(), side(24)], 1).narrow(1, 24, columns);
        let wide_x = Tensor::cat(vec![Tensor::<B, 2>::zeros([rows, 8], &device).cast(dtype), x.clone()], 1).narrow(1, 8, k);
        check_close(&format!("{what}, views"), kernel(wide_x, stacked), &x, &w, atol, rtol);
    }
}

/// The unfused kernel with `k` cut into spans as given, whatever the device says (wgpu reports
/// no multiprocessors, so the registered kernel never splits there).
fn check_spans(dtype: DType, atol: f32, rtol: f32) {
    let device = Default::default();
    for (rows, k, columns) in [(1, 1000, 256), (9, 333, 520), (64, 2048, 1024)] {
        let x = Tensor::<Unfused, 2>::random([rows, k], Distribution::Uniform(-1.0, 1.0), &device).cast(dtype);
        let w = Tensor::<Unfused, 2>::random([k, columns], Distribution::Uniform(-0.1, 0.1), &device).cast(dtype);
        for spans in [1, 3, 7] {
            let primitive = |t: Tensor<Unfused, 2>| -> CubeTensor<burn_wgpu::WgpuRuntime> { t.into_primitive().tensor() };
            let output = Tensor::<Unfused, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(skinny_matmul(primitive(x.clone()), primitive(w.clone()), Some(spans))));
            check_close(&format!("unfused {dtype:?}, {rows} x {k} x {columns}, {spans} spans"), output, &x, &w, atol, rtol);
        }
    }
}

/// f32: both sides sum `k` products in f32, in different orders: 1e-5 of the sum of
/// magnitudes, 1e-6 absolute.
#[test]
fn the_skinny_matmul_kernel_matches_the_product_in_f32() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F32, 1e-6, 1e-5);
    check::<Unfused>(DType::F32, 1e-6, 1e-5);
    check_spans(DType::F32, 1e-6, 1e-5);
}

/// f16 operands: the kernel's f32 sums are rounded once to f16 (2⁻¹¹ of the result, at most
/// the sum of magnitudes), against the product of the same f16 values in f32: 2⁻¹⁰ of the sum
/// of magnitudes, 1e-4 absolute near 0.
#[test]
fn the_skinny_matmul_kernel_matches_the_product_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F16, 1e-4, 1.0 / 1024.0);
    check::<Unfused>(DType::F16, 1e-4, 1.0 / 1024.0);
    check_spans(DType::F16, 1e-4, 1.0 / 1024.0);
}

//! The RMS-norm kernel of `prompt-r1-device-kernels` against burn's ops on wgpu (fused and
//! unfused), as the model finds it through the registry: rows narrower and wider than the
//! kernel's 64 units and not a multiple of them (Qwen3's head_dim 128 for q_norm and k_norm, a
//! hidden size of 1,024), one row and many (more than the grid's first axis takes), values of several magnitudes per row; f32 and f16
//! (the dtype the GPU's bf16 takes the same code for: statistics in f32, the normalised value
//! rounded to the input's dtype before the weight, as HF does).

use burn::tensor::{DType, Distribution, Tensor};
use device_kernels::DeviceKernels;

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

/// `weight · cast(x / sqrt(mean(x²) + eps))` with burn's ops, the statistics in f32.
fn reference<B: burn::tensor::backend::Backend>(x: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let x32 = x.cast(DType::F32);
    let variance = x32.clone().square().mean_dim(1);
    let normed = (x32 * (variance + eps).sqrt().recip()).cast(dtype);
    weight.unsqueeze::<2>() * normed
}

/// The kernel against [`reference`] on `B`: the largest difference over each shape.
fn check<B: DeviceKernels>(dtype: DType, tolerance: f32) {
    device_kernels::register::<B>(common::kernel_passes());
    let kernel = prompt_r1_model::device_kernels::rms_norm::<B>().expect("registered just now");
    let device = Default::default();
    for (rows, hidden) in [(1, 128), (7, 24), (33, 130), (5, 1024), (300, 128), (40_000, 8)] {
        // Rows of different magnitudes: the norm must not depend on the scale.
        let scales: Vec<f32> = (0..rows).map(|r| 10f32.powi(r as i32 % 5 - 2)).collect();
        let scales = Tensor::<B, 1>::from_floats(scales.as_slice(), &device).reshape([rows, 1]);
        let x = (Tensor::<B, 2>::random([rows, hidden], Distribution::Normal(0.0, 1.0), &device) * scales).cast(dtype);
        let weight = Tensor::<B, 1>::random([hidden], Distribution::Uniform(0.5, 1.5), &device).cast(dtype);
        let expected = reference(x.clone(), weight.clone(), 1e-6).cast(DType::F32);
        let output = kernel(x, weight, 1e-6);
        assert_eq!((output.dims(), output.dtype()), ([rows, hidden], dtype));
        let worst: f32 = (output.cast(DType::F32) - expected).abs().max().into_scalar().to_string().parse().expect("a float");
        println!("{} {dtype:?}, {rows} rows of {hidden}: worst |Δ| {worst:.2e}", std::any::type_name::<B>());
        assert!(worst <= tolerance, "{rows} rows of {hidden}, {dtype:?}: |Δ| {worst} > {tolerance}");
    }
}

/// f32: both take the mean of squares in f32 in another order (outputs of order 1: 1e-5).
#[test]
fn the_rms_norm_kernel_matches_burns_ops_in_f32() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F32, 1e-5);
    check::<Unfused>(DType::F32, 1e-5);
}

/// f16: the normalised value rounds to f16 on both sides, and a sum in another order can move
/// it by one f16 step (2⁻¹⁰ relative, outputs up to about 5: 1e-2).
#[test]
fn the_rms_norm_kernel_matches_burns_ops_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F16, 1e-2);
}

//! The RMS-norm kernels of `prompt-r1-device-kernels` against burn's ops on wgpu (fused and
//! unfused), as the model finds them through the registry: the norm alone, with the residual
//! addition before it, and with RoPE after it. Rows narrower and wider than the kernels' 64
//! units and not a multiple of them (Qwen3's head_dim 128 for q_norm and k_norm, a hidden size
//! of 1,024), one row and many (more than the grid's first axis takes), values of several
//! magnitudes per row; f32 and f16 (the dtype the GPU's bf16 takes the same code for:
//! statistics in f32, the normalised value rounded to the input's dtype before the weight, as
//! HF does).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};
use device_kernels::DeviceKernels;
use prompt_r1_model::device_kernels::NormKernels;

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

const EPS: f64 = 1e-6;

/// `weight · cast(x / sqrt(mean(x²) + eps))` with burn's ops, the statistics in f32.
fn reference<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 1>) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let x32 = x.cast(DType::F32);
    let variance = x32.clone().square().mean_dim(1);
    let normed = (x32 * (variance + EPS).sqrt().recip()).cast(dtype);
    weight.unsqueeze::<2>() * normed
}

/// HF's RoPE with burn's ops on `x` `[tokens, heads, d]`, tables `[tokens, d]` broadcast over
/// the heads: `x · cos + cat(x2, x1) · signed_sin`.
fn rotated<B: Backend>(x: Tensor<B, 3>, cos: Tensor<B, 2>, signed_sin: Tensor<B, 2>) -> Tensor<B, 3> {
    let [tokens, heads, d] = x.dims();
    let half = d / 2;
    let swapped = Tensor::cat(vec![x.clone().slice([0..tokens, 0..heads, half..d]), x.clone().slice([0..tokens, 0..heads, 0..half])], 2);
    x * cos.unsqueeze_dim::<3>(1) + swapped * signed_sin.unsqueeze_dim::<3>(1)
}

/// `[rows, width]` normal values whose rows differ in scale by up to 10⁴ (the norm must not
/// depend on it), in `dtype`.
fn scaled_rows<B: Backend>(rows: usize, width: usize, dtype: DType, device: &B::Device) -> Tensor<B, 2> {
    let scales: Vec<f32> = (0..rows).map(|r| 10f32.powi(r as i32 % 5 - 2)).collect();
    let scales = Tensor::<B, 1>::from_floats(scales.as_slice(), device).reshape([rows, 1]);
    (Tensor::<B, 2>::random([rows, width], Distribution::Normal(0.0, 1.0), device) * scales).cast(dtype)
}

fn uniform<B: Backend, const D: usize>(shape: [usize; D], low: f64, high: f64, dtype: DType, device: &B::Device) -> Tensor<B, D> {
    Tensor::<B, D>::random(shape, Distribution::Uniform(low, high), device).cast(dtype)
}

/// The largest `|output − expected|`, after checking the output's shape and dtype.
fn worst<B: Backend, const D: usize>(output: Tensor<B, D>, expected: Tensor<B, D>, dtype: DType) -> f32 {
    assert_eq!((output.dims(), output.dtype()), (expected.dims(), dtype));
    (output.cast(DType::F32) - expected.cast(DType::F32)).abs().max().into_scalar().to_string().parse().expect("a float")
}

fn kernels<B: DeviceKernels>() -> NormKernels<B> {
    device_kernels::register::<B>(common::kernel_passes());
    prompt_r1_model::device_kernels::norms::<B>().expect("registered just now")
}

fn report<B: Backend>(kernel: &str, dtype: DType, shape: &str, worst: f32, tolerance: f32) {
    println!("{kernel} on {}, {dtype:?}, {shape}: worst |Δ| {worst:.2e}", std::any::type_name::<B>());
    assert!(worst <= tolerance, "{kernel}, {shape}, {dtype:?}: |Δ| {worst} > {tolerance}");
}

/// Each kernel against burn's ops on `B`: the largest difference over each shape, within
/// `tolerance` for the norms and `rope_tolerance` for the norm with RoPE.
fn check<B: DeviceKernels>(dtype: DType, tolerance: f32, rope_tolerance: f32) {
    let kernels = kernels::<B>();
    let device = Default::default();
    for (rows, hidden) in [(1, 128), (7, 24), (33, 130), (5, 1024), (300, 128), (40_000, 8)] {
        let shape = format!("{rows} rows of {hidden}");
        let x = scaled_rows::<B>(rows, hidden, dtype, &device);
        let weight = uniform::<B, 1>([hidden], 0.5, 1.5, dtype, &device);
        let output = (kernels.rms_norm)(x.clone(), weight.clone(), EPS);
        report::<B>("rms_norm", dtype, &shape, worst(output, reference(x.clone(), weight.clone()), dtype), tolerance);

        // The residual addition: the sum is burn's to the last bit (one rounding either way),
        // the norm is of the rounded sum.
        let delta = scaled_rows::<B>(rows, hidden, dtype, &device);
        let (sum, normed) = (kernels.add_rms_norm)(x.clone(), delta.clone(), weight.clone(), EPS);
        let expected_sum = x + delta;
        report::<B>("add_rms_norm's sum", dtype, &shape, worst(sum, expected_sum.clone(), dtype), 0.0);
        report::<B>("add_rms_norm", dtype, &shape, worst(normed, reference(expected_sum, weight), dtype), tolerance);
    }
    // RoPE after the norm of each head: tokens' heads side by side, tables one row a token.
    for (tokens, heads, head_dim) in [(1, 16, 128), (3, 8, 128), (5, 2, 64), (7, 3, 24), (2, 5, 130), (40_000, 1, 8)] {
        let shape = format!("{tokens} tokens of {heads} heads of {head_dim}");
        let rows = tokens * heads;
        let x = scaled_rows::<B>(rows, head_dim, dtype, &device);
        let weight = uniform::<B, 1>([head_dim], 0.5, 1.5, dtype, &device);
        let cos = uniform::<B, 2>([tokens, head_dim], -1.0, 1.0, dtype, &device);
        let signed_sin = uniform::<B, 2>([tokens, head_dim], -1.0, 1.0, dtype, &device);
        let output = (kernels.rms_norm_rope)(x.clone(), weight.clone(), cos.clone(), signed_sin.clone(), EPS);
        let normed = reference(x, weight).reshape([tokens, heads, head_dim]);
        let expected = rotated(normed, cos, signed_sin).reshape([rows, head_dim]);
        report::<B>("rms_norm_rope", dtype, &shape, worst(output, expected, dtype), rope_tolerance);
    }
}

/// f32: both take the mean of squares in f32 in another order (outputs of order 1, RoPE's up to
/// about 10: 1e-5).
#[test]
fn the_rms_norm_kernels_match_burns_ops_in_f32() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F32, 1e-5, 1e-5);
    check::<Unfused>(DType::F32, 1e-5, 1e-5);
}

/// f16: the normalised value rounds to f16 on both sides, and a sum in another order can move
/// it by one f16 step (2⁻¹⁰ relative, norms up to about 7: 1e-2). RoPE's outputs reach about
/// 10, where a step is 2⁻⁷, and its two products and their sum each round to f16: a step of
/// the norm carried through and up to two more, 2e-2.
#[test]
fn the_rms_norm_kernels_match_burns_ops_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F16, 1e-2, 2e-2);
    check::<Unfused>(DType::F16, 1e-2, 2e-2);
}

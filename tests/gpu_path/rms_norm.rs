//! The RMS-norm kernels of `prompt-r1-device-kernels` against burn's ops on wgpu (fused and
//! unfused), as the model finds them through the registry: the norm alone, with the residual
//! addition before it, and as `q_norm` and `k_norm` with RoPE after them and the keys and
//! values written to a KV cache's pools. Rows narrower and wider than the kernels' 64
//! units and not a multiple of them (Qwen3's head_dim 128 for q_norm and k_norm, a hidden size
//! of 1,024), one row and many (more than the grid's first axis takes), values of several
//! magnitudes per row; f32 and f16 (the dtype the GPU's bf16 takes the same code for:
//! statistics in f32, the normalised value rounded to the input's dtype before the weight, as
//! HF does).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, IndexingUpdateOp, Int, Tensor, TensorData};
use device_kernels::DeviceKernels;
use prompt_r1_model::device_kernels::{NormKernels, QkNormRopeWrite, Qkv};

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
    device_kernels::register::<B>();
    prompt_r1_model::DeviceKernelChoice::default().norms::<B>().expect("registered just now")
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
    for (tokens, heads, kv_heads, head_dim) in [(1, 16, 8, 128), (3, 8, 2, 128), (5, 2, 1, 64), (7, 3, 3, 24), (2, 4, 2, 130), (20_000, 1, 1, 8)] {
        check_qk_norm_rope_write::<B>(kernels, [tokens, heads, kv_heads, head_dim], dtype, rope_tolerance);
    }
}

/// `q_norm` and `k_norm` with RoPE and the write to the pools against burn's ops (the norm,
/// RoPE, `scatter_nd`) for `tokens` tokens of `heads` query and `kv_heads` key heads of
/// `head_dim`: the rotated queries and keys within `tolerance`, the values and every slot not
/// written unchanged. Two passes: tokens at distinct slots into pools held nowhere else (written
/// in place: a copy of them queued before the kernel must still read them as they were), then
/// padding (every other token at the scratch slot 0, whose contents are not compared) written
/// into pools still held elsewhere, which must be left as they were (the kernel writes a copy).
/// Each pass three times, the projections one each, side by side (`qkv_proj`'s output), and side
/// by side as columns inside a wider tensor (rows further apart than their width, starting
/// into its buffer), which must give the same bits.
fn check_qk_norm_rope_write<B: DeviceKernels>(kernels: NormKernels<B>, [tokens, heads, kv_heads, head_dim]: [usize; 4], dtype: DType, tolerance: f32) {
    let device = Default::default();
    let shape = format!("{tokens} tokens of {heads} and {kv_heads} heads of {head_dim}");
    let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
    let query = scaled_rows::<B>(tokens * heads, head_dim, dtype, &device).reshape([tokens, q_width]);
    let key = scaled_rows::<B>(tokens * kv_heads, head_dim, dtype, &device).reshape([tokens, kv_width]);
    let value = uniform::<B, 2>([tokens, kv_width], -2.0, 2.0, dtype, &device);
    let qkv = Tensor::cat(vec![query.clone(), key.clone(), value.clone()], 1);
    let extra = || Tensor::<B, 2>::zeros([tokens, 128], &device).cast(dtype);
    let wide = Tensor::cat(vec![extra(), qkv.clone(), extra()], 1);
    let q_weight = uniform::<B, 1>([head_dim], 0.5, 1.5, dtype, &device);
    let k_weight = uniform::<B, 1>([head_dim], 0.5, 1.5, dtype, &device);
    let cos = uniform::<B, 2>([tokens, head_dim], -1.0, 1.0, dtype, &device);
    let signed_sin = uniform::<B, 2>([tokens, head_dim], -1.0, 1.0, dtype, &device);
    let pool_slots = 2 * tokens + 3;
    // Distinct slots in an order unlike the tokens', never the scratch slot; then with padding.
    let distinct: Vec<usize> = (0..tokens).map(|t| 1 + (t * 7919) % (2 * tokens + 1)).collect();
    let padded: Vec<usize> = distinct.iter().enumerate().map(|(t, &s)| if t % 2 == 1 { 0 } else { s }).collect();
    for (slots, held) in [(distinct, false), (padded, true)] {
        let keys = uniform::<B, 3>([kv_heads, pool_slots, head_dim], -3.0, 3.0, dtype, &device);
        let values = uniform::<B, 3>([kv_heads, pool_slots, head_dim], -3.0, 3.0, dtype, &device);
        let index: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
        let pairs: Vec<i64> = slots.iter().flat_map(|&s| (0..kv_heads).flat_map(move |h| [h as i64, s as i64])).collect();
        let pairs = Tensor::<B, 2, Int>::from_data(TensorData::new(pairs, [tokens * kv_heads, 2]), &device);
        let rope = |x: Tensor<B, 2>, weight: Tensor<B, 1>, n: usize| {
            let normed = reference(x.reshape([tokens * n, head_dim]), weight).reshape([tokens, n, head_dim]);
            rotated(normed, cos.clone(), signed_sin.clone()).reshape([tokens, n * head_dim])
        };
        let expected_query = rope(query.clone(), q_weight.clone(), heads);
        let pool_rows = |x: Tensor<B, 2>| x.reshape([tokens * kv_heads, head_dim]);
        let expected_keys = keys.clone().scatter_nd(pairs.clone(), pool_rows(rope(key.clone(), k_weight.clone(), kv_heads)), IndexingUpdateOp::Assign);
        let expected_values = values.clone().scatter_nd(pairs, pool_rows(value.clone()), IndexingUpdateOp::Assign);
        let mut separate_results = None;
        for layout in ["separate", "stacked", "a view"] {
            let qkv = match layout {
                "separate" => Qkv::Separate([query.clone(), key.clone(), value.clone()]),
                "stacked" => Qkv::Stacked(qkv.clone()),
                _ => Qkv::Stacked(wide.clone().narrow(1, 128, q_width + 2 * kv_width)),
            };
            // Pools still held elsewhere keep their contents (host copies to compare with
            // after). Unheld, the pools are written in place, after what reads them before the
            // kernel (a copy queued here) has read them.
            let (keys, values) = (keys.clone() * 1.0, values.clone() * 1.0);
            let before = [keys.to_data(), values.to_data()];
            let readers = if held { [keys.clone(), values.clone()] } else { [keys.clone() * 1.0, values.clone() * 1.0] };
            let pass = QkNormRopeWrite {
                qkv,
                heads,
                q_weight: q_weight.clone(),
                k_weight: k_weight.clone(),
                cos: cos.clone(),
                signed_sin: signed_sin.clone(),
                slots: Tensor::from_data(TensorData::new(index.clone(), [tokens]), &device),
                keys,
                values,
                eps: EPS,
            };
            let (rotated_query, written_keys, written_values) = (kernels.qk_norm_rope_write)(pass);
            let but_scratch = |pool: Tensor<B, 3>| pool.slice([0..kv_heads, 1..pool_slots, 0..head_dim]);
            let case = format!("{shape}, {layout}{}", if held { ", padded, pools held" } else { "" });
            report::<B>("qk_norm_rope_write's query", dtype, &case, worst(rotated_query.clone(), expected_query.clone(), dtype), tolerance);
            report::<B>("qk_norm_rope_write's keys", dtype, &case, worst(but_scratch(written_keys.clone()), but_scratch(expected_keys.clone()), dtype), tolerance);
            report::<B>("qk_norm_rope_write's values", dtype, &case, worst(but_scratch(written_values.clone()), but_scratch(expected_values.clone()), dtype), 0.0);
            let reader = if held { "held" } else { "read before the kernel" };
            for ((name, pool), before) in ["keys", "values"].into_iter().zip(readers).zip(before) {
                let before = Tensor::<B, 3>::from_data(before, &device);
                report::<B>(&format!("qk_norm_rope_write's {name} {reader}"), dtype, &case, worst(pool, before, dtype), 0.0);
            }
            match &separate_results {
                None => separate_results = Some((rotated_query, written_keys, written_values)),
                Some((query, keys, values)) => {
                    report::<B>("qk_norm_rope_write's query, against separate", dtype, &case, worst(rotated_query, query.clone(), dtype), 0.0);
                    report::<B>("qk_norm_rope_write's keys, against separate", dtype, &case, worst(but_scratch(written_keys), but_scratch(keys.clone()), dtype), 0.0);
                    report::<B>("qk_norm_rope_write's values, against separate", dtype, &case, worst(but_scratch(written_values), but_scratch(values.clone()), dtype), 0.0);
                }
            }
        }
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

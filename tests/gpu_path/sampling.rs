//! The token-choice kernel of `prompt-r1-device-kernels` on wgpu (fused and unfused), through
//! `device_sampling::choose_tokens` as the decoder calls it, and burn's ops on the same backend
//! (`choose_tokens_with_ops`: the path with `--device-kernels off`), against the host's sampler
//! (`generation::choose_token`, sums in f64) on the same draws: the same tokens, except where a
//! draw lies within f32 rounding of the boundary between two tokens, and log-probabilities
//! within 1e-4. Vocabularies of 5 tokens (fewer than the cube's units: empty chunks), 1,000,
//! and Qwen3's 151,936; temperatures 0 (greedy), 0.7, 1 and 1.6 in one batch;
//! f32 and f16 logits.

use burn::tensor::{DType, Tensor, TensorData};
use device_kernels::DeviceKernels;
use prompt_r1_model::device_sampling::{choose_tokens, choose_tokens_with_ops};
use prompt_r1_model::generation::choose_token;
use prompt_r1_model::Sampling;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

/// Where the host's cumulative probability (in f64) reaches token `t`'s start.
fn cdf_before(row: &[f32], temperature: f32, t: usize) -> f64 {
    let z: Vec<f64> = row.iter().map(|&x| f64::from(x) / f64::from(temperature)).collect();
    let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = z.iter().map(|&x| (x - max).exp()).collect();
    w[..t].iter().sum::<f64>() / w.iter().sum::<f64>()
}

/// How far (in probability) a draw may lie from the boundary between two tokens where an f32
/// path picks the other one: the f32 rounding of a running sum over `vocab` weights, at most
/// half an ulp a term (1e-5 at least).
fn boundary_tolerance(vocab: usize) -> f64 {
    1e-5f64.max(vocab as f64 * f64::from(f32::EPSILON) / 2.0)
}

/// Rows of `vocab` seeded logits (one row with a dominant token, one with a tie for the
/// maximum) chosen on `B` in `dtype` by the kernel and by burn's ops, and on the host; returns
/// how many sampled tokens of each path differ at a boundary (panicking on any other
/// difference).
fn boundary_differences<B: DeviceKernels>(vocab: usize, dtype: DType) -> [usize; 2] {
    device_kernels::register::<B>();
    let kernels = prompt_r1_model::DeviceKernelChoice::default();
    assert!(kernels.token_choice::<B>().is_some(), "registered just now");
    let rows = 32;
    let temperatures: Vec<f32> = (0..rows).map(|r| [0.0, 0.7, 1.0, 1.6][r % 4]).collect();
    let mut rng = StdRng::seed_from_u64(vocab as u64);
    let mut values: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-6.0..6.0f32)).collect();
    values[3] = 40.0;
    // Row 4 (greedy): the maximum twice; the first is the argmax.
    values[4 * vocab + vocab / 3] = 50.0;
    values[4 * vocab + vocab - 1] = 50.0;
    let device = Default::default();
    let logits = Tensor::<B, 2>::from_data(TensorData::new(values, [rows, vocab]), &device).cast(dtype);
    // The host sees the logits as the kernel reads them (rounded to `dtype`).
    let seen: Vec<f32> = logits.clone().cast(DType::F32).into_data().to_vec().expect("f32 logits");
    let mut uniforms = Vec::new();
    let host: Vec<(u32, f32)> = (0..rows)
        .map(|r| {
            let seed = r as u64 * 7919 + vocab as u64;
            uniforms.push(StdRng::seed_from_u64(seed).random::<f64>());
            let config = Sampling { temperature: temperatures[r], ..Sampling::default() };
            choose_token(&seen[r * vocab..(r + 1) * vocab], &config, &mut StdRng::seed_from_u64(seed))
        })
        .collect();
    let mut differences = [0; 2];
    // The kernel, and burn's ops on the same backend.
    let by_kernel = choose_tokens(kernels, logits.clone(), &temperatures, &uniforms).expect("tokens");
    let by_ops = choose_tokens_with_ops(logits, &temperatures, &uniforms).expect("tokens");
    for (p, (path, chosen)) in [("kernel", by_kernel), ("burn's ops", by_ops)].into_iter().enumerate() {
        for (r, (h, d)) in host.iter().zip(&chosen).enumerate() {
            let row = &seen[r * vocab..(r + 1) * vocab];
            let t = temperatures[r];
            if h.0 != d.0 {
                let later = h.0.max(d.0) as usize;
                let gap = (cdf_before(row, t, later) - uniforms[r]).abs();
                println!("vocab {vocab}, {path}, T {t}, row {r}: token {} where the host took {}, the draw {gap:.2e} from the boundary", d.0, h.0);
                assert!(t > 0.0 && gap < boundary_tolerance(vocab), "vocab {vocab}, {dtype:?}, T {t}, row {r}: host {h:?}, {path} {d:?}");
                differences[p] += 1;
                continue;
            }
            assert!((h.1 - d.1).abs() < 1e-4, "vocab {vocab}, {dtype:?}, T {t}, row {r}: log-prob {} vs {path} {}", h.1, d.1);
        }
        assert_eq!(chosen[4].0 as usize, vocab / 3, "{path}: the first maximum is the greedy token");
    }
    println!("{} {dtype:?}, vocab {vocab}: {differences:?} of {rows} rows differ at a boundary (kernel, burn's ops)", std::any::type_name::<B>());
    differences
}

/// The kernel chooses what the host chooses (ties and boundaries aside).
#[test]
fn the_token_choice_kernel_matches_the_host_sampler() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    let mut kernel = 0;
    for (vocab, dtype) in [(5, DType::F32), (1000, DType::F32), (5_003, DType::F32), (151_936, DType::F32), (1000, DType::F16), (151_936, DType::F16)] {
        let fused = boundary_differences::<Fused>(vocab, dtype);
        kernel += fused[0];
        if dtype == DType::F32 {
            kernel += boundary_differences::<Unfused>(vocab, dtype)[0];
        }
        // burn's ops sum a flat row of 151,936 tokens in f32 with a cumulative sum: they part
        // from the host on about a quarter of such rows, each time within the rounding above.
        if vocab <= 1000 {
            assert!(fused[1] <= 1, "burn's ops: {} of 32 rows differ at a boundary", fused[1]);
        }
    }
    assert!(kernel <= 2, "the kernel: {kernel} of 320 choices differ at a boundary");
}

/// Logits that start inside their buffer (rows sliced off a larger batch) give the kernel the
/// tokens that the same values in a buffer of their own give it.
#[test]
fn the_token_choice_kernel_reads_a_slice_of_rows() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    device_kernels::register::<Fused>();
    let kernels = prompt_r1_model::DeviceKernelChoice::default();
    let (rows, vocab) = (6, 20_000);
    let mut rng = StdRng::seed_from_u64(5);
    let values: Vec<f32> = (0..(rows + 1) * vocab).map(|_| rng.random_range(-4.0..4.0f32)).collect();
    let device = Default::default();
    let whole = Tensor::<Fused, 2>::from_data(TensorData::new(values.clone(), [rows + 1, vocab]), &device);
    let alone = Tensor::<Fused, 2>::from_data(TensorData::new(values[vocab..].to_vec(), [rows, vocab]), &device);
    let temperatures = [0.0, 1.0, 0.7, 1.0, 0.0, 1.3];
    let uniforms = [0.1, 0.5, 0.9, 0.999, 0.3, 0.0];
    let sliced = choose_tokens(kernels, whole.slice([1..rows + 1, 0..vocab]), &temperatures, &uniforms).expect("tokens");
    let fresh = choose_tokens(kernels, alone, &temperatures, &uniforms).expect("tokens");
    assert_eq!(sliced, fresh);
}

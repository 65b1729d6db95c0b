// The attention cases: the memory-efficient attention against HF's eager formula, outputs and
// the gradients of q, k and v, for multi-head and grouped-query attention (groups 1, 2, 4), a
// prefill (as many queries as keys) and a pass after cached keys (fewer queries), left padding
// with rows whose keys are all masked, lengths that are not a multiple of the block, and bf16
// operands where the backend holds bf16. Included by `tests/integration/attention.rs` (burn-flex)
// and by the workspace's `tests/gpu_path/attention.rs` (burn's wgpu backend) in modules that
// define the inner backend `Inner` and bring `common` (this folder's `mod.rs`) into scope.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
use prompt_r1_model::qwen3::attention::eager::{eager_attention_forward, grouped_bias};
use prompt_r1_model::qwen3::attention::memory_efficient::Operands;
use prompt_r1_model::qwen3::attention::memory_efficient_attention;
use prompt_r1_model::qwen3::{register_autodiff_attention, AttentionMask};

type B = Autodiff<Inner>;

/// One case: sizes, the keys cached before the queries, left padding per row, the block size.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    queries: usize,
    past: usize,
    head_dim: usize,
    /// Padded keys at the start of row 1 (row 0 has none).
    left_pad: usize,
    block: usize,
}

impl Case {
    fn keys(&self) -> usize {
        self.past + self.queries
    }
}

/// Multi-head and groups of 1, 2 and 4; prefills and cached passes; left padding; lengths that
/// are and are not multiples of the block; a block larger than the pass.
fn cases() -> Vec<Case> {
    let base = Case { batch: 2, heads: 4, kv_heads: 4, queries: 13, past: 0, head_dim: 8, left_pad: 0, block: 4 };
    vec![
        base,
        Case { kv_heads: 2, ..base },
        Case { kv_heads: 1, ..base },
        Case { kv_heads: 2, left_pad: 5, ..base },
        Case { kv_heads: 1, queries: 16, left_pad: 3, ..base },
        Case { kv_heads: 2, queries: 3, past: 9, ..base },
        Case { kv_heads: 4, queries: 1, past: 20, left_pad: 6, ..base },
        Case { kv_heads: 2, queries: 5, past: 6, left_pad: 2, block: 8, ..base },
        Case { kv_heads: 2, queries: 9, block: 64, ..base },
    ]
}

/// The key mask `[b, k]`: row 1 starts with `left_pad` padded keys; `None` without padding.
fn key_mask(case: Case) -> Option<Tensor<B, 2, Int>> {
    let device = &Default::default();
    (case.left_pad > 0).then(|| {
        let k = case.keys();
        let values: Vec<i64> = (0..case.batch * k)
            .map(|i| i64::from(!(i / k == 1 && i % k < case.left_pad)))
            .collect();
        Tensor::from_data(TensorData::new(values, [case.batch, k]), device)
    })
}

/// Weights `[b, heads, q, d]` of the test loss `Σ out ∘ w`: random on query rows that see a real
/// key, zero on rows whose every key is padding (their output is defined only as finite).
fn loss_weights(case: Case) -> Tensor<B, 4> {
    let device = &Default::default();
    let [b, h, q, d] = [case.batch, case.heads, case.queries, case.head_dim];
    let w = Tensor::<B, 4>::random([b, h, q, d], Distribution::Uniform(-1.0, 1.0), device);
    let live: Vec<f32> = (0..b * q)
        .map(|i| {
            let (row, query) = (i / q, i % q);
            let position = case.past + query;
            f32::from(!(row == 1 && position < case.left_pad))
        })
        .collect();
    w * Tensor::<B, 2>::from_data(TensorData::new(live, [b, q]), device).reshape([b, 1, q, 1])
}

struct Outcome {
    output: Vec<f32>,
    grads: [Vec<f32>; 3],
}

/// The output and the q, k, v gradients of the loss under `implementation` ("eager" or
/// "memory-efficient") for operands of `dtype`.
fn run(case: Case, memory_efficient: bool, dtype: DType, operands: &[Tensor<Inner, 4>; 3], weights: &Tensor<B, 4>) -> Outcome {
    let device = Default::default();
    let [q, k, v] = operands.clone().map(|t| Tensor::<B, 4>::from_inner(t.cast(dtype)).require_grad());
    let mask = AttentionMask::new(key_mask(case).as_ref(), case.batch, case.past, case.queries, &device);
    let scale = 1.0 / (case.head_dim as f32).sqrt();
    let output = if memory_efficient {
        let x = Operands { query: q.clone(), key: k.clone(), value: v.clone() };
        memory_efficient_attention(x, &mask, case.block, scale, device_kernel_choice())
    } else {
        let bias = grouped_bias(&mask.bias(dtype), case.heads, case.kv_heads);
        eager_attention_forward(q.clone(), k.clone(), v.clone(), &bias, scale as f64)
    };
    let loss = (output.clone().cast(DType::F32) * weights.clone()).sum();
    let grads = loss.backward();
    let host = |t: Tensor<Inner, 4>| t.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
    Outcome {
        output: host(output.inner()),
        grads: [&q, &k, &v].map(|t| host(t.grad(&grads).expect("a gradient"))),
    }
}

/// `|got − want| <= atol + rtol · |want|` everywhere, naming the first element that is not.
fn assert_close(got: &[f32], want: &[f32], rtol: f32, atol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g}");
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
}

/// The output and the gradients of each case, in `dtype`, at the given tolerances (the outputs
/// compared on rows that see a real key, all rows finite).
fn compare(dtype: DType, (out_rtol, grad_rtol, atol): (f32, f32, f32)) {
    register_autodiff_attention::<B>();
    let device = Default::default();
    for case in cases() {
        let [b, h, kv, q, k, d] = [case.batch, case.heads, case.kv_heads, case.queries, case.keys(), case.head_dim];
        let normal = Distribution::Normal(0.0, 1.0);
        let operands = [
            Tensor::<Inner, 4>::random([b, h, q, d], normal, &device),
            Tensor::<Inner, 4>::random([b, kv, k, d], normal, &device),
            Tensor::<Inner, 4>::random([b, kv, k, d], normal, &device),
        ];
        let weights = loss_weights(case);
        let eager = run(case, false, dtype, &operands, &weights);
        let blocks = run(case, true, dtype, &operands, &weights);
        let live: Vec<f32> = weights.clone().inner().abs().into_data().to_vec().unwrap();
        let keep = |v: &[f32]| -> Vec<f32> { v.iter().zip(&live).filter(|(_, w)| **w > 0.0).map(|(x, _)| *x).collect() };
        assert!(blocks.output.iter().all(|x| x.is_finite()), "{case:?}: a non-finite output");
        assert_close(&keep(&blocks.output), &keep(&eager.output), out_rtol, atol, &format!("{case:?} output"));
        for (name, (got, want)) in ["dq", "dk", "dv"].iter().zip(blocks.grads.iter().zip(&eager.grads)) {
            assert_close(got, want, grad_rtol, atol, &format!("{case:?} {name}"));
        }
    }
}

#[test]
fn memory_efficient_attention_matches_eager_in_f32() {
    if !backend_ready::<Inner>() {
        return;
    }
    compare(DType::F32, (1e-5, 1e-4, 1e-5));
}

/// bf16 operands: the scores and the products with V in bf16 (as the eager formula computes
/// them), so the two differ by bf16 roundings.
#[test]
fn memory_efficient_attention_matches_eager_in_bf16() {
    if !backend_ready::<Inner>() {
        return;
    }
    if !Inner::supports_dtype(&Default::default(), DType::BF16) {
        eprintln!("skipped: this backend holds no bf16");
        return;
    }
    compare(DType::BF16, (3e-2, 5e-2, 3e-2));
}

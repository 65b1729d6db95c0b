//! The attention of passes without a KV cache through `prompt-r1-device-kernels`
//! (`paged_attention::fresh_attention`: scoring's and a training step's forward where a GPU
//! backend lends it), run on wgpu (fused and unfused), against the memory-efficient forward in
//! burn's ops on the CPU (`memory_efficient::forward`, in f32): the output and each query's
//! log-sum-exp, from which the backward recomputes the probabilities. Right padding (a scored
//! batch's), a row padded on the left whose first queries see no key (zeros out, log-sum-exp 0),
//! cached keys before the queries, grouped heads, one query a row, and several blocks of
//! queries. The kernel's forward and backward against HF's eager formula are
//! `attention::wgpu`'s cases under `PROMPT_R1_DEVICE_KERNELS=all` (CI runs them so).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
use device_kernels::{DeviceKernels, Products};
use prompt_r1_model::qwen3::attention::memory_efficient::{self, Blocks, Operands};
use prompt_r1_model::device_kernels::{DeviceKernelChoice, KernelPasses};
use prompt_r1_model::qwen3::AttentionMask;

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;
type Cpu = burn::backend::Flex;

/// One case: `rows` rows of `queries` queries after `past` keys, `heads` query heads over
/// `kv_heads`, heads of `head_dim`; row 1 padded on the left over `left_pad` keys, row 0 on the
/// right over `right_pad`.
#[derive(Debug, Clone, Copy)]
struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    queries: usize,
    past: usize,
    left_pad: usize,
    right_pad: usize,
}

const ROWS: usize = 3;

impl Case {
    fn width(&self) -> usize {
        self.past + self.queries
    }

    /// 1 where column `c` of row `r` is a key.
    fn valid(&self, r: usize, c: usize) -> bool {
        !(r == 1 && c < self.left_pad) && !(r == 0 && c >= self.width() - self.right_pad)
    }
}

fn cases() -> Vec<Case> {
    let base = Case { heads: 4, kv_heads: 2, head_dim: 8, queries: 13, past: 0, left_pad: 0, right_pad: 4 };
    vec![
        base,
        Case { heads: 2, kv_heads: 2, head_dim: 128, queries: 37, right_pad: 9, ..base },
        Case { heads: 8, kv_heads: 2, head_dim: 64, queries: 20, left_pad: 5, ..base },
        Case { queries: 3, past: 9, ..base },
        Case { heads: 4, kv_heads: 4, queries: 1, past: 20, left_pad: 6, right_pad: 0, ..base },
        Case { heads: 4, kv_heads: 1, queries: 1, past: 150, right_pad: 0, ..base },
    ]
}

/// `x` on the CPU in f32.
fn to_cpu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<Cpu, D> {
    Tensor::from_data(x.cast(DType::F32).into_data(), &Default::default())
}

/// The largest difference between `got` and `want`, over the entries `keep` marks, divided by
/// `want`'s magnitude there where that exceeds 1.
fn worst(got: Tensor<Cpu, 3>, want: Tensor<Cpu, 3>, keep: &Tensor<Cpu, 3>) -> f32 {
    let scale = (want.clone().abs() * keep.clone()).max().into_scalar().max(1.0);
    let diff = ((got - want).abs() * keep.clone()).max().into_scalar();
    diff / scale
}

/// The kernel's output and log-sum-exp against the CPU's on backend `B` in `dtype`, its products
/// as `products` says: the worst differences of each.
fn differences<B: DeviceKernels>(case: Case, dtype: DType, products: Products) -> (f32, f32) {
    let device = B::Device::default();
    let cpu = Default::default();
    let Case { heads, kv_heads, head_dim: d, queries, .. } = case;
    let width = case.width();
    let normal = Distribution::Normal(0.0, 1.0);
    let query = Tensor::<Cpu, 4>::random([ROWS, queries, heads, d], normal, &cpu);
    let key = Tensor::<Cpu, 4>::random([ROWS, width, kv_heads, d], normal, &cpu);
    let value = Tensor::<Cpu, 4>::random([ROWS, width, kv_heads, d], normal, &cpu);
    let key_mask: Vec<i64> = (0..ROWS * width).map(|i| i64::from(case.valid(i / width, i % width))).collect();
    let key_mask = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(key_mask, [ROWS, width]), &cpu);
    let scale = 1.0 / (d as f32).sqrt();

    // The CPU's forward in `dtype` (its scores and products in that dtype), one block of queries.
    let rounded = |t: &Tensor<Cpu, 4>| t.clone().cast(dtype).swap_dims(1, 2);
    let x = Operands { query: rounded(&query), key: rounded(&key), value: rounded(&value) };
    let mask = AttentionMask::new(Some(&key_mask), ROWS, case.past, queries, &cpu);
    let want = memory_efficient::forward(&x, &mask, Blocks { queries, keys: width, scale, device_kernels: DeviceKernelChoice::OFF });
    let want_out = want.output.cast(DType::F32).swap_dims(1, 2).reshape([ROWS, queries, heads * d]);
    let want_lse = want.lse[0].clone().reshape([ROWS, heads, queries]).swap_dims(1, 2);

    let on_device = |t: &Tensor<Cpu, 4>| Tensor::<B, 4>::from_data(t.clone().into_data(), (&device, dtype));
    let tokens = |t: &Tensor<Cpu, 4>| on_device(t).reshape([ROWS * width, kv_heads, d]).into_primitive().tensor();
    let valid = Tensor::<B, 2>::from_data(key_mask.clone().float().into_data(), (&device, DType::F32));
    let (out, lse) = B::fresh_attention(on_device(&query).into_primitive().tensor(), tokens(&key), tokens(&value), valid.into_primitive().tensor(), scale, products);
    let got_out = to_cpu(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out))).reshape([ROWS, queries, heads * d]);
    let got_lse = to_cpu(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(lse))).reshape([ROWS, queries, heads]);

    // Queries that see a key: the memory-efficient forward averages a blind query's masked
    // columns, where the kernel gives zeros and a log-sum-exp of 0.
    let sees: Vec<f32> = (0..ROWS * queries)
        .map(|i| {
            let (r, q) = (i / queries, i % queries);
            f32::from(u8::from((0..=case.past + q).any(|c| case.valid(r, c))))
        })
        .collect();
    let sees = Tensor::<Cpu, 1>::from_data(TensorData::new(sees.clone(), [ROWS * queries]), &cpu).reshape([ROWS, queries, 1]);
    let blind_lse = (got_lse.clone() * (sees.clone().neg().add_scalar(1.0))).abs().max().into_scalar();
    assert_eq!(blind_lse, 0.0, "{case:?}: a query that sees no key has a log-sum-exp of 0");
    let blind_out = (got_out.clone() * (sees.clone().neg().add_scalar(1.0))).abs().max().into_scalar();
    assert_eq!(blind_out, 0.0, "{case:?}: a query that sees no key gets zeros");
    (worst(got_out, want_out, &sees), worst(got_lse, want_lse, &sees))
}

fn check<B: DeviceKernels>(dtype: DType, out_tolerance: f32, lse_tolerance: f32) {
    for case in cases() {
        let (out, lse) = differences::<B>(case, dtype, Products::Units);
        println!("{case:?} {dtype:?}: output {out:.2e}, log-sum-exp {lse:.2e}");
        assert!(out <= out_tolerance, "{case:?}: the output {out} from the CPU's (tolerance {out_tolerance})");
        assert!(lse <= lse_tolerance, "{case:?}: the log-sum-exp {lse} from the CPU's (tolerance {lse_tolerance})");
    }
}

#[test]
fn fresh_attention_matches_the_memory_efficient_forward_in_f32() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F32, 1e-5, 1e-5);
    check::<Unfused>(DType::F32, 1e-5, 1e-5);
}

/// f16 operands (the dtype the GPU's bf16 takes the same code for): the scores rounded to f16
/// before the scale in both, the kernel's products with V in f32 where the CPU's round the
/// probabilities to f16 first, and its output rounded to f16.
#[test]
fn fresh_attention_matches_the_memory_efficient_forward_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check::<Fused>(DType::F16, 2e-3, 2e-3);
}

/// The tensor-core kernel's layout (`Products::TensorCoreLayout`, its products a unit at a time
/// on lavapipe) in f16, on the cases whose heads it takes (whole fragments of 16) with several
/// queries a row: right and left padding, blind queries, blocks of 8 to 32 queries of 1, 2 and 4
/// heads, cached keys before the queries; within the general kernel's f16 tolerances.
#[test]
fn the_tensor_core_layout_matches_the_memory_efficient_forward() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    let mut cases = cases();
    cases.push(Case { heads: 8, kv_heads: 2, head_dim: 32, queries: 40, past: 7, left_pad: 11, right_pad: 3 });
    cases.push(Case { heads: 3, kv_heads: 1, head_dim: 16, queries: 19, past: 0, left_pad: 0, right_pad: 0 });
    let taken: Vec<Case> = cases.into_iter().filter(|c| c.queries > 1 && device_kernels::tensor_core_attention::takes(DType::F16, c.head_dim)).collect();
    assert!(taken.len() >= 4, "cases the layout takes: {taken:?}");
    for case in taken {
        let (out, lse) = differences::<Unfused>(case, DType::F16, Products::TensorCoreLayout);
        println!("tensor-core layout, {case:?}: output {out:.2e}, log-sum-exp {lse:.2e}");
        assert!(out <= 2e-3 && lse <= 2e-3, "{case:?}: output {out}, log-sum-exp {lse} (tolerance 2e-3)");
    }
}

/// With the kernel taking passes without a cache (`--device-kernels all`, CUDA's default),
/// scoring (the plain backend) and a training step's forward (the attention's autodiff node)
/// attend through it alike: the same output bit for bit, so that a step's first PPO ratios stay
/// exactly 1.
#[test]
fn scoring_and_the_training_forward_attend_alike() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    let all = DeviceKernelChoice::with_passes(Some(KernelPasses::All));
    assert!(all.fresh_attention::<Fused>().is_some(), "the kernel is lent for passes without a cache");
    assert!(DeviceKernelChoice::default().fresh_attention::<Fused>().is_none(), "only where the choice hands it those passes");
    type Trained = burn::backend::Autodiff<Fused>;
    prompt_r1_model::qwen3::register_autodiff_attention::<Trained>();
    let device = Default::default();
    let (heads, kv_heads, queries, d) = (4, 2, 21, 16);
    let normal = Distribution::Normal(0.0, 1.0);
    let operands = [[ROWS, heads, queries, d], [ROWS, kv_heads, queries, d], [ROWS, kv_heads, queries, d]].map(|shape| Tensor::<Fused, 4>::random(shape, normal, &device));
    let key_mask: Vec<i64> = (0..ROWS * queries).map(|i| i64::from(!(i / queries == 0 && i % queries >= queries - 6))).collect();
    let key_mask = Tensor::<Fused, 2, Int>::from_data(TensorData::new(key_mask, [ROWS, queries]), &device);
    let scale = 1.0 / (d as f32).sqrt();
    let [query, key, value] = operands.clone();
    let mask = AttentionMask::new(Some(&key_mask), ROWS, 0, queries, &device);
    let scored = prompt_r1_model::qwen3::attention::memory_efficient_attention(Operands { query, key, value }, &mask, 8, scale, all);
    let [query, key, value] = operands.map(|t| Tensor::<Trained, 4>::from_inner(t).require_grad());
    let mask = AttentionMask::new(Some(&Tensor::from_inner(key_mask)), ROWS, 0, queries, &device);
    let trained = prompt_r1_model::qwen3::attention::memory_efficient_attention(Operands { query, key, value }, &mask, 8, scale, all);
    let bits = |t: Tensor<Fused, 4>| t.into_data().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(scored), bits(trained.inner()), "scoring and the training forward attend alike");
}

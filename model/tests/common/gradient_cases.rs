// The gradient cases, included by `tests/integration/gradients.rs` (fused CPU kernels and
// autodiff nodes) and by the workspace's `tests/gpu_path/gradients.rs` (burn's portable ops under
// autodiff, the path the CUDA backend takes; burn's wgpu backend: the CUDA backend's CubeCL
// kernels) in modules that define the inner backend `Inner` and `PORTABLE`, and bring `common`
// (this folder's `mod.rs`) into scope.

use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};
use common::*;
use prompt_r1_model::weights::{named_parameters, to_hf_layout, NamedParam, ParamKind};
use prompt_r1_model::{load_pretrained, token_logprobs, MatmulPrecision, Padding, Qwen3ForCausalLM, TokenBatch};

type B = Autodiff<Inner>;

/// The fixture; `None` (the test skipped) when the fixtures or the backend are missing here.
fn fixture(name: &str) -> Option<Fixture> {
    prompt_r1_model::qwen3::register_autodiff_attention::<B>();
    if !backend_ready::<Inner>() {
        return None;
    }
    common::fixture(name)
}

fn close(got: f32, expected: f32) -> bool {
    (got - expected).abs() <= 1e-6 + 1e-3 * expected.abs()
}

/// The fixture's GRPO-style token-mean loss of `model` on its completion batch.
fn grpo_loss(model: &Qwen3ForCausalLM<B>, fx: &Fixture) -> Tensor<B, 1> {
    let device = Default::default();
    let spec = &fx.json["completion_logprobs"];
    let sequences: Vec<Vec<u32>> = spec["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .zip(spec["attention_mask"].as_array().unwrap())
        .map(|(ids_row, mask)| {
            let keep = flat(mask).iter().filter(|&&m| m == 1.0).count();
            ids(ids_row)[..keep].to_vec()
        })
        .collect();
    let batch = TokenBatch::<B>::new(&sequences, Padding::Right, 0, &device).unwrap();
    let logp = token_logprobs(model, &batch, 1).unwrap();
    let [rows, width] = logp.dims();

    // completion_mask[i, t] marks token t; logp[:, j] scores token j + 1.
    let cm: Vec<f32> = spec["completion_mask"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| flat(row)[1..].to_vec())
        .collect();
    let advantages = floats(&fx.json["grpo_grad"]["advantages"]);
    let weights: Vec<f32> = (0..rows * width).map(|k| cm[k] * advantages[k / width]).collect();
    let count: f32 = cm.iter().sum();
    let weights = Tensor::<B, 2>::from_data(TensorData::new(weights, [rows, width]), &device);
    (logp * weights).sum().neg().div_scalar(count)
}

/// Every parameter's gradient in HF's layout, by HF name.
fn hf_gradients(model: &Qwen3ForCausalLM<B>, grads: &<B as AutodiffBackend>::Gradients) -> Vec<(String, Vec<f32>, Vec<usize>)> {
    named_parameters(model)
        .into_iter()
        .map(|(name, param)| {
            let hf = match param {
                NamedParam::Matrix(p, kind) => to_hf_layout(p.val().grad(grads).unwrap(), kind),
                NamedParam::Vector(p) => to_hf_layout(p.val().grad(grads).unwrap(), ParamKind::Norm),
            };
            (name, hf.values, hf.shape)
        })
        .collect()
}

#[test]
fn grpo_loss_and_gradients_match_pytorch() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let model = load_pretrained::<B>(&fx.dir, &Default::default(), common::load_options(PORTABLE)).unwrap();
        let grad_spec = &fx.json["grpo_grad"];
        let loss = grpo_loss(&model, &fx);
        let loss_value: f32 = loss.clone().into_scalar();
        let expected_loss = grad_spec["loss"].as_f64().unwrap() as f32;
        assert!(close(loss_value, expected_loss), "{name} loss {loss_value} vs {expected_loss}");

        let grads = loss.backward();
        let mut total_sq = 0.0f64;
        let per_param = grad_spec["per_param_grad_norm"].as_object().unwrap();
        let slices = grad_spec["grad_slices"].as_object().unwrap();
        for (param_name, values, shape) in hf_gradients(&model, &grads) {
            let norm = values.iter().map(|&g| (g as f64).powi(2)).sum::<f64>();
            total_sq += norm;
            let expected = per_param[&param_name].as_f64().unwrap() as f32;
            assert!(close(norm.sqrt() as f32, expected), "{name} {param_name}: |g| {} vs {expected}", norm.sqrt());
            for (key, slice) in slices {
                let Some(rest) = key.strip_prefix(param_name.as_str()) else { continue };
                let expected = floats(slice);
                let got: Vec<f32> = if let Some(row) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(",:8]")) {
                    let row: usize = row.parse().unwrap();
                    let cols = shape[1];
                    values[row * cols..row * cols + 8].to_vec()
                } else {
                    assert_eq!(rest, "[:8]", "slice key {key}");
                    values[..8].to_vec()
                };
                for (g, e) in got.iter().zip(&expected) {
                    assert!(close(*g, *e), "{name} {key}: {got:?} vs {expected:?}");
                }
            }
        }
        let total = total_sq.sqrt() as f32;
        let expected_total = grad_spec["grad_norm_total"].as_f64().unwrap() as f32;
        println!("{name}: loss {loss_value} (torch {expected_loss}), grad norm {total} (torch {expected_total})");
        assert!(close(total, expected_total), "{name} total grad norm {total} vs {expected_total}");
    }
}

/// `MatmulPrecision::Bf16` (operands of every product rounded to bf16, f32 sums) against the
/// f32 run: the loss within 1% of PyTorch's f32 loss, and every parameter's gradient pointing the
/// same way as the f32 one (cosine above 0.999; measured 0.9997) with its norm within 2%. The
/// fixture's batch has 22 rows, so every projection and the head take the bf16 path.
#[test]
fn bf16_products_keep_the_loss_and_gradients_close() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let device = Default::default();
        if !Inner::supports_dtype(&device, DType::BF16) {
            eprintln!("skipped: the {} backend has no bf16", Inner::name(&device));
            return;
        }
        let f32_model = load_pretrained::<B>(&fx.dir, &Default::default(), common::load_options(PORTABLE)).unwrap();
        let bf16_model = f32_model.clone().with_matmul_precision(MatmulPrecision::Bf16);
        let (f32_loss, bf16_loss) = (grpo_loss(&f32_model, &fx), grpo_loss(&bf16_model, &fx));
        let (a, b): (f32, f32) = (f32_loss.clone().into_scalar(), bf16_loss.clone().into_scalar());
        let expected = fx.json["grpo_grad"]["loss"].as_f64().unwrap() as f32;
        assert!((b - expected).abs() <= 0.01 * expected.abs(), "{name} bf16 loss {b} vs torch {expected}");
        assert_ne!(a, b, "{name}: the bf16 products were not used");
        let (f32_grads, bf16_grads) = (f32_loss.backward(), bf16_loss.backward());
        let mut worst_cosine = 1.0f64;
        for ((param, want, _), (_, got, _)) in hf_gradients(&f32_model, &f32_grads).into_iter().zip(hf_gradients(&bf16_model, &bf16_grads)) {
            let dot = |u: &[f32], v: &[f32]| u.iter().zip(v).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>();
            let (nw, ng) = (dot(&want, &want).sqrt(), dot(&got, &got).sqrt());
            let cosine = dot(&want, &got) / (nw * ng).max(1e-30);
            worst_cosine = worst_cosine.min(cosine);
            assert!(cosine > 0.999, "{name} {param}: cosine {cosine}");
            assert!((ng - nw).abs() <= 0.02 * nw, "{name} {param}: |g| {ng} vs {nw}");
        }
        println!("{name}: bf16 products: loss {b} (f32 {a}, torch {expected}), worst gradient cosine {worst_cosine:.5}");
    }
}

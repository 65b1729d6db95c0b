//! Gradient parity through burn-autodiff: the GRPO-style token-mean loss of the fixtures,
//! `loss = -Σ cm·A·logp / Σ cm`, against PyTorch's loss and gradients (rtol 1e-3, atol 1e-6).

mod common;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorData};
use common::*;
use prompt_r1_model::weights::{named_parameters, to_hf_layout, NamedParam, ParamKind};
use prompt_r1_model::{load_pretrained, token_logprobs, LoadOptions, Padding, TokenBatch};

type B = Autodiff<Flex>;

fn close(got: f32, expected: f32) -> bool {
    (got - expected).abs() <= 1e-6 + 1e-3 * expected.abs()
}

#[test]
fn grpo_loss_and_gradients_match_pytorch() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let device = Default::default();
        let model = load_pretrained::<B>(&fx.dir, &device, LoadOptions::default()).unwrap();
        let spec = &fx.json["completion_logprobs"];
        let grad_spec = &fx.json["grpo_grad"];
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
        let logp = token_logprobs(&model, &batch, 1).unwrap();
        let [rows, width] = logp.dims();

        // completion_mask[i, t] marks token t; logp[:, j] scores token j + 1.
        let cm: Vec<f32> = spec["completion_mask"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| flat(row)[1..].to_vec())
            .collect();
        let advantages = floats(&grad_spec["advantages"]);
        let weights: Vec<f32> = (0..rows * width).map(|k| cm[k] * advantages[k / width]).collect();
        let count: f32 = cm.iter().sum();
        let weights = Tensor::<B, 2>::from_data(TensorData::new(weights, [rows, width]), &device);
        let loss = (logp * weights).sum().neg().div_scalar(count);

        let loss_value: f32 = loss.clone().into_scalar();
        let expected_loss = grad_spec["loss"].as_f64().unwrap() as f32;
        assert!(close(loss_value, expected_loss), "{name} loss {loss_value} vs {expected_loss}");

        let grads = loss.backward();
        let mut total_sq = 0.0f64;
        let per_param = grad_spec["per_param_grad_norm"].as_object().unwrap();
        let slices = grad_spec["grad_slices"].as_object().unwrap();
        for (param_name, param) in named_parameters(&model) {
            let hf = match param {
                NamedParam::Matrix(p, kind) => to_hf_layout(p.val().grad(&grads).unwrap(), kind),
                NamedParam::Vector(p) => to_hf_layout(p.val().grad(&grads).unwrap(), ParamKind::Norm),
            };
            let norm = hf.values.iter().map(|&g| (g as f64).powi(2)).sum::<f64>();
            total_sq += norm;
            let expected = per_param[&param_name].as_f64().unwrap() as f32;
            assert!(close(norm.sqrt() as f32, expected), "{name} {param_name}: |g| {} vs {expected}", norm.sqrt());
            for (key, values) in slices {
                let Some(rest) = key.strip_prefix(param_name.as_str()) else { continue };
                let expected = floats(values);
                let got: Vec<f32> = if let Some(row) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(",:8]")) {
                    let row: usize = row.parse().unwrap();
                    let cols = hf.shape[1];
                    hf.values[row * cols..row * cols + 8].to_vec()
                } else {
                    assert_eq!(rest, "[:8]", "slice key {key}");
                    hf.values[..8].to_vec()
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

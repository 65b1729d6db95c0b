//! Activation checkpointing (`grpo.activation_checkpointing`) computes the gradients it replaces:
//! the learning step's gradient with and without it on the reference fixtures (full fine-tuning
//! with tied and untied embeddings; LoRA adapters over an f32 and a bf16 base), and a whole
//! training step of the trainer's test setup.

use crate::common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::{DType, Tensor, TensorData};
use model::lora::AdapterWeights;
use model::weights::{named_parameters, NamedParam};
use model::{load_pretrained, LoadOptions, LoraAdapters, LoraConfig, Qwen3ForCausalLM};
use prompt_r1_trainer::grpo::{
    learn_step, learn_step_lora, sequence_logprobs, GrpoError, LearnConfig, PolicyBatch,
};
use serde_json::Value;

use common::B;

type Inner = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;

/// Every trained parameter's gradient, in the module's order, as the optimiser was handed it.
type Captured = Vec<Vec<f32>>;

/// An "optimiser" that records the gradients of each step and leaves the module as it is.
#[derive(Clone, Default)]
struct Capture {
    steps: Arc<Mutex<Vec<Captured>>>,
}

/// Collects the gradient of every parameter of a module.
struct Collect<'a> {
    grads: &'a GradientsParams,
    out: Captured,
}

impl ModuleVisitor<B> for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self
            .grads
            .get::<Inner, D>(param.id)
            .expect("every trained parameter has a gradient");
        self.out
            .push(grad.into_data().convert::<f32>().to_vec::<f32>().unwrap());
    }
}

impl<M: AutodiffModule<B>> Optimizer<M, B> for Capture {
    type Record = ();

    fn step(&mut self, _lr: LearningRate, module: M, grads: GradientsParams) -> M {
        let mut collect = Collect {
            grads: &grads,
            out: Vec::new(),
        };
        module.visit(&mut collect);
        self.steps.lock().unwrap().push(collect.out);
        module
    }

    fn step_multi(&mut self, _: LearningRate, _: M, _: MultiGradientsParams) -> M {
        unreachable!("the learning step hands one set of gradients per optimiser step")
    }

    fn to_record(&self) {}

    fn load_record(self, _: ()) -> Self {
        self
    }
}

/// `shared/fixtures/<name>`, or `None` (the test skipped, or failed in CI) when absent.
fn fixture(name: &str) -> Option<(PathBuf, Value)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures")
        .join(name);
    if !dir.is_dir() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true but {} is missing", dir.display());
        }
        eprintln!(
            "skipped: {} not found (it sits beside the checkout in CI)",
            dir.display()
        );
        return None;
    }
    let json = std::fs::read_to_string(dir.join("fixture.json")).unwrap();
    Some((dir, serde_json::from_str(&json).unwrap()))
}

/// The fixture's completions (prompt tokens masked out) and a shorter copy of the first, so
/// that a micro-batch is padded; old log-probs off the model's own so that some ratios leave
/// the clip range, reference log-probs shifted, advantages of both signs.
fn batch(model: &Qwen3ForCausalLM<B>, json: &Value) -> PolicyBatch {
    let spec = &json["completion_logprobs"];
    let rows = |key: &str| -> Vec<Vec<u64>> {
        let rows = spec[key].as_array().unwrap();
        rows.iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap())
                    .collect()
            })
            .collect()
    };
    let (ids, masks, completion) = (
        rows("input_ids"),
        rows("attention_mask"),
        rows("completion_mask"),
    );
    let mut sequences: Vec<(Vec<u32>, Vec<u8>)> = ids
        .iter()
        .zip(&masks)
        .zip(&completion)
        .map(|((ids, mask), cm)| {
            let keep = mask.iter().filter(|&&m| m == 1).count();
            (
                ids[..keep].iter().map(|&t| t as u32).collect(),
                cm[..keep].iter().map(|&m| m as u8).collect(),
            )
        })
        .collect();
    let (first_ids, first_mask) = sequences[0].clone();
    let short = first_ids.len() - 3;
    sequences.push((first_ids[..short].to_vec(), first_mask[..short].to_vec()));
    let tokens: Vec<Vec<u32>> = sequences.iter().map(|(t, _)| t.clone()).collect();
    let current = sequence_logprobs(&model.valid(), &tokens, 0, 8).unwrap();
    let advantages = [1.3, -0.8, 0.6];
    let sequences = sequences
        .into_iter()
        .zip(current)
        .zip(advantages)
        .map(|(((tokens, loss_mask), logp), advantage)| common::shifted_sequence(tokens, loss_mask, &logp, advantage))
        .collect();
    PolicyBatch::new(sequences).unwrap()
}

/// The learn step's settings: one mini-batch of the whole batch in micro-batches of 2, the KL
/// and entropy terms on, no clipping.
fn config(batch: &PolicyBatch, checkpointing: bool) -> LearnConfig {
    let mut config = LearnConfig {
        mini_batch_size: batch.len(),
        micro_batch_size: 2,
        activation_checkpointing: checkpointing,
        ..LearnConfig::default()
    };
    config.loss.kl_coef = 0.1;
    config.loss.entropy_coef = 0.01;
    config.optimizer.grad_clip = f32::MAX;
    config
}

/// The one gradient a capturing optimiser was handed.
fn captured(capture: Capture) -> Captured {
    let mut steps = capture.steps.lock().unwrap();
    assert_eq!(steps.len(), 1);
    steps.pop().unwrap()
}

/// The gradient `learn_step` hands the optimiser.
fn step_gradient(model: Qwen3ForCausalLM<B>, batch: &PolicyBatch, checkpointing: bool) -> Captured {
    let mut capture = Capture::default();
    let (_, stats) = learn_step(model, &mut capture, batch, &config(batch, checkpointing)).unwrap();
    assert_eq!(stats.optimizer_steps, 1);
    captured(capture)
}

/// The gradient `learn_step_lora` hands the optimiser.
fn lora_step_gradient(
    base: &Qwen3ForCausalLM<B>,
    adapters: LoraAdapters<B>,
    batch: &PolicyBatch,
    checkpointing: bool,
) -> Result<Captured, GrpoError> {
    let mut capture = Capture::default();
    let (_, stats) = learn_step_lora(
        base,
        adapters,
        &mut capture,
        batch,
        &config(batch, checkpointing),
    )?;
    assert_eq!(stats.optimizer_steps, 1);
    Ok(captured(capture))
}

/// Asserts that every parameter's gradients differ by at most `tolerance` of its largest
/// entry; returns the largest such relative difference.
fn compare(what: &str, want: &Captured, got: &Captured, tolerance: f32) -> f32 {
    assert_eq!(want.len(), got.len(), "{what}: parameter counts");
    let mut worst = 0.0f32;
    for (k, (want, got)) in want.iter().zip(got).enumerate() {
        let scale = want.iter().fold(0.0f32, |m, g| m.max(g.abs()));
        assert!(scale > 0.0, "{what}: parameter {k} has a zero gradient");
        let diff = want
            .iter()
            .zip(got)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / scale);
        assert!(
            diff <= tolerance * scale,
            "{what}: parameter {k} differs by {diff} (largest entry {scale})"
        );
    }
    worst
}

/// Rank-4 adapters on every projection with non-zero `lora_B` (PEFT starts it at zero, which
/// would leave `lora_A` without a gradient).
fn adapters(base: &Qwen3ForCausalLM<B>, dropout: f64) -> LoraAdapters<B> {
    let config = LoraConfig {
        rank: 4,
        dropout,
        ..LoraConfig::default()
    };
    LoraAdapters::from_weights(
        &config,
        &base.config,
        &Default::default(),
        |layer, target, (fan_in, fan_out)| {
            let values = |n: usize, salt: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i * 31 + layer * 7 + salt) as f32 * 0.37).sin() * 0.2)
                    .collect()
            };
            AdapterWeights {
                lora_A: TensorData::new(values(fan_in * 4, target as usize), [fan_in, 4]),
                lora_B: TensorData::new(values(4 * fan_out, 11 + target as usize), [4, fan_out]),
            }
        },
    )
}

/// Every parameter's gradient with checkpointing equals the one without, to f32 rounding: both
/// run the same operations on the same values, and only the order in which burn sums a
/// tensor's gradient contributions may differ. Tolerance: 1e-5 of the parameter's largest
/// gradient entry (measured: exactly equal, see the printed line, also with the CPU kernels off).
#[test]
fn checkpointed_gradients_equal_the_full_graphs() {
    for name in ["tiny", "tiny-untied"] {
        let Some((dir, json)) = fixture(name) else {
            return;
        };
        let model =
            load_pretrained::<B>(&dir, &Default::default(), LoadOptions::default()).unwrap();
        let batch = batch(&model, &json);
        let plain = step_gradient(model.clone(), &batch, false);
        let checkpointed = step_gradient(model, &batch, true);
        let worst = compare(name, &plain, &checkpointed, 1e-5);
        println!(
            "{name}: {} parameters, largest difference {worst:e} of a parameter's largest entry",
            plain.len()
        );
    }
}

/// With LoRA only the adapters are trained (the embedding's pass is skipped): their gradients
/// with checkpointing equal those without, over an f32 base and over a bf16 base (whose
/// activations are bf16: the same operations on the same values either way, tolerance as
/// above). Dropout would draw other masks when a layer is recomputed, so that combination is
/// refused.
#[test]
fn checkpointed_lora_gradients_equal_the_full_graphs() {
    let Some((dir, json)) = fixture("tiny") else {
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        let base = load_pretrained::<B>(&dir, &Default::default(), LoadOptions { dtype, ..Default::default() }).unwrap();
        let batch = batch(
            &load_pretrained::<B>(&dir, &Default::default(), LoadOptions::default()).unwrap(),
            &json,
        );
        let plain = lora_step_gradient(&base, adapters(&base, 0.0), &batch, false).unwrap();
        let checkpointed = lora_step_gradient(&base, adapters(&base, 0.0), &batch, true).unwrap();
        assert_eq!(
            plain.len(),
            2 * 7 * base.config.num_hidden_layers,
            "lora_A and lora_B of every projection"
        );
        let worst = compare(
            &format!("LoRA over a {dtype:?} base"),
            &plain,
            &checkpointed,
            1e-5,
        );
        println!(
            "LoRA over a {dtype:?} base: {} adapter tensors, largest difference {worst:e}",
            plain.len()
        );
    }
    let base = load_pretrained::<B>(&dir, &Default::default(), LoadOptions::default()).unwrap();
    let batch = batch(&base, &json);
    let err = lora_step_gradient(&base, adapters(&base, 0.1), &batch, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("dropout"), "{err}");
}

/// One training step of the trainer's test setup with and without checkpointing, training every
/// weight and training LoRA adapters: the same rollouts (same seed and weights), the same loss
/// terms and gradient norm, and the same trained parameters after the AdamW step (relative
/// 1e-5: the gradients differ by f32 rounding at most, and AdamW's first step moves each
/// parameter by about lr·sign(g)).
#[test]
fn a_training_step_with_checkpointing_matches_one_without() {
    let run = |checkpointing: bool, lora: bool| {
        let dir = tempfile::tempdir().unwrap();
        let mut config = common::setup(dir.path());
        config.grpo.activation_checkpointing = checkpointing;
        config.lora = lora.then(LoraConfig::default);
        let (trainer, records) = common::train(config, 1, false);
        let values = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();
        let parameters: Vec<f32> = match trainer.adapters() {
            Some(adapters) => adapters
                .iter()
                .flat_map(|(_, _, a)| [values(a.lora_A.val()), values(a.lora_B.val())])
                .flatten()
                .collect(),
            None => named_parameters(trainer.policy())
                .into_iter()
                .flat_map(|(_, p)| match p {
                    NamedParam::Matrix(p, _) => values(p.val()),
                    NamedParam::Vector(p) => p.val().into_data().to_vec::<f32>().unwrap(),
                })
                .collect(),
        };
        (records.into_iter().next().unwrap(), parameters)
    };
    for lora in [false, true] {
        let (plain, plain_parameters) = run(false, lora);
        let (checkpointed, parameters) = run(true, lora);
        assert_eq!(
            plain.agent_tokens, checkpointed.agent_tokens,
            "the same rollouts"
        );
        assert_eq!(plain.reward_mean, checkpointed.reward_mean);
        assert_eq!(checkpointed.optimizer_steps, 1);
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()) + 1e-7;
        assert!(
            close(plain.loss, checkpointed.loss),
            "lora {lora}: loss {} vs {}",
            plain.loss,
            checkpointed.loss
        );
        assert!(close(plain.pg_loss, checkpointed.pg_loss));
        let (g_plain, g_ckpt) = (plain.grad_norm.unwrap(), checkpointed.grad_norm.unwrap());
        assert!(
            g_plain > 0.0 && close(g_plain, g_ckpt),
            "lora {lora}: grad norm {g_plain} vs {g_ckpt}"
        );
        assert_eq!(plain_parameters.len(), parameters.len());
        let same = plain_parameters
            .iter()
            .zip(&parameters)
            .all(|(a, b)| close(*a, *b));
        assert!(
            same,
            "lora {lora}: the trained parameters after the step differ"
        );
    }
}

//! Activation checkpointing (`grpo.activation_checkpointing`) computes the gradients it replaces:
//! the learning step's gradient with and without it, on the reference fixtures (tied and untied
//! embeddings), and a whole training step of the trainer's test setup.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use model::weights::{named_parameters, NamedParam};
use model::{load_pretrained, LoadOptions, Qwen3ForCausalLM};
use prompt_r1_trainer::grpo::{
    learn_step, sequence_logprobs, LearnConfig, PolicyBatch, PolicySequence,
};
use serde_json::Value;

use common::B;

type Inner = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;

/// Every parameter's gradient, by HF name, as the optimiser was handed it.
type Captured = Vec<(String, Vec<f32>)>;

/// An "optimiser" that records the gradients of each step and leaves the model as it is.
#[derive(Clone, Default)]
struct Capture {
    steps: Arc<Mutex<Vec<Captured>>>,
}

impl Optimizer<Qwen3ForCausalLM<B>, B> for Capture {
    type Record = ();

    fn step(
        &mut self,
        _lr: LearningRate,
        module: Qwen3ForCausalLM<B>,
        grads: GradientsParams,
    ) -> Qwen3ForCausalLM<B> {
        let values = |t: burn::tensor::Tensor<Inner, 1>| t.into_data().to_vec::<f32>().unwrap();
        let captured = named_parameters(&module)
            .into_iter()
            .map(|(name, param)| {
                let grad = match param {
                    NamedParam::Matrix(p, _) => {
                        grads.get::<Inner, 2>(p.id).map(|g| values(g.flatten(0, 1)))
                    }
                    NamedParam::Vector(p) => grads.get::<Inner, 1>(p.id).map(values),
                };
                (
                    name.clone(),
                    grad.unwrap_or_else(|| panic!("no gradient for {name}")),
                )
            })
            .collect();
        self.steps.lock().unwrap().push(captured);
        module
    }

    fn step_multi(
        &mut self,
        _: LearningRate,
        _: Qwen3ForCausalLM<B>,
        _: MultiGradientsParams,
    ) -> Qwen3ForCausalLM<B> {
        unreachable!("learn_step takes one set of gradients per step")
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
        spec[key]
            .as_array()
            .unwrap()
            .iter()
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
    let shift = |k: usize, scale: f32| ((k * 7 % 11) as f32 - 5.0) * scale;
    let sequences = sequences
        .into_iter()
        .zip(current)
        .zip(advantages)
        .map(|(((tokens, loss_mask), logp), advantage)| PolicySequence {
            old_logprobs: logp
                .iter()
                .enumerate()
                .map(|(k, l)| l + shift(k, 0.08))
                .collect(),
            ref_logprobs: Some(
                logp.iter()
                    .enumerate()
                    .map(|(k, l)| l - shift(k + 3, 0.1))
                    .collect(),
            ),
            tokens,
            loss_mask,
            advantage,
        })
        .collect();
    PolicyBatch::new(sequences).unwrap()
}

/// The gradient `learn_step` hands the optimiser, for one mini-batch of the whole batch.
fn step_gradient(model: Qwen3ForCausalLM<B>, batch: &PolicyBatch, checkpointing: bool) -> Captured {
    let mut config = LearnConfig {
        mini_batch_size: batch.len(),
        micro_batch_size: 2,
        activation_checkpointing: checkpointing,
        ..LearnConfig::default()
    };
    config.loss.kl_coef = 0.1;
    config.loss.entropy_coef = 0.01;
    config.optimizer.grad_clip = f32::MAX;
    let mut capture = Capture::default();
    let (_, stats) = learn_step(model, &mut capture, batch, &config).unwrap();
    assert_eq!(stats.optimizer_steps, 1);
    let mut steps = capture.steps.lock().unwrap();
    assert_eq!(steps.len(), 1);
    steps.pop().unwrap()
}

/// Every parameter's gradient with checkpointing equals the one without, to f32 rounding: both
/// run the same operations on the same values, and only the order in which burn sums a
/// tensor's gradient contributions may differ. Tolerance: 1e-5 of the parameter's largest
/// gradient entry (measured: exactly equal, see the printed line).
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
        let mut worst = 0.0f32;
        for ((param, want), (_, got)) in plain.iter().zip(&checkpointed) {
            let scale = want.iter().fold(0.0f32, |m, g| m.max(g.abs()));
            assert!(scale > 0.0, "{name} {param}: zero gradient");
            let diff = want
                .iter()
                .zip(got)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale);
            assert!(
                diff <= 1e-5 * scale,
                "{name} {param}: differs by {diff} (largest entry {scale})"
            );
        }
        println!(
            "{name}: {} parameters, largest difference {worst:e} of a parameter's largest entry",
            plain.len()
        );
    }
}

/// One training step of the trainer's test setup with and without checkpointing: the same
/// rollouts (same seed and weights), the same loss terms and gradient norm, and the same
/// weights after the AdamW step (relative 1e-5: the gradients differ by f32 rounding at most,
/// and AdamW's first step moves each weight by about lr·sign(g)).
#[test]
fn a_training_step_with_checkpointing_matches_one_without() {
    let run = |checkpointing: bool| {
        let dir = tempfile::tempdir().unwrap();
        let mut config = common::setup(dir.path());
        config.grpo.activation_checkpointing = checkpointing;
        let (trainer, records) = common::train(config, 1, false);
        let weights: Vec<f32> = named_parameters(&trainer.policy().valid())
            .into_iter()
            .flat_map(|(_, p)| match p {
                NamedParam::Matrix(p, _) => p.val().into_data().to_vec::<f32>().unwrap(),
                NamedParam::Vector(p) => p.val().into_data().to_vec::<f32>().unwrap(),
            })
            .collect();
        (records.into_iter().next().unwrap(), weights)
    };
    let (plain, plain_weights) = run(false);
    let (checkpointed, weights) = run(true);
    assert_eq!(
        plain.agent_tokens, checkpointed.agent_tokens,
        "the same rollouts"
    );
    assert_eq!(plain.reward_mean, checkpointed.reward_mean);
    assert_eq!(checkpointed.optimizer_steps, 1);
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()) + 1e-7;
    assert!(
        close(plain.loss, checkpointed.loss),
        "loss {} vs {}",
        plain.loss,
        checkpointed.loss
    );
    assert!(close(plain.pg_loss, checkpointed.pg_loss));
    let (g_plain, g_ckpt) = (plain.grad_norm.unwrap(), checkpointed.grad_norm.unwrap());
    assert!(
        g_plain > 0.0 && close(g_plain, g_ckpt),
        "grad norm {g_plain} vs {g_ckpt}"
    );
    assert!(
        plain_weights
            .iter()
            .zip(&weights)
            .all(|(a, b)| close(*a, *b)),
        "weights after the step differ"
    );
}

//! The learning step on a tiny random Qwen3 (Autodiff<Flex>): micro-batching is exact, masked
//! positions are inert, non-finite steps are skipped, and repeated steps move log-probs the way
//! the advantages say.

use crate::common;

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::SgdConfig;
use model::{load_pretrained, LoadOptions, Qwen3ForCausalLM};
use prompt_r1_trainer::grpo::{
    learn_step, sequence_logprobs, AggMode, LearnConfig, PolicyBatch, PolicySequence,
};
use prompt_r1_trainer::optim::OptimizerConfig;

type B = Autodiff<Flex>;

fn load(dir: &Path) -> Qwen3ForCausalLM<B> {
    load_pretrained::<B>(dir, &Default::default(), LoadOptions::default()).unwrap()
}

/// Every parameter, flattened in a fixed order.
fn flat_params(model: &Qwen3ForCausalLM<B>) -> Vec<f32> {
    common::named_weights(model).into_iter().flat_map(|(_, values)| values).collect()
}

fn max_abs(v: impl Iterator<Item = f32>) -> f32 {
    v.fold(0.0, |m, x| m.max(x.abs()))
}

/// Deterministic tokens in 3..500.
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((x >> 33) % 497) as u32
        })
        .collect()
}

/// Five conversations of different lengths: a prompt (mask 0), agent turns (mask 1) and an
/// environment reply (mask 0) in between; old log-probs near the model's own (so some ratios
/// leave the clip range), reference log-probs shifted, advantages of both signs.
fn batch(model: &Qwen3ForCausalLM<B>) -> PolicyBatch {
    let layouts: [&[(u8, usize)]; 5] = [
        &[(0, 4), (1, 3), (0, 2), (1, 4)],
        &[(0, 6), (1, 9)],
        &[(0, 3), (1, 2), (0, 5), (1, 1), (0, 1)],
        &[(0, 5), (1, 6), (0, 3), (1, 3)],
        &[(0, 2), (1, 1)],
    ];
    let advantages = [1.2, -0.7, 0.4, -1.5, 0.9];
    let sequences: Vec<Vec<u32>> = layouts
        .iter()
        .enumerate()
        .map(|(i, l)| tokens(i as u64, l.iter().map(|(_, n)| n).sum()))
        .collect();
    let current = sequence_logprobs(&model.valid(), &sequences, 0, 8).unwrap();
    let seqs = layouts
        .iter()
        .zip(sequences)
        .zip(current)
        .zip(advantages)
        .map(|(((layout, tokens), logp), advantage)| {
            let loss_mask: Vec<u8> = layout.iter().flat_map(|&(m, n)| vec![m; n]).collect();
            common::shifted_sequence(tokens, loss_mask, &logp, advantage)
        })
        .collect();
    PolicyBatch::new(seqs).unwrap()
}

/// SGD with lr 1 and no clipping: the parameter change is minus the accumulated gradient.
fn sgd_update(dir: &Path, batch: &PolicyBatch, config: &LearnConfig) -> (Vec<f32>, f32) {
    let model = load(dir);
    let before = flat_params(&model);
    let mut optim = SgdConfig::new().init::<B, Qwen3ForCausalLM<B>>();
    let (model, stats) = learn_step(model, &mut optim, batch, config).unwrap();
    assert_eq!(stats.skipped_steps, 0);
    let delta = flat_params(&model)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    (delta, stats.loss)
}

fn sgd_config(mini: usize, micro: usize, mode: AggMode) -> LearnConfig {
    let mut config = LearnConfig {
        mini_batch_size: mini,
        micro_batch_size: micro,
        optimizer: OptimizerConfig {
            lr: 1.0,
            grad_clip: f32::INFINITY,
            ..Default::default()
        },
        ..Default::default()
    };
    config.loss.agg_mode = mode;
    config.loss.kl_coef = 0.05;
    config
}

#[test]
fn micro_batches_give_the_same_update_as_one_batch() {
    let dir = common::tiny_checkpoint(11);
    let batch = batch(&load(dir.path()));
    for mode in [
        AggMode::TokenMean,
        AggMode::SeqMeanTokenMean,
        AggMode::SeqMeanTokenSum,
    ] {
        for mini in [5, 3] {
            let (whole, whole_loss) = sgd_update(dir.path(), &batch, &sgd_config(mini, mini, mode));
            let scale = max_abs(whole.iter().copied());
            assert!(scale > 1e-4, "{mode:?}: no update");
            for micro in [1, 2] {
                let (split, split_loss) =
                    sgd_update(dir.path(), &batch, &sgd_config(mini, micro, mode));
                let diff = max_abs(whole.iter().zip(&split).map(|(a, b)| a - b));
                println!("{mode:?} mini {mini} micro {micro}: max |Δ| {scale:.3e}, max diff {diff:.3e}, loss {whole_loss} vs {split_loss}");
                assert!(
                    diff <= 1e-4 * scale,
                    "{mode:?} mini {mini} micro {micro}: diff {diff} vs {scale}"
                );
                assert!((whole_loss - split_loss).abs() <= 1e-5 * whole_loss.abs().max(1.0));
            }
        }
    }
}

#[test]
fn values_at_masked_positions_do_not_matter() {
    let dir = common::tiny_checkpoint(11);
    let tame = batch(&load(dir.path()));
    let wild: Vec<PolicySequence> = tame
        .sequences()
        .iter()
        .map(|s| {
            let mut s = s.clone();
            for t in 0..s.tokens.len() {
                if s.loss_mask[t] == 0 {
                    s.old_logprobs[t] = if t % 2 == 0 { f32::NAN } else { 1e30 };
                    s.ref_logprobs.as_mut().unwrap()[t] = f32::NEG_INFINITY;
                }
            }
            s
        })
        .collect();
    let wild = PolicyBatch::new(wild).unwrap();
    let config = sgd_config(5, 2, AggMode::TokenMean);
    let (a, loss_a) = sgd_update(dir.path(), &tame, &config);
    let (b, loss_b) = sgd_update(dir.path(), &wild, &config);
    assert_eq!(a, b);
    assert_eq!(loss_a, loss_b);
}

#[test]
fn non_finite_gradient_skips_the_step() {
    // An advantage of 3e38 keeps the loss finite but overflows the squared gradient norm.
    let dir = common::tiny_checkpoint(11);
    let model = load(dir.path());
    let good = batch(&model);
    let mut huge = good.sequences().to_vec();
    huge[0].advantage = 3e38;
    let huge = PolicyBatch::new(huge).unwrap();
    let config = LearnConfig {
        mini_batch_size: 5,
        micro_batch_size: 5,
        ..Default::default()
    };
    let before = flat_params(&model);
    let mut optim = config.optimizer.init::<B, Qwen3ForCausalLM<B>>().unwrap();
    let (model, stats) = learn_step(model, &mut optim, &huge, &config).unwrap();
    assert_eq!(
        (stats.skipped_steps, stats.optimizer_steps),
        (1, 0),
        "{stats:?}"
    );
    assert!(!stats.grad_norms[0].is_finite());
    assert_eq!(flat_params(&model), before);
    // The optimiser is still usable.
    let (model, stats) = learn_step(model, &mut optim, &good, &config).unwrap();
    assert_eq!((stats.skipped_steps, stats.optimizer_steps), (0, 1));
    assert_ne!(flat_params(&model), before);
}

#[test]
fn input_errors_come_before_any_update() {
    let dir = common::tiny_checkpoint(11);
    let model = load(dir.path());
    let mut no_ref = batch(&model).sequences().to_vec();
    no_ref[2].ref_logprobs = None;
    let no_ref = PolicyBatch::new(no_ref).unwrap();
    let config = LearnConfig::default();
    let mut optim = config.optimizer.init::<B, Qwen3ForCausalLM<B>>().unwrap();
    let err = learn_step(model, &mut optim, &no_ref, &config).unwrap_err();
    assert!(err.to_string().contains("reference"), "{err}");

    let mut out_of_vocab = batch(&load(dir.path())).sequences().to_vec();
    out_of_vocab[1].tokens[3] = 512;
    let out_of_vocab = PolicyBatch::new(out_of_vocab).unwrap();
    let err = learn_step(load(dir.path()), &mut optim, &out_of_vocab, &config).unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");

    let zero_micro = LearnConfig {
        micro_batch_size: 0,
        ..Default::default()
    };
    assert!(learn_step(load(dir.path()), &mut optim, &out_of_vocab, &zero_micro).is_err());
}

/// Two completions of one prompt, advantages +1 and −1, on-policy every step (old log-probs
/// recomputed), KL to the initial weights on (the default 0.001, k3), AdamW lr 1e-3.
#[test]
fn repeated_steps_follow_the_advantages() {
    let dir = common::tiny_checkpoint(11);
    let mut model = load(dir.path());
    let prompt = tokens(100, 6);
    let good: Vec<u32> = prompt
        .iter()
        .copied()
        .chain([11, 250, 37, 400, 2])
        .collect();
    let bad: Vec<u32> = prompt.iter().copied().chain([90, 91, 92, 93, 2]).collect();
    let sequences = vec![good.clone(), bad.clone()];
    let mask: Vec<u8> = (0..good.len())
        .map(|t| u8::from(t >= prompt.len()))
        .collect();
    let reference = sequence_logprobs(&model.valid(), &sequences, 0, 2).unwrap();
    let completion_logp = |logp: &[f32]| logp[prompt.len()..].iter().sum::<f32>();
    let config = LearnConfig {
        mini_batch_size: 2,
        micro_batch_size: 1,
        optimizer: OptimizerConfig {
            lr: 1e-3,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut optim = config.optimizer.init::<B, Qwen3ForCausalLM<B>>().unwrap();
    let mut history = Vec::new();
    let mut last_stats = None;
    for _ in 0..12 {
        let old = sequence_logprobs(&model.valid(), &sequences, 0, 2).unwrap();
        history.push((completion_logp(&old[0]), completion_logp(&old[1])));
        let seqs = [(&good, 1.0), (&bad, -1.0)]
            .into_iter()
            .zip(old.iter().zip(&reference))
            .map(|((tokens, advantage), (old, reference))| PolicySequence {
                tokens: tokens.clone(),
                loss_mask: mask.clone(),
                old_logprobs: old.clone(),
                ref_logprobs: Some(reference.clone()),
                advantage,
            })
            .collect();
        let (next, stats) =
            learn_step(model, &mut optim, &PolicyBatch::new(seqs).unwrap(), &config).unwrap();
        model = next;
        // On-policy with one mini-batch: every ratio is 1, nothing is clipped.
        assert_eq!((stats.policy.clip_frac, stats.policy.dual_clip_frac), (0.0, 0.0));
        assert_eq!((stats.optimizer_steps, stats.n_tokens), (1, 10));
        last_stats = Some(stats);
    }
    let (first, last) = (history[0], history[history.len() - 1]);
    println!(
        "log p(good) {:.3} → {:.3}, log p(bad) {:.3} → {:.3}",
        first.0, last.0, first.1, last.1
    );
    println!("last step: {:?}", last_stats);
    assert!(last.0 - first.0 > 2.0, "good completion: {history:?}");
    assert!(first.1 - last.1 > 2.0, "bad completion: {history:?}");
    let stats = last_stats.unwrap();
    assert!(
        stats.kl.unwrap() > 0.0 && stats.entropy.unwrap() > 0.0,
        "{stats:?}"
    );
}

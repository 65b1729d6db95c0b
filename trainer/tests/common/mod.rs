//! Shared parts of the trainer's whole-run tests: a tiny random Qwen3 with its tokenizer, a
//! scripted environment and a reward whose best behaviour is known.
#![allow(dead_code)]

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use env::{ChatMessage, EnvError, Environment, Trajectory};
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::tiny_tokenizer::{train_tiny_tokenizer, write_tokenizer_files, TINY_VOCAB_SIZE};
use model::weights::{named_parameters, to_hf_layout, NamedParam, ParamKind};
use model::{LoraConfig, Preset, Qwen3ForCausalLM};
use prompt_r1_trainer::run::{EpisodeScore, EpisodeScorer, StepRecord, TrainConfig, Trainer};

pub type B = Autodiff<Flex>;

/// Replies with a fixed sentence; it is never reached when the agent makes no call.
pub struct Scripted;

impl Environment for Scripted {
    fn complete(&self, _messages: &[ChatMessage]) -> Result<String, EnvError> {
        Ok("The answer is Paris.".into())
    }
}

/// The known best behaviour: emit only byte-level tokens (ids below 256). A random policy
/// scores about 256/512 = 0.5 per token; the best policy scores 1.
pub struct ByteTokens;

impl EpisodeScorer for ByteTokens {
    fn score(&self, t: &Trajectory, _answers: &[String]) -> EpisodeScore {
        let agent: Vec<u32> = t
            .token_ids
            .iter()
            .zip(&t.loss_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&id, _)| id)
            .collect();
        let bytes = agent.iter().filter(|&&id| id < 256).count();
        EpisodeScore {
            reward: bytes as f32 / agent.len().max(1) as f32,
            format: None,
            f1: None,
        }
    }
}

/// A tiny random Qwen3 (f32, from `seed`) with the project's tiny tokenizer, written to
/// `model_dir`.
pub fn tiny_model(model_dir: &Path, seed: u64) {
    let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    write_tokenizer_files(&tokenizer, model_dir).unwrap();
    let special = *tokenizer.special();
    let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![special.im_end, special.endoftext]);
    write_random_checkpoint(&config, model_dir, seed, StorageDtype::F32).unwrap();
}

/// A tiny random checkpoint (f32, from `seed`; a 512-token vocabulary, no tokenizer) in a
/// temporary folder.
pub fn tiny_checkpoint(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(&Preset::Tiny.config(512, vec![2]), dir.path(), seed, StorageDtype::F32).unwrap();
    dir
}

/// Every parameter of `model` by name, in Hugging Face layout, as host values.
pub fn named_weights<K: Backend>(model: &Qwen3ForCausalLM<K>) -> Vec<(String, Vec<f32>)> {
    named_parameters(model)
        .into_iter()
        .map(|(name, p)| {
            let host = match p {
                NamedParam::Matrix(t, kind) => to_hf_layout(t.val(), kind),
                NamedParam::Vector(t) => to_hf_layout(t.val(), ParamKind::Norm),
            };
            (name, host.values)
        })
        .collect()
}

/// A tiny model with its tokenizer, short prompts and a 6-question dataset.
pub fn setup(dir: &Path) -> TrainConfig {
    let model_dir = dir.join("model");
    tiny_model(&model_dir, 1);
    std::fs::write(dir.join("system.txt"), "You help.").unwrap();
    std::fs::write(dir.join("instruction.txt"), "Answer.").unwrap();
    let rows: String = ["Paris?", "Rome?", "Oslo?", "Lima?", "Bern?", "Kyiv?"]
        .iter()
        .enumerate()
        .map(|(i, q)| format!("{{\"id\":\"q{i}\",\"data_source\":\"toy\",\"question\":\"{q}\",\"answers\":[\"x\"]}}\n"))
        .collect();
    std::fs::write(dir.join("train.jsonl"), rows).unwrap();
    let toml = r#"
model = "model"
[data]
train = ["train.jsonl"]
[episode]
max_turns = 1
max_turn_tokens = 8
max_response_tokens = 64
system_prompt = "system.txt"
instruction = "instruction.txt"
[rollout]
batch_size = 3
n = 4
generation_batch = 12
[rollout.sampling]
seed = 7
[grpo]
mini_batch_size = 12
micro_batch_size = 6
[grpo.loss]
kl_coef = 0.0
[grpo.optimizer]
lr = 0.003
[run]
out_dir = "run"
steps = 40
save_every = 10
validate_every = 0
"#;
    std::fs::write(dir.join("run.toml"), toml).unwrap();
    TrainConfig::from_toml_file(&dir.join("run.toml")).unwrap()
}

/// `config` training LoRA adapters (rank 8, alpha 16, all-linear, no dropout) at a learning
/// rate that suits them on the tiny model.
///
/// The adapters move hidden states only, and the logits are those states against the (frozen,
/// tied) embedding table: with the random init's embeddings (std 0.02, norm 0.16 in 64
/// dimensions) no hidden state gives any token a logit beyond about ±1.3, so no policy is far from
/// uniform over 512 tokens and there is nothing to learn. The base's embeddings are therefore
/// scaled by [`LORA_EMBEDDING_SCALE`], as a trained model's spread is.
pub fn with_lora(mut config: TrainConfig) -> TrainConfig {
    scale_embeddings(&config.model, LORA_EMBEDDING_SCALE);
    config.lora = Some(LoraConfig::default());
    config.grpo.optimizer.lr = LORA_LR;
    config
}

pub const LORA_LR: f64 = 0.01;

/// The embeddings' scale for LoRA runs: std 0.13, logits up to about ±8. At ×5 (std 0.1, ±6) the
/// adapters plateaued near a reward of 0.6 and whether 40 steps rose by 0.1 depended on the
/// host's rounding (a bf16 base on AVX2 rose 0.075, with AVX-512 BF16 0.13); at ×6.5, with
/// [`every_question_each_step`], they rise by 0.22 to 0.34 on every path measured.
pub const LORA_EMBEDDING_SCALE: f32 = 6.5;

/// `config` collecting every question of the tiny dataset at each step (6 × 4 = 24 episodes,
/// one mini-batch), halving the reward's sampling variance against [`setup`]'s 12: for the LoRA
/// learning tests, whose adapters learn more slowly than full fine-tuning.
pub fn every_question_each_step(mut config: TrainConfig) -> TrainConfig {
    config.rollout.batch_size = 6;
    config.rollout.generation_batch = 24;
    config.grpo.mini_batch_size = 24;
    config
}

/// Rewrites the checkpoint in `dir` with its embedding table multiplied by `factor`.
pub fn scale_embeddings(dir: &Path, factor: f32) {
    model::checkpoint::scale_tensors(dir, |name| name == "model.embed_tokens.weight", factor).unwrap();
}

pub fn train(config: TrainConfig, steps: u64, resume: bool) -> (Trainer<B>, Vec<StepRecord>) {
    train_on::<B>(config, steps, resume)
}

/// [`train`] on any backend, on its default device.
pub fn train_on<A: AutodiffBackend>(
    config: TrainConfig,
    steps: u64,
    resume: bool,
) -> (Trainer<A>, Vec<StepRecord>) {
    let mut trainer = Trainer::<A>::start(config, Default::default(), resume).unwrap();
    let records = (0..steps)
        .map(|_| trainer.train_step(&Scripted, &ByteTokens).unwrap())
        .collect();
    (trainer, records)
}

/// `run` for each seed, the seeds on threads of their own: the learning tests' runs are
/// independent and mostly single-threaded (tiny shapes), so on CI's 2 cores 5 seeds take about
/// half the time they take one after another. A run that panics fails the caller with its own
/// message. Results in the order of `seeds`.
pub fn for_each_seed<T: Send>(seeds: &[u64], run: impl Fn(u64) -> T + Sync) -> Vec<T> {
    let run = &run;
    std::thread::scope(|scope| {
        let runs: Vec<_> = seeds.iter().map(|&seed| scope.spawn(move || run(seed))).collect();
        runs.into_iter()
            .map(|handle| handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    })
}

pub fn first_last_gap(records: &[StepRecord]) -> (f32, f32) {
    let mean = |rs: &[StepRecord]| rs.iter().map(|r| r.reward_mean).sum::<f32>() / rs.len() as f32;
    (mean(&records[..5]), mean(&records[records.len() - 5..]))
}

/// Every adapter matrix, `lora_A` then `lora_B` of each projection in order, as host values.
pub fn adapter_values<A: burn::tensor::backend::Backend>(adapters: &model::LoraAdapters<A>) -> Vec<Vec<f32>> {
    adapters
        .iter()
        .flat_map(|(_, _, a)| [a.lora_A.val(), a.lora_B.val()])
        .map(|t| t.into_data().to_vec().unwrap())
        .collect()
}

/// A GRPO sequence whose old log-probs are `current` (the model's own) shifted by up to ±0.4,
/// so that some ratios leave the clip range, and whose reference log-probs are shifted by up to
/// ±0.5 the other way.
pub fn shifted_sequence(
    tokens: Vec<u32>,
    loss_mask: Vec<u8>,
    current: &[f32],
    advantage: f32,
) -> prompt_r1_trainer::grpo::PolicySequence {
    let shift = |k: usize, scale: f32| ((k * 7 % 11) as f32 - 5.0) * scale;
    prompt_r1_trainer::grpo::PolicySequence {
        old_logprobs: current.iter().enumerate().map(|(k, l)| l + shift(k, 0.08)).collect(),
        ref_logprobs: Some(current.iter().enumerate().map(|(k, l)| l - shift(k + 3, 0.1)).collect()),
        tokens,
        loss_mask,
        advantage,
    }
}

//! The GRPO training loop: rollouts with the current policy on the plain backend, rewards,
//! group-relative advantages, old and reference log-probs without autodiff, then the clipped
//! policy update on the autodiff backend. The update trains every weight, or (`[lora]`) LoRA
//! adapters beside a frozen base that rollouts, scoring, validation and the KL reference share.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, Module};
use burn::optim::Optimizer;
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use data::{BatchSampler, Example, SamplerConfig};
use env::{Environment, StopReason, Trajectory};
use model::checkpoint::StorageDtype;
use model::tokenizer::Qwen3Tokenizer;
use model::generation::row_seed;
use model::lora::{is_adapter_dir, load_adapter, save_adapter};
use model::{
    load_pretrained, save_pretrained, with_dtype, LoadOptions, LoraAdapters, LoraConfig, LoraModel, Qwen3ForCausalLM, Sampling,
};

use super::checkpoint::{
    checkpoint_name, latest_checkpoint, publish, staging_dir, TrainerState, OPTIMIZER_FILE, STATE_FILE,
};
use super::config::{InferenceDtype, TrainConfig};
use super::error::TrainError;
use super::memory::peak_rss_mb;
use super::metrics_log::{append_record, truncate_after, StepRecord};
use super::dynamic_sampling::groups_without_signal;
use super::reward::{EpisodeScore, EpisodeScorer};
use super::validation::ValidationReport;
use crate::grpo::{
    group_advantages, learn_step, learn_step_lora, sequence_logprobs, PolicyBatch, PolicySequence, StepStats,
};
use crate::optim::AdamWOptimizer;
use crate::rollout::LocalAgent;

type Policy<B> = Qwen3ForCausalLM<B>;
type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// Files copied from the initial model into every checkpoint, so that a checkpoint is a
/// complete HF directory.
const TOKENIZER_FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];

/// What a run trains, with its optimiser.
enum Learner<B: AutodiffBackend> {
    /// Every weight (f32), and a frozen copy of the initial model as the KL reference.
    Full {
        /// Absent only inside a learn step.
        policy: Option<Policy<B>>,
        optimizer: AdamWOptimizer<Policy<B>, B>,
        reference: Option<Policy<Inner<B>>>,
    },
    /// LoRA adapters (f32, with the only optimiser state) beside the frozen base (no gradients,
    /// in `model_dtype`). The KL reference is the base with the adapters off.
    Lora {
        base: Policy<B>,
        /// Absent only inside a learn step.
        adapters: Option<LoraAdapters<B>>,
        optimizer: AdamWOptimizer<LoraAdapters<B>, B>,
    },
}

/// A GRPO run in progress.
pub struct Trainer<B: AutodiffBackend> {
    config: TrainConfig,
    device: B::Device,
    learner: Learner<B>,
    tokenizer: Qwen3Tokenizer,
    train: Vec<Example>,
    validation: Vec<Example>,
    sampler: BatchSampler,
    step: u64,
    last_validation: Option<ValidationReport>,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Starts a run from `config.model`, or continues the newest checkpoint in
    /// `config.run.out_dir` when `resume` is set and one exists.
    pub fn start(config: TrainConfig, device: B::Device, resume: bool) -> Result<Self, TrainError> {
        config.validate().map_err(TrainError::Invalid)?;
        let run_dir = config.run.out_dir.clone();
        std::fs::create_dir_all(&run_dir).map_err(TrainError::io(&run_dir))?;
        let checkpoint = if resume { latest_checkpoint(&run_dir)? } else { None };
        if !resume && latest_checkpoint(&run_dir)?.is_some() {
            return Err(TrainError::Invalid(format!(
                "{} already holds checkpoints: pass --resume to continue it, or choose another run.out_dir",
                run_dir.display()
            )));
        }

        let tokenizer = Qwen3Tokenizer::from_dir(&config.model)?;
        let train = load_examples(&config.data.train, &config)?;
        let mut validation = load_examples(&config.data.validation, &config)?;
        if let Some(limit) = config.data.validation_limit {
            validation.truncate(limit);
        }
        let learner = match &config.lora {
            None => Learner::start_full(&config, &device, checkpoint.as_deref())?,
            Some(lora) => Learner::start_lora(&config, lora, &device, checkpoint.as_deref())?,
        };

        let (sampler, step) = match &checkpoint {
            Some(dir) => {
                let state: TrainerState = read_json(&dir.join(STATE_FILE))?;
                let sampler = BatchSampler::resume(state.cursor, train.len())?;
                truncate_after(&run_dir, state.step)?;
                (sampler, state.step)
            }
            None => {
                let sampler = BatchSampler::new(
                    train.len(),
                    SamplerConfig {
                        batch_size: config.rollout.batch_size,
                        seed: config.run.seed,
                        shuffle: true,
                        drop_last: false,
                    },
                )?;
                (sampler, 0)
            }
        };
        let config_path = run_dir.join("run_config.json");
        let json = serde_json::to_string_pretty(&config).expect("config serialises");
        model::checkpoint::write_atomic(&config_path, json.as_bytes())?;
        Ok(Self {
            config,
            device,
            learner,
            tokenizer,
            train,
            validation,
            sampler,
            step,
            last_validation: None,
        })
    }

    /// Steps completed so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The run's configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The policy's model: the whole policy in full fine-tuning, the frozen base with LoRA
    /// (whose adapters are [`Self::adapters`]).
    pub fn policy(&self) -> &Policy<B> {
        match &self.learner {
            Learner::Full { policy, .. } => policy.as_ref().expect("the policy is only absent inside a learn step"),
            Learner::Lora { base, .. } => base,
        }
    }

    /// The LoRA adapters being trained, if the run trains adapters.
    pub fn adapters(&self) -> Option<&LoraAdapters<B>> {
        match &self.learner {
            Learner::Full { .. } => None,
            Learner::Lora { adapters, .. } => {
                Some(adapters.as_ref().expect("the adapters are only absent inside a learn step"))
            }
        }
    }

    /// The current policy as scoring and generation take it: the model with its adapters.
    pub fn model(&self) -> LoraModel<'_, B> {
        LoraModel::new(self.policy(), self.adapters())
    }

    /// The policy on the plain backend (no autodiff graph): its model and adapters.
    fn inference_policy(&self) -> (Policy<Inner<B>>, Option<LoraAdapters<Inner<B>>>) {
        (self.policy().valid(), self.adapters().map(|a| a.valid()))
    }

    /// One GRPO step: a batch of questions, `n` episodes each, rewards, advantages, update.
    /// The record is also appended to `metrics.jsonl`.
    pub fn train_step(&mut self, env: &dyn Environment, scorer: &dyn EpisodeScorer) -> Result<StepRecord, TrainError> {
        let step = self.step + 1;
        let batch = self.sampler.next_batch();
        let n = self.config.rollout.n;
        let examples: Vec<&Example> = batch
            .indices
            .iter()
            .flat_map(|&i| std::iter::repeat_n(&self.train[i], n))
            .collect();

        let rollout_start = Instant::now();
        let (policy_model, adapters) = self.inference_policy();
        let rollout_model = self.for_rollouts(policy_model.clone());
        let rollout_policy = LoraModel::new(&rollout_model, adapters.as_ref());
        let trajectories = self.rollouts(rollout_policy, env, &examples, step, &self.config.rollout.sampling)?;
        drop(rollout_model);
        let rollout_secs = rollout_start.elapsed().as_secs_f32();

        // Score, drop failed episodes, group by question.
        let mut kept: Vec<(usize, &Trajectory, EpisodeScore)> = Vec::new();
        let mut env_failures = 0;
        let mut first_error = None;
        for (k, (t, ex)) in trajectories.iter().zip(&examples).enumerate() {
            if t.stop_reason == StopReason::EnvFailure {
                env_failures += 1;
                first_error.get_or_insert_with(|| t.error.clone().unwrap_or_default());
                continue;
            }
            kept.push((k / n, t, scorer.score(t, ex.answers())));
        }
        if kept.is_empty() {
            return Err(TrainError::AllEpisodesFailed {
                step,
                first: first_error.unwrap_or_else(|| "no episodes".into()),
            });
        }
        let rewards: Vec<f32> = kept.iter().map(|(_, _, s)| s.reward).collect();
        let groups: Vec<usize> = kept.iter().map(|(g, _, _)| *g).collect();
        let no_signal = groups_without_signal(&rewards, &groups);
        let scored = kept.clone();
        let groups_dropped = if self.config.rollout.dynamic_sampling {
            kept.retain(|(g, _, _)| !no_signal.contains(g));
            no_signal.len()
        } else {
            0
        };
        let learn_start = Instant::now();
        let stats = if kept.is_empty() {
            // Dynamic sampling dropped every group: nothing to learn from this step.
            drop((policy_model, adapters));
            StepStats::default()
        } else {
            self.learn(step, policy_model, adapters, &kept)?
        };
        let learn_secs = learn_start.elapsed().as_secs_f32();
        self.step = step;

        let mean = |xs: &[f32]| xs.iter().sum::<f32>() / xs.len().max(1) as f32;
        let reward_mean = mean(&rewards);
        let reward_std = (rewards.iter().map(|r| (r - reward_mean).powi(2)).sum::<f32>()
            / rewards.len().max(1) as f32)
            .sqrt();
        let optional_mean = |f: fn(&EpisodeScore) -> Option<f32>| {
            let values: Vec<f32> = scored.iter().filter_map(|(_, _, s)| f(s)).collect();
            (!values.is_empty()).then(|| mean(&values))
        };
        let agent_tokens: usize = trajectories.iter().map(|t| t.loss_mask.iter().filter(|&&m| m == 1).count()).sum();
        let mut record = StepRecord {
            step,
            epoch: batch.epoch,
            reward_mean,
            reward_std,
            format_mean: optional_mean(|s| s.format),
            f1_mean: optional_mean(|s| s.f1),
            loss: stats.loss,
            pg_loss: stats.pg_loss,
            kl: stats.kl,
            entropy: stats.entropy,
            clip_frac: stats.clip_frac,
            dual_clip_frac: stats.dual_clip_frac,
            approx_kl: stats.approx_kl,
            grad_norm: stats.mean_grad_norm(),
            optimizer_steps: stats.optimizer_steps,
            skipped_steps: stats.skipped_steps,
            env_failures,
            episodes: trajectories.len(),
            agent_tokens,
            mean_response_tokens: mean(&trajectories.iter().map(|t| t.response_tokens as f32).collect::<Vec<_>>()),
            mean_turns: mean(&trajectories.iter().map(|t| t.turns.len() as f32).collect::<Vec<_>>()),
            rollout_secs,
            learn_secs,
            rollout_tokens_per_sec: agent_tokens as f32 / rollout_secs.max(1e-6),
            validation_reward: None,
            validation_f1: None,
            peak_rss_mb: peak_rss_mb().map(|mb| mb as f32),
            groups_no_signal: no_signal.len(),
            groups_dropped,
            validation_by_source: BTreeMap::new(),
        };
        let every = self.config.run.validate_every;
        self.last_validation = None;
        if every > 0 && step % every == 0 && !self.validation.is_empty() {
            self.validate_into(&mut record, env, scorer)?;
        }
        append_record(&self.config.run.out_dir, &record)?;
        Ok(record)
    }

    /// Validates the initial policy before the first step when `run.validate_before_train`
    /// asks for it and there is validation data, writing the results as the `step` 0 line of
    /// `metrics.jsonl`. Does nothing (and returns `None`) otherwise, or after step 0.
    pub fn validate_before_training(
        &mut self,
        env: &dyn Environment,
        scorer: &dyn EpisodeScorer,
    ) -> Result<Option<StepRecord>, TrainError> {
        if self.step != 0 || !self.config.run.validate_before_train || self.validation.is_empty() {
            return Ok(None);
        }
        let mut record = StepRecord {
            peak_rss_mb: peak_rss_mb().map(|mb| mb as f32),
            ..StepRecord::default()
        };
        self.validate_into(&mut record, env, scorer)?;
        append_record(&self.config.run.out_dir, &record)?;
        Ok(Some(record))
    }

    /// The validation of the last step that validated (or of [`Self::validate_before_training`]),
    /// with its per-source table.
    pub fn last_validation(&self) -> Option<&ValidationReport> {
        self.last_validation.as_ref()
    }

    fn validate_into(
        &mut self,
        record: &mut StepRecord,
        env: &dyn Environment,
        scorer: &dyn EpisodeScorer,
    ) -> Result<(), TrainError> {
        let report = self.validate(env, scorer)?;
        record.validation_reward = Some(report.reward_mean);
        record.validation_f1 = report.f1_mean;
        record.validation_by_source = report.metrics();
        self.last_validation = Some(report);
        Ok(())
    }

    /// Advantages, old and reference log-probs (without autodiff), then the clipped policy
    /// update on the `(group, trajectory, score)` episodes.
    fn learn(
        &mut self,
        step: u64,
        policy_model: Policy<Inner<B>>,
        adapters: Option<LoraAdapters<Inner<B>>>,
        kept: &[(usize, &Trajectory, EpisodeScore)],
    ) -> Result<StepStats, TrainError> {
        let rewards: Vec<f32> = kept.iter().map(|(_, _, s)| s.reward).collect();
        let groups: Vec<usize> = kept.iter().map(|(g, _, _)| *g).collect();
        let advantages = group_advantages(&rewards, &groups, self.config.rollout.advantage)?;

        // Old (the policy before this update) and reference log-probs, without autodiff. With
        // LoRA the reference is the same base with the adapters off.
        let sequences: Vec<Vec<u32>> = kept.iter().map(|(_, t, _)| t.token_ids.clone()).collect();
        let pad = self.tokenizer.special().endoftext;
        let chunk = self.config.grpo.micro_batch_size.max(1);
        let old = sequence_logprobs(&LoraModel::new(&policy_model, adapters.as_ref()), &sequences, pad, chunk)?;
        let reference = match &self.learner {
            Learner::Full { reference: Some(r), .. } => Some(sequence_logprobs(r, &sequences, pad, chunk)?),
            Learner::Lora { .. } if self.config.grpo.loss.uses_kl() => {
                Some(sequence_logprobs(&policy_model, &sequences, pad, chunk)?)
            }
            _ => None,
        };
        drop((policy_model, adapters));
        let policy_sequences: Vec<PolicySequence> = kept
            .iter()
            .enumerate()
            .map(|(i, (_, t, _))| PolicySequence {
                tokens: t.token_ids.clone(),
                loss_mask: t.loss_mask.clone(),
                old_logprobs: old[i].clone(),
                ref_logprobs: reference.as_ref().map(|r| r[i].clone()),
                advantage: advantages[i],
            })
            .collect();
        let batch_data = PolicyBatch::new(policy_sequences)?;
        let grpo = &self.config.grpo;
        let stats = match &mut self.learner {
            Learner::Full { policy, optimizer, .. } => {
                let model = policy.take().expect("policy present between steps");
                let (model, stats) = learn_step(model, optimizer, &batch_data, grpo)?;
                *policy = Some(model);
                stats
            }
            Learner::Lora { base, adapters, optimizer } => {
                let trained = adapters.take().expect("adapters present between steps");
                if trained.config().dropout > 0.0 {
                    // Dropout masks from a stream of the seed and the step: a resumed run draws
                    // what an uninterrupted one would.
                    B::seed(&self.device, row_seed(self.config.run.seed, step));
                }
                let (trained, stats) = learn_step_lora(base, trained, optimizer, &batch_data, grpo)?;
                *adapters = Some(trained);
                stats
            }
        };
        Ok(stats)
    }

    /// Greedy episodes on the held-out set with the current policy.
    pub fn validate(&self, env: &dyn Environment, scorer: &dyn EpisodeScorer) -> Result<ValidationReport, TrainError> {
        let (policy_model, adapters) = self.inference_policy();
        let model = self.for_rollouts(policy_model);
        let examples: Vec<&Example> = self.validation.iter().collect();
        let greedy = Sampling {
            temperature: 0.0,
            ..self.config.rollout.sampling.clone()
        };
        let trajectories = self.rollouts(LoraModel::new(&model, adapters.as_ref()), env, &examples, 0, &greedy)?;
        Ok(ValidationReport::from_scores(trajectories.iter().zip(&examples).map(|(t, ex)| {
            let score = (t.stop_reason != StopReason::EnvFailure).then(|| scorer.score(t, ex.answers()));
            (ex.data_source(), score)
        })))
    }

    /// The model episodes sample from: the policy (or LoRA base) itself, or its copy in
    /// `rollout.dtype` (LoRA adapters stay f32).
    fn for_rollouts(&self, policy: Policy<Inner<B>>) -> Policy<Inner<B>> {
        match self.config.rollout.dtype {
            InferenceDtype::F32 => policy,
            other => with_dtype(policy, other.dtype()),
        }
    }

    /// Runs one episode per example, `generation_batch` at a time. Every chunk samples from its
    /// own stream of `sampling.seed`, `stream` and the chunk number.
    fn rollouts(
        &self,
        model: LoraModel<'_, Inner<B>>,
        env: &dyn Environment,
        examples: &[&Example],
        stream: u64,
        sampling: &Sampling,
    ) -> Result<Vec<Trajectory>, TrainError> {
        let mut agent = LocalAgent::new(model.base, &self.tokenizer, sampling.clone()).with_adapters(model.adapters);
        let episode = self.config.episode.episode_config()?;
        let mut out = Vec::with_capacity(examples.len());
        for (c, chunk) in examples.chunks(self.config.rollout.generation_batch).enumerate() {
            agent.set_batch_stream((stream << 20) | c as u64);
            let questions: Vec<&str> = chunk.iter().map(|e| e.question()).collect();
            out.extend(env::run_episodes(&mut agent, env, &questions, &episode));
        }
        Ok(out)
    }

    /// Writes a checkpoint of the current state (see the module docs of `checkpoint`).
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        let run_dir = &self.config.run.out_dir;
        let name = checkpoint_name(self.step);
        let tmp = staging_dir(run_dir, &name)?;
        let optimizer_state = |result: Result<(), burn::record::RecorderError>| {
            result.map_err(|e| TrainError::Checkpoint { path: tmp.clone(), reason: format!("optimizer state: {e}") })
        };
        let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
        match &self.learner {
            Learner::Full { optimizer, .. } => {
                save_pretrained(&self.policy().valid(), &tmp, StorageDtype::F32)?;
                optimizer_state(recorder.record(optimizer.to_record(), tmp.join(OPTIMIZER_FILE)))?;
            }
            Learner::Lora { optimizer, .. } => {
                let adapters = self.adapters().expect("a LoRA run has adapters").valid();
                save_adapter(&adapters, &tmp, &self.config.model.to_string_lossy())?;
                optimizer_state(recorder.record(optimizer.to_record(), tmp.join(OPTIMIZER_FILE)))?;
            }
        }
        for file in TOKENIZER_FILES {
            let from = self.config.model.join(file);
            if from.is_file() {
                std::fs::copy(&from, tmp.join(file)).map_err(TrainError::io(&from))?;
            }
        }
        let state = TrainerState {
            step: self.step,
            cursor: self.sampler.cursor(),
            seed: self.config.run.seed,
        };
        let json = serde_json::to_string_pretty(&state).expect("state serialises");
        model::checkpoint::write_atomic(&tmp.join(STATE_FILE), json.as_bytes())?;
        publish(run_dir, &tmp, &name, self.config.run.keep_checkpoints)
    }

    /// The device the run computes on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }
}

impl<B: AutodiffBackend> Learner<B> {
    /// Full fine-tuning from `config.model`, or from `checkpoint` with its optimiser state.
    fn start_full(config: &TrainConfig, device: &B::Device, checkpoint: Option<&Path>) -> Result<Self, TrainError> {
        let matmul = config.grpo.matmul;
        let reference = if config.grpo.loss.uses_kl() {
            let options = LoadOptions { dtype: config.rollout.dtype.dtype() };
            Some(load_pretrained::<Inner<B>>(&config.model, device, options)?.with_matmul_precision(matmul))
        } else {
            None
        };
        let mut optimizer = config.grpo.optimizer.init::<B, Policy<B>>()?;
        let policy = match checkpoint {
            Some(dir) => {
                if is_adapter_dir(dir) {
                    return Err(TrainError::Checkpoint {
                        path: dir.to_path_buf(),
                        reason: "it holds LoRA adapters but the config has no [lora] section".into(),
                    });
                }
                optimizer = optimizer.load_record(load_optimizer_record(dir, device)?);
                load_pretrained::<B>(dir, device, LoadOptions::default())?
            }
            None => load_pretrained::<B>(&config.model, device, LoadOptions::default())?,
        };
        Ok(Learner::Full { policy: Some(policy.with_matmul_precision(matmul)), optimizer, reference })
    }

    /// LoRA on the frozen `config.model` (in `model_dtype`): fresh adapters (seeded by
    /// `run.seed`), or the checkpoint's with their optimiser state.
    fn start_lora(
        config: &TrainConfig,
        lora: &LoraConfig,
        device: &B::Device,
        checkpoint: Option<&Path>,
    ) -> Result<Self, TrainError> {
        let options = LoadOptions { dtype: config.model_dtype.dtype() };
        let base = load_pretrained::<B>(&config.model, device, options)?
            .no_grad()
            .with_matmul_precision(config.grpo.matmul);
        let mut optimizer = config.grpo.optimizer.init::<B, LoraAdapters<B>>()?;
        let adapters = match checkpoint {
            Some(dir) => {
                if !is_adapter_dir(dir) {
                    return Err(TrainError::Checkpoint {
                        path: dir.to_path_buf(),
                        reason: "it holds a whole model, not LoRA adapters, but the config has a [lora] section".into(),
                    });
                }
                let (adapters, saved) = load_adapter::<B>(dir, &base.config, device)?;
                let same = |a: &LoraConfig| (a.rank, a.alpha, a.target_modules.clone());
                if same(&saved.lora) != same(lora) {
                    return Err(TrainError::Checkpoint {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "its adapters (rank {}, alpha {}, {:?}) differ from the config's [lora] (rank {}, alpha {}, {:?})",
                            saved.lora.rank, saved.lora.alpha, saved.lora.target_modules, lora.rank, lora.alpha, lora.target_modules
                        ),
                    });
                }
                optimizer = optimizer.load_record(load_optimizer_record(dir, device)?);
                // The config's dropout applies (PEFT's file records it too, but a resumed run
                // follows the run's settings).
                LoraAdapters::from_weights(lora, &base.config, device, |layer, target, _| {
                    let a = adapters.layers[layer].get(target).expect("same targets, checked above");
                    model::lora::AdapterWeights { lora_A: a.lora_A.val().into_data(), lora_B: a.lora_B.val().into_data() }
                })
            }
            None => LoraAdapters::init(lora, &base.config, config.run.seed, device),
        };
        Ok(Learner::Lora { base, adapters: Some(adapters), optimizer })
    }
}

/// The optimiser state saved in a checkpoint.
fn load_optimizer_record<R: burn::record::Record<B>, B: burn::tensor::backend::Backend>(
    dir: &Path,
    device: &B::Device,
) -> Result<R, TrainError> {
    BinFileRecorder::<FullPrecisionSettings>::new()
        .load(dir.join(OPTIMIZER_FILE), device)
        .map_err(|e| TrainError::Checkpoint { path: dir.to_path_buf(), reason: format!("optimizer state: {e}") })
}

fn load_examples(files: &[PathBuf], config: &TrainConfig) -> Result<Vec<Example>, TrainError> {
    let mut all = Vec::new();
    for file in files {
        all.extend(data::load(file, config.on_bad_row())?.into_examples());
    }
    Ok(all)
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, TrainError> {
    let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
    serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

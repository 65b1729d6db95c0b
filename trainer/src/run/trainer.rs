//! The GRPO training loop: rollouts with the current policy on the plain backend, rewards,
//! group-relative advantages, old and reference log-probs without autodiff, then the clipped
//! policy update on the autodiff backend. The update trains every weight, or (`[lora]`) LoRA
//! adapters beside a frozen base that rollouts, scoring, validation and the KL reference share.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use data::{BatchSampler, Example};
use env::{Environment, StopReason, Trajectory};
use model::tokenizer::Qwen3Tokenizer;
use model::lora::merge_adapters;
use model::{load_pretrained, with_dtype, LoadOptions, LoraAdapters, LoraModel, Qwen3ForCausalLM, Sampling};

use super::config::{InferenceDtype, RolloutSection, TrainConfig};
use super::dynamic_sampling::groups_without_signal;
use super::error::TrainError;
use super::learner::{Learner, LearnerSettings, Update};
use super::memory::{end_device_phase, gib, peak_rss_mb, reset_peak_rss, DeviceMemoryProbe};
use super::metrics_log::StepRecord;
use super::reward::{EpisodeScore, EpisodeScorer};
use super::session::{Resume, RunSession, SessionSettings, SettingsRecord, SteppedRun};
use super::validation::ValidationReport;
use crate::grpo::{
    group_advantages, learn, sequence_logprobs, LearnConfig, PolicyBatch, PolicySequence, StepStats, Trainable,
};
use crate::optim::AdamWOptimizer;
use crate::rollout::{engine_for, RolloutBatch, RolloutEngine, RolloutStats};

type Policy<B> = Qwen3ForCausalLM<B>;
type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// A GRPO run in progress.
pub struct Trainer<B: AutodiffBackend> {
    config: TrainConfig,
    session: RunSession,
    device: B::Device,
    learner: Learner<B>,
    /// The frozen initial model as the KL reference, in full fine-tuning with a KL term (with
    /// LoRA the reference is the base with the adapters off).
    reference: Option<Policy<Inner<B>>>,
    tokenizer: Qwen3Tokenizer,
    train: Vec<Example>,
    validation: Vec<Example>,
    sampler: BatchSampler,
    step: u64,
    last_validation: Option<ValidationReport>,
    /// Tokens of the longest first prompt among the training and validation questions.
    longest_prompt: usize,
    /// What generates the episodes (`rollout.engine`).
    engine: Box<dyn RolloutEngine<Inner<B>>>,
    /// Whether the engine has been told of the current policy (see [`Self::sync_policy`]).
    policy_synced: bool,
    /// Reads the device's memory pool as each phase ends ([`Self::watch_device_memory`]).
    device_memory: Option<DeviceMemoryProbe>,
    /// What the pool reserved at most in this step's phases, by that probe.
    reserved: PhaseReserved,
}

/// Bytes the device's memory pool reserved at most in a step's rollouts (validation's
/// included) and in its scoring and update; `None` where nothing was read.
#[derive(Debug, Clone, Copy, Default)]
struct PhaseReserved {
    rollouts: Option<u64>,
    update: Option<u64>,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// Starts a run from `config.model`, or continues a checkpoint in `config.run.out_dir` as
    /// `resume` says (`true`: the newest, if there is one; see [`Resume`] and [`RunSession`]).
    pub fn start(
        config: TrainConfig,
        device: B::Device,
        resume: impl Into<Resume>,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        let mut session = RunSession::open(
            SessionSettings {
                out_dir: &config.run.out_dir,
                initial: &config.model,
                seed: config.run.seed,
                save_every: config.run.save_every,
                keep_checkpoints: config.run.keep_checkpoints,
            },
            resume.into(),
        )?;

        let tokenizer = Qwen3Tokenizer::from_dir(&config.model)?;
        let train = load_examples(&config.data.train, &config)?;
        if train.is_empty() {
            let files: Vec<String> = config.data.train.iter().map(|f| f.display().to_string()).collect();
            return Err(TrainError::Invalid(format!(
                "data.train holds no question to train on: {} (every row empty{})",
                files.join(", "),
                if config.on_bad_row() == data::OnBadRow::Skip { ", or skipped as malformed" } else { "" }
            )));
        }
        let mut validation = load_examples(&config.data.validation, &config)?;
        if let Some(limit) = config.data.validation_limit {
            validation.truncate(limit);
        }
        let settings = LearnerSettings {
            model: &config.model,
            model_dtype: config.model_dtype,
            lora: config.lora.as_ref(),
            compute: config.compute(),
            optimizer: &config.grpo.optimizer,
            seed: config.run.seed,
        };
        // Before the weights load: config.json alone gives the context and the vocabulary.
        let model_config = model::Qwen3Config::from_file(&config.model.join("config.json"))?;
        tokenizer.check_fits_vocabulary(&config.model, model_config.vocab_size)?;
        let context = model_config.max_position_embeddings;
        let longest_prompt = check_episodes_fit_the_context(&config, &tokenizer, context, train.iter().chain(&validation))?;
        let learner = session.load(|checkpoint| Learner::start(&settings, &device, checkpoint))?;
        let reference = if config.lora.is_none() && config.grpo.loss.uses_kl() {
            let options = LoadOptions { dtype: config.rollout.dtype.dtype(), compute: config.compute() };
            Some(load_pretrained::<Inner<B>>(&config.model, &device, options)?)
        } else {
            None
        };
        let sampler = session.sampler(train.len(), config.rollout.batch_size, "rollout.batch_size", "run.seed")?;
        let step = session.start_step();
        let engine = engine_for::<Inner<B>>(&config)?;
        let record = SettingsRecord { settings: &config, kernels: config.compute().kernels_on::<Inner<B>>() };
        session.begin("run_config.json", &record, config.run.steps)?;
        Ok(Self {
            config,
            session,
            device,
            learner,
            reference,
            tokenizer,
            train,
            validation,
            sampler,
            step,
            last_validation: None,
            longest_prompt,
            engine,
            policy_synced: false,
            device_memory: None,
            reserved: PhaseReserved::default(),
        })
    }

    /// Has each step read the device's memory pool with `probe` as its rollouts and its update
    /// end (on the trainer's thread), into `perf/max_memory_reserved_gb` and the per-phase keys
    /// of `metrics.jsonl`. Without a probe (the CPU) those keys are null.
    pub fn watch_device_memory(&mut self, probe: DeviceMemoryProbe) {
        self.device_memory = Some(probe);
    }

    /// Ends a phase on the device: its queued work run, the pool read (see
    /// [`end_device_phase`]), its unused pages given back. Returns the bytes the pool reserved.
    fn end_phase(&self) -> Result<Option<u64>, TrainError> {
        Ok(end_device_phase::<B>(&self.device, self.device_memory.as_ref())?.map(|m| m.reserved))
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
        self.learner.model()
    }

    /// The LoRA adapters being trained, if the run trains adapters.
    pub fn adapters(&self) -> Option<&LoraAdapters<B>> {
        self.learner.adapters()
    }

    /// The current policy as scoring and generation take it: the model with its adapters.
    pub fn model(&self) -> LoraModel<'_, B> {
        self.learner.policy()
    }

    /// The policy on the plain backend (no autodiff graph): its model and adapters.
    fn inference_policy(&self) -> (Policy<Inner<B>>, Option<LoraAdapters<Inner<B>>>) {
        (self.policy().valid(), self.adapters().map(|a| a.valid()))
    }

    /// One GRPO step: a batch of questions, `n` episodes each, rewards, advantages, update.
    /// The record is also appended to `metrics.jsonl`.
    pub fn train_step(&mut self, env: &dyn Environment, scorer: &dyn EpisodeScorer) -> Result<StepRecord, TrainError> {
        reset_peak_rss();
        self.reserved = PhaseReserved::default();
        let step = self.step + 1;
        let batch = self.sampler.next_batch();
        let n = self.config.rollout.n;
        let picked: Vec<usize> = batch.indices.iter().flat_map(|&i| std::iter::repeat_n(i, n)).collect();
        let questions: Vec<String> = picked.iter().map(|&i| self.train[i].question().to_string()).collect();

        let rollout_start = Instant::now();
        self.sync_policy()?;
        let (policy_model, adapters) = self.inference_policy();
        let sampling = self.config.rollout.sampling.clone();
        let (trajectories, rolled) = self.rollouts(&policy_model, adapters.as_ref(), env, &questions, step, &sampling)?;
        let decoded = rolled.decoder;
        let rollout_secs = rollout_start.elapsed().as_secs_f32();
        let examples: Vec<&Example> = picked.iter().map(|&i| &self.train[i]).collect();

        // Score, drop failed episodes (the environment's or the agent's generation: neither is
        // the policy's doing, so neither is learnt from), group by question.
        let mut kept: Vec<(usize, &Trajectory, EpisodeScore)> = Vec::new();
        let (mut env_failures, mut agent_failures) = (0, 0);
        let (mut env_failure_why, mut agent_failure_why) = (None, None);
        for (k, (t, ex)) in trajectories.iter().zip(&examples).enumerate() {
            let (count, why) = match t.stop_reason {
                StopReason::EnvFailure => (&mut env_failures, &mut env_failure_why),
                StopReason::AgentFailure => (&mut agent_failures, &mut agent_failure_why),
                _ => {
                    kept.push((k / n, t, scorer.score(t, ex.answers())));
                    continue;
                }
            };
            *count += 1;
            why.get_or_insert_with(|| t.error.clone().unwrap_or_else(|| "no reason given".into()));
        }
        if kept.is_empty() {
            return Err(TrainError::AllEpisodesFailed {
                step,
                first: env_failure_why.or(agent_failure_why).unwrap_or_else(|| "no episodes".into()),
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
            // The engine hears of the new policy before its next rollout.
            self.policy_synced = false;
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
            policy: stats.policy,
            grad_norm: stats.mean_grad_norm(),
            optimizer_steps: stats.optimizer_steps,
            skipped_steps: stats.skipped_steps,
            env_failures,
            agent_failures,
            env_failure_why,
            agent_failure_why,
            episodes: trajectories.len(),
            agent_tokens,
            mean_response_tokens: mean(&trajectories.iter().map(|t| t.response_tokens as f32).collect::<Vec<_>>()),
            mean_turns: mean(&trajectories.iter().map(|t| t.turns.len() as f32).collect::<Vec<_>>()),
            rollout_secs,
            learn_secs,
            rollout_tokens_per_sec: agent_tokens as f32 / rollout_secs.max(1e-6),
            prefill_tokens: decoded.prefill_tokens,
            shared_prefix_tokens: decoded.shared_prefix_tokens,
            context_tokens: trajectories.iter().map(|t| t.token_ids.len() as u64).sum(),
            kv_peak_positions: decoded.peak_kv_positions as u64,
            preemptions: decoded.preemptions + decoded.evictions,
            server_retries: rolled.server_retries,
            workers_left_out: rolled.workers_left_out.len() as u64,
            workers_left_out_why: rolled.workers_left_out,
            rollout_decode_secs: rolled.steps.decode_time.as_secs_f32(),
            rollout_prefill_secs: rolled.steps.prefill_time.as_secs_f32(),
            rollout_rows_per_step: rolled.steps.rows_per_step(decoded.decode_tokens) as f32,
            validation_reward: None,
            validation_f1: None,
            peak_rss_mb: peak_rss_mb().map(|mb| mb as f32),
            // Set below, once the validation's rollouts have run too.
            max_memory_reserved_gb: None,
            gen_max_memory_reserved_gb: None,
            update_max_memory_reserved_gb: None,
            groups_no_signal: no_signal.len(),
            groups_dropped,
            validation_by_source: BTreeMap::new(),
        };
        let every = self.config.run.validate_every;
        self.last_validation = None;
        if every > 0 && step % every == 0 && !self.validation.is_empty() {
            self.validate_into(&mut record, env, scorer)?;
        }
        let PhaseReserved { rollouts, update } = self.reserved;
        record.max_memory_reserved_gb = rollouts.max(update).map(gib);
        record.gen_max_memory_reserved_gb = rollouts.map(gib);
        record.update_max_memory_reserved_gb = update.map(gib);
        self.session.record(&record)?;
        Ok(record)
    }

    /// Validates the initial policy before the first step when `run.validate_before_train`
    /// asks for it and there is validation data, writing the results as the `step` 0 line of
    /// `metrics.jsonl`: the validation keys only ([`StepRecord::validation_only`]; the record
    /// returned has only its validation fields set). Does nothing (and returns `None`)
    /// otherwise, or after step 0.
    pub fn validate_before_training(
        &mut self,
        env: &dyn Environment,
        scorer: &dyn EpisodeScorer,
    ) -> Result<Option<StepRecord>, TrainError> {
        if self.step != 0 || !self.config.run.validate_before_train || self.validation.is_empty() {
            return Ok(None);
        }
        let mut record = StepRecord::default();
        self.validate_into(&mut record, env, scorer)?;
        self.session.record(&record.validation_only())?;
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
        record.validation_reward = report.reward_mean;
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
        let reference = match (&self.reference, &self.learner) {
            (Some(r), _) => Some(sequence_logprobs(r, &sequences, pad, chunk)?),
            (None, Learner::Lora { .. }) if self.config.grpo.loss.uses_kl() => {
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
        let batch = PolicyBatch::new(policy_sequences)?;
        let update = GrpoUpdate { batch: &batch, config: &self.config.grpo };
        let stats = self.learner.update(update, self.config.run.seed, step, &self.device)?;
        // The update's activations and gradients are gone: their pages go back before the
        // next rollouts.
        self.reserved.update = self.end_phase()?;
        Ok(stats)
    }

    /// Greedy episodes on the held-out set with the current policy.
    pub fn validate(&mut self, env: &dyn Environment, scorer: &dyn EpisodeScorer) -> Result<ValidationReport, TrainError> {
        self.sync_policy()?;
        let (policy_model, adapters) = self.inference_policy();
        let questions: Vec<String> = self.validation.iter().map(|e| e.question().to_string()).collect();
        let greedy = Sampling {
            temperature: 0.0,
            ..self.config.rollout.sampling.clone()
        };
        let (trajectories, _) = self.rollouts(&policy_model, adapters.as_ref(), env, &questions, 0, &greedy)?;
        let mut report = ValidationReport::from_scores(trajectories.iter().zip(&self.validation).map(|(t, ex)| {
            let score = (t.stop_reason != StopReason::EnvFailure).then(|| scorer.score(t, ex.answers()));
            (ex.data_source(), score)
        }));
        report.first_failure = trajectories
            .iter()
            .find(|t| t.stop_reason == StopReason::EnvFailure)
            .map(|t| t.error.clone().unwrap_or_else(|| "no reason given".into()));
        Ok(report)
    }

    /// Tells the engine of the current policy, once after each update (and before the first
    /// rollout): rollout workers load it before they sample again.
    fn sync_policy(&mut self) -> Result<(), TrainError> {
        if self.policy_synced {
            return Ok(());
        }
        let (policy_model, adapters) = self.inference_policy();
        self.engine.policy_changed(self.step, LoraModel::new(&policy_model, adapters.as_ref()))?;
        self.policy_synced = true;
        Ok(())
    }

    /// One episode per question from the engine ([`RolloutEngine::rollouts`]), each sampling
    /// from its own stream of `sampling.seed`, `stream` and its place among `questions`. A
    /// local engine samples from the policy in `rollout.dtype`, its LoRA adapters merged in
    /// unless `rollout.merge_lora` is off ([`for_rollouts`]).
    fn rollouts(
        &mut self,
        policy_model: &Policy<Inner<B>>,
        adapters: Option<&LoraAdapters<Inner<B>>>,
        env: &dyn Environment,
        questions: &[impl AsRef<str>],
        stream: u64,
        sampling: &Sampling,
    ) -> Result<(Vec<Trajectory>, RolloutStats), TrainError> {
        let copy = self.engine.samples_locally().then(|| for_rollouts(policy_model.clone(), adapters, &self.config.rollout));
        let (model, adapters) = match &copy {
            Some((model, true)) => (model, None),
            Some((model, false)) => (model, adapters),
            None => (policy_model, adapters),
        };
        let episode = self.config.episode.episode_config()?;
        let questions: Vec<&str> = questions.iter().map(AsRef::as_ref).collect();
        let rolled = self.engine.rollouts(RolloutBatch {
            policy: LoraModel::new(model, adapters),
            tokenizer: &self.tokenizer,
            env,
            questions: &questions,
            episode: &episode,
            stream,
            sampling,
            // A KV budget must hold the run's longest episode, whichever questions this batch
            // drew, so that a run too long for it stops before its first episode.
            longest_prompt: self.longest_prompt,
        });
        // The episodes' KV caches and the rollouts' copy of the policy are gone: their pages
        // go back before scoring and the update allocate theirs.
        drop(copy);
        let reserved = self.end_phase()?;
        self.reserved.rollouts = self.reserved.rollouts.max(reserved);
        rolled
    }

    /// Writes a checkpoint of the current state (see the module docs of `checkpoint`).
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        self.session.save(&self.learner, self.step, self.sampler.cursor())
    }

    /// The run's session: its directory, resume and checkpoint cadence.
    pub fn session(&self) -> &RunSession {
        &self.session
    }

    /// The device the run computes on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }
}

impl<B: AutodiffBackend> SteppedRun for Trainer<B> {
    type Record = StepRecord;

    fn session(&self) -> &RunSession {
        &self.session
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    /// `run.steps`.
    fn last_step(&self) -> u64 {
        self.config.run.steps
    }

    fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        Trainer::save_checkpoint(self)
    }
}

/// The GRPO update of one step's batch ([`crate::grpo::learn`]), on either kind of learner.
struct GrpoUpdate<'a> {
    batch: &'a PolicyBatch,
    config: &'a LearnConfig,
}

impl<B: AutodiffBackend> Update<B> for GrpoUpdate<'_> {
    type Stats = StepStats;

    fn apply<M: Trainable<B>>(
        self,
        module: M,
        frozen: &M::Frozen,
        optimizer: &mut AdamWOptimizer<M, B>,
    ) -> Result<(M, StepStats), TrainError> {
        Ok(learn(module, frozen, optimizer, self.batch, self.config)?)
    }
}

/// Refuses, before any episode, a run whose longest episode could outgrow the model's context:
/// the longest first prompt among `examples` plus `episode.max_response_tokens` must fit
/// `max_position_embeddings` (`context`), as vLLM refuses requests past `max_model_len`.
/// Otherwise the rollouts would run past the positions the model was trained for (the local
/// engine) or have every turn refused (rollout servers). Returns the longest first prompt's
/// tokens.
fn check_episodes_fit_the_context<'e>(
    config: &TrainConfig,
    tokenizer: &Qwen3Tokenizer,
    context: usize,
    examples: impl Iterator<Item = &'e Example>,
) -> Result<usize, TrainError> {
    let episode = config.episode.episode_config()?;
    let (prompt, question) = crate::rollout::longest_first_prompt(tokenizer, examples.map(Example::question), &episode)?;
    let responses = config.episode.max_response_tokens;
    if prompt >= context {
        let shown: String = question.chars().take(60).collect();
        return Err(TrainError::Invalid(format!(
            "a question is too long for the model's context of {context} tokens (max_position_embeddings in {}): \
             its first prompt alone has {prompt} tokens (question \"{shown}\"); shorten it or leave it out of the data",
            config.model.join("config.json").display()
        )));
    }
    if prompt + responses > context {
        let shown: String = question.chars().take(60).collect();
        return Err(TrainError::Invalid(format!(
            "an episode may not fit the model's context of {context} tokens (max_position_embeddings in {}): \
             the longest first prompt has {prompt} tokens (question \"{shown}\"), plus episode.max_response_tokens = {responses}; \
             lower episode.max_response_tokens to at most {}",
            config.model.join("config.json").display(),
            context.saturating_sub(prompt)
        )));
    }
    Ok(prompt)
}

fn load_examples(files: &[PathBuf], config: &TrainConfig) -> Result<Vec<Example>, TrainError> {
    let mut all = Vec::new();
    for file in files {
        all.extend(data::load(file, config.on_bad_row())?.into_examples());
    }
    Ok(all)
}

/// The model a local engine's episodes sample from, and whether `adapters` are merged into it:
/// the policy (or LoRA base) itself, or a copy with the adapters merged
/// (`rollout.merge_lora`) and in `rollout.dtype` (unmerged adapters stay f32). A copy whose
/// stacked projections' weights are all new (cast, or merged with adapters on every one of
/// them, as the default `target_modules` has) is prepared for inference on `B` (stacked where a
/// GPU backend's kernels read them in place, `Qwen3ForCausalLM::for_inference`): the separate
/// weights become views of the stacked ones, so no weight is held twice. Elsewhere stacking
/// would copy weights the policy still holds, and the model is left as it is.
fn for_rollouts<B: Backend>(policy: Policy<B>, adapters: Option<&LoraAdapters<B>>, rollout: &RolloutSection) -> (Policy<B>, bool) {
    let (policy, merged) = match adapters {
        Some(adapters) if rollout.merge_lora => (merge_adapters(policy, adapters), true),
        _ => (policy, false),
    };
    // f32 leaves the policy's dtype as it is; a cast to the dtype it has copies nothing.
    let cast_to = match rollout.dtype {
        InferenceDtype::F32 => None,
        other => Some(other.dtype()).filter(|&dtype| policy.model.layers.first().is_some_and(|l| l.self_attn.q_proj.weight.dtype() != dtype)),
    };
    let (policy, cast) = match cast_to {
        Some(dtype) => (with_dtype(policy, dtype), true),
        None => (policy, false),
    };
    let fresh = cast || (merged && adapters.is_some_and(LoraAdapters::adapt_every_stacked_projection));
    let policy = if fresh { policy.for_inference() } else { policy };
    (policy, merged)
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{DType, Int, Tensor};
    use model::checkpoint::StorageDtype;
    use model::init::write_random_checkpoint;
    use model::{LoraConfig, Preset};

    use super::*;

    /// With LoRA the rollouts sample from the base with the adapters merged (`merge_lora`, the
    /// default), which computes what the base with the adapters computes (f32: within 1e-5 of
    /// the logits), in `rollout.dtype`; with `merge_lora = false` the adapters go beside the
    /// base as they are.
    #[test]
    fn rollouts_sample_from_the_merged_adapters() {
        let config = Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        write_random_checkpoint(&config, dir.path(), 3, StorageDtype::F32).unwrap();
        let device = Default::default();
        let base = load_pretrained::<Flex>(dir.path(), &device, LoadOptions::default()).unwrap();
        let mut adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &config, 1, &device);
        for layer in &mut adapters.layers {
            for a in [&mut layer.q_proj, &mut layer.v_proj, &mut layer.up_proj].into_iter().flatten() {
                a.lora_B = a.lora_B.clone().map(|b| b.ones_like().mul_scalar(0.05));
            }
        }
        let logits = |model: LoraModel<'_, Flex>| -> Vec<f32> {
            let ids = Tensor::<Flex, 2, Int>::from_ints([[1, 5, 9, 200, 7]], &device);
            let positions = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 2, 3, 4]], &device);
            model.base.forward_with_adapters(ids, positions, None, None, model.adapters).cast(DType::F32).into_data().to_vec().unwrap()
        };
        let adapted = logits(LoraModel::new(&base, Some(&adapters)));
        let plain = logits(LoraModel::new(&base, None));
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(diff(&adapted, &plain) > 1e-2, "the adapters change the logits");

        let rollout = RolloutSection::default();
        assert!(rollout.merge_lora, "merging is the default");
        let (merged, was_merged) = for_rollouts(base.clone(), Some(&adapters), &rollout);
        assert!(was_merged);
        let worst = diff(&logits(LoraModel::new(&merged, None)), &adapted);
        assert!(worst < 1e-5, "merged against adapters beside the base: {worst}");

        let bf16 = RolloutSection { dtype: InferenceDtype::Bf16, ..RolloutSection::default() };
        let (merged, _) = for_rollouts(base.clone(), Some(&adapters), &bf16);
        assert_eq!(merged.model.layers[0].self_attn.q_proj.weight.val().dtype(), DType::BF16);

        let apart = RolloutSection { merge_lora: false, ..RolloutSection::default() };
        let (same, was_merged) = for_rollouts(base.clone(), Some(&adapters), &apart);
        assert!(!was_merged);
        assert_eq!(logits(LoraModel::new(&same, None)), plain, "the base as it was");
        let (same, was_merged) = for_rollouts(base, None, &rollout);
        assert!(!was_merged, "nothing to merge without adapters");
        assert_eq!(logits(LoraModel::new(&same, None)), plain);

        // A bf16 base: the merged weights round once to bf16, the adapters beside the base
        // round their sum at each projection's output; both stay far closer to each other than
        // to the base alone.
        let base = load_pretrained::<Flex>(dir.path(), &device, LoadOptions { dtype: DType::BF16, ..Default::default() }).unwrap();
        let adapted = logits(LoraModel::new(&base, Some(&adapters)));
        let plain = logits(LoraModel::new(&base, None));
        let (merged, _) = for_rollouts(base, Some(&adapters), &rollout);
        assert_eq!(merged.model.layers[0].mlp.up_proj.weight.val().dtype(), DType::BF16);
        let (moved, apart) = (diff(&adapted, &plain), diff(&logits(LoraModel::new(&merged, None)), &adapted));
        println!("bf16 base: the adapters move the logits by {moved}, merged and apart differ by {apart}");
        assert!(apart < 0.1 * moved, "merged against apart {apart}, the adapters' change {moved}");
    }

    /// Where a backend lends the GPU kernels, the rollout copy is stacked exactly when its
    /// stacked projections' weights are all new: merged with adapters on every one of them, or
    /// cast. Elsewhere (adapters on some projections, no merge, full fine-tuning in f32, a cast
    /// to the dtype the policy has) it is left as it is, sharing the policy's weights. (Fake
    /// kernels on a backend no other test computes on: the registry is the process's.)
    #[test]
    fn the_rollout_copy_is_stacked_only_where_its_weights_are_new() {
        use burn::backend::Autodiff;
        use model::device_kernels::{register_norms, register_silu_mul, NormKernels};
        type Lent = Autodiff<Autodiff<Flex>>;
        register_norms::<Lent>(NormKernels { rms_norm: |x, _, _| x, add_rms_norm: |r, d, _, _| (r, d), qk_norm_rope_write: |p| (p.q_weight.unsqueeze(), p.keys, p.values) });
        register_silu_mul::<Lent>(|_| unreachable!("not run"));
        let config = Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        write_random_checkpoint(&config, dir.path(), 3, StorageDtype::F32).unwrap();
        let device = Default::default();
        let base = load_pretrained::<Lent>(dir.path(), &device, LoadOptions::default()).unwrap();
        let every = LoraAdapters::<Lent>::init(&LoraConfig::default(), &config, 1, &device);
        let some = LoraAdapters::<Lent>::init(&LoraConfig { target_modules: vec![model::lora::LoraTarget::QProj, model::lora::LoraTarget::VProj], ..LoraConfig::default() }, &config, 1, &device);
        let merge = RolloutSection::default();
        let apart = RolloutSection { merge_lora: false, ..RolloutSection::default() };
        let bf16 = RolloutSection { dtype: InferenceDtype::Bf16, ..RolloutSection::default() };
        let stacked = |adapters: Option<&LoraAdapters<Lent>>, rollout: &RolloutSection| for_rollouts(base.clone(), adapters, rollout).0.is_stacked();
        assert!(stacked(Some(&every), &merge), "merged with adapters on every stacked projection");
        assert!(!stacked(Some(&some), &merge), "merged with adapters on q and v only: k, gate and up are the policy's");
        assert!(!stacked(Some(&every), &apart), "adapters beside the policy");
        assert!(!stacked(None, &merge), "full fine-tuning in f32: the policy itself");
        assert!(stacked(None, &bf16) && stacked(Some(&some), &bf16), "cast to bf16");
        let bf16_policy = with_dtype(base.clone(), DType::BF16);
        assert!(!for_rollouts(bf16_policy, None, &bf16).0.is_stacked(), "a bf16 policy needs no cast to bf16");
    }
}

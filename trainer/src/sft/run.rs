//! A whole SFT run: the rows loaded once, seeded batches that resume mid-epoch, one optimiser
//! step per batch, `metrics.jsonl`, the held-out loss, and checkpoints in the layout of GRPO
//! runs (`checkpoints/step-NNNNNNN/` with the model in HF layout, or LoRA's adapters as a PEFT
//! directory, the AdamW state and `trainer_state.json`, published atomically), so `export`,
//! `plot` and `train` read them. What is trained (every weight, or adapters) is GRPO's
//! `Learner`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use data::BatchSampler;
use model::chat_template::{ChatTemplate, ChatTemplateError};
use model::tokenizer::Qwen3Tokenizer;
use model::{LoraAdapters, LoraModel, Qwen3ForCausalLM};
use serde::{Deserialize, Serialize};

use super::config::SftConfig;
use super::data::{DataSummary, RowEncoder, SftSequence};
use super::step::{sft_step, validation_loss, SftStepStats};
use crate::grpo::Trainable;
use crate::optim::{AdamWOptimizer, StepOutcome};
use crate::run::learner::{Learner, LearnerSettings, Update};
use crate::run::metrics_log::{null_as_nan, read_lines};
use crate::run::session::{SessionSettings, SettingsRecord};
use crate::run::{
    end_device_phase, gib, peak_rss_mb, reset_peak_rss, DeviceMemoryProbe, Resume, RunSession, SteppedRun, TrainError, METRICS_FILE,
};

/// File in the run directory holding the run's configuration (with its paths resolved).
pub const SFT_CONFIG_FILE: &str = "sft_config.json";

/// What one SFT step did: a line of `metrics.jsonl`, under the names verl's SFT trainer logs
/// (`train/loss`, `val/loss`, `train/time(s)`; its `train/lr(1e-3)` is written here as the
/// plain `train/lr`) and the step keys of GRPO runs (`training/global_step`, `training/epoch`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SftRecord {
    #[serde(rename = "training/global_step")]
    pub step: u64,
    /// The epoch the step's batch came from (from 0).
    #[serde(rename = "training/epoch")]
    pub epoch: u64,
    /// Mean NLL per trained token of the step's batch, before the update (NaN is written as
    /// null).
    #[serde(rename = "train/loss", deserialize_with = "null_as_nan")]
    pub loss: f32,
    /// The learning rate of the step.
    #[serde(rename = "train/lr")]
    pub lr: f64,
    /// Global gradient norm before clipping (absent when not finite).
    #[serde(rename = "train/grad_norm")]
    pub grad_norm: Option<f32>,
    /// Whether the gradient was scaled down to `optimizer.grad_clip`.
    #[serde(rename = "train/clipped")]
    pub clipped: bool,
    /// 1 when the gradient norm was not finite and the step was skipped (weights and AdamW
    /// state untouched).
    #[serde(rename = "train/skipped_steps")]
    pub skipped_steps: usize,
    /// Trained tokens and sequences of the batch.
    #[serde(rename = "train/tokens")]
    pub tokens: usize,
    #[serde(rename = "train/sequences")]
    pub sequences: usize,
    /// Mean NLL per trained token of the validation rows, on the steps that validate.
    #[serde(rename = "val/loss")]
    pub validation_loss: Option<f32>,
    /// Seconds the step took (validation excluded).
    #[serde(rename = "train/time(s)")]
    pub step_secs: f32,
    /// Trained tokens per second of the step.
    #[serde(rename = "perf/tokens_per_s")]
    pub tokens_per_sec: f32,
    /// Peak resident memory of the process during this step (Linux).
    #[serde(rename = "perf/peak_rss_mb")]
    pub peak_rss_mb: Option<f32>,
    /// The most the GPU's memory pool reserved during this step (validation included), in GiB
    /// as verl's key; `None` on the CPU. Read as the step ends, just before its unused pages go
    /// back to the device (see `run::end_device_phase`).
    #[serde(rename = "perf/max_memory_reserved_gb", default)]
    pub max_memory_reserved_gb: Option<f32>,
}

/// Whether the run directory's `metrics.jsonl` is an SFT run's (its first line has `train/loss`).
pub fn is_sft_run(run_dir: &Path) -> bool {
    std::fs::read_to_string(run_dir.join(METRICS_FILE))
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| !l.trim().is_empty())?.to_owned();
            serde_json::from_str::<serde_json::Value>(&line).ok()
        })
        .is_some_and(|first| first.get("train/loss").is_some())
}

/// Reads an SFT run's `metrics.jsonl`; a malformed line is an error naming its number.
pub fn read_sft_metrics(run_dir: &Path) -> Result<Vec<SftRecord>, TrainError> {
    read_lines(run_dir, &["train/loss"])
}

/// An SFT run in progress.
pub struct SftRun<B: AutodiffBackend> {
    config: SftConfig,
    session: RunSession,
    device: B::Device,
    learner: Learner<B>,
    train: Vec<SftSequence>,
    validation: Vec<SftSequence>,
    train_summary: DataSummary,
    validation_summary: DataSummary,
    sampler: BatchSampler,
    step: u64,
    total_steps: u64,
    /// Reads the device's memory pool as each step ends ([`Self::watch_device_memory`]).
    device_memory: Option<DeviceMemoryProbe>,
}

impl<B: AutodiffBackend> SftRun<B> {
    /// Starts from `config.model`, or continues a checkpoint of `config.run.out_dir` as `resume`
    /// says (`true`: the newest, if there is one; see [`Resume`] and [`RunSession`]).
    pub fn start(
        config: SftConfig,
        device: B::Device,
        resume: impl Into<Resume>,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        let mut session = RunSession::open(
            SessionSettings {
                out_dir: &config.run.out_dir,
                initial: &config.model,
                seed: config.train.seed,
                save_every: config.run.save_every,
                keep_checkpoints: config.run.keep_checkpoints,
            },
            resume.into(),
        )?;
        let tokenizer = Qwen3Tokenizer::from_dir(&config.model)?;
        // No sequence may pass the model's context: longer ones are cut to it, as to a smaller
        // data.max_length.
        let model_config = model::Qwen3Config::from_file(&config.model.join("config.json"))?;
        tokenizer.check_fits_vocabulary(&config.model, model_config.vocab_size)?;
        let context = model_config.max_position_embeddings;
        let rows = RowEncoder {
            tokenizer: &tokenizer,
            template: chat_template(&config.model)?,
            max_length: Some(config.data.max_length.map_or(context, |max| max.min(context))),
        };
        let (train, train_summary) = rows.load_files(&config.data.train)?;
        if train.is_empty() {
            return Err(TrainError::Invalid(format!(
                "no training sequence left: {train_summary}"
            )));
        }
        let (validation, validation_summary) = rows.load_files(&config.data.validation)?;
        let total_steps = config.total_steps(train.len());
        let settings = LearnerSettings {
            model: &config.model,
            model_dtype: config.model_dtype,
            lora: config.lora.as_ref(),
            compute: config.compute(),
            optimizer: &config.optimizer,
            seed: config.train.seed,
        };
        let learner = session.load(|checkpoint| Learner::start(&settings, &device, checkpoint))?;
        let sampler = session.sampler(train.len(), config.train.batch_size, "train.batch_size", "train.seed")?;
        let step = session.start_step();
        let record = SettingsRecord { settings: &config, kernels: config.compute().kernels_on::<B::InnerBackend>() };
        session.begin(SFT_CONFIG_FILE, &record, total_steps)?;
        Ok(Self {
            config,
            session,
            device,
            learner,
            train,
            validation,
            train_summary,
            validation_summary,
            sampler,
            step,
            total_steps,
            device_memory: None,
        })
    }

    /// Has each step read the device's memory pool with `probe` as it ends (on the run's
    /// thread), into `perf/max_memory_reserved_gb`, and give the step's unused pages back. Without
    /// a probe (the CPU) the key is null and the pool is left as it is.
    pub fn watch_device_memory(&mut self, probe: DeviceMemoryProbe) {
        self.device_memory = Some(probe);
    }

    /// Steps completed so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Steps the run makes in all.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// The run's configuration.
    pub fn config(&self) -> &SftConfig {
        &self.config
    }

    /// What loading the training and the validation rows found.
    pub fn data_summaries(&self) -> (&DataSummary, &DataSummary) {
        (&self.train_summary, &self.validation_summary)
    }

    /// The model: the one being trained, or LoRA's frozen base (see [`Self::adapters`]).
    pub fn model(&self) -> &Qwen3ForCausalLM<B> {
        self.learner.model()
    }

    /// The LoRA adapters being trained, in a run with `[lora]`.
    pub fn adapters(&self) -> Option<&LoraAdapters<B>> {
        self.learner.adapters()
    }

    /// One optimiser step on the next batch; the record is also appended to `metrics.jsonl`,
    /// with the validation loss when this step validates (every `run.validate_every` steps and
    /// at the last step).
    pub fn train_step(&mut self) -> Result<SftRecord, TrainError> {
        reset_peak_rss();
        let step = self.step + 1;
        let batch = self.sampler.next_batch();
        let sequences: Vec<SftSequence> = batch
            .indices
            .iter()
            .map(|&i| self.train[i].clone())
            .collect();
        let lr = self.config.lr_at(step, self.total_steps);
        let started = Instant::now();
        let stats = self.learn(step, &sequences, lr)?;
        let step_secs = started.elapsed().as_secs_f32();
        self.step = step;
        let grad_norm = stats.outcome.grad_norm();
        let every = self.config.run.validate_every;
        let validates = (every > 0 && step % every == 0) || step == self.total_steps;
        let validation_loss = if validates { self.validate()? } else { None };
        let reserved = match &self.device_memory {
            Some(probe) => end_device_phase::<B>(&self.device, Some(probe))?.map(|m| m.reserved),
            None => None,
        };
        let record = SftRecord {
            step,
            epoch: batch.epoch,
            loss: stats.loss,
            lr,
            grad_norm: grad_norm.is_finite().then_some(grad_norm),
            clipped: matches!(stats.outcome, StepOutcome::Applied { clipped: true, .. }),
            skipped_steps: usize::from(stats.outcome.is_skipped()),
            tokens: stats.tokens,
            sequences: stats.sequences,
            validation_loss,
            step_secs,
            tokens_per_sec: stats.tokens as f32 / step_secs.max(1e-6),
            peak_rss_mb: peak_rss_mb().map(|mb| mb as f32),
            max_memory_reserved_gb: reserved.map(gib),
        };
        self.session.record(&record)?;
        Ok(record)
    }

    /// The mean NLL per trained token of the validation rows (`None` without any).
    pub fn validate(&self) -> Result<Option<f32>, TrainError> {
        if self.validation.is_empty() {
            return Ok(None);
        }
        let (model, adapters) = (self.model().valid(), self.adapters().map(|a| a.valid()));
        validation_loss(
            &LoraModel::new(&model, adapters.as_ref()),
            &self.validation,
            self.config.train.micro_batch_size,
        )
    }

    /// One optimiser step of what the run trains.
    fn learn(
        &mut self,
        step: u64,
        sequences: &[SftSequence],
        lr: f64,
    ) -> Result<SftStepStats, TrainError> {
        let update = SftUpdate {
            sequences,
            micro_batch_size: self.config.train.micro_batch_size,
            lr,
            grad_clip: self.config.optimizer.grad_clip,
        };
        self.learner
            .update(update, self.config.train.seed, step, &self.device)
    }

    /// Writes a checkpoint of the current state.
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        self.session
            .save(&self.learner, self.step, self.sampler.cursor())
    }

    /// The run's session: its directory, resume and checkpoint cadence.
    pub fn session(&self) -> &RunSession {
        &self.session
    }
}

impl<B: AutodiffBackend> SteppedRun for SftRun<B> {
    type Record = SftRecord;

    fn session(&self) -> &RunSession {
        &self.session
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    /// [`SftRun::total_steps`].
    fn last_step(&self) -> u64 {
        self.total_steps
    }

    fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        SftRun::save_checkpoint(self)
    }
}

/// The SFT step on one batch ([`sft_step`]), on either kind of learner.
struct SftUpdate<'a> {
    sequences: &'a [SftSequence],
    micro_batch_size: usize,
    lr: f64,
    grad_clip: f32,
}

impl<B: AutodiffBackend> Update<B> for SftUpdate<'_> {
    type Stats = SftStepStats;

    fn apply<M: Trainable<B>>(
        self,
        module: M,
        frozen: &M::Frozen,
        optimizer: &mut AdamWOptimizer<M, B>,
    ) -> Result<(M, SftStepStats), TrainError> {
        sft_step(
            module,
            frozen,
            optimizer,
            self.sequences,
            self.micro_batch_size,
            self.lr,
            self.grad_clip,
        )
    }
}

/// The model directory's chat template; Qwen3's when it names none.
fn chat_template(dir: &Path) -> Result<ChatTemplate, TrainError> {
    match ChatTemplate::from_dir(dir) {
        Ok(template) => Ok(template),
        Err(ChatTemplateError::MissingTemplate { .. } | ChatTemplateError::Read { .. }) => {
            Ok(ChatTemplate::Qwen3)
        }
        Err(err) => Err(TrainError::Invalid(format!(
            "{err} (chat rows are rendered with the Qwen3 chat template)"
        ))),
    }
}

//! The SFT configuration (`sft.toml`): model, data, length of the run, batch sizes, learning-rate
//! schedule, AdamW and where the run goes. Every key but `model` and `data.train` has a default;
//! unknown keys are errors. `assets/sft.example.toml` documents every key.

use std::path::{Path, PathBuf};

use model::{AttnImplementation, Compute, LoraConfig, MatmulPrecision};
use serde::{Deserialize, Serialize};

use crate::optim::OptimizerConfig;
use crate::run::config::read_toml_config;
use crate::run::{ModelDtype, TrainError};

/// Everything an SFT run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftConfig {
    /// The initial model: an HF directory with `tokenizer.json` (its chat template renders the
    /// `messages` rows; Qwen3's when it has none).
    pub model: PathBuf,
    /// The dtype of the frozen base under LoRA ("bf16" needs `[lora]`), as in `train`'s config.
    #[serde(default)]
    pub model_dtype: ModelDtype,
    /// Attention's implementation, as in `train`'s config (`memory_efficient` or `eager`).
    #[serde(default)]
    pub attn_implementation: AttnImplementation,
    /// Queries per block of the memory-efficient attention, as in `train`'s config.
    #[serde(default = "crate::run::config::default_attention_block_size")]
    pub attention_block_size: usize,
    /// The CPU kernels the run's models use on burn-flex: not a config key (the default is what
    /// the environment says; commands and tests choose another in code).
    #[serde(skip)]
    pub cpu_kernels: model::cpu_kernels::Kernels,
    /// The kernels a GPU backend lends that the run's models run: not a config key (the binary
    /// chooses them from its flags for the device).
    #[serde(skip)]
    pub device_kernels: model::DeviceKernelChoice,
    /// LoRA: train adapters beside the frozen model instead of every weight (absent: full
    /// fine-tuning); the keys of `train`'s `[lora]`.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    pub data: SftData,
    #[serde(default)]
    pub train: SftTrain,
    /// AdamW and the gradient clip, as `[grpo.optimizer]` of `train` (same keys and defaults:
    /// lr 1e-6, so an SFT run names its own).
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    #[serde(default)]
    pub run: SftRunSection,
}

/// Training and validation files (JSONL: chat transcripts or saved episodes, mixed freely).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftData {
    /// Files whose rows are trained on, concatenated.
    pub train: Vec<PathBuf>,
    /// Held-out files: their loss is measured every `run.validate_every` steps.
    #[serde(default)]
    pub validation: Vec<PathBuf>,
    /// Sequences longer than this many tokens are cut to it (counted at start); at most, and by
    /// default, the model's context (`max_position_embeddings`).
    #[serde(default)]
    pub max_length: Option<usize>,
}

/// How the learning-rate changes over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// `optimizer.lr` after the warm-up.
    #[default]
    Constant,
    /// From `optimizer.lr` after the warm-up down to 0 at the last step along half a cosine.
    Cosine,
}

/// The length of the run and its batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftTrain {
    /// Passes over the training rows (ignored when `steps` is set).
    pub epochs: u64,
    /// Optimiser steps in all; when unset, `epochs` × the steps of one epoch.
    pub steps: Option<u64>,
    /// Sequences per optimiser step (the last batch of an epoch may be smaller).
    pub batch_size: usize,
    /// Sequences per forward/backward pass; bounds activation memory, not the result (the
    /// gradients of a step's micro-batches are summed with each micro-batch weighted by its
    /// share of the step's assistant tokens).
    pub micro_batch_size: usize,
    /// Steps over which the learning rate rises linearly to `optimizer.lr` (step k of the
    /// warm-up uses `lr · k / warmup_steps`, k = 1, 2, ...).
    pub warmup_steps: u64,
    /// `constant` or `cosine`.
    pub schedule: LrSchedule,
    /// Precision of the matrix products: `f32`, or `bf16` (f32 weights, bf16 products, f32 sums).
    pub matmul: MatmulPrecision,
    /// Seed of the data order (rows are shuffled every epoch).
    pub seed: u64,
}

impl Default for SftTrain {
    fn default() -> Self {
        Self {
            epochs: 1,
            steps: None,
            batch_size: 16,
            micro_batch_size: 4,
            warmup_steps: 0,
            schedule: LrSchedule::Constant,
            matmul: MatmulPrecision::F32,
            seed: 0,
        }
    }
}

/// Outputs and cadence of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftRunSection {
    /// Where checkpoints and `metrics.jsonl` go.
    pub out_dir: PathBuf,
    /// Checkpoint every this many steps (and at the end).
    pub save_every: u64,
    /// Loss on `data.validation` every this many steps (0: never); the end of the run always
    /// validates when there are validation rows.
    pub validate_every: u64,
    /// Keep at most this many checkpoints (oldest removed first; 0 keeps all).
    pub keep_checkpoints: usize,
}

impl Default for SftRunSection {
    fn default() -> Self {
        Self {
            out_dir: PathBuf::from("runs/sft"),
            save_every: 100,
            validate_every: 0,
            keep_checkpoints: 3,
        }
    }
}

impl SftConfig {
    /// How the run's model computes: the attention settings, `train.matmul`, the CPU kernels and
    /// the GPU kernels.
    pub fn compute(&self) -> Compute {
        Compute {
            attn_implementation: self.attn_implementation,
            attention_block_size: self.attention_block_size,
            matmul: self.train.matmul,
            cpu_kernels: self.cpu_kernels,
            device_kernels: self.device_kernels,
        }
    }

    /// Reads a TOML file; relative paths inside are taken relative to the file's folder.
    pub fn from_toml_file(path: &Path) -> Result<Self, TrainError> {
        read_toml_config(path, |config: &mut Self, base| {
            config.resolve_paths(base);
            config.validate()
        })
    }

    /// Makes relative paths absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.model);
        self.data.train.iter_mut().for_each(fix);
        self.data.validation.iter_mut().for_each(fix);
        fix(&mut self.run.out_dir);
    }

    /// Checks the settings a run relies on; the message names the key.
    pub fn validate(&self) -> Result<(), model::SettingError> {
        if self.data.train.is_empty() {
            return Err("data.train names no file".into());
        }
        if self.data.max_length.is_some_and(|n| n < 2) {
            return Err("data.max_length must be at least 2".into());
        }
        self.compute().validate()?;
        if self.train.batch_size == 0 || self.train.micro_batch_size == 0 {
            return Err("train.batch_size and train.micro_batch_size must be at least 1".into());
        }
        if self.train.steps.is_none() && self.train.epochs == 0 {
            return Err("train.epochs must be at least 1 (or set train.steps)".into());
        }
        if self.train.steps == Some(0) {
            return Err("train.steps must be at least 1".into());
        }
        if self.run.save_every == 0 {
            return Err("run.save_every must be at least 1".into());
        }
        match &self.lora {
            Some(lora) => lora.validate()?,
            None if self.model_dtype != ModelDtype::F32 => {
                return Err("model_dtype = \"bf16\" needs a [lora] section: full fine-tuning keeps f32 weights".into())
            }
            None => {}
        }
        self.optimizer.validate().map_err(|e| format!("optimizer: {e}").into())
    }

    /// The run's optimiser steps for a training set of `rows` sequences.
    pub fn total_steps(&self, rows: usize) -> u64 {
        self.train
            .steps
            .unwrap_or_else(|| self.train.epochs * rows.div_ceil(self.train.batch_size) as u64)
    }

    /// The learning rate of optimiser step `step` (1-based) of `total`.
    pub fn lr_at(&self, step: u64, total: u64) -> f64 {
        let lr = self.optimizer.lr;
        let warmup = self.train.warmup_steps;
        if step <= warmup {
            return lr * step as f64 / warmup as f64;
        }
        match self.train.schedule {
            LrSchedule::Constant => lr,
            LrSchedule::Cosine => {
                let span = total.saturating_sub(warmup).max(1) as f64;
                let progress = ((step - warmup - 1) as f64 / span).min(1.0);
                lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &str) -> Result<SftConfig, toml::de::Error> {
        toml::from_str(&format!("model = \"m\"\n[data]\ntrain = [\"t.jsonl\"]\n{extra}"))
    }

    #[test]
    fn defaults_and_unknown_keys() {
        let c = parse("").unwrap();
        assert_eq!(
            (c.train.epochs, c.train.batch_size, c.train.micro_batch_size),
            (1, 16, 4)
        );
        assert_eq!(c.optimizer, OptimizerConfig::default());
        assert_eq!(c.run.out_dir, PathBuf::from("runs/sft"));
        assert!(c.validate().is_ok());
        let err = parse("[train]\nepoch = 2\n").unwrap_err().to_string();
        assert!(err.contains("epoch"), "{err}");
        let err = parse("[train]\nschedule = \"linear\"\n").unwrap_err().to_string();
        assert!(err.contains("linear") && err.contains("cosine"), "{err}");
        let zero = parse("[train]\nbatch_size = 0\n").unwrap();
        assert!(zero.validate().unwrap_err().0.contains("train.batch_size"));
        let no_steps = parse("[train]\nsteps = 0\n").unwrap();
        assert_eq!(no_steps.validate().unwrap_err().0, "train.steps must be at least 1");
    }

    #[test]
    fn steps_come_from_epochs_unless_given() {
        let c = parse("[train]\nepochs = 3\nbatch_size = 4\n").unwrap();
        assert_eq!(c.total_steps(10), 9, "3 epochs of ceil(10 / 4) batches");
        let c = parse("[train]\nepochs = 3\nsteps = 5\n").unwrap();
        assert_eq!(c.total_steps(10), 5);
    }

    /// Warm-up rises linearly to lr in `warmup_steps` steps; cosine starts at lr right after it
    /// and reaches 0 after the last step.
    #[test]
    fn learning_rate_schedule() {
        let c = parse("[optimizer]\nlr = 1.0\n[train]\nwarmup_steps = 2\nschedule = \"cosine\"\n").unwrap();
        let lrs: Vec<f64> = (1..=6).map(|s| c.lr_at(s, 6)).collect();
        assert_eq!(&lrs[..3], &[0.5, 1.0, 1.0]);
        // 4 steps after the warm-up: cos(π·k/4)/2 + 1/2 for k = 0..3.
        assert!(
            (lrs[3] - 0.853_553).abs() < 1e-6 && (lrs[5] - 0.146_447).abs() < 1e-6,
            "{lrs:?}"
        );
        let constant = parse("[optimizer]\nlr = 0.1\n").unwrap();
        assert_eq!(constant.lr_at(1, 10), 0.1);
        assert_eq!(constant.lr_at(10, 10), 0.1);
    }

    /// The documented example parses and holds the defaults, but for the learning rate it marks.
    #[test]
    fn the_example_config_is_valid_and_holds_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/sft.example.toml");
        let config = SftConfig::from_toml_file(&path).unwrap();
        let defaults = parse("").unwrap();
        assert_eq!((config.train, config.data.max_length), (defaults.train, None));
        assert_eq!(config.optimizer.lr, 1e-5);
        assert_eq!(
            OptimizerConfig {
                lr: 1e-6,
                ..config.optimizer
            },
            defaults.optimizer
        );
        assert!(config.run.out_dir.ends_with("runs/sft"));
        assert_eq!(
            SftRunSection {
                out_dir: defaults.run.out_dir.clone(),
                ..config.run
            },
            defaults.run
        );
        assert_eq!((config.attn_implementation, config.attention_block_size), (defaults.attn_implementation, defaults.attention_block_size));
    }

    /// The example shows every key an SFT run's settings hold (`[lora]` filled in), and every key
    /// it shows commented out exists.
    #[test]
    fn the_example_config_names_every_key() {
        use crate::run::config::example_keys::{uncommented, undocumented};
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/sft.example.toml");
        let example = std::fs::read_to_string(&path).unwrap();
        let mut settings = parse("").unwrap();
        settings.lora = Some(LoraConfig::default());
        settings.data.max_length = Some(4096);
        settings.train.steps = Some(1000);
        let missing = undocumented(&serde_json::to_value(&settings).unwrap(), &example);
        assert!(missing.is_empty(), "keys that {} does not show: {missing:?}", path.display());
        let all_set: SftConfig = toml::from_str(&uncommented(&example)).unwrap();
        assert!(all_set.lora.is_some() && all_set.train.steps.is_some());
    }

    #[test]
    fn relative_paths_follow_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sft.toml");
        std::fs::write(&path, "model = \"m\"\n[data]\ntrain = [\"t.jsonl\"]\n").unwrap();
        let config = SftConfig::from_toml_file(&path).unwrap();
        assert_eq!(config.model, dir.path().join("m"));
        assert_eq!(config.data.train[0], dir.path().join("t.jsonl"));
        std::fs::write(&path, "model = \"m\"\n[data]\ntrain = []\n").unwrap();
        let err = SftConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(err.contains("sft.toml") && err.contains("data.train"), "{err}");
    }
}

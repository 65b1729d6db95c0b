//! `prompt-r1 sft --config sft.toml`: supervised fine-tuning of a Qwen3 checkpoint on chat
//! transcripts or saved episodes, with the loss on the tokens the model is to write.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::backend::Backend;
use clap::Args as ClapArgs;
use model::MatmulPrecision;
use trainer::run::{DeviceMemoryProbe, Resume};
use trainer::sft::{SftConfig, SftRecord, SftRun};

use super::train::{already_done, drive};
use super::{print_lora_share, NAN_HINT};
use crate::device::{run_on, DeviceChoice, OnBackend};
use crate::model_dir::parse_matmul;

/// Fine-tune a model on chat transcripts or saved episodes (settings in a TOML file; see
/// `assets/sft.example.toml`).
///
/// Rows (JSONL, mixed freely): `{"messages": [{"role": "system"|"user"|"assistant", "content":
/// "..."}, ...]}` (the TRL / LLaMA-Factory format), rendered with the model's chat template;
/// an episode as `infer --json` prints it; a row of `eval`'s `predictions.jsonl`. The loss is the
/// mean negative log-likelihood of the assistant tokens only (of an episode: the agent's
/// tokens, as its loss mask says). AdamW with the global gradient clip, micro-batches with
/// gradient accumulation, a constant or cosine learning rate with warm-up. The run directory
/// gets `metrics.jsonl` (`train/loss`, `train/lr`, `train/grad_norm`, `val/loss`, ...) and
/// checkpoints in the layout of `train` runs: `plot`, `export` and `train` (as `model`) read
/// them, and `--resume` continues the newest one exactly (`--resume-from STEP` an earlier one).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// The SFT configuration (TOML). Paths inside it are relative to the file.
    #[arg(long)]
    pub config: PathBuf,
    /// Continue from the newest checkpoint in the run directory.
    #[arg(long)]
    pub resume: bool,
    /// Continue from the checkpoint of step STEP of the run directory (implies --resume): when
    /// the newest checkpoint is damaged, an earlier one.
    #[arg(long, value_name = "STEP")]
    pub resume_from: Option<u64>,
    /// Override train.steps (optimiser steps in all).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Override train.epochs (and clear train.steps).
    #[arg(long, conflicts_with = "steps")]
    pub epochs: Option<u64>,
    /// Override run.out_dir.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Override the initial model directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Override optimizer.lr.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Override train.seed (the data order).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Override train.matmul: f32, or bf16 (f32 weights with bf16 products and f32 sums).
    #[arg(long, value_parser = parse_matmul)]
    pub matmul: Option<MatmulPrecision>,
    /// Compute device: cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Override attn_implementation: memory_efficient (the default) or eager (HF's formula).
    #[arg(long, value_parser = clap::value_parser!(model::AttnImplementation))]
    pub attn_implementation: Option<model::AttnImplementation>,
}

impl Args {
    /// The configuration file with the flags applied.
    pub fn config(&self) -> Result<SftConfig> {
        let mut config = SftConfig::from_toml_file(&self.config)?;
        if let Some(steps) = self.steps {
            config.train.steps = Some(steps);
        }
        if let Some(epochs) = self.epochs {
            config.train.epochs = epochs;
            config.train.steps = None;
        }
        if let Some(dir) = &self.out_dir {
            config.run.out_dir = dir.clone();
        }
        if let Some(model) = &self.model {
            config.model = model.clone();
        }
        if let Some(lr) = self.lr {
            config.optimizer.lr = lr;
        }
        if let Some(seed) = self.seed {
            config.train.seed = seed;
        }
        if let Some(matmul) = self.matmul {
            config.train.matmul = matmul;
        }
        if let Some(attn) = self.attn_implementation {
            config.attn_implementation = attn;
        }
        config.device_kernels = crate::device::device_kernels(self.device);
        config.validate().context("invalid configuration")?;
        Ok(config)
    }
}

pub fn run(args: Args) -> Result<()> {
    let config = args.config()?;
    let resume = Resume::from_flags(args.resume, args.resume_from);
    let memory = crate::device::memory_probe(args.device);
    run_on(args.device, FineTuning { config, resume, memory }).map(drop)
}

/// A configured SFT run, ready to start on a backend.
pub struct FineTuning {
    pub config: SftConfig,
    /// Whether and from where it continues a checkpoint.
    pub resume: Resume,
    /// Reads the GPU's memory pool as each step ends (`None` on the CPU).
    pub memory: Option<DeviceMemoryProbe>,
}

impl OnBackend for FineTuning {
    type Output = Vec<SftRecord>;

    fn run<B: Backend>(self, device: B::Device) -> Result<Vec<SftRecord>> {
        let mut run = SftRun::<Autodiff<B>>::start(self.config, device, self.resume)?;
        if let Some(probe) = self.memory {
            run.watch_device_memory(probe);
        }
        super::note_resume(self.resume, run.step_count(), run.session());
        let (train, validation) = run.data_summaries();
        eprintln!("training rows: {train}");
        if validation.chats + validation.episodes > 0 {
            eprintln!("validation rows: {validation}");
        }
        if let Some(adapters) = run.adapters() {
            print_lora_share(adapters.num_params(), run.model().num_params(), run.config().model_dtype);
        }
        if already_done(&run) {
            return Ok(Vec::new());
        }
        let step = |run: &mut SftRun<Autodiff<B>>| {
            run.train_step()
                .with_context(|| format!("step {}", run.step_count() + 1))
        };
        drive(&mut run, step, |_, record| {
            let mut message = format!(
                "loss {:.4} lr {:.2e} grad norm {} {:.0} tok/s",
                record.loss,
                record.lr,
                record.grad_norm.map_or("-".into(), |g| format!("{g:.3}")),
                record.tokens_per_sec
            );
            if let Some(gib) = record.max_memory_reserved_gb {
                message.push_str(&format!(" GPU {gib:.1} GiB"));
            }
            let mut lines = Vec::new();
            if let Some(v) = record.validation_loss {
                lines.push(format!("step {}: validation loss {v:.4}", record.step));
            }
            if record.skipped_steps > 0 {
                lines.push(format!("step {}: skipped (gradient norm not finite); {NAN_HINT}", record.step));
            }
            (message, lines)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// Flags override the file; `--epochs` clears the file's `steps`.
    #[test]
    fn flags_override_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sft.toml");
        std::fs::write(
            &path,
            "model = \"m\"\n[data]\ntrain = [\"t.jsonl\"]\n[train]\nsteps = 7\n",
        )
        .unwrap();
        let config = |extra: &[&str]| {
            let mut argv = vec!["sft", "--config", path.to_str().unwrap()];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).unwrap().args.config().unwrap()
        };
        assert_eq!(config(&[]).train.steps, Some(7));
        let c = config(&[
            "--epochs",
            "2",
            "--lr",
            "0.001",
            "--matmul",
            "bf16",
            "--out-dir",
            "elsewhere",
        ]);
        assert_eq!((c.train.steps, c.train.epochs, c.optimizer.lr), (None, 2, 0.001));
        assert_eq!(
            (c.train.matmul, c.run.out_dir),
            (MatmulPrecision::Bf16, PathBuf::from("elsewhere"))
        );
        assert_eq!(config(&["--steps", "3"]).train.steps, Some(3));
        let args = |extra: &[&str]| {
            let mut argv = vec!["sft", "--config", "x"];
            argv.extend_from_slice(extra);
            let args = Cli::try_parse_from(argv).unwrap().args;
            Resume::from_flags(args.resume, args.resume_from)
        };
        assert_eq!(args(&[]), Resume::Fresh);
        assert_eq!(args(&["--resume"]), Resume::Latest);
        assert_eq!(args(&["--resume-from", "4"]), Resume::From(4));
        assert!(Cli::try_parse_from(["sft", "--config", "x", "--steps", "1", "--epochs", "1"]).is_err());
    }
}

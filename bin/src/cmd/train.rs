//! `prompt-r1 train --config run.toml`: GRPO training of the agent against a large LLM.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::backend::Backend;
use clap::Args as ClapArgs;
use env::OpenAiClient;
use model::cpu_kernels::isa::PORTABLE_OPS_ENV;
use model::cpu_kernels::{Bf16Products, Kernels, BF16_PRODUCTS_ENV};
use model::MatmulPrecision;
use trainer::plan::{format_size, MemoryPlan};
use trainer::run::{run_to_end, DeviceMemoryProbe, PromptR1Scorer, Resume, StepRecord, SteppedRun, TrainConfig, Trainer};

use super::plan::device_memory_text;
use super::{print_lora_share, say, step_bar, NAN_HINT};
use crate::device::{run_on, DeviceChoice, OnBackend};
use crate::model_dir::parse_matmul;

/// Train the agent with GRPO (settings in a TOML file; see `assets/run.example.toml`; a `[lora]`
/// section trains LoRA adapters beside the frozen model instead of every weight).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// The run configuration (TOML). Paths inside it are relative to the file.
    #[arg(long)]
    pub config: PathBuf,
    /// Continue from the newest checkpoint in the run directory.
    #[arg(long)]
    pub resume: bool,
    /// Continue from the checkpoint of step STEP of the run directory (implies --resume): when
    /// the newest checkpoint is damaged, an earlier one.
    #[arg(long, value_name = "STEP")]
    pub resume_from: Option<u64>,
    /// Override run.steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Override run.out_dir.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Override run.seed (data order and sampling).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Override the initial model directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Override grpo.optimizer.lr.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Override grpo.matmul: f32, or bf16 (f32 weights with bf16 products and f32 sums; how much
    /// faster than f32 depends on the CPU's bf16 dot products: `prompt-r1 bench --products`
    /// compares them).
    #[arg(long, value_parser = parse_matmul)]
    pub matmul: Option<MatmulPrecision>,
    /// Override attn_implementation: memory_efficient (the default; blocks of queries and keys,
    /// memory linear in the context) or eager (HF's formula, [batch, heads, q, k] scores).
    #[arg(long, value_parser = clap::value_parser!(model::AttnImplementation))]
    pub attn_implementation: Option<model::AttnImplementation>,
    /// Override environment.base_url (the large LLM's OpenAI-compatible endpoint).
    #[arg(long)]
    pub env_url: Option<String>,
    /// Override environment.model.
    #[arg(long)]
    pub env_model: Option<String>,
    /// Compute device: cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Override run.device_memory: the device's memory for the check at start (e.g. 80GiB).
    #[arg(long, value_parser = device_memory_text)]
    pub device_memory: Option<String>,
}

impl Args {
    /// The configuration file with the flags applied.
    pub fn config(&self) -> Result<TrainConfig> {
        let mut config = TrainConfig::from_toml_file(&self.config)?;
        if let Some(steps) = self.steps {
            config.run.steps = steps;
        }
        if let Some(dir) = &self.out_dir {
            config.run.out_dir = dir.clone();
        }
        if let Some(seed) = self.seed {
            config.run.seed = seed;
            config.rollout.sampling.seed = seed;
        }
        if let Some(model) = &self.model {
            config.model = model.clone();
        }
        if let Some(lr) = self.lr {
            config.grpo.optimizer.lr = lr;
        }
        if let Some(matmul) = self.matmul {
            config.grpo.matmul = matmul;
        }
        if let Some(attn) = self.attn_implementation {
            config.attn_implementation = attn;
        }
        config.device_kernels = crate::device::device_kernels(self.device);
        if let Some(url) = &self.env_url {
            config.environment.base_url = url.clone();
        }
        if let Some(name) = &self.env_model {
            config.environment.model = name.clone();
        }
        if let Some(size) = &self.device_memory {
            config.run.device_memory = Some(size.clone());
        }
        config.validate().context("invalid configuration")?;
        if config.environment.base_url.is_empty() || config.environment.model.is_empty() {
            bail!("set environment.base_url and environment.model in the config (or --env-url/--env-model)");
        }
        if let Some(note) = no_signal_note(&config) {
            eprintln!("note: {note}");
        }
        Ok(config)
    }
}

/// A validation reward to three places, or `-` when every episode failed.
fn shown(reward: Option<f32>) -> String {
    reward.map_or_else(|| "-".into(), |v| format!("{v:.3}"))
}

/// What to tell a user whose groups cannot differ, so that GRPO's advantages are all zero and
/// the policy cannot learn: one episode per question, or greedy rollouts.
fn no_signal_note(config: &TrainConfig) -> Option<String> {
    if config.rollout.n == 1 {
        return Some("rollout.n = 1: each question's group is one episode, whose advantage is 0, so the policy will not learn (GRPO compares episodes of a question)".into());
    }
    (config.rollout.sampling.temperature == 0.0).then(|| {
        "rollout.sampling.temperature = 0: a question's episodes are all the same greedy episode, whose advantages are 0, so the policy will not learn".into()
    })
}

/// What to tell a user who asked for `grpo.matmul = "bf16"` on this CPU, if it will not be
/// faster than f32 with the run's `kernels`: off, or without the AVX-512 BF16 products, or with
/// those products widened to f32 FMAs ([`Kernels::bf16_products`]), a step takes about as long
/// as an f32 one or longer; with `vdpbf16ps` pairs it is faster (BENCHMARKS.md, "the bf16-base
/// LoRA test on Intel Xeons").
fn bf16_products_note(kernels: Kernels) -> Option<String> {
    if !kernels.is_on() {
        return Some(format!(
            "grpo.matmul = \"bf16\" but the CPU kernels are off ({PORTABLE_OPS_ENV}=1): the products run \
             through burn's portable tensor ops, the GPU backends' path, not the AVX-512 BF16 kernels"
        ));
    }
    if !model::cpu_kernels::has_bf16_kernels(kernels) {
        return Some(
            "grpo.matmul = \"bf16\" but the CPU kernels run without AVX-512 BF16 (this CPU lacks it, \
             or PROMPT_R1_CPU_ISA caps it): the products round their operands and go through the f32 \
             GEMM, a little slower than matmul = \"f32\""
                .to_owned(),
        );
    }
    (kernels.bf16_products() == Bf16Products::Widened).then(|| {
        format!(
            "grpo.matmul = \"bf16\" is unlikely to be faster than \"f32\" on this CPU: its bf16 products \
             widen to f32 FMAs ({BF16_PRODUCTS_ENV}=widened, the default on CPUs that are not AMD's); \
             `prompt-r1 bench --products` compares the two"
        )
    })
}

pub fn run(args: Args) -> Result<()> {
    let mut config = args.config()?;
    for note in config.unused_settings() {
        eprintln!("note: {note}");
    }
    let plan = super::plan::check_before_training(&mut config, args.device).context("memory plan")?;
    crate::agent_flags::probe_environment(config.environment.clone())?;
    if config.grpo.matmul == MatmulPrecision::Bf16 && args.device == DeviceChoice::Cpu {
        if let Some(note) = bf16_products_note(config.cpu_kernels) {
            eprintln!("note: {note}");
        }
    }
    let resume = Resume::from_flags(args.resume, args.resume_from);
    let training = Training {
        config,
        resume,
        memory: crate::device::memory_probe(args.device),
        planned: Some(PlannedPeaks::of(&plan)),
    };
    run_on(args.device, training).map(drop)
}

/// A configured run, ready to start on a backend.
pub struct Training {
    pub config: TrainConfig,
    /// Whether and from where it continues a checkpoint.
    pub resume: Resume,
    /// Reads the GPU's memory pool as each step's phases end (`None` on the CPU).
    pub memory: Option<DeviceMemoryProbe>,
    /// The plan's peaks, printed beside what the pool reserved at the end of the run.
    pub planned: Option<PlannedPeaks>,
}

/// What `prompt-r1 plan` predicts for the two phases a GPU's pool is read after (without its
/// margin), in bytes.
#[derive(Debug, Clone, Copy)]
pub struct PlannedPeaks {
    pub rollouts: u64,
    pub learn: u64,
}

impl PlannedPeaks {
    pub fn of(plan: &MemoryPlan) -> Self {
        Self { rollouts: plan.rollout_peak(), learn: plan.learn_peak() }
    }
}

/// The most a GPU's memory pool reserved in the rollouts and in scoring and the update over
/// `records`, beside the plan's prediction; `None` when no record read the pool (the CPU).
fn reserved_summary(records: &[StepRecord], planned: Option<PlannedPeaks>) -> Option<String> {
    let most = |f: fn(&StepRecord) -> Option<f32>| records.iter().filter_map(f).reduce(f32::max);
    let (rollouts, learn) = (most(|r| r.gen_max_memory_reserved_gb), most(|r| r.update_max_memory_reserved_gb));
    if rollouts.is_none() && learn.is_none() {
        return None;
    }
    let gib = |g: Option<f32>| g.map_or("-".to_owned(), |g| format_size((f64::from(g) * f64::from(1u32 << 30)) as u64));
    let mut line = format!(
        "GPU memory: the pool reserved at most {} in the rollouts and {} in scoring and the update",
        gib(rollouts),
        gib(learn)
    );
    if let Some(p) = planned {
        line.push_str(&format!(
            " (`prompt-r1 plan`: {} and {}, before its margin)",
            format_size(p.rollouts),
            format_size(p.learn)
        ));
    }
    Some(line)
}

impl OnBackend for Training {
    type Output = Vec<StepRecord>;

    fn run<B: Backend>(self, device: B::Device) -> Result<Vec<StepRecord>> {
        let env = OpenAiClient::new(self.config.environment.clone()).context("environment client")?;
        let scorer = PromptR1Scorer {
            config: self.config.reward.clone(),
        };
        let mut trainer = Trainer::<Autodiff<B>>::start(self.config, device, self.resume)?;
        if let Some(probe) = self.memory {
            trainer.watch_device_memory(probe);
        }
        super::note_resume(self.resume, trainer.step_count(), trainer.session());
        if let Some(adapters) = trainer.adapters() {
            print_lora_share(adapters.num_params(), trainer.policy().num_params(), trainer.config().model_dtype);
        }
        if already_done(&trainer) {
            return Ok(Vec::new());
        }
        if let Some(record) = trainer.validate_before_training(&env, &scorer).context("validation before training")? {
            eprintln!("validation before training: reward {}", shown(record.validation_reward));
            if let Some(report) = trainer.last_validation() {
                eprint!("{report}");
            }
        }
        let step = |trainer: &mut Trainer<Autodiff<B>>| {
            trainer
                .train_step(&env, &scorer)
                .with_context(|| format!("step {}", trainer.step_count() + 1))
        };
        let planned = self.planned;
        let records = drive(&mut trainer, step, |trainer, record| {
            let mut message = format!(
                "reward {:.3} kl {} clip {:.3} {:.0} tok/s",
                record.reward_mean,
                record.kl.map_or("-".into(), |k| format!("{k:.4}")),
                record.policy.clip_frac,
                record.rollout_tokens_per_sec
            );
            if let Some(gib) = record.max_memory_reserved_gb {
                message.push_str(&format!(" GPU {gib:.1} GiB"));
            }
            let mut lines = Vec::new();
            if !record.validation_by_source.is_empty() {
                lines.push(format!("step {}: validation reward {}", record.step, shown(record.validation_reward)));
                if let Some(report) = trainer.last_validation() {
                    lines.push(report.to_string().trim_end().to_owned());
                }
            }
            if record.groups_dropped > 0 {
                lines.push(format!(
                    "step {}: {} groups without signal left out (dynamic sampling)",
                    record.step, record.groups_dropped
                ));
            }
            if record.skipped_steps > 0 {
                lines.push(format!(
                    "step {}: {} optimiser steps skipped (gradient norm not finite); {NAN_HINT}",
                    record.step, record.skipped_steps
                ));
            }
            if record.env_failures > 0 {
                lines.push(format!(
                    "step {}: {} episodes dropped (environment failures; the first: {})",
                    record.step,
                    record.env_failures,
                    record.env_failure_why.as_deref().unwrap_or("no reason given")
                ));
            }
            if record.agent_failures > 0 {
                lines.push(format!(
                    "step {}: {} episodes dropped (the agent's generation failed; the first: {})",
                    record.step,
                    record.agent_failures,
                    record.agent_failure_why.as_deref().unwrap_or("no reason given")
                ));
            }
            for worker in &record.workers_left_out_why {
                lines.push(format!("step {}: rollout worker left out: {worker}", record.step));
            }
            (message, lines)
        })?;
        if let Some(line) = reserved_summary(&records, planned) {
            eprintln!("{line}");
        }
        Ok(records)
    }
}

/// Whether `run` (GRPO or SFT) is already at its last step, saying so.
pub(super) fn already_done(run: &impl SteppedRun) -> bool {
    let (done, last) = (run.step_count(), run.last_step());
    if done >= last {
        eprintln!("{} is already at step {done} of {last}", run.session().dir().display());
    }
    done >= last
}

/// Steps a run (GRPO or SFT) to its last step under a progress bar, with the checkpoints of its
/// cadence ([`run_to_end`]): `step` makes one step; `show` gives the bar's message for a record
/// and the lines to print above the bar.
pub(super) fn drive<R: SteppedRun>(
    run: &mut R,
    step: impl FnMut(&mut R) -> Result<R::Record>,
    show: impl Fn(&R, &R::Record) -> (String, Vec<String>),
) -> Result<Vec<R::Record>> {
    let bar = step_bar(run.last_step(), run.step_count());
    let records = run_to_end(run, step, |run, record, saved| {
        let (message, lines) = show(run, record);
        bar.set_message(message);
        bar.inc(1);
        for line in lines {
            say(&bar, line);
        }
        if let Some(dir) = saved {
            say(&bar, format!("checkpoint {}", dir.display()));
        }
    })?;
    bar.finish();
    eprintln!("metrics in {}", run.session().dir().join(trainer::run::METRICS_FILE).display());
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use model::cpu_kernels::Isa;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// The end-of-run line: the most each phase reserved over the steps, beside the plan; none
    /// where no step read a pool.
    #[test]
    fn the_reserved_summary_takes_each_phase_at_its_most() {
        let step = |gen: f32, update: f32| StepRecord {
            gen_max_memory_reserved_gb: Some(gen),
            update_max_memory_reserved_gb: Some(update),
            ..StepRecord::default()
        };
        let records = [step(30.0, 41.5), step(32.5, 40.0)];
        let planned = PlannedPeaks { rollouts: 31 << 30, learn: 39 << 30 };
        let line = reserved_summary(&records, Some(planned)).unwrap();
        assert_eq!(
            line,
            "GPU memory: the pool reserved at most 32.5 GiB in the rollouts and 41.5 GiB in scoring and the update \
             (`prompt-r1 plan`: 31.0 GiB and 39.0 GiB, before its margin)"
        );
        assert!(reserved_summary(&records, None).unwrap().ends_with("the update"));
        assert_eq!(reserved_summary(&[StepRecord::default()], Some(planned)), None);
    }

    /// The note on bf16 products: always with the kernels off or below AVX-512 BF16, with them
    /// only where the packed products widen to f32 FMAs.
    #[test]
    fn bf16_note_depends_on_the_product_kernel() {
        assert!(bf16_products_note(Kernels::off()).unwrap().contains("kernels are off"));
        assert!(bf16_products_note(Kernels::at(Isa::Avx2)).unwrap().contains("without AVX-512 BF16"));
        if Isa::host() < Isa::Avx512Bf16 {
            println!("skipped: the AVX-512 BF16 product kernels (this CPU's best is {})", Isa::host());
            return;
        }
        let slow = bf16_products_note(Kernels::host().with_bf16_products(Bf16Products::Widened)).unwrap();
        assert!(slow.contains("widened") && slow.contains("bench --products"), "{slow}");
        assert_eq!(bf16_products_note(Kernels::host().with_bf16_products(Bf16Products::Pairs)), None);
    }

    /// `--matmul` overrides the file's `grpo.matmul`; without it the file's value stands.
    #[test]
    fn matmul_flag_overrides_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        let toml = "model = \"m\"\n[data]\ntrain = [\"t.jsonl\"]\n[environment]\nbase_url = \"http://x\"\nmodel = \"big\"\n[grpo]\nmatmul = \"bf16\"\n";
        std::fs::write(&path, toml).unwrap();
        let config = |extra: &[&str]| {
            let mut argv = vec!["train", "--config", path.to_str().unwrap()];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).unwrap().args.config().unwrap()
        };
        assert_eq!(config(&[]).grpo.matmul, MatmulPrecision::Bf16);
        assert_eq!(config(&["--matmul", "f32"]).grpo.matmul, MatmulPrecision::F32);
        let err = Cli::try_parse_from(["train", "--config", "x", "--matmul", "fp8"]).err().unwrap().to_string();
        assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
    }

    /// One episode per question, or greedy rollouts, give groups without signal: a note says so.
    #[test]
    fn groups_that_cannot_differ_are_noted() {
        let config: TrainConfig = toml::from_str("model = \"m\"\n[data]\ntrain = [\"t.jsonl\"]\n").unwrap();
        assert_eq!(no_signal_note(&config), None);
        let mut one = config.clone();
        one.rollout.n = 1;
        assert!(no_signal_note(&one).unwrap().starts_with("rollout.n = 1"));
        let mut greedy = config;
        greedy.rollout.sampling.temperature = 0.0;
        assert!(no_signal_note(&greedy).unwrap().starts_with("rollout.sampling.temperature = 0"));
    }
}

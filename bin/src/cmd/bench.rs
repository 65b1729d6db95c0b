//! `prompt-r1 bench`: throughput and peak memory of the model on random weights: load,
//! prefill, KV-cache decode at several batch sizes, and per-token log-prob scoring; optionally a
//! GRPO training step and the projections' matrix products alone; or (`--rollout`) multi-turn
//! rollouts against a local scripted environment beside pure decode at the same batch.
//! Figures are wall-clock on this machine, each the median of several runs after a warm-up;
//! compare runs only on the same machine.

use model::cpu_kernels::{Isa, Kernels};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::{backend::Backend, DType};
use clap::Args as ClapArgs;
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::{
    completion_logprobs, generate, DeviceKernelChoice, load_pretrained, CausalLm, LoadOptions, LoraAdapters, LoraConfig, LoraModel, MatmulPrecision,
    Preset, Qwen3Config, Sampling, SamplingConfig,
};
use serde::Serialize;

use crate::device::{run_on, AttentionArgs, ComputeArgs, DeviceChoice, OnBackend};
use crate::model_dir::{parse_matmul, preset_parser};
use chained::Feed;
use trainer::plan::{LoraPlan, MemoryPlan, PlanSettings};
use trainer::run::{end_device_phase, peak_rss_mb, reset_peak_rss, DeviceMemoryProbe};

mod chained;
mod rollout;

/// Prompt tokens of each decode row unless `--decode-context` says otherwise (the decode
/// figures' long-standing workload, named without its context).
const DEFAULT_DECODE_CONTEXT: usize = 16;

/// An inference workload of `bench` (see [`Args::workloads`]).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// One prompt of `--prompt-len` tokens through the model, its first token chosen.
    Prefill,
    /// `--decode-tokens` decoding steps at each `--decode-batch`.
    Decode,
    /// Per-token log-probs of two `--prompt-len`-token sequences (no autodiff).
    Score,
    /// The greedy steps after the first of `--decode-tokens` at each `--decode-batch`, twice on
    /// one KV cache: with the tokens read back to the host at every step (as the decoder does)
    /// and chained on the device (read once at the end), to show what waiting for each step
    /// costs.
    Chained,
}

/// Measure load time, prefill, decode and scoring speed with peak memory.
///
/// Prefill, each decode batch and scoring are the median of 3 runs after a warm-up.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Architecture to benchmark (random weights are written to a temporary directory).
    #[arg(long, default_value = "qwen3-0.6b", value_parser = preset_parser())]
    pub preset: Preset,
    /// Benchmark an existing checkpoint directory instead of a random preset.
    #[arg(long, conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// Prompt length for prefill and scoring (at least 8).
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    /// Tokens generated per decode measurement (at least 2): the steps after the first token
    /// are timed, apart from the prefill.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Batch sizes for the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub decode_batch: Vec<usize>,
    /// Prompt tokens of each decode row: the context its decoding steps attend to starts there
    /// (on a GPU, burn's ops gather it per layer and step; the paged-attention kernel reads it
    /// in place). Its prefill is not timed.
    #[arg(long, default_value_t = DEFAULT_DECODE_CONTEXT)]
    pub decode_context: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
    /// Precision of products with f32 weights, for every workload but decode (whose few rows
    /// stay f32): f32, or bf16 (operands rounded to bf16, sums in f32: the trainer's
    /// `grpo.matmul = "bf16"`; how much faster than f32 depends on the CPU's bf16 dot products
    /// (BENCHMARKS.md): `--products` shows which CPU kernel runs, and
    /// PROMPT_R1_BF16_PRODUCTS=pairs|widened chooses it).
    #[arg(long, default_value = "f32", value_parser = parse_matmul)]
    pub matmul: MatmulPrecision,
    /// Also time a GRPO training step (forward + backward + AdamW) on --batch sequences of
    /// --seq-len tokens: the median of 3 steps after a warm-up step. Its peak memory covers the
    /// 3 steps only (freed buffers the allocator keeps count: PROMPT_R1_ALLOC_CACHE_MB=0 measures
    /// what is in use), and the memory plan's prediction for the same step is printed beside it.
    #[arg(long)]
    pub train_step: bool,
    /// Time the training step only (no load, prefill, decode or scoring figures).
    #[arg(long, requires = "train_step")]
    pub train_step_only: bool,
    /// The inference workloads to time, from prefill, decode, score and chained: e.g. `--workloads
    /// prefill` alone, so that a profile of the GPU's kernels (`CUBECL_DEBUG_OPTION=
    /// profile-medium`) holds one workload's (the load figure is always given).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "prefill,decode,score")]
    pub workloads: Vec<Workload>,
    /// Sequences in the training step (one micro-batch).
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Tokens per training sequence (default: --prompt-len).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Train with activation checkpointing (grpo.activation_checkpointing).
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// LoRA adapters (rank 8 on every linear projection, `[lora]`'s defaults) beside the frozen
    /// base, held in --dtype (`model_dtype`): the training step trains them instead of every
    /// weight, and prefill, decode and scoring run through them (each adapted projection adds
    /// two small products: what unmerged rollouts cost).
    #[arg(long)]
    pub lora: bool,
    /// With --lora, prefill, decode and scoring run on the adapters merged into a copy of the
    /// weights (`rollout.merge_lora`, the trainer's default for its rollouts).
    #[arg(long, requires = "lora")]
    pub merge_lora: bool,
    /// Also time the projections' matrix products alone, f32 operands at f32 and at bf16
    /// precision, on the training step's 2 × prompt-len rows and the model's projection shapes
    /// (GFLOP/s; the median of 5 after a warm-up); on a GPU that lends the skinny-matmul kernel,
    /// also at each --decode-batch's rows, burn's matmul against the decoding passes' kernel;
    /// on a GPU that lends the token-choice kernel, each --decode-batch's rows of tokens drawn
    /// from the model's vocabulary by burn's ops and by the kernel.
    #[arg(long)]
    pub products: bool,
    /// Time attention alone instead of the model's workloads: each implementation (eager,
    /// memory_efficient) forward and forward + backward, with the model's heads on random
    /// operands of --attention-lens tokens (one sequence, a causal prefill; burn's ops, the GPU
    /// path: no CPU kernel stands in), and each one's peak memory.
    #[arg(long)]
    pub attention: bool,
    /// Sequence lengths of --attention.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
    pub attention_lens: Vec<usize>,
    /// Switch the fused CPU kernels off: every op runs through burn's portable tensor ops, the
    /// path the CUDA backend takes (measures what the kernels gain; the environment variable
    /// does the same for any command, with 1/0, true/false, yes/no or on/off).
    #[arg(long, env = "PROMPT_R1_PORTABLE_OPS", value_parser = clap::builder::BoolishValueParser::new())]
    pub portable_ops: bool,
    /// Cap the instruction set the CPU kernels use: portable, avx2, avx512 or avx512bf16 (a
    /// level above this CPU's runs at the CPU's; the environment variable does the same for any
    /// command).
    #[arg(long, value_name = "LEVEL", env = "PROMPT_R1_CPU_ISA")]
    pub cpu_isa: Option<Isa>,
    /// Time rollouts instead of the model's workloads: multi-turn episodes through the
    /// trainer's rollout path (`LocalAgent` + the episode loop) against a local scripted
    /// environment, every turn but the last forced to be a call (a random model writes no
    /// well-formed ones), at each --rollout-batch; beside it pure decode of as many tokens at the
    /// same batch. Reports agent tokens/s, prefill tokens per episode and rollout / decode speed.
    /// On a few CPU cores the default 0.6B shape takes hours at these defaults: try
    /// `--preset small` (BENCHMARKS.md).
    #[arg(long, conflicts_with_all = ["attention", "train_step"])]
    pub rollout: bool,
    /// Most episodes in flight at once (`rollout.generation_batch`) for --rollout; a comma list
    /// or repeated.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub rollout_batch: Vec<usize>,
    /// Episodes per measured rollout (default: the --rollout-batch): with more, the next
    /// episode begins as one ends, as `train` runs a step's episodes, and the rollout is also
    /// timed in fixed batches of --rollout-batch (how `train` ran them before), each batch
    /// waiting for its longest episode.
    #[arg(long, value_name = "N", requires = "rollout")]
    pub rollout_episodes: Option<usize>,
    /// Give each --rollout episode its own number of turns, from 1 to --rollout-turns (drawn
    /// from its index, the same every run), as real episodes answer after different numbers of
    /// calls; default: every episode takes --rollout-turns.
    #[arg(long, requires = "rollout")]
    pub rollout_varied_turns: bool,
    /// The rollouts' KV budget for --rollout (`[rollout] kv_budget`, e.g. 160MiB): episodes wait
    /// or are preempted rather than hold more; default: no limit.
    #[arg(long, value_name = "SIZE", value_parser = parse_kv_budget, requires = "rollout")]
    pub kv_budget: Option<u64>,
    /// Most episodes decoding at once in --rollout (`[rollout] max_num_seqs`, vLLM's
    /// `max_num_seqs`): the others in flight wait for a row, so that while some wait on the
    /// environment others decode. The pure decode beside it runs this many rows. Default: every
    /// episode in flight decodes.
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..), requires = "rollout")]
    pub max_num_seqs: Option<u64>,
    /// Whether --rollout's episodes share the KV blocks of equal prefixes (`[rollout]
    /// share_prefixes`, the trainer's default: on).
    #[arg(long, value_name = "on|off", default_value = "on", action = clap::ArgAction::Set,
          value_parser = crate::on_off, requires = "rollout")]
    pub share_prefixes: bool,
    /// Episodes asking the same question in --rollout, one after another (a GRPO group:
    /// `rollout.n`; the trainer's default is 5): their first prompts are equal, so with shared
    /// prefixes it is computed once. Default: each episode its own question.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..), requires = "rollout")]
    pub rollout_group_size: u64,
    /// Whether --rollout's steps with episodes joining run their prefill beside the decoding
    /// rows in ragged passes (vLLM's mixed batches; the default), where the model takes them: a
    /// GPU's paged-attention kernel that takes prefills (`--device-kernels all`). `off` runs
    /// each step's prefill in passes of its own, as the CPU path always does.
    #[arg(long, value_name = "on|off", default_value = "on", action = clap::ArgAction::Set,
          value_parser = crate::on_off, requires = "rollout")]
    pub ragged_passes: bool,
    /// Also time each --rollout batch without shared prefixes, for what sharing gains.
    #[arg(long, requires = "rollout")]
    pub rollout_unshared: bool,
    /// Agent turns per episode for --rollout (every turn but the last calls the environment).
    #[arg(long, default_value_t = 5)]
    pub rollout_turns: usize,
    /// Tokens the agent generates per turn for --rollout (`max_turn_tokens`; a turn ends earlier
    /// only if the model samples a stop token, which is counted).
    #[arg(long, default_value_t = 128)]
    pub rollout_turn_tokens: usize,
    /// Seed of the agent's sampling for --rollout (the same seed gives the same episodes).
    #[arg(long, default_value_t = 0)]
    pub rollout_seed: u64,
    /// Timed runs of each --rollout measurement (rollout and pure decode; the median is
    /// reported). On a GPU the first run of each rollout mode also compiles the kernels of its
    /// new shapes: take 3 there for figures without it.
    #[arg(long, default_value_t = 1)]
    pub rollout_runs: usize,
    /// Most tokens a decoder step runs in --rollout (`[rollout] max_num_batched_tokens`, the
    /// trainer's default): longer prefills run in chunks over the next steps, as in training.
    #[arg(long, default_value_t = trainer::plan::DEFAULT_MAX_NUM_BATCHED_TOKENS, requires = "rollout")]
    pub max_num_batched_tokens: usize,
    /// Also time each --rollout batch turn by turn (`[rollout] continuous_batching = false`:
    /// every episode's turn, then all their calls), for the cost of reproducible batches.
    #[arg(long, requires = "rollout")]
    pub rollout_turn_by_turn: bool,
    /// Latency of each call of the scripted environment, in milliseconds (--rollout).
    #[arg(long, default_value_t = 200)]
    pub env_latency_ms: u64,
    /// Tokens (of the agent's tokenizer) in each reply of the scripted environment (--rollout).
    #[arg(long, default_value_t = 300)]
    pub env_reply_tokens: usize,
    /// Most environment calls in flight at once (--rollout; `episode.env_concurrency`).
    #[arg(long, default_value_t = 32)]
    pub env_concurrency: usize,
    /// Also run each --rollout batch on these rollout workers (`prompt-r1 serve` or vLLM
    /// serving the same --model; a comma list or repeated), as `[rollout] engine = "servers"`
    /// runs it: same seeds, so the same tokens as the local rollout; reports their agent tokens/s
    /// beside the local figure.
    #[arg(long, value_name = "URL", value_delimiter = ',', requires = "rollout")]
    pub rollout_workers: Vec<String>,
    /// The model name the --rollout-workers serve (default: the --model directory's name, what
    /// `serve` calls it unless told otherwise).
    #[arg(long, value_name = "NAME", requires = "rollout_workers")]
    pub rollout_worker_model: Option<String>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One measured workload.
#[derive(Debug, Serialize)]
struct Figure {
    workload: String,
    seconds: f64,
    tokens_per_second: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gflop_per_second: Option<f64>,
    peak_rss_mb: Option<f64>,
    /// `--rollout`'s counts and ratios.
    #[serde(skip_serializing_if = "Option::is_none")]
    rollout: Option<rollout::RolloutStats>,
}

impl Figure {
    /// A workload measured in tokens.
    fn tokens(workload: String, seconds: f64, tokens: Option<f64>, peak_rss_mb: Option<f64>) -> Self {
        let tokens_per_second = tokens.map(|t| t / seconds);
        Figure { workload, seconds, tokens_per_second, gflop_per_second: None, peak_rss_mb, rollout: None }
    }
}

pub fn run(mut args: Args) -> Result<()> {
    let kernels = &mut args.compute.attention.cpu_kernels;
    if args.portable_ops {
        *kernels = Kernels::off();
    } else if let Some(level) = args.cpu_isa {
        *kernels = kernels.capped(level);
    }
    match kernels.level() {
        None => eprintln!("fused CPU kernels off: every op runs through burn's portable tensor ops"),
        Some(level) => eprintln!("CPU kernels at the {level} level (this CPU's best: {})", Isa::host()),
    }
    let device = args.compute.device;
    run_on(device, args)
}

impl Args {
    /// Refuses workloads that would feed positions past the model's `context` (the decoder holds
    /// no sequence longer): prefill feeds `--prompt-len` positions, decoding (plain or chained)
    /// `--decode-context` and `--decode-tokens` less one, a rollout 16 and every turn's tokens
    /// less one; notes a scoring pass or training step past it (a plain forward, timed as is).
    fn check_positions(&self, context: usize) -> Result<()> {
        let past = |what: String, positions: usize| {
            anyhow::anyhow!("{what} feed {positions} positions, past the model's context of {context} tokens (max_position_embeddings): lower them")
        };
        if self.attention {
            if self.attention_lens.contains(&0) {
                anyhow::bail!("--attention-lens must be at least 1 each");
            }
            return Ok(());
        }
        if self.rollout {
            let positions = rollout::DECODE_PROMPT + (self.rollout_turns * self.rollout_turn_tokens).saturating_sub(1);
            if positions > context {
                return Err(past(format!("--rollout-turns {} of --rollout-turn-tokens {} (after a {}-token prompt)", self.rollout_turns, self.rollout_turn_tokens, rollout::DECODE_PROMPT), positions));
            }
            return Ok(());
        }
        if !self.train_step_only {
            if self.workloads.contains(&Workload::Prefill) && self.prompt_len > context {
                return Err(past(format!("--prompt-len {}", self.prompt_len), self.prompt_len));
            }
            let decoded = self.decode_context.saturating_add(self.decode_tokens - 1);
            if (self.workloads.contains(&Workload::Decode) || self.workloads.contains(&Workload::Chained)) && decoded > context {
                return Err(past(format!("--decode-context {} and --decode-tokens {}", self.decode_context, self.decode_tokens), decoded));
            }
            if self.workloads.contains(&Workload::Score) && self.prompt_len > context {
                eprintln!("note: scoring's {} positions pass the model's context of {context} tokens (max_position_embeddings): the timings hold, the outputs mean nothing there", self.prompt_len);
            }
        }
        let trained = self.seq_len.unwrap_or(self.prompt_len);
        if self.train_step && trained > context {
            eprintln!(
                "note: the training step's {trained} positions pass the model's context of {context} tokens (max_position_embeddings): the timings hold, the outputs mean nothing there"
            );
        }
        Ok(())
    }
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        if self.prompt_len < 8 {
            anyhow::bail!("--prompt-len must be at least 8 (got {})", self.prompt_len);
        }
        if self.decode_context == 0 {
            anyhow::bail!("--decode-context must be at least 1");
        }
        if self.decode_batch.contains(&0) {
            anyhow::bail!("--decode-batch must be at least 1 each");
        }
        if self.decode_tokens < 2 {
            anyhow::bail!("--decode-tokens must be at least 2: the decoding steps timed are those after the first token (got {})", self.decode_tokens);
        }
        // The model's context, before any random weights are written: workloads past it are
        // refused, each by what it feeds.
        let context = match &self.model {
            Some(dir) => Qwen3Config::from_file(&dir.join("config.json"))?.max_position_embeddings,
            None => self.preset.config(512, vec![2]).max_position_embeddings,
        };
        self.check_positions(context)?;
        let temp;
        let dir = match &self.model {
            Some(dir) => dir.clone(),
            None => {
                let preset = self.preset;
                temp = crate::scratch::ScratchDir::new()?;
                let config = preset.config(512, vec![2]);
                eprintln!("writing random {} weights ({} parameters)...", preset.name(), config.num_parameters());
                write_random_checkpoint(&config, temp.path(), 0, StorageDtype::BF16)?;
                temp.path().to_path_buf()
            }
        };
        let mut figures = Vec::new();
        if self.rollout {
            self.rollout_figures::<B>(&dir, &device, &mut figures)?;
        } else if self.attention {
            let config = Qwen3Config::from_file(&dir.join("config.json"))?;
            let (block_size, kernels) = (self.compute.attention.attention_block_size, crate::device::device_kernels(self.compute.device));
            figures.extend(attention_figures::<B>(&device, &config, &self.attention_lens, block_size, kernels)?);
        } else if !self.train_step_only {
            self.inference_figures::<B>(&dir, &device, &mut figures)?;
        }
        if self.train_step {
            let seq_len = self.seq_len.unwrap_or(self.prompt_len);
            if seq_len < 2 || self.batch == 0 {
                anyhow::bail!("--seq-len must be at least 2 and --batch at least 1");
            }
            let step = TrainStep {
                batch: self.batch,
                seq_len,
                checkpointing: self.activation_checkpointing,
                lora: self.lora.then(LoraConfig::default),
                dtype: self.compute.dtype,
                matmul: self.matmul,
                attention: self.compute.attention.clone(),
                device: self.compute.device,
            };
            let plan = step.plan(&dir)?;
            if let (Some(plan), Some((memory, source))) = (&plan, crate::device::total_memory(self.compute.device)) {
                let needed = if self.compute.device == DeviceChoice::Cpu { plan.update_peak() } else { plan.update_pool_peak() };
                if needed > memory {
                    let length = if self.seq_len.is_some() { "--seq-len" } else { "--prompt-len" };
                    let checkpointing = if self.activation_checkpointing { "" } else { ", or add --activation-checkpointing" };
                    anyhow::bail!(
                        "the training step of --batch {} x {length} {seq_len} needs about {} by the memory plan, more than {} ({source}): \
                         lower --batch or {length}{checkpointing}",
                        self.batch,
                        trainer::plan::format_size(needed),
                        trainer::plan::format_size(memory)
                    );
                }
            }
            let pool = crate::device::memory_probe(self.compute.device);
            let (seconds, peak, reserved) = step.measure::<B>(&dir, &device, pool.as_ref())?;
            let mode = match (&step.lora, step.checkpointing) {
                (Some(_), false) => " LoRA",
                (Some(_), true) => " LoRA ckpt",
                (None, false) => "",
                (None, true) => " ckpt",
            };
            let workload = format!("train step {} x {}{mode}", self.batch, seq_len);
            figures.push(Figure::tokens(workload, seconds, Some((self.batch * seq_len) as f64), peak));
            if let Some(plan) = plan {
                // On a GPU the device's pool is what the plan predicts (the CUDA context aside),
                // not the host's RSS.
                let (predicted, measured, what) = match reserved {
                    Some(mb) => (plan.update_pool_peak(), Some(mb), "reservation of the GPU's pool"),
                    None => (plan.update_peak(), peak, "peak"),
                };
                let predicted = predicted as f64 / (1024.0 * 1024.0);
                let off = measured.map_or(String::new(), |mb| {
                    format!(", {:+.1}% off the measured {what} ({mb:.0} MiB)", 100.0 * (predicted - mb) / mb)
                });
                eprintln!("memory plan for this training step: {predicted:.0} MiB{off}");
            }
        }

        if self.json {
            println!("{}", serde_json::to_string_pretty(&figures)?);
        } else {
            for stats in figures.iter().filter_map(|f| f.rollout.as_ref()) {
                rollout::print(stats);
            }
            println!("{:<34} {:>10} {:>16} {:>14}", "workload", "seconds", "tokens/s", "peak RSS (MB)");
            for f in &figures {
                let rate = match (f.tokens_per_second, f.gflop_per_second) {
                    (Some(r), _) => format!("{r:.1}"),
                    (None, Some(g)) => format!("{g:.1} GFLOP/s"),
                    (None, None) => "-".into(),
                };
                let rss = f.peak_rss_mb.map_or("-".into(), |m| format!("{m:.0}"));
                println!("{:<34} {:>10.3} {:>16} {:>14}", f.workload, f.seconds, rate, rss);
            }
        }
        Ok(())
    }
}

impl Args {
    /// `--rollout`: at each batch, pure decode and the rollout (see [`rollout`]).
    fn rollout_figures<B: Backend>(&self, dir: &std::path::Path, device: &B::Device, figures: &mut Vec<Figure>) -> Result<()> {
        let model = load_pretrained::<B>(dir, device, self.compute.load_options())?
            .with_matmul_precision(self.matmul)
            .for_inference();
        let tokenizer = rollout::tokenizer(dir)?;
        let settings = rollout::RolloutSettings {
            turns: self.rollout_turns,
            turn_tokens: self.rollout_turn_tokens,
            latency: std::time::Duration::from_millis(self.env_latency_ms),
            reply_tokens: self.env_reply_tokens,
            env_concurrency: self.env_concurrency,
            seed: self.rollout_seed,
            runs: self.rollout_runs,
            workers: self.rollout_workers.clone(),
            worker_model: self.rollout_worker_model.clone().unwrap_or_else(|| crate::cmd::serve::dir_name(dir)),
            turn_by_turn: self.rollout_turn_by_turn,
            max_batched_tokens: self.max_num_batched_tokens.max(1),
            episodes: self.rollout_episodes,
            varied_turns: self.rollout_varied_turns,
            kv_budget: self.kv_budget,
            max_num_seqs: self.max_num_seqs.map(|rows| rows as usize),
            share_prefixes: self.share_prefixes,
            unshared: self.rollout_unshared,
            group_size: self.rollout_group_size as usize,
            ragged_passes: self.ragged_passes,
        };
        if self.rollout_unshared && !self.share_prefixes {
            eprintln!("note: --rollout-unshared does nothing with --share-prefixes off (every run is unshared)");
        }
        for &batch in &self.rollout_batch {
            eprintln!("rollout batch {batch}: pure decode, then {} episodes of {} turns...", settings.episodes.unwrap_or(batch), settings.turns);
            reset_peak_rss();
            let probe = crate::device::MemoryProbe::new(self.compute.device).map(std::rc::Rc::new);
            let stats = rollout::measure(&model, &tokenizer, &settings, batch, probe)?;
            let peak = peak_rss_mb();
            let decoded = (stats.decode_rows * (settings.turns * settings.turn_tokens - 1)) as f64;
            figures.push(Figure::tokens(
                format!("decode batch {} ({} tokens)", stats.decode_rows, settings.turns * settings.turn_tokens),
                decoded / stats.decode_tokens_per_second,
                Some(decoded),
                None,
            ));
            figures.push(Figure::tokens(
                format!("decode batch {} from {}", stats.decode_rows, stats.context_decode_prompt_tokens),
                decoded / stats.context_decode_tokens_per_second,
                Some(decoded),
                None,
            ));
            let workload = format!("rollout batch {batch} x {} turns", settings.turns);
            let mut figure = Figure::tokens(workload, stats.seconds, Some(stats.agent_tokens as f64), peak);
            figure.rollout = Some(stats);
            figures.push(figure);
        }
        Ok(())
    }

    /// Load, prefill, decode and scoring (and the products alone with `--products`).
    fn inference_figures<B: Backend>(&self, dir: &std::path::Path, device: &B::Device, figures: &mut Vec<Figure>) -> Result<()> {
        reset_peak_rss();
        let start = Instant::now();
        let model = load_pretrained::<B>(dir, device, self.compute.load_options())?
            .with_matmul_precision(self.matmul)
            .for_inference();
        B::sync(device)?;
        figures.push(Figure::tokens("load".into(), start.elapsed().as_secs_f64(), None, peak_rss_mb()));
        let adapters = self.lora.then(|| LoraAdapters::<B>::init(&LoraConfig::default(), &model.config, 0, device));
        let (model, adapters) = match adapters {
            Some(adapters) if self.merge_lora => (model::lora::merge_adapters(model, &adapters), None),
            adapters => (model, adapters),
        };
        let policy = LoraModel::new(&model, adapters.as_ref());
        let lora = match (self.lora, self.merge_lora) {
            (false, _) => "",
            (true, false) => ", LoRA",
            (true, true) => ", LoRA merged",
        };
        let vocab = model.config.vocab_size as u32;
        let tokens = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect() };
        let prompt = tokens(self.prompt_len);
        // Decode prompts are --decode-context-token windows of one fixed sequence.
        let decode_source = tokens(self.decode_context + 7);
        let decode_prompts = |batch: usize| -> Vec<Vec<u32>> { (0..batch).map(|b| decode_source[b % 8..b % 8 + self.decode_context].to_vec()).collect() };
        // The decode figures' names give the context where it is not the default.
        let context = match self.decode_context {
            DEFAULT_DECODE_CONTEXT => String::new(),
            context => format!(", context {context}"),
        };

        // Warm-up: one short forward so kernel compilation / allocation is not timed.
        generate(&policy, &[prompt[..8].to_vec()], &SamplingConfig { max_new_tokens: 2, ..Default::default() })?;

        if self.workloads.contains(&Workload::Prefill) {
            reset_peak_rss();
            let seconds = median_seconds(TIMED_RUNS, || {
                let start = Instant::now();
                generate(&policy, &[prompt.clone()], &SamplingConfig { max_new_tokens: 1, ..Default::default() })?;
                Ok(start.elapsed().as_secs_f64())
            })?;
            let workload = format!("prefill {} tokens{lora}", self.prompt_len);
            figures.push(Figure::tokens(workload, seconds, Some(self.prompt_len as f64), peak_rss_mb()));
        }

        let decode_batches = if self.workloads.contains(&Workload::Decode) { &self.decode_batch[..] } else { &[] };
        for &batch in decode_batches {
            let prompts = decode_prompts(batch);
            let config = SamplingConfig {
                max_new_tokens: self.decode_tokens,
                sampling: Sampling { temperature: 1.0, seed: 1, ..Sampling::default() },
                ..Default::default()
            };
            reset_peak_rss();
            let seconds = median_seconds(TIMED_RUNS, || decoding_seconds(&policy, &prompts, &config))?;
            let tokens = (batch * (self.decode_tokens - 1)) as f64;
            let workload = format!("decode batch {batch}{context}{lora}");
            figures.push(Figure::tokens(workload, seconds, Some(tokens), peak_rss_mb()));
        }

        let chained_batches = if self.workloads.contains(&Workload::Chained) { &self.decode_batch[..] } else { &[] };
        for &batch in chained_batches {
            let prompts = decode_prompts(batch);
            let steps = self.decode_tokens - 1;
            let mut chosen = Vec::new();
            for (feed, name) in [(Feed::ReadBack, "tokens read back each step"), (Feed::Chained, "chained on the device")] {
                chained::decode(&policy, &prompts, 2, feed)?;
                reset_peak_rss();
                let seconds = median_seconds(TIMED_RUNS, || {
                    let (tokens, seconds) = chained::decode(&policy, &prompts, steps, feed)?;
                    chosen.push(tokens);
                    Ok(seconds)
                })?;
                let workload = format!("decode batch {batch}{context}, greedy, {name}{lora}");
                figures.push(Figure::tokens(workload, seconds, Some((batch * steps) as f64), peak_rss_mb()));
            }
            if chosen.windows(2).any(|pair| pair[0] != pair[1]) {
                eprintln!("warning: greedy decoding at batch {batch} chose different tokens across the read-back and chained runs");
            }
        }

        if self.workloads.contains(&Workload::Score) {
            reset_peak_rss();
            let half = self.prompt_len / 2;
            let pairs = vec![(prompt[..half].to_vec(), prompt[half..].to_vec()); 2];
            let seconds = median_seconds(TIMED_RUNS, || {
                let start = Instant::now();
                completion_logprobs(&policy, &pairs, 0)?;
                Ok(start.elapsed().as_secs_f64())
            })?;
            let workload = format!("score 2 x {} tokens{lora}", self.prompt_len);
            figures.push(Figure::tokens(workload, seconds, Some((2 * self.prompt_len) as f64), peak_rss_mb()));
        }

        let c = &model.config;
        let shapes = [
            (c.hidden_size, c.num_attention_heads * c.head_dim),
            (c.hidden_size, c.intermediate_size),
            (c.intermediate_size, c.hidden_size),
        ];
        let vocab = c.vocab_size;
        drop(adapters);
        drop(model);
        if self.products {
            figures.extend(product_figures::<B>(device, 2 * self.prompt_len, &shapes, &self.compute)?);
            for &rows in &self.decode_batch {
                figures.extend(decoding_product_figures::<B>(device, rows, &shapes, &self.compute)?);
                figures.extend(token_choice_figures::<B>(device, rows, vocab, &self.compute)?);
            }
        }
        Ok(())
    }
}

/// `--products` at a decoding step's `rows` (each `--decode-batch`), where the device lends the
/// skinny-matmul kernel for them: `x[rows, k] · w[k, n]` with f32 and with bf16 operands (f16
/// where the device has no bf16), by
/// burn's matmul and by the decoding passes' path (the kernel); the median of
/// [`TIMED_PRODUCTS`] after a warm-up. Nothing where the kernel is not lent (the CPU) or is
/// switched off.
fn decoding_product_figures<B: Backend>(device: &B::Device, rows: usize, shapes: &[(usize, usize)], compute_args: &ComputeArgs) -> Result<Vec<Figure>> {
    use burn::tensor::{DType, Distribution, Tensor};
    let compute = compute_args.attention.compute(MatmulPrecision::F32, compute_args.device);
    if compute.device_kernels.skinny_matmul::<B>(rows).is_none() {
        return Ok(Vec::new());
    }
    let mut figures = Vec::new();
    for &(k, n) in shapes {
        for (dtype, name) in [(DType::F32, "f32"), half_dtype::<B>(device)] {
            let x = Tensor::<B, 2>::random([rows, k], Distribution::Uniform(-1.0, 1.0), device).cast(dtype);
            let w = Tensor::<B, 2>::random([k, n], Distribution::Uniform(-0.05, 0.05), device).cast(dtype);
            for (path, skinny) in [("burn's matmul", false), ("decoding pass", true)] {
                let run = || -> Result<f64> {
                    let start = Instant::now();
                    let y = match skinny {
                        true => model::qwen3::decoding_product(x.clone(), w.clone(), &compute),
                        false => model::qwen3::product(x.clone(), w.clone(), &compute),
                    };
                    B::sync(device)?;
                    drop(y);
                    Ok(start.elapsed().as_secs_f64())
                };
                run()?;
                let seconds = median_seconds(TIMED_PRODUCTS, run)?;
                figures.push(Figure {
                    workload: format!("product {rows} x {k} x {n} {name}, {path}"),
                    seconds,
                    tokens_per_second: None,
                    gflop_per_second: Some(2.0 * (rows * k * n) as f64 / 1e9 / seconds),
                    peak_rss_mb: None,
                    rollout: None,
                });
            }
        }
    }
    Ok(figures)
}

/// The 16-bit float the device computes with, and its name: bf16 on CUDA, f16 where bf16 is
/// missing (lavapipe).
fn half_dtype<B: Backend>(device: &B::Device) -> (burn::tensor::DType, &'static str) {
    use burn::tensor::DType;
    if B::supports_dtype(device, DType::BF16) { (DType::BF16, "bf16") } else { (DType::F16, "f16") }
}

/// `--products` at a decoding step's `rows` (each `--decode-batch`), where the device lends the
/// token-choice kernel: each row's token drawn from `[rows, vocab]` logits (temperature 1), f32
/// and bf16 (f16 where the device has no bf16), by burn's ops and by the kernel, each with the
/// read of the `[rows, 2]` result a decoding step makes; the median of [`TIMED_PRODUCTS`] after a
/// warm-up. Nothing where the kernel is not lent (the CPU) or is switched off.
fn token_choice_figures<B: Backend>(device: &B::Device, rows: usize, vocab: usize, compute_args: &ComputeArgs) -> Result<Vec<Figure>> {
    use burn::tensor::{DType, Distribution, Tensor};
    use model::device_sampling::{choose_tokens, choose_tokens_with_ops};
    let kernels = compute_args.attention.compute(MatmulPrecision::F32, compute_args.device).device_kernels;
    if kernels.token_choice::<B>().is_none() {
        return Ok(Vec::new());
    }
    let temperatures = vec![1.0; rows];
    let uniforms: Vec<f64> = (0..rows).map(|r| (r as f64 + 0.5) / rows as f64).collect();
    let mut figures = Vec::new();
    for (dtype, name) in [(DType::F32, "f32"), half_dtype::<B>(device)] {
        let logits = Tensor::<B, 2>::random([rows, vocab], Distribution::Uniform(-8.0, 8.0), device).cast(dtype);
        for (path, by_kernel) in [("burn's ops", false), ("kernel", true)] {
            let run = || -> Result<f64> {
                let start = Instant::now();
                match by_kernel {
                    true => choose_tokens(kernels, logits.clone(), &temperatures, &uniforms)?,
                    false => choose_tokens_with_ops(logits.clone(), &temperatures, &uniforms)?,
                };
                Ok(start.elapsed().as_secs_f64())
            };
            run()?;
            let seconds = median_seconds(TIMED_PRODUCTS, run)?;
            figures.push(Figure {
                workload: format!("token choice {rows} x {vocab} {name}, {path}"),
                seconds,
                tokens_per_second: Some(rows as f64 / seconds),
                gflop_per_second: None,
                peak_rss_mb: None,
                rollout: None,
            });
        }
    }
    Ok(figures)
}

/// The `--train-step` workload.
struct TrainStep {
    batch: usize,
    seq_len: usize,
    checkpointing: bool,
    /// Adapters to train beside the frozen base (`None`: every weight).
    lora: Option<LoraConfig>,
    /// The weights' dtype (the frozen base's with LoRA).
    dtype: DType,
    matmul: MatmulPrecision,
    attention: AttentionArgs,
    device: DeviceChoice,
}

impl TrainStep {
    /// The learn step's settings: one micro-batch of every sequence, no entropy.
    fn config(&self) -> trainer::grpo::LearnConfig {
        trainer::grpo::LearnConfig {
            mini_batch_size: self.batch,
            micro_batch_size: self.batch,
            track_entropy: false,
            matmul: self.matmul,
            activation_checkpointing: self.checkpointing,
            ..Default::default()
        }
    }

    /// One learn step of the GRPO trainer on `batch` sequences of `seq_len` tokens (every token
    /// but the first an agent token, advantages alternating +1/−1): the median of
    /// [`TIMED_STEPS`] steps after a warm-up step (the second step still pays one-time costs,
    /// BENCHMARKS.md), the peak RSS of the timed steps, and on a GPU (`pool`) the most its
    /// memory pool reserved during them, in MiB (its unused pages given back before them).
    fn measure<B: Backend>(&self, dir: &std::path::Path, device: &B::Device, pool: Option<&DeviceMemoryProbe>) -> Result<(f64, Option<f64>, Option<f64>)> {
        use burn::backend::Autodiff;
        use burn::module::Module;
        use trainer::grpo::{learn_step, learn_step_lora, PolicyBatch, PolicySequence};

        let options = LoadOptions { dtype: self.dtype, compute: self.attention.compute(self.matmul, self.device) };
        let model = load_pretrained::<Autodiff<B>>(dir, device, options)?;
        let config = self.config();
        let vocab = model.config.vocab_size as u32;
        let sequence = |i: usize| {
            let tokens: Vec<u32> = (0..self.seq_len as u32).map(|t| (t * 7919 + 13 + i as u32 * 101) % vocab).collect();
            PolicySequence {
                loss_mask: std::iter::once(0).chain(std::iter::repeat_n(1, tokens.len() - 1)).collect(),
                old_logprobs: vec![-1.0; tokens.len()],
                ref_logprobs: Some(vec![-1.0; tokens.len()]),
                advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
                tokens,
            }
        };
        let batch = PolicyBatch::new((0..self.batch).map(sequence).collect())?;
        // A warm-up step, then the timed ones; the peak covers the timed steps only.
        let timed = |mut step: Box<dyn FnMut() -> Result<()> + '_>| -> Result<(f64, Option<f64>, Option<f64>)> {
            step()?;
            end_device_phase::<B>(device, None)?;
            reset_peak_rss();
            let seconds = median_seconds(TIMED_STEPS, || {
                let start = Instant::now();
                step()?;
                B::sync(device)?;
                Ok(start.elapsed().as_secs_f64())
            })?;
            let reserved = end_device_phase::<B>(device, pool)?.map(|m| m.reserved as f64 / (1024.0 * 1024.0));
            Ok((seconds, peak_rss_mb(), reserved))
        };
        match &self.lora {
            None => {
                let mut optimizer = config.optimizer.init::<Autodiff<B>, _>()?;
                let mut policy = Some(model);
                timed(Box::new(|| {
                    let (stepped, _) = learn_step(policy.take().expect("each step returns the policy"), &mut optimizer, &batch, &config)?;
                    policy = Some(stepped);
                    Ok(())
                }))
            }
            Some(lora) => {
                let base = model.no_grad();
                let mut optimizer = config.optimizer.init::<Autodiff<B>, LoraAdapters<Autodiff<B>>>()?;
                let mut adapters = Some(LoraAdapters::init(lora, &base.config, 0, device));
                timed(Box::new(|| {
                    let current = adapters.take().expect("each step returns the adapters");
                    let (stepped, _) = learn_step_lora(&base, current, &mut optimizer, &batch, &config)?;
                    adapters = Some(stepped);
                    Ok(())
                }))
            }
        }
    }

    /// The memory plan of this step (`None` for bf16 weights under full fine-tuning, which the
    /// trainer does not do).
    fn plan(&self, dir: &std::path::Path) -> Result<Option<MemoryPlan>> {
        let device = self.device;
        if self.dtype != DType::F32 && self.lora.is_none() {
            return Ok(None);
        }
        let shape = Qwen3Config::from_file(&dir.join("config.json"))?;
        let config = self.config();
        let settings = PlanSettings {
            model: shape,
            lora: self.lora.as_ref().map(LoraPlan::from_config),
            base_dtype: self.dtype,
            rollout_dtype: self.dtype,
            merge_lora: false,
            kl: false,
            entropy_grad: false,
            micro_batch: config.micro_batch_size,
            mini_batch: config.mini_batch_size,
            generation_batch: 1,
            step_episodes: config.mini_batch_size,
            rollout: Default::default(),
            context: self.seq_len,
            checkpointing: self.checkpointing,
            matmul: self.matmul,
            attention: self.attention.attn_implementation,
            attention_block: self.attention.attention_block_size,
            device: crate::cmd::plan::plan_device(device, &self.attention.compute(self.matmul, device)),
            cuda_memory: match device {
                DeviceChoice::Cuda(_) => crate::device::total_memory(device).map(|(bytes, _)| bytes),
                _ => None,
            },
        };
        Ok(Some(MemoryPlan::new(settings)))
    }
}

/// `--products`: `x[rows, k] · w[k, n]` for each `(k, n)`, f32 operands at both precisions
/// (bf16 only where the device has bf16 products: not lavapipe), through the projections' own
/// path ([`model::qwen3::product`]); the median of [`TIMED_PRODUCTS`] after a warm-up.
fn product_figures<B: Backend>(device: &B::Device, rows: usize, shapes: &[(usize, usize)], compute_args: &ComputeArgs) -> Result<Vec<Figure>> {
    use burn::tensor::{DType, Distribution, Tensor};
    let mut precisions = vec![(MatmulPrecision::F32, "f32")];
    if B::supports_dtype(device, DType::BF16) {
        precisions.push((MatmulPrecision::Bf16, "bf16"));
    }
    let mut figures = Vec::new();
    for &(k, n) in shapes {
        let x = Tensor::<B, 2>::random([rows, k], Distribution::Uniform(-1.0, 1.0), device);
        let w = Tensor::<B, 2>::random([k, n], Distribution::Uniform(-0.05, 0.05), device);
        for &(matmul, name) in &precisions {
            let compute = compute_args.attention.compute(matmul, compute_args.device);
            let run = || -> Result<f64> {
                let start = Instant::now();
                let y = model::qwen3::product(x.clone(), w.clone(), &compute);
                B::sync(device)?;
                drop(y);
                Ok(start.elapsed().as_secs_f64())
            };
            run()?;
            let seconds = median_seconds(TIMED_PRODUCTS, run)?;
            let gflop = 2.0 * (rows * k * n) as f64 / 1e9;
            figures.push(Figure {
                workload: format!("product {rows} x {k} x {n} {name}"),
                seconds,
                tokens_per_second: None,
                gflop_per_second: Some(gflop / seconds),
                peak_rss_mb: None,
                rollout: None,
            });
        }
    }
    Ok(figures)
}

/// `--attention`: each implementation alone on one causal prefill of each length with the
/// model's heads (random f32 operands), forward and forward + backward (under autodiff, the
/// gradients of q, k and v of `Σ output`); the median of [`TIMED_ATTENTION`] runs after a
/// warm-up, and the peak RSS of the timed runs. The eager formula's bias
/// is built outside the timed part (the model builds it once per pass for every layer).
fn attention_figures<B: Backend>(device: &B::Device, config: &Qwen3Config, lens: &[usize], block_size: usize, device_kernels: DeviceKernelChoice) -> Result<Vec<Figure>> {
    use burn::backend::Autodiff;
    use burn::tensor::{Distribution, Tensor};
    use model::qwen3::attention::eager::{eager_attention_forward, grouped_bias};
    use model::qwen3::attention::memory_efficient::Operands;
    use model::qwen3::attention::memory_efficient_attention;
    use model::qwen3::AttentionMask;
    use model::AttnImplementation;

    #[allow(clippy::too_many_arguments)]
    fn attend<A: Backend>(
        implementation: AttnImplementation,
        x: Operands<A>,
        mask: &AttentionMask<A>,
        bias: &Tensor<A, 4>,
        block_size: usize,
        scale: f32,
        device_kernels: DeviceKernelChoice,
    ) -> Tensor<A, 4> {
        match implementation {
            AttnImplementation::Eager => eager_attention_forward(x.query, x.key, x.value, bias, scale as f64),
            AttnImplementation::MemoryEfficient => memory_efficient_attention(x, mask, block_size, scale, device_kernels),
        }
    }

    model::qwen3::register_autodiff_attention::<Autodiff<B>>();
    let (heads, kv_heads, d) = (config.num_attention_heads, config.num_key_value_heads, config.head_dim);
    let scale = 1.0 / (d as f32).sqrt();
    let mut figures = Vec::new();
    for &len in lens {
        let normal = Distribution::Normal(0.0, 1.0);
        let q = Tensor::<B, 4>::random([1, heads, len, d], normal, device);
        let k = Tensor::<B, 4>::random([1, kv_heads, len, d], normal, device);
        let v = Tensor::<B, 4>::random([1, kv_heads, len, d], normal, device);
        for implementation in AttnImplementation::ALL {
            let mask = AttentionMask::<B>::new(None, 1, 0, len, device);
            let bias = match implementation {
                AttnImplementation::Eager => grouped_bias(&mask.bias(q.dtype()), heads, kv_heads),
                AttnImplementation::MemoryEfficient => Tensor::zeros([1, 1, 1, 1], device),
            };
            let forward = || -> Result<f64> {
                let start = Instant::now();
                let x = Operands { query: q.clone(), key: k.clone(), value: v.clone() };
                let out = attend(implementation, x, &mask, &bias, block_size, scale, device_kernels);
                B::sync(device)?;
                drop(out);
                Ok(start.elapsed().as_secs_f64())
            };
            forward()?;
            reset_peak_rss();
            let seconds = median_seconds(TIMED_ATTENTION, forward)?;
            figures.push(Figure::tokens(format!("attention {len} {implementation} fwd"), seconds, Some(len as f64), peak_rss_mb()));

            let tracked = |t: &Tensor<B, 4>| Tensor::<Autodiff<B>, 4>::from_inner(t.clone()).require_grad();
            let (mask_ad, bias_ad) = (AttentionMask::<Autodiff<B>>::new(None, 1, 0, len, device), Tensor::<Autodiff<B>, 4>::from_inner(bias.clone()));
            let backward = || -> Result<f64> {
                let start = Instant::now();
                let x = Operands { query: tracked(&q), key: tracked(&k), value: tracked(&v) };
                let grads = attend(implementation, x, &mask_ad, &bias_ad, block_size, scale, device_kernels).sum().backward();
                B::sync(device)?;
                drop(grads);
                Ok(start.elapsed().as_secs_f64())
            };
            backward()?;
            reset_peak_rss();
            let seconds = median_seconds(TIMED_ATTENTION, backward)?;
            figures.push(Figure::tokens(format!("attention {len} {implementation} fwd+bwd"), seconds, Some(len as f64), peak_rss_mb()));
        }
    }
    Ok(figures)
}

/// The seconds one `generate` of `config` from `prompts` spent on its decoding steps: from when
/// its first step's tokens (the prompts' prefill and first token) reached the host to its end.
fn decoding_seconds<B: Backend>(model: &impl CausalLm<B>, prompts: &[Vec<u32>], config: &SamplingConfig) -> Result<f64> {
    let mut first_step = None;
    model::generate_observed(model, prompts, config, |step| {
        if step == 1 {
            first_step = Some(Instant::now());
        }
    })?;
    let first_step = first_step.context("a decode that ran no step")?;
    Ok(first_step.elapsed().as_secs_f64())
}

/// The median of `runs` calls of `time`, each returning the seconds it measured.
fn median_seconds(runs: usize, mut time: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut seconds = (0..runs).map(|_| time()).collect::<Result<Vec<_>>>()?;
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[runs / 2])
}

/// Runs timed per inference workload (prefill, each decode batch, scoring; the median is
/// reported): one run of a shared VM can be a third slower than the next.
/// `scripts/bench_pytorch.py` times PyTorch the same way.
const TIMED_RUNS: usize = 3;

/// Runs timed per attention workload by `--attention` (the median is reported): a 256-token
/// call takes milliseconds, where one run of a shared VM can be a third off the next.
const TIMED_ATTENTION: usize = 9;

/// Products timed per shape and precision by `--products` (the median is reported).
const TIMED_PRODUCTS: usize = 5;

/// Training steps timed by `--train-step` (the median is reported); `scripts/bench_pytorch.py`
/// times PyTorch the same way.
const TIMED_STEPS: usize = 3;

/// `--kv-budget`: a size such as `160MiB` or `2GB`.
fn parse_kv_budget(text: &str) -> Result<u64, model::SettingError> {
    trainer::plan::parse_size(text)
}

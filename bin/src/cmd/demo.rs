//! `prompt-r1 demo`: the whole Prompt-R1 loop on a fresh machine with no downloads, in a few
//! minutes on 2 CPU cores, with a reward that rises:
//! 1. `init-model --preset tiny` makes the agent and, with another seed, the model that plays
//!    the large LLM (random weights, the project's own 512-token tokenizer);
//! 2. `sft` teaches the large LLM the bundled facts (`assets/demo/questions.jsonl`): asked a
//!    question exactly, it answers it;
//! 3. `serve` puts it behind the OpenAI chat API on a free local port;
//! 4. a scripted teacher writes three demonstrations per training question through the real
//!    loop (its calls reach the served LLM, its answers copy the real replies): one good and two
//!    deliberately imperfect ("I do not know" after asking, answering without asking, a
//!    malformed call, or neither asking nor answering); `sft` on these episodes is the agent's
//!    cold start;
//! 5. GRPO steps train the agent against the served LLM, scored by the double-constrained
//!    reward of the `rewards` crate;
//! 6. `infer` runs the trained agent on a held-out question, turn by turn;
//! 7. `plot` draws the training curves.
//!
//! The reward rises because GRPO moves the agent away from the imperfect demonstrations. A
//! model of 107k parameters learns the protocol and, for the questions it trained on, the
//! answers; it does not learn to copy a question or a reply it has never seen, so the held-out
//! question shows a well-formed episode whose call the large LLM cannot answer.

mod teacher;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use env::{OpenAiClient, ENV_SYSTEM_MESSAGE};
use model::checkpoint::write_atomic;
use trainer::run::{Resume, StepRecord, TrainConfig};
use trainer::sft::SftConfig;

use self::teacher::{Demonstration, Teacher};
use crate::device::{run_on, DeviceChoice};

/// Bundled demo questions with their answers (also used by the CLI tests).
const QUESTIONS: &str = include_str!("../../../assets/demo/questions.jsonl");
/// The last this many bundled questions are held out of the agent's training.
const HELD_OUT: usize = 8;
/// The agent's system message and instruction in the demo (short: tiny models, short contexts).
const SYSTEM: &str = "Ask the large model, then answer with its reply.";
const INSTRUCTION: &str = "Use <interaction_prompt></interaction_prompt>, then <answer></answer>.";
/// The name the large LLM is served under.
const ENV_NAME: &str = "demo-llm";

/// Run the built-in demo of the whole loop (no downloads): a reward that rises in a few minutes.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Where the demo writes its models, runs and plot.
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// GRPO steps to train.
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Seed of everything: the models' weights, the data orders, the agent's sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// SFT steps that teach the large LLM the facts (8 chats a step).
    #[arg(long, default_value_t = 200)]
    pub env_sft_steps: u64,
    /// SFT steps of the agent's cold start on the demonstrations (8 a step).
    #[arg(long, default_value_t = 200)]
    pub agent_sft_steps: u64,
    /// Questions per GRPO step.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Episodes per question (the GRPO group).
    #[arg(long, default_value_t = 4)]
    pub n: usize,
    /// Sampling temperature of the agent in GRPO rollouts.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Learning rate of GRPO (AdamW).
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f64,
    /// Compute device: cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Replace the demo's folders and files in --out (agent/, train/, ...) even where no demo
    /// wrote them. A demo's own --out is replaced without it.
    #[arg(long)]
    pub force: bool,
}

/// What the demo writes in `--out`: a new demo replaces each of them.
const WRITTEN: [&str; 12] = [
    "agent",
    "environment-llm",
    "environment-sft",
    "agent-sft",
    "train",
    "train.jsonl",
    "held-out.jsonl",
    "facts.jsonl",
    "system.txt",
    "instruction.txt",
    "demos.jsonl",
    "serve.log",
];
/// The file marking a folder as a demo's `--out`, whose contents a new demo may replace.
const MARKER: &str = ".prompt-r1-demo";

/// Refuses an `--out` holding folders or files of the demo's names that no demo wrote (a real
/// run's `train/`, a model in `agent/`), unless `force`.
fn check_out_is_the_demos(out: &Path, force: bool) -> Result<()> {
    // A demo of an earlier version left no marker, but its own data files.
    let earlier_demo = out.join("facts.jsonl").is_file() && out.join("demos.jsonl").is_file();
    if force || out.join(MARKER).is_file() || earlier_demo {
        return Ok(());
    }
    let taken: Vec<&str> = WRITTEN.iter().copied().filter(|name| out.join(name).exists()).collect();
    if !taken.is_empty() {
        bail!(
            "{} already holds {} that no demo wrote, and the demo would replace: choose another --out, or pass --force to replace them",
            out.display(),
            taken.join(", ")
        );
    }
    Ok(())
}

/// Refuses flag values the demo's stages would refuse only later, naming the flag.
fn check_flags(args: &Args) -> Result<()> {
    if args.steps == 0 || args.env_sft_steps == 0 || args.agent_sft_steps == 0 {
        bail!("--steps, --env-sft-steps and --agent-sft-steps must be at least 1");
    }
    if args.batch_size == 0 || args.n == 0 {
        bail!("--batch-size and --n must be at least 1");
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!("--temperature must be a finite number of at least 0 (got {})", args.temperature);
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        bail!("--lr must be a finite number above 0 (got {})", args.lr);
    }
    Ok(())
}

/// Kills the environment server when the demo ends, however it ends.
struct ServerGuard(Child);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Where the demo puts things inside `--out`.
struct Layout {
    out: PathBuf,
}

impl Layout {
    fn path(&self, name: &str) -> PathBuf {
        self.out.join(name)
    }
}

pub fn run(args: Args) -> Result<()> {
    check_flags(&args)?;
    let started = Instant::now();
    let exe = std::env::current_exe().context("locating the prompt-r1 binary")?;
    check_out_is_the_demos(&args.out, args.force)?;
    super::create_dir(&args.out)?;
    let layout = Layout {
        out: args.out.canonicalize()?,
    };
    model::checkpoint::write_atomic(&layout.path(MARKER), b"written by prompt-r1 demo: a new demo replaces what it wrote here\n")?;
    // Every stage starts afresh: a demo is a reproducible run of its seed.
    for name in WRITTEN {
        let path = layout.path(name);
        if path.is_dir() {
            std::fs::remove_dir_all(&path).with_context(|| format!("clearing {}", path.display()))?;
        }
    }
    let (train_rows, held_out) = write_data(&layout)?;

    stage("1/7 models: a tiny agent, and a tiny model to play the large LLM");
    for (dir, seed) in [("agent", args.seed), ("environment-llm", args.seed + 1)] {
        super::init_model::run(super::init_model::Args {
            preset: model::Preset::Tiny,
            out: layout.path(dir),
            seed,
            dtype: None,
            tokenizer: None,
            force: true,
        })?;
    }

    stage("2/7 sft: the large LLM learns the bundled facts");
    let env_sft = sft_config(
        &layout.path("environment-llm"),
        &layout.path("facts.jsonl"),
        &layout.path("environment-sft"),
        args.env_sft_steps,
        3e-3,
        args.seed,
    )?;
    let env_model = fine_tune(env_sft, args.device)?;

    stage("3/7 environment: prompt-r1 serve");
    let port = free_port()?;
    let log = std::fs::File::create(layout.path("serve.log"))?;
    let child = Command::new(&exe)
        .args(["serve", "--model"])
        .arg(&env_model)
        .args(["--port", &port.to_string(), "--served-model-name", ENV_NAME, "--no-thinking", "--max-batch", "16"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting prompt-r1 serve")?;
    let _server = ServerGuard(child);
    wait_for_port(port, Duration::from_secs(60))?;
    let env_url = format!("http://127.0.0.1:{port}/v1");
    eprintln!("the large LLM at {env_url} (log: {})", layout.path("serve.log").display());

    stage("4/7 cold start: demonstrations through the real loop, then sft of the agent");
    let train_config = grpo_config(&layout, &args, &env_url)?;
    let demos = demonstrate(&layout, &train_config, &train_rows)?;
    let agent_sft = sft_config(
        &layout.path("agent"),
        &demos,
        &layout.path("agent-sft"),
        args.agent_sft_steps,
        3e-3,
        args.seed,
    )?;
    let cold_start = fine_tune(agent_sft, args.device)?;

    stage("5/7 GRPO: the agent against the served LLM, the Prompt-R1 reward");
    let mut config = train_config;
    config.model = cold_start;
    config.device_kernels = crate::device::device_kernels(args.device);
    let training = super::train::Training {
        config,
        resume: Resume::Fresh,
        memory: crate::device::memory_probe(args.device),
        planned: None,
    };
    let records = run_on(args.device, training)?;
    let (first, last) = first_and_last(&records);
    for r in &records {
        eprintln!(
            "step {:>3}: reward {:+.3} ± {:.3}, format {:.2}, f1 {:.2}, {} groups without signal, rollout {:.1}s, learn {:.1}s",
            r.step,
            r.reward_mean,
            r.reward_std,
            r.format_mean.unwrap_or(0.0),
            r.f1_mean.unwrap_or(0.0),
            r.groups_no_signal,
            r.rollout_secs,
            r.learn_secs
        );
    }
    let window = window(records.len());
    eprintln!("mean reward: first {window} steps {first:+.3}, last {window} steps {last:+.3}");
    let run_dir = layout.path("train");
    let checkpoint = trainer::run::latest_checkpoint(&run_dir)?.context("the run wrote no checkpoint")?;

    stage("6/7 infer: the trained agent on a held-out question");
    let question = held_out["question"].as_str().context("a held-out question")?;
    eprintln!("question: {question} (reference answers: {})", held_out["answers"]);
    let status = Command::new(&exe)
        .arg("infer")
        .arg("--agent")
        .arg(&checkpoint)
        .args(["--env-url", &env_url, "--env-model", ENV_NAME, "--env-temperature", "0", "--env-max-tokens", "16"])
        .args(["--max-turns", "2", "--max-turn-tokens", "48"])
        .arg("--system-prompt")
        .arg(layout.path("system.txt"))
        .arg("--instruction")
        .arg(layout.path("instruction.txt"))
        .args(["--question", question])
        .status()
        .context("running prompt-r1 infer")?;
    if !status.success() {
        bail!("prompt-r1 infer failed");
    }

    stage("7/7 plot");
    let status = Command::new(&exe).arg("plot").arg(&run_dir).status().context("running prompt-r1 plot")?;
    if !status.success() {
        bail!("prompt-r1 plot failed");
    }
    eprintln!(
        "\ndone in {:.0} s: mean reward {first:+.3} over the first {window} GRPO steps, {last:+.3} over the last {window}\n\
         agent {}\nmetrics {}\ncurves {}",
        started.elapsed().as_secs_f64(),
        checkpoint.display(),
        run_dir.join(trainer::run::METRICS_FILE).display(),
        run_dir.join("curves.png").display()
    );
    Ok(())
}

fn stage(title: &str) {
    eprintln!("\n== {title}");
}

/// Steps averaged at each end of the run for the summary: a fifth of the run, at least 1.
pub fn window(steps: usize) -> usize {
    (steps / 5).max(1)
}

/// The mean reward of the first and of the last [`window`] steps.
pub fn first_and_last(records: &[StepRecord]) -> (f32, f32) {
    let k = window(records.len()).min(records.len());
    let mean = |rs: &[StepRecord]| rs.iter().map(|r| r.reward_mean).sum::<f32>() / rs.len().max(1) as f32;
    (mean(&records[..k]), mean(&records[records.len() - k..]))
}

/// Writes the data files: the training and held-out questions, the facts as chats for the
/// large LLM, and the agent's prompt texts. Returns the training rows and the first held-out
/// row.
fn write_data(layout: &Layout) -> Result<(Vec<serde_json::Value>, serde_json::Value)> {
    let rows: Vec<serde_json::Value> =
        QUESTIONS.lines().map(serde_json::from_str).collect::<Result<_, _>>().context("the bundled questions")?;
    let split = rows.len() - HELD_OUT;
    let lines = |rows: &[serde_json::Value]| rows.iter().map(|r| format!("{r}\n")).collect::<String>();
    write_atomic(&layout.path("train.jsonl"), lines(&rows[..split]).as_bytes())?;
    write_atomic(&layout.path("held-out.jsonl"), lines(&rows[split..]).as_bytes())?;
    let facts: String = rows
        .iter()
        .map(|r| {
            let chat = serde_json::json!({"messages": [
                {"role": "system", "content": ENV_SYSTEM_MESSAGE},
                {"role": "user", "content": r["question"]},
                {"role": "assistant", "content": r["answers"][0]},
            ]});
            format!("{chat}\n")
        })
        .collect();
    write_atomic(&layout.path("facts.jsonl"), facts.as_bytes())?;
    write_atomic(&layout.path("system.txt"), SYSTEM.as_bytes())?;
    write_atomic(&layout.path("instruction.txt"), INSTRUCTION.as_bytes())?;
    Ok((rows[..split].to_vec(), rows[split].clone()))
}

/// An SFT run of `steps` steps of 8 rows on `data`, starting from `model`.
fn sft_config(model: &Path, data: &Path, out: &Path, steps: u64, lr: f64, seed: u64) -> Result<SftConfig> {
    let text = format!(
        r#"
model = {model:?}
[data]
train = [{data:?}]
[train]
steps = {steps}
batch_size = 8
micro_batch_size = 8
seed = {seed}
[optimizer]
lr = {lr:e}
[run]
out_dir = {out:?}
save_every = {steps}
keep_checkpoints = 1
"#
    );
    let config: SftConfig = toml::from_str(&text).context("the demo's SFT configuration")?;
    config.validate()?;
    Ok(config)
}

/// Runs an SFT configuration; returns its final checkpoint.
fn fine_tune(mut config: SftConfig, device: DeviceChoice) -> Result<PathBuf> {
    config.device_kernels = crate::device::device_kernels(device);
    let out = config.run.out_dir.clone();
    let fine_tuning = super::sft::FineTuning { config, resume: Resume::Fresh, memory: crate::device::memory_probe(device) };
    let records = run_on(device, fine_tuning)?;
    if let (Some(first), Some(last)) = (records.first(), records.last()) {
        eprintln!("loss per trained token: {:.3} at step 1, {:.3} at step {}", first.loss, last.loss, last.step);
    }
    trainer::run::latest_checkpoint(&out)?.context("the SFT run wrote no checkpoint")
}

/// Three demonstrations per training question, written by the teacher through the real episode
/// loop against the served LLM, saved as episodes (`infer --json`'s format) in `demos.jsonl`.
fn demonstrate(layout: &Layout, config: &TrainConfig, rows: &[serde_json::Value]) -> Result<PathBuf> {
    let questions: Vec<&str> = rows.iter().filter_map(|r| r["question"].as_str()).collect();
    let mut script = Vec::new();
    let mut asked = Vec::new();
    for (i, q) in questions.iter().enumerate() {
        for kind in Demonstration::for_question(i) {
            script.push(kind);
            asked.push(*q);
        }
    }
    let client = OpenAiClient::new(config.environment.clone()).context("the environment client")?;
    let episode = config.episode.episode_config()?;
    let episodes = env::run_episodes(&mut Teacher { script: script.clone() }, &client, &asked, &episode);
    let path = layout.path("demos.jsonl");
    let mut lines = Vec::new();
    for e in &episodes {
        if let Some(error) = e.error.as_deref() {
            bail!("a demonstration failed: {error}");
        }
        writeln!(lines, "{}", serde_json::to_string(e)?)?;
    }
    write_atomic(&path, &lines)?;
    let imperfect = script.iter().filter(|k| **k != Demonstration::Good).count();
    eprintln!(
        "{} demonstrations ({} good, {imperfect} deliberately imperfect) in {}",
        episodes.len(),
        episodes.len() - imperfect,
        path.display()
    );
    Ok(path)
}

/// The GRPO run: the reference prompts replaced by the demo's short ones, two turns (a call
/// and an answer), the large LLM greedy.
fn grpo_config(layout: &Layout, args: &Args, env_url: &str) -> Result<TrainConfig> {
    let (steps, seed) = (args.steps, args.seed);
    let text = format!(
        r#"
model = {agent:?}
[data]
train = [{train:?}]
validation = [{held_out:?}]
[environment]
base_url = "{env_url}"
model = "{ENV_NAME}"
read_timeout_secs = 120.0
[environment.sampling]
temperature = 0.0
max_tokens = 16
[episode]
max_turns = 2
max_turn_tokens = 48
max_response_tokens = 160
system_prompt = {system:?}
instruction = {instruction:?}
[rollout]
batch_size = {batch}
n = {n}
generation_batch = 64
continuous_batching = false   # turn by turn: the same run every time on one host (README)
[rollout.sampling]
temperature = {temperature}
seed = {seed}
[grpo]
mini_batch_size = {episodes}
micro_batch_size = 32
[grpo.loss]
kl_coef = 0.0
[grpo.optimizer]
lr = {lr:e}
[run]
out_dir = {run:?}
steps = {steps}
save_every = {steps}
validate_every = {steps}
keep_checkpoints = 1
seed = {seed}
"#,
        agent = layout.path("agent"),
        train = layout.path("train.jsonl"),
        held_out = layout.path("held-out.jsonl"),
        system = layout.path("system.txt"),
        instruction = layout.path("instruction.txt"),
        batch = args.batch_size,
        n = args.n,
        episodes = args.batch_size * args.n,
        temperature = args.temperature,
        lr = args.lr,
        run = layout.path("train"),
    );
    let config: TrainConfig = toml::from_str(&text).context("the demo's GRPO configuration")?;
    config.validate()?;
    Ok(config)
}

/// A port nobody listens on right now.
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

fn wait_for_port(port: u16, limit: Duration) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("prompt-r1 serve did not start listening on port {port} within {limit:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_and_last_windows() {
        let records: Vec<StepRecord> = (1..=10)
            .map(|s| StepRecord {
                step: s,
                reward_mean: s as f32,
                ..StepRecord::default()
            })
            .collect();
        assert_eq!(window(10), 2);
        assert_eq!(first_and_last(&records), (1.5, 9.5));
        assert_eq!(first_and_last(&records[..1]), (1.0, 1.0));
    }
}

//! `prompt-r1 demo`: the whole Prompt-R1 loop on a fresh machine with no downloads, in a couple
//! of minutes on 2 CPU cores:
//! 1. `init-model --preset tiny` makes the agent (random weights, the project's own tokenizer)
//!    and, with another seed, a second tiny model that plays the large LLM;
//! 2. `serve` puts that second model behind the OpenAI chat API on a free local port;
//! 3. a few GRPO steps train the agent on bundled questions against it, with a checkpoint;
//! 4. `infer` runs the trained checkpoint on one question, showing every turn;
//! 5. `plot` draws the training curves.
//!
//! The models are random, so the rewards stay low: the demo shows the machinery, not learning
//! (the trainer's tests show learning on a task a tiny model can learn).

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use trainer::run::TrainConfig;

use crate::device::{run_on, DeviceChoice};

/// Bundled demo questions (also used by the CLI tests).
const QUESTIONS: &str = include_str!("../../../assets/demo/questions.jsonl");

/// Run the built-in demo of the whole loop (no downloads).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Where the demo writes its models, run and plot.
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// GRPO steps to train.
    #[arg(long, default_value_t = 4)]
    pub steps: u64,
    /// Compute device: cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
}

/// Kills the environment server when the demo ends, however it ends.
struct ServerGuard(Child);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(args: Args) -> Result<()> {
    let exe = std::env::current_exe().context("locating the prompt-r1 binary")?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let out = args.out.canonicalize()?;
    let agent_dir = out.join("agent");
    let env_dir = out.join("environment-llm");
    let run_dir = out.join("train");

    step("1/5 models");
    for (dir, seed) in [(&agent_dir, 0u64), (&env_dir, 1)] {
        if dir.join("model.safetensors").is_file() {
            eprintln!("using {}", dir.display());
        } else {
            super::init_model::run(super::init_model::Args {
                preset: model::Preset::Tiny,
                out: dir.clone(),
                seed,
                dtype: None,
                tokenizer: None,
                force: false,
            })?;
        }
    }

    step("2/5 environment: prompt-r1 serve");
    let port = free_port()?;
    let log = std::fs::File::create(out.join("serve.log"))?;
    let child = Command::new(&exe)
        .args(["serve", "--model"])
        .arg(&env_dir)
        .args(["--port", &port.to_string(), "--served-model-name", "tiny-env"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting prompt-r1 serve")?;
    let _server = ServerGuard(child);
    wait_for_port(port, Duration::from_secs(60))?;
    let env_url = format!("http://127.0.0.1:{port}/v1");
    eprintln!("environment at {env_url} (log: {})", out.join("serve.log").display());

    step("3/5 GRPO training");
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("clearing {}", run_dir.display()))?;
    }
    let questions = out.join("questions.jsonl");
    std::fs::write(&questions, QUESTIONS)?;
    let config = demo_config(&agent_dir, &questions, &run_dir, &env_url, args.steps)?;
    let records = run_on(args.device, super::train::Training { config, resume: false })?;
    for r in &records {
        eprintln!(
            "step {}: reward {:.3} ± {:.3}, format {:.2}, kl {:.5}, {} agent tokens, rollout {:.1}s, learn {:.1}s, peak RSS {:.0} MB",
            r.step,
            r.reward_mean,
            r.reward_std,
            r.format_mean.unwrap_or(0.0),
            r.kl.unwrap_or(0.0),
            r.agent_tokens,
            r.rollout_secs,
            r.learn_secs,
            r.peak_rss_mb.unwrap_or(0.0)
        );
    }
    let checkpoint = trainer::run::latest_checkpoint(&run_dir)?.context("the run wrote no checkpoint")?;

    step("4/5 infer with the trained checkpoint");
    let status = Command::new(&exe)
        .arg("infer")
        .arg("--agent")
        .arg(&checkpoint)
        .args(["--env-url", &env_url, "--env-model", "tiny-env", "--max-turns", "2"])
        .args(["--question", "Which river flows through Paris?"])
        .status()
        .context("running prompt-r1 infer")?;
    if !status.success() {
        bail!("prompt-r1 infer failed");
    }

    step("5/5 plot");
    let status = Command::new(&exe).arg("plot").arg(&run_dir).status().context("running prompt-r1 plot")?;
    if !status.success() {
        bail!("prompt-r1 plot failed");
    }
    eprintln!(
        "\ndone: checkpoint {}, metrics {}, curves {}",
        checkpoint.display(),
        run_dir.join(trainer::run::METRICS_FILE).display(),
        run_dir.join("curves.png").display()
    );
    Ok(())
}

fn step(title: &str) {
    eprintln!("\n== {title}");
}

/// A small but complete configuration: the reference prompts and reward, short turns.
fn demo_config(agent: &Path, questions: &Path, run_dir: &Path, env_url: &str, steps: u64) -> Result<TrainConfig> {
    let text = format!(
        r#"
model = {agent:?}
[data]
train = [{questions:?}]
validation = [{questions:?}]
validation_limit = 2
[environment]
base_url = "{env_url}"
model = "tiny-env"
read_timeout_secs = 120.0
[environment.sampling]
max_tokens = 32
[episode]
max_turns = 2
max_turn_tokens = 24
max_response_tokens = 256
[rollout]
batch_size = 2
n = 4
generation_batch = 8
[grpo]
mini_batch_size = 8
micro_batch_size = 4
[grpo.optimizer]
lr = 1e-4
[run]
out_dir = {run_dir:?}
steps = {steps}
save_every = {steps}
validate_every = {steps}
keep_checkpoints = 1
"#
    );
    let mut config: TrainConfig = toml::from_str(&text).context("the demo configuration")?;
    config.validate().map_err(anyhow::Error::msg)?;
    config.resolve_paths(Path::new("."));
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

//! `prompt-r1 infer`: one question, one episode — the agent prompts the large LLM turn by turn,
//! then answers.

use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use env::{run_episodes_observed, EpisodeObserver, Trajectory, TurnRecord};

use crate::agent_flags::{AgentFlags, EnvFlags, EpisodeFlags};

/// Answer one question with the agent prompting the large LLM.
///
/// Shows each turn as it happens (the agent's thinking, its prompt, the large LLM's reply),
/// then the final answer and why the episode stopped. `--json` prints only the trajectory, as
/// one JSON object: {"question", "answer", "stop_reason", "error", "turns": [{"think",
/// "prompt", "response", "answer", "text", ...}], token ids, timings, ...}. The exit status is 1
/// when the episode failed (the environment or the agent broke down).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// The question.
    #[arg(long)]
    pub question: String,
    /// Print the trajectory as one JSON object instead of the turns.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub agent: AgentFlags,
    #[command(flatten)]
    pub env: EnvFlags,
    #[command(flatten)]
    pub episode: EpisodeFlags,
}

pub fn run(mut args: Args) -> Result<()> {
    if args.question.trim().is_empty() {
        bail!("--question is empty");
    }
    args.agent.apply_preset(args.episode.preset);
    // One question at a terminal: say why nothing happens while the large LLM is retried.
    let env = args
        .env
        .client("infer")?
        .on_retry(|notice| eprintln!("note: the large LLM: {notice}"));
    let config = args.episode.config(&args.env)?;
    let trajectory = args.agent.with_agent(|agent| {
        let mut printer = TurnPrinter {
            show: !args.json,
            turns: 0,
        };
        let questions = [args.question.as_str()];
        let mut out = run_episodes_observed(agent, &env, &questions, &config, &mut printer);
        out.pop().context("the episode loop returned no trajectory")
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&trajectory)?);
    } else {
        print_outcome(&trajectory);
    }
    if trajectory.stop_reason.is_failure() {
        bail!(
            "the episode failed: {}",
            trajectory.error.as_deref().unwrap_or("no reason given")
        );
    }
    Ok(())
}

/// Prints each turn when it is complete.
struct TurnPrinter {
    show: bool,
    turns: usize,
}

impl EpisodeObserver for TurnPrinter {
    fn turn_finished(&mut self, _episode: usize, turn: &TurnRecord) {
        if !self.show {
            return;
        }
        self.turns += 1;
        println!("── turn {} ──", self.turns);
        if let Some(think) = &turn.think {
            section("think", think);
        }
        if let Some(prompt) = &turn.prompt {
            section("prompt", prompt);
        }
        if let Some(reply) = &turn.response {
            let ms = turn
                .env_ms
                .map(|ms| format!(", {ms} ms"))
                .unwrap_or_default();
            let cut = if turn.response_truncated {
                ", shown to the agent cut"
            } else {
                ""
            };
            section(
                &format!("reply ({} chars{ms}{cut})", reply.chars().count()),
                reply,
            );
        }
        if let Some(answer) = &turn.answer {
            section("answer", answer);
        }
        if turn.think.is_none() && turn.prompt.is_none() && turn.answer.is_none() {
            section("text (no <think>, call or answer)", &turn.text);
        }
        let _ = std::io::stdout().flush();
    }
}

/// A heading and its text, indented.
fn section(heading: &str, text: &str) {
    println!("{heading}:");
    if text.trim().is_empty() {
        println!("  (empty)");
    }
    for line in text.trim().lines() {
        println!("  {line}");
    }
}

fn print_outcome(trajectory: &Trajectory) {
    println!("──");
    match &trajectory.answer {
        Some(answer) => println!("answer: {answer}"),
        None => println!("answer: (none)"),
    }
    let reason = serde_json::to_value(trajectory.stop_reason)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let calls = match trajectory.env_calls {
        1 => "1 call".to_string(),
        n => format!("{n} calls"),
    };
    println!(
        "stop reason: {reason} ({calls} to the large LLM, {:.1} s)",
        trajectory.timings.total_ms as f64 / 1000.0
    );
    // A failed episode's cause ends the command as its error (stderr), once.
    if let Some(error) = trajectory.error.as_ref().filter(|_| !trajectory.stop_reason.is_failure()) {
        println!("error: {error}");
    }
}

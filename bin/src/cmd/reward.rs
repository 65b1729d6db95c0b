//! `prompt-r1 reward`: the double-constrained reward of a saved episode, with its breakdown.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use rewards::{RewardBreakdown, RewardConfig};
use serde_json::json;

/// Score a saved episode: format terms per agent turn, cap, gate and answer F1.
///
/// The episode is the decoded text with special tokens kept; its agent turns are the complete
/// `<|im_start|>assistant\n … <|im_end|>` blocks (the environment's replies sit in user blocks
/// and are skipped).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Text file holding the decoded episode.
    #[arg(long)]
    pub episode: PathBuf,
    /// Reference answers as a JSON array of strings, e.g. '["Paris", "Paris, France"]'.
    #[arg(long)]
    pub answers: String,
    /// JSON file with reward constants (call_turn, answer_tag, answer_non_empty,
    /// think_answer_layout, cap, gate); missing keys keep the reference values.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print {"reward", "format", "format_raw", "f1", "em"} as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let answers = parse_answers(&args.answers)?;
    let config = match &args.config {
        Some(path) => load_config(path)?,
        None => RewardConfig::default(),
    };
    let text = std::fs::read_to_string(&args.episode)
        .with_context(|| format!("cannot read episode {}", args.episode.display()))?;
    let breakdown = RewardBreakdown::from_text(&text, &answers, &config);
    if args.json {
        let summary = json!({
            "reward": breakdown.reward,
            "format": breakdown.format,
            "format_raw": breakdown.format_raw,
            "f1": breakdown.f1,
            "em": breakdown.em,
        });
        println!("{summary}");
    } else {
        print!("{}", render(&breakdown));
    }
    Ok(())
}

/// The `--answers` JSON array; at least one answer.
fn parse_answers(text: &str) -> Result<Vec<String>> {
    let answers: Vec<String> = serde_json::from_str(text)
        .with_context(|| format!("--answers must be a JSON array of strings, got {text}"))?;
    if answers.is_empty() {
        bail!("--answers must list at least one reference answer");
    }
    Ok(answers)
}

fn load_config(path: &Path) -> Result<RewardConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read reward config {}", path.display()))?;
    let config: RewardConfig = serde_json::from_str(&text)
        .with_context(|| format!("reward config {} is not valid", path.display()))?;
    config.validate()?;
    Ok(config)
}

/// A readable breakdown: totals, then the terms that fired on each turn.
fn render(b: &RewardBreakdown) -> String {
    let gate = if b.gate_passed {
        "passed"
    } else {
        "not passed"
    };
    let mut out = format!(
        "reward      {:.4}\nformat      {:.4} (raw {:.4}, gate {gate})\nf1          {:.4}\nem          {:.4}\nanswer      {}\n",
        b.reward,
        b.format,
        b.format_raw,
        b.f1,
        b.em,
        b.answer.as_deref().unwrap_or("(none)"),
    );
    if b.turns.is_empty() {
        out.push_str("no complete assistant turn found\n");
    }
    for (i, turn) in b.turns.iter().enumerate() {
        let role = turn.role.name();
        let terms: Vec<&str> = turn.terms.iter().map(|t| t.name()).collect();
        let terms = if terms.is_empty() {
            "(none)".to_string()
        } else {
            terms.join(", ")
        };
        out.push_str(&format!("turn {} ({role}): {terms}\n", i + 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_must_be_a_non_empty_string_array() {
        assert_eq!(parse_answers(r#"["a", "b"]"#).unwrap(), ["a", "b"]);
        assert!(parse_answers("[]").is_err());
        assert!(parse_answers("a").is_err());
        assert!(parse_answers("[1]").is_err());
    }

    #[test]
    fn render_lists_every_turn() {
        let text = "<|im_start|>assistant\n<think>a</think><interaction_prompt>p</interaction_prompt><|im_end|>\n\
                    <|im_start|>assistant\n<think>\nb</think><answer>x</answer><|im_end|>";
        let b = RewardBreakdown::from_text(text, &["x"], &RewardConfig::default());
        let out = render(&b);
        assert!(out.contains("turn 1 (call): well_formed_call\n"), "{out}");
        assert!(
            out.contains("turn 2 (final): answer_tag, answer_non_empty, think_answer_layout\n"),
            "{out}"
        );
        assert!(out.starts_with("reward      1.0000\n"), "{out}");
    }
}

//! `prompt-r1 reward`: the double-constrained reward of a saved episode, with its breakdown.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use rewards::{RewardBreakdown, RewardConfig};
use serde_json::json;

/// Score a saved episode: format terms per agent turn, cap, gate and answer F1.
///
/// The episode is a decoded episode text with special tokens kept, an episode as `infer --json`
/// prints it, or a row of `eval`'s `predictions.jsonl` (whose `answers` serve when `--answers`
/// is not given). Its agent turns are the `<|im_start|>assistant\n … <|im_end|>` blocks, a last
/// one cut by the token limit included (the environment's replies sit in user blocks and are
/// skipped).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// The episode: a text file, or a JSON file holding one episode (`infer --json`) or one
    /// `predictions.jsonl` row.
    #[arg(long)]
    pub episode: PathBuf,
    /// Reference answers as a JSON array of strings, e.g. '["Paris", "Paris, France"]'
    /// (default: a predictions row's `answers`).
    #[arg(long)]
    pub answers: Option<String>,
    /// JSON file with reward constants (call_turn, answer_tag, answer_non_empty,
    /// think_answer_layout, cap, gate); missing keys keep the reference values.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print {"reward", "format", "format_raw", "f1", "em"} as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let config = match &args.config {
        Some(path) => load_config(path)?,
        None => RewardConfig::default(),
    };
    let raw = std::fs::read_to_string(&args.episode)
        .with_context(|| format!("cannot read episode {}", args.episode.display()))?;
    let episode = read_episode(&raw).with_context(|| format!("episode {}", args.episode.display()))?;
    let answers = match (&args.answers, episode.answers) {
        (Some(text), _) => parse_answers(text)?,
        (None, Some(answers)) => answers,
        (None, None) => bail!(
            "--answers is needed: {} holds no reference answers (only a predictions.jsonl row does)",
            args.episode.display()
        ),
    };
    let breakdown = RewardBreakdown::from_text(&episode.text, &answers, &config);
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

/// An episode's decoded text, with the reference answers its file holds.
struct Episode {
    text: String,
    answers: Option<Vec<String>>,
}

/// `raw` as a decoded episode text, or, when it is a JSON object, as an episode (`prompt_text`
/// and `response_text`) or a predictions row (`trajectory` and `answers`).
fn read_episode(raw: &str) -> Result<Episode> {
    let raw = raw.strip_prefix('\u{feff}').unwrap_or(raw);
    if raw.trim().is_empty() {
        bail!("the file is empty: give an episode's decoded text, an episode as `infer --json` prints it, or a predictions.jsonl row");
    }
    if !raw.trim_start().starts_with('{') {
        if serde_json::from_str::<serde_json::Value>(raw.trim()).is_ok() {
            bail!("holds JSON that is not an object: a JSON episode is an object (as `infer --json` prints it, or a predictions.jsonl row)");
        }
        return Ok(Episode { text: raw.to_owned(), answers: None });
    }
    let value: serde_json::Value = serde_json::from_str(raw.trim()).context("starts with `{` but is not one JSON object")?;
    let answers = match value.get("answers") {
        Some(answers) => Some(
            serde_json::from_value::<Vec<String>>(answers.clone())
                .ok()
                .filter(|answers| !answers.is_empty())
                .context("`answers` must be a non-empty array of strings")?,
        ),
        None => None,
    };
    let trajectory = value.get("trajectory").unwrap_or(&value);
    let part = |key: &str| {
        trajectory.get(key).and_then(|v| v.as_str()).with_context(|| {
            format!("a JSON episode needs `{key}` (as `infer --json` prints it, or a predictions.jsonl row's `trajectory`)")
        })
    };
    Ok(Episode { text: format!("{}{}", part("prompt_text")?, part("response_text")?), answers })
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
        out.push_str("no assistant turn found\n");
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

    /// An empty file, or JSON that is not an object, is no episode: refused, not scored −1.
    #[test]
    fn an_empty_file_or_other_json_is_no_episode() {
        for raw in ["", " \n", "\u{feff}"] {
            assert!(read_episode(raw).err().unwrap().to_string().contains("empty"), "{raw:?}");
        }
        for raw in ["[1, 2]", "\"text\"", "3"] {
            assert!(read_episode(raw).err().unwrap().to_string().contains("not an object"), "{raw:?}");
        }
        assert_eq!(read_episode("<|im_start|>assistant\nx").unwrap().text, "<|im_start|>assistant\nx");
    }

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

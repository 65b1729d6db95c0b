//! `metrics.jsonl`: one JSON object per training step, appended and flushed as the run goes;
//! a first object with `training/global_step` 0 holds the validation run before training, when
//! there is one, and only its `val/…` keys (see [`StepRecord::validation_only`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize};

use super::error::TrainError;
use crate::grpo::PolicyLossStats;

/// File name of the per-step metrics inside the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// What one GRPO step did. Serialised under the metric names verl logs (`actor/pg_loss`,
/// `critic/score/mean`, `timing_s/gen`, ...), so tools written for verl runs read ours; fields
/// verl has no name for sit under the same kind of slash names. A key that a line lacks reads as the
/// field's default (0, `None`): the step-0 line of the validation before training holds only
/// the step and the validation keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepRecord {
    #[serde(rename = "training/global_step")]
    pub step: u64,
    #[serde(rename = "training/epoch")]
    pub epoch: u64,
    #[serde(rename = "critic/score/mean", deserialize_with = "null_as_nan")]
    pub reward_mean: f32,
    #[serde(rename = "critic/score/std", deserialize_with = "null_as_nan")]
    pub reward_std: f32,
    #[serde(rename = "reward/format/mean")]
    pub format_mean: Option<f32>,
    #[serde(rename = "reward/f1/mean")]
    pub f1_mean: Option<f32>,
    #[serde(rename = "actor/loss", deserialize_with = "null_as_nan")]
    pub loss: f32,
    #[serde(rename = "actor/pg_loss", deserialize_with = "null_as_nan")]
    pub pg_loss: f32,
    #[serde(rename = "actor/kl_loss")]
    pub kl: Option<f32>,
    #[serde(rename = "actor/entropy")]
    pub entropy: Option<f32>,
    /// The per-token statistics of the update (`actor/pg_clipfrac`, `actor/ppo_kl`, ...), under
    /// their own names; they also read as the record's fields (`record.approx_kl`). Declared
    /// before `validation_by_source`, which takes its keys from what the flattened fields leave.
    #[serde(flatten)]
    pub policy: PolicyLossStats,
    #[serde(rename = "actor/grad_norm")]
    pub grad_norm: Option<f32>,
    #[serde(rename = "actor/optimizer_steps")]
    pub optimizer_steps: usize,
    /// Optimiser steps skipped because the gradient norm was not finite (this step).
    #[serde(rename = "actor/skipped_steps")]
    pub skipped_steps: usize,
    /// Episodes dropped because the environment failed (this step).
    #[serde(rename = "rollout/env_failures")]
    pub env_failures: usize,
    /// Episodes dropped because the agent's own generation failed (a rollout worker refused or
    /// was lost, the decoder could not hold it): not scored, not learnt from (this step).
    #[serde(rename = "rollout/agent_failures")]
    pub agent_failures: usize,
    #[serde(rename = "rollout/episodes")]
    pub episodes: usize,
    #[serde(rename = "rollout/agent_tokens")]
    pub agent_tokens: usize,
    #[serde(rename = "response_length/mean", deserialize_with = "null_as_nan")]
    pub mean_response_tokens: f32,
    #[serde(rename = "num_turns/mean", deserialize_with = "null_as_nan")]
    pub mean_turns: f32,
    #[serde(rename = "timing_s/gen", deserialize_with = "null_as_nan")]
    pub rollout_secs: f32,
    #[serde(rename = "timing_s/update_actor", deserialize_with = "null_as_nan")]
    pub learn_secs: f32,
    /// Agent tokens generated per second during the rollout.
    #[serde(rename = "perf/gen_tokens_per_s", deserialize_with = "null_as_nan")]
    pub rollout_tokens_per_sec: f32,
    /// Tokens run through prefill during the rollouts (each episode's prompt and environment
    /// replies, once: its KV cache is kept across turns; again only after a preemption), to
    /// compare with `perf/context_tokens`. With `rollout.engine = "servers"`, what the workers
    /// report: each reply's `usage.prompt_tokens` less its `prompt_tokens_details.cached_tokens`
    /// (a worker's prefix cache spares an episode's earlier turns).
    #[serde(rename = "perf/prefill_tokens")]
    pub prefill_tokens: u64,
    /// Context positions the rollouts took from KV blocks other episodes had computed instead of
    /// prefilling them (`rollout.share_prefixes`: prompts' common prefixes). With
    /// `perf/prefill_tokens` and the agent's decoded tokens they make up about
    /// `perf/context_tokens` (each episode's last token is never fed; a preempted episode is fed
    /// again).
    #[serde(rename = "perf/shared_prefix_tokens", default)]
    pub shared_prefix_tokens: u64,
    /// Tokens of the rollouts' contexts at their end: prompts, agent and environment tokens.
    #[serde(rename = "perf/context_tokens")]
    pub context_tokens: u64,
    /// Most KV-cache positions the rollouts' paged pool held at once (the blocks of running and
    /// parked episodes, free blocks), to compare with `rollout.kv_budget` and the plan.
    #[serde(rename = "perf/kv_peak_positions")]
    pub kv_peak_positions: u64,
    /// Episodes whose KV cache was dropped during the rollouts to stay within
    /// `rollout.kv_budget` (prefilled again later).
    #[serde(rename = "rollout/preemptions")]
    pub preemptions: u64,
    /// Turns sent again to another rollout worker after one failed (`rollout.engine =
    /// "servers"`; 0 otherwise).
    #[serde(rename = "rollout/server_retries")]
    pub server_retries: u64,
    /// Rollout workers not in use at the rollout's end: unreachable, or they did not take the
    /// step's policy (`rollout.engine = "servers"`; 0 otherwise).
    #[serde(rename = "rollout/workers_left_out")]
    pub workers_left_out: u64,
    /// Those workers, each as `url (why)`, for the console (not in `metrics.jsonl`).
    #[serde(skip)]
    pub workers_left_out_why: Vec<String>,
    /// Why the first episode dropped for the environment failed, and the first dropped for the
    /// agent, for the console (not in `metrics.jsonl`).
    #[serde(skip)]
    pub env_failure_why: Option<String>,
    #[serde(skip)]
    pub agent_failure_why: Option<String>,
    /// Seconds of the local rollouts' decoder steps that only decoded (sampling included), and
    /// of those that also prefilled joining episodes: where `timing_s/gen` went (0 on workers).
    #[serde(rename = "timing_s/gen_decode_steps", deserialize_with = "null_as_nan")]
    pub rollout_decode_secs: f32,
    #[serde(rename = "timing_s/gen_prefill_steps", deserialize_with = "null_as_nan")]
    pub rollout_prefill_secs: f32,
    /// Episodes decoding per step of the local rollouts' decoder, on average (at most
    /// `rollout.max_num_seqs`; 0 on workers): on a GPU whose step costs about the same at any
    /// number of rows, the rollouts' speed follows it.
    #[serde(rename = "perf/gen_rows_per_step", deserialize_with = "null_as_nan")]
    pub rollout_rows_per_step: f32,
    /// Greedy validation reward, on the steps that validate.
    #[serde(rename = "val/reward/mean")]
    pub validation_reward: Option<f32>,
    #[serde(rename = "val/f1/mean")]
    pub validation_f1: Option<f32>,
    /// Peak resident memory of the process during this step (Linux; the counter is reset as
    /// each step starts), so a step that keeps more than the one before shows.
    #[serde(rename = "perf/peak_rss_mb")]
    pub peak_rss_mb: Option<f32>,
    /// The most the GPU's memory pool (CubeCL's) reserved during this step, in GiB (bytes /
    /// 1024³), as verl's `perf/max_memory_reserved_gb` reads PyTorch's caching allocator; `None`
    /// on the CPU. It is read as each phase ends, before the phase's unused pages go back to the
    /// device: a pool gives pages back only then, so that reading is the phase's peak. Compare
    /// with `prompt-r1 plan` (its peak less the CUDA context's few hundred MiB).
    #[serde(rename = "perf/max_memory_reserved_gb", default)]
    pub max_memory_reserved_gb: Option<f32>,
    /// `perf/max_memory_reserved_gb` of the rollouts alone (the step's validation included).
    #[serde(rename = "perf/gen_max_memory_reserved_gb", default)]
    pub gen_max_memory_reserved_gb: Option<f32>,
    /// `perf/max_memory_reserved_gb` of scoring (old and reference log-probs) and the update.
    #[serde(rename = "perf/update_max_memory_reserved_gb", default)]
    pub update_max_memory_reserved_gb: Option<f32>,
    /// Groups whose episodes all got the same reward, so zero advantages (this step), counted
    /// whether dynamic sampling is on or off.
    #[serde(rename = "batch/groups_no_signal", default)]
    pub groups_no_signal: usize,
    /// Groups left out of the update by dynamic sampling (`rollout.dynamic_sampling`).
    #[serde(rename = "batch/groups_dropped", default)]
    pub groups_dropped: usize,
    /// Greedy validation per data source, as `val/<source>/<metric>` keys (see
    /// `ValidationReport::metrics`), on the steps that validate. Step 0, when present, holds
    /// only the validation run before training.
    #[serde(flatten, deserialize_with = "validation_keys")]
    pub validation_by_source: BTreeMap<String, f32>,
}

/// A number that may be `null`: serde_json writes a NaN (a loss of a step whose gradients were
/// not finite, a mean over no episodes) as `null`, which reads back as NaN.
pub(crate) fn null_as_nan<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(deserializer)?.unwrap_or(f32::NAN))
}

/// The key of the step, in every run's records (GRPO's and SFT's).
pub(crate) const STEP_KEY: &str = "training/global_step";

impl StepRecord {
    /// The validation before training as its line of `metrics.jsonl`: the step key and the
    /// `val/…` keys only, so a dashboard plots no training metric at step 0 (reading the line
    /// back gives a record with the validation fields set and the others at their defaults).
    pub fn validation_only(&self) -> serde_json::Value {
        let mut fields = match serde_json::to_value(self).expect("records serialise") {
            serde_json::Value::Object(fields) => fields,
            _ => unreachable!("a record serialises as an object"),
        };
        fields.retain(|key, _| key == STEP_KEY || key.starts_with("val/"));
        serde_json::Value::Object(fields)
    }
}

/// The `val/…` keys of a record among the keys no other field took (others are ignored, as
/// for every record); a `val/…` key must hold a number.
fn validation_keys<'de, D: Deserializer<'de>>(deserializer: D) -> Result<BTreeMap<String, f32>, D::Error> {
    let rest = BTreeMap::<String, serde_json::Value>::deserialize(deserializer)?;
    rest.into_iter()
        .filter(|(key, _)| key.starts_with("val/"))
        .map(|(key, value)| match value.as_f64() {
            Some(number) => Ok((key, number as f32)),
            None => Err(D::Error::custom(format!("{key} must be a number, not {value}"))),
        })
        .collect()
}

/// Appends any run's record (GRPO or SFT) to `metrics.jsonl` as one line, flushed to disk.
pub(crate) fn append_line<R: Serialize>(run_dir: &Path, record: &R) -> Result<(), TrainError> {
    let path = run_dir.join(METRICS_FILE);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(TrainError::io(&path))?;
    let line = serde_json::to_string(record).expect("records serialise");
    writeln!(file, "{line}").map_err(TrainError::io(&path))?;
    file.sync_data().map_err(TrainError::io(&path))
}

/// Reads `metrics.jsonl`; a malformed line is an error naming its number, and an incomplete
/// last line is dropped (see `read_lines`).
pub fn read_metrics(run_dir: &Path) -> Result<Vec<StepRecord>, TrainError> {
    read_lines(run_dir, &["critic/score/mean"])
}

/// Reads `metrics.jsonl` as records of type `R`; a malformed line is an error naming its number,
/// as is a line without the step key, or a training step's line (step 1 on; step 0 holds only
/// the validation before training) without one of the `required` keys: a line of another kind
/// would otherwise read as zeros. Every record is written as one line ending in a newline, so a
/// last line without one was cut short by an interrupted write (a crash, a full disk): it is
/// dropped with a note, as `eval` does with `predictions.jsonl`, and a resumed run's
/// [`truncate_after`] rewrites the file without it.
pub(crate) fn read_lines<R: DeserializeOwned>(run_dir: &Path, required: &[&str]) -> Result<Vec<R>, TrainError> {
    let path = run_dir.join(METRICS_FILE);
    let malformed = |number: usize, reason: String| TrainError::Config { path: path.clone(), reason: format!("line {number}: {reason}") };
    complete_lines(&path)?
        .into_iter()
        .map(|(number, line)| {
            let fields: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&line).map_err(|e| malformed(number, e.to_string()))?;
            let step = fields.get(STEP_KEY).ok_or_else(|| malformed(number, format!("no `{STEP_KEY}`: not a line of a run's metrics")))?;
            if step.as_u64().is_some_and(|step| step > 0) {
                if let Some(missing) = required.iter().find(|key| !fields.contains_key(**key)) {
                    return Err(malformed(number, format!("step {step} has no `{missing}`: not a line of this kind of run's metrics")));
                }
            }
            serde_path_to_error::deserialize(serde_json::Value::Object(fields)).map_err(|e| {
                // Keys read through a flattened struct have no path of their own ("." or "?").
                let key = e.path().to_string();
                match key.as_str() {
                    "." | "?" => malformed(number, e.into_inner().to_string()),
                    _ => malformed(number, format!("`{key}`: {}", e.into_inner())),
                }
            })
        })
        .collect()
}

/// The text of `path` without an incomplete last line (with a note when there was one).
fn complete_text(path: &Path) -> Result<String, TrainError> {
    let mut text = data::read_text(path)?;
    let complete = text.rfind('\n').map_or(0, |i| i + 1);
    if !text[complete..].trim().is_empty() {
        eprintln!(
            "note: {} ends with an incomplete line (an interrupted write); dropping it",
            path.display()
        );
    }
    text.truncate(complete);
    Ok(text)
}

/// The non-blank complete lines of `path` with their numbers (from 1).
fn complete_lines(path: &Path) -> Result<Vec<(usize, String)>, TrainError> {
    Ok(complete_text(path)?
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.to_owned()))
        .collect())
}

/// Drops the lines of steps after `step` and an incomplete last line (used on resume, so a
/// crash between a metrics line and its checkpoint, or a resume from an earlier checkpoint,
/// does not leave a step twice). The lines kept are left as they were written; any run's
/// records (GRPO's, SFT's) are cut by their step key. A line that is not a record with a step
/// is an error naming its number.
pub fn truncate_after(run_dir: &Path, step: u64) -> Result<(), TrainError> {
    let path = run_dir.join(METRICS_FILE);
    if !path.exists() {
        return Ok(());
    }
    let (kept, _) = split_at_step(&path, step)?;
    write_metrics_text(&path, &kept)
}

/// [`truncate_after`], the lines dropped written first to a `metrics.jsonl` in `folder`.
pub(crate) fn move_lines_after(run_dir: &Path, step: u64, folder: &Path) -> Result<(), TrainError> {
    let path = run_dir.join(METRICS_FILE);
    if !path.exists() {
        return Ok(());
    }
    let (kept, after) = split_at_step(&path, step)?;
    write_metrics_text(&folder.join(METRICS_FILE), &after)?;
    write_metrics_text(&path, &kept)
}

/// The complete lines of `metrics.jsonl` at `path` up to `step`, and those after it.
fn split_at_step(path: &Path, step: u64) -> Result<(String, String), TrainError> {
    let (mut kept, mut after) = (String::new(), String::new());
    for (number, line) in complete_lines(path)? {
        let value: serde_json::Value = serde_json::from_str(&line).map_err(|e| TrainError::Config {
            path: path.to_path_buf(),
            reason: format!("line {number}: {e}"),
        })?;
        let line_step = [STEP_KEY, "step"]
            .iter()
            .find_map(|key| value.get(key).and_then(serde_json::Value::as_u64))
            .ok_or_else(|| TrainError::Config {
                path: path.to_path_buf(),
                reason: format!("line {number}: no {STEP_KEY}"),
            })?;
        let side = if line_step <= step { &mut kept } else { &mut after };
        side.push_str(&line);
        side.push('\n');
    }
    Ok((kept, after))
}

/// Writes an empty `metrics.jsonl` (a fresh start: the lines of an earlier start that stopped
/// before its first checkpoint are not continued).
pub(crate) fn clear(run_dir: &Path) -> Result<(), TrainError> {
    write_metrics_text(&run_dir.join(METRICS_FILE), "")
}

fn write_metrics_text(path: &Path, text: &str) -> Result<(), TrainError> {
    model::checkpoint::write_atomic(path, text.as_bytes()).map_err(|e| TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A last line cut short by an interrupted write is dropped when the metrics are read and
    /// when a resumed run truncates them; a malformed complete line is still an error.
    #[test]
    fn an_incomplete_last_line_is_dropped_and_a_malformed_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        for step in 1..=2 {
            append_line(dir.path(), &StepRecord { step, ..StepRecord::default() }).unwrap();
        }
        let path = dir.path().join(METRICS_FILE);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(r#"{"step":3,"critic/score/me"#);
        std::fs::write(&path, &text).unwrap();
        let steps: Vec<u64> = read_metrics(dir.path()).unwrap().iter().map(|r| r.step).collect();
        assert_eq!(steps, vec![1, 2]);
        truncate_after(dir.path(), 2).unwrap();
        let rewritten = std::fs::read_to_string(&path).unwrap();
        assert_eq!(rewritten.lines().count(), 2);
        assert!(rewritten.ends_with("}\n"), "{rewritten}");
        append_line(dir.path(), &StepRecord { step: 3, ..StepRecord::default() }).unwrap();
        assert_eq!(read_metrics(dir.path()).unwrap().len(), 3);

        let first = rewritten.lines().next().unwrap();
        std::fs::write(&path, format!("{first}\nnot json\n")).unwrap();
        let err = read_metrics(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        // Lines of another kind do not read as zeros: no step key, or a training step without
        // its reward.
        for (line, expected) in [
            (r#"{"step":2,"reward":0.9}"#, "line 2: no `training/global_step`"),
            (r#"{"training/global_step":2}"#, "line 2: step 2 has no `critic/score/mean`"),
        ] {
            std::fs::write(&path, format!("{first}\n{line}\n")).unwrap();
            let err = read_metrics(dir.path()).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
        }
        // A value of the wrong type names its key.
        std::fs::write(&path, format!("{first}\n{}\n", first.replacen("\"critic/score/mean\":", "\"critic/score/mean\":\"high\",\"x\":", 1))).unwrap();
        let err = read_metrics(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 2: `critic/score/mean`: ") && err.contains("\"high\""), "{err}");
        std::fs::write(&path, format!("{}\n{first}\n", r#"{"training/global_step":0,"val/reward/mean":0.5}"#)).unwrap();
        assert_eq!(read_metrics(dir.path()).unwrap().len(), 2, "the validation before training has no reward");
    }

    /// The line of the validation before training holds the step and the validation keys only
    /// (no `critic/score/mean: 0` for a dashboard to plot), and reads back as a record with the
    /// validation fields set, beside the lines of training steps.
    #[test]
    fn the_validation_line_holds_only_validation_keys_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let before = StepRecord {
            validation_reward: Some(0.25),
            validation_f1: Some(0.5),
            validation_by_source: BTreeMap::from([("val/hotpot/reward".to_string(), 0.25)]),
            ..StepRecord::default()
        };
        let line = before.validation_only();
        let mut keys: Vec<&str> = line.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["training/global_step", "val/f1/mean", "val/hotpot/reward", "val/reward/mean"]);
        append_line(dir.path(), &line).unwrap();
        append_line(dir.path(), &StepRecord { step: 1, reward_mean: 0.5, ..StepRecord::default() }).unwrap();
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        assert!(!text.lines().next().unwrap().contains("critic/score/mean"), "{text}");
        let records = read_metrics(dir.path()).unwrap();
        assert_eq!(records[0], before);
        assert_eq!((records[1].step, records[1].reward_mean), (1, 0.5));
        truncate_after(dir.path(), 0).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap(), format!("{line}\n"));
    }

    /// A step whose losses were NaN (a skipped non-finite step) writes them as `null`, which
    /// reads back as NaN, so the run stays readable for `plot` and resumes.
    #[test]
    fn a_nan_loss_reads_back_as_nan() {
        let dir = tempfile::tempdir().unwrap();
        let nan = StepRecord {
            step: 1,
            loss: f32::NAN,
            pg_loss: f32::NAN,
            reward_mean: f32::NAN,
            policy: PolicyLossStats { approx_kl: f32::NAN, ..PolicyLossStats::default() },
            skipped_steps: 1,
            ..StepRecord::default()
        };
        append_line(dir.path(), &nan).unwrap();
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        assert!(text.contains(r#""actor/loss":null"#), "{text}");
        let back = read_metrics(dir.path()).unwrap();
        assert_eq!(back.len(), 1);
        let back = &back[0];
        assert!(back.loss.is_nan() && back.pg_loss.is_nan() && back.reward_mean.is_nan() && back.policy.approx_kl.is_nan());
        assert_eq!((back.step, back.skipped_steps, back.reward_std), (1, 1, 0.0));
    }

    #[test]
    fn validation_keys_round_trip_and_other_keys_are_ignored() {
        let record = StepRecord {
            step: 3,
            groups_no_signal: 2,
            validation_by_source: BTreeMap::from([("val/hotpot/reward".to_string(), 0.5)]),
            ..StepRecord::default()
        };
        let mut json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["val/hotpot/reward"], 0.5);
        assert_eq!(json["batch/groups_no_signal"], 2);
        json["someone_elses_key"] = serde_json::json!(null);
        let back: StepRecord = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, record);
        json["val/hotpot/f1"] = serde_json::json!("high");
        let err = serde_json::from_value::<StepRecord>(json).unwrap_err().to_string();
        assert!(err.contains("val/hotpot/f1"), "{err}");
    }

    /// Every key of a training step's line, in the order written, with distinct values that
    /// read back to the same line: what dashboards and `plot` read must not move.
    #[test]
    fn a_step_line_keeps_its_keys_order_and_values() {
        let line = concat!(
            r#"{"training/global_step":7,"training/epoch":2,"critic/score/mean":0.5,"critic/score/std":0.25,"#,
            r#""reward/format/mean":0.75,"reward/f1/mean":0.375,"actor/loss":-1.5,"actor/pg_loss":-1.25,"#,
            r#""actor/kl_loss":0.0625,"actor/entropy":1.75,"actor/pg_clipfrac":0.125,"#,
            r#""actor/pg_clipfrac_lower":0.03125,"actor/ppo_kl":-0.015625,"actor/grad_norm":2.5,"#,
            r#""actor/optimizer_steps":3,"actor/skipped_steps":1,"rollout/env_failures":4,"rollout/agent_failures":7,"#,
            r#""rollout/episodes":64,"rollout/agent_tokens":4096,"response_length/mean":64.5,"#,
            r#""num_turns/mean":2.5,"timing_s/gen":12.5,"timing_s/update_actor":30.25,"#,
            r#""perf/gen_tokens_per_s":327.5,"perf/prefill_tokens":20480,"perf/shared_prefix_tokens":1024,"perf/context_tokens":9216,"#,
            r#""perf/kv_peak_positions":12288,"rollout/preemptions":2,"rollout/server_retries":3,"rollout/workers_left_out":1,"#,
            r#""timing_s/gen_decode_steps":8.5,"timing_s/gen_prefill_steps":3.75,"perf/gen_rows_per_step":6.25,"#,
            r#""val/reward/mean":0.625,"val/f1/mean":0.6875,"#,
            r#""perf/peak_rss_mb":2048.0,"perf/max_memory_reserved_gb":41.5,"perf/gen_max_memory_reserved_gb":30.25,"#,
            r#""perf/update_max_memory_reserved_gb":41.5,"batch/groups_no_signal":5,"batch/groups_dropped":6,"#,
            r#""val/hotpot/reward":0.875}"#
        );
        let record: StepRecord = serde_json::from_str(line).unwrap();
        assert_eq!(serde_json::to_string(&record).unwrap(), line);
        let policy = PolicyLossStats { clip_frac: 0.125, dual_clip_frac: 0.03125, approx_kl: -0.015625 };
        assert_eq!(record.policy, policy);
        assert_eq!((record.pg_loss, record.kl, record.entropy), (-1.25, Some(0.0625), Some(1.75)));
        assert_eq!(record.validation_by_source, BTreeMap::from([("val/hotpot/reward".to_string(), 0.875)]));
        // A record with nothing set writes every key but the per-source validation ones.
        let empty = serde_json::to_value(StepRecord::default()).unwrap();
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let mut keys: Vec<&String> = value.as_object().unwrap().keys().filter(|k| *k != "val/hotpot/reward").collect();
        let mut empty_keys: Vec<&String> = empty.as_object().unwrap().keys().collect();
        keys.sort_unstable();
        empty_keys.sort_unstable();
        assert_eq!(keys, empty_keys);
    }

    #[test]
    fn records_are_written_under_verl_metric_names() {
        let record = StepRecord {
            step: 3,
            reward_mean: 0.5,
            pg_loss: -0.25,
            policy: PolicyLossStats { clip_frac: 0.125, ..PolicyLossStats::default() },
            rollout_secs: 2.0,
            ..StepRecord::default()
        };
        let json: serde_json::Value = serde_json::to_value(&record).unwrap();
        assert_eq!(json["training/global_step"], 3);
        assert_eq!(json["critic/score/mean"], 0.5);
        assert_eq!(json["actor/pg_loss"], -0.25);
        assert_eq!(json["actor/pg_clipfrac"], 0.125);
        assert_eq!(json["timing_s/gen"], 2.0);
        assert!(json.get("reward_mean").is_none() && json.get("step").is_none(), "{json}");
        let back: StepRecord = serde_json::from_value(json).unwrap();
        assert_eq!(back, record);
    }
}

//! `metrics.jsonl`: one JSON object per training step, appended and flushed as the run goes;
//! a first object with `step` 0 holds the validation run before training, when there is one.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use super::error::TrainError;

/// File name of the per-step metrics inside the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// What one GRPO step did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    pub reward_mean: f32,
    pub reward_std: f32,
    pub format_mean: Option<f32>,
    pub f1_mean: Option<f32>,
    pub loss: f32,
    pub pg_loss: f32,
    pub kl: Option<f32>,
    pub entropy: Option<f32>,
    pub clip_frac: f32,
    pub dual_clip_frac: f32,
    pub approx_kl: f32,
    pub grad_norm: Option<f32>,
    pub optimizer_steps: usize,
    /// Optimiser steps skipped because the gradient norm was not finite (this step).
    pub skipped_steps: usize,
    /// Episodes dropped because the environment failed (this step).
    pub env_failures: usize,
    pub episodes: usize,
    pub agent_tokens: usize,
    pub mean_response_tokens: f32,
    pub mean_turns: f32,
    pub rollout_secs: f32,
    pub learn_secs: f32,
    /// Agent tokens generated per second during the rollout.
    pub rollout_tokens_per_sec: f32,
    /// Greedy validation reward, on the steps that validate.
    pub validation_reward: Option<f32>,
    pub validation_f1: Option<f32>,
    /// Peak resident memory of the process so far (Linux), to see that steps do not leak.
    pub peak_rss_mb: Option<f32>,
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

/// Appends one record as a line and flushes it to disk.
pub fn append_record(run_dir: &Path, record: &StepRecord) -> Result<(), TrainError> {
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

/// Reads `metrics.jsonl`; a malformed line is an error naming its number.
pub fn read_metrics(run_dir: &Path) -> Result<Vec<StepRecord>, TrainError> {
    let path = run_dir.join(METRICS_FILE);
    let text = std::fs::read_to_string(&path).map_err(TrainError::io(&path))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|e| TrainError::Config {
                path: path.clone(),
                reason: format!("line {}: {e}", i + 1),
            })
        })
        .collect()
}

/// Drops records of steps after `step` (used on resume, so a crash between a metrics line and
/// its checkpoint does not leave duplicate steps).
pub fn truncate_after(run_dir: &Path, step: u64) -> Result<(), TrainError> {
    let path = run_dir.join(METRICS_FILE);
    if !path.exists() {
        return Ok(());
    }
    let kept: Vec<StepRecord> = read_metrics(run_dir)?.into_iter().filter(|r| r.step <= step).collect();
    let mut text = String::new();
    for r in &kept {
        text.push_str(&serde_json::to_string(r).expect("records serialise"));
        text.push('\n');
    }
    model::checkpoint::write_atomic(&path, text.as_bytes()).map_err(|e| TrainError::Checkpoint {
        path,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

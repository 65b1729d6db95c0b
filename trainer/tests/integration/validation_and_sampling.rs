//! Validation before training and per data source, and dynamic sampling, on the tiny run of
//! `common`.

use crate::common;

use burn::module::AutodiffModule;
use common::{setup, ByteTokens, Scripted, B};
use env::Trajectory;
use prompt_r1_trainer::run::{read_metrics, EpisodeScore, EpisodeScorer, Trainer};

/// Every episode gets the same reward: every group has zero advantages.
struct Constant;

impl EpisodeScorer for Constant {
    fn score(&self, _t: &Trajectory, _answers: &[String]) -> EpisodeScore {
        EpisodeScore {
            reward: -1.0,
            format: Some(0.0),
            f1: Some(0.0),
        }
    }
}

fn weights(trainer: &Trainer<B>) -> Vec<(String, Vec<f32>)> {
    common::named_weights(&trainer.policy().valid())
}

/// Validation runs before the first step (the `step` 0 line) and on the steps that validate,
/// each time with every metric per data source under `val/<source>/<metric>`.
#[test]
fn validation_before_training_and_per_source() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    let rows = "{\"id\":\"a\",\"data_source\":\"alpha\",\"question\":\"A?\",\"answers\":[\"x\"]}\n\
                {\"id\":\"b\",\"data_source\":\"beta\",\"question\":\"B?\",\"answers\":[\"x\"]}\n\
                {\"id\":\"c\",\"data_source\":\"beta\",\"question\":\"C?\",\"answers\":[\"x\"]}\n";
    let validation = dir.path().join("validation.jsonl");
    std::fs::write(&validation, rows).unwrap();
    config.data.validation = vec![validation];
    config.run.validate_every = 2;
    let out_dir = config.run.out_dir.clone();
    let mut trainer = Trainer::<B>::start(config, Default::default(), false).unwrap();

    let before = trainer
        .validate_before_training(&Scripted, &ByteTokens)
        .unwrap()
        .unwrap();
    assert_eq!(before.step, 0);
    let report = trainer.last_validation().unwrap().clone();
    assert_eq!(report.episodes, 3);
    assert_eq!(report.by_source["beta"].episodes, 2);
    // The overall mean is the mean over the three episodes: (alpha + 2 × beta) / 3.
    let alpha = before.validation_by_source["val/alpha/reward"];
    let beta = before.validation_by_source["val/beta/reward"];
    assert!((before.validation_reward.unwrap() - (alpha + 2.0 * beta) / 3.0).abs() < 1e-5);
    assert_eq!(before.validation_by_source["val/beta/env_failures"], 0.0);
    assert!(report.to_string().lines().any(|l| l.starts_with("alpha")));

    let first = trainer.train_step(&Scripted, &ByteTokens).unwrap();
    assert!(first.validation_by_source.is_empty() && first.validation_reward.is_none());
    let second = trainer.train_step(&Scripted, &ByteTokens).unwrap();
    assert!(second.validation_by_source.contains_key("val/alpha/reward"));
    assert!(trainer
        .validate_before_training(&Scripted, &ByteTokens)
        .unwrap()
        .is_none());

    // metrics.jsonl: the step 0 line, then one line per step, the per-source keys read back.
    let text = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    let first_line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first_line["training/global_step"], 0);
    assert!(first_line["val/beta/reward"].is_number());
    // Only the validation keys: no training metric at 0 for a dashboard to plot.
    for key in first_line.as_object().unwrap().keys() {
        assert!(key == "training/global_step" || key.starts_with("val/"), "{key} in {first_line}");
    }
    let records = read_metrics(&out_dir).unwrap();
    let steps: Vec<u64> = records.iter().map(|r| r.step).collect();
    assert_eq!(steps, [0, 1, 2]);
    assert_eq!(records[0], before);
    assert_eq!(records[2].validation_by_source, second.validation_by_source);
}

/// A fresh start over a run directory without checkpoints (a run that stopped before its first)
/// starts `metrics.jsonl` afresh, as SFT runs do, instead of appending to the old lines.
#[test]
fn a_fresh_start_does_not_continue_old_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let out_dir = config.run.out_dir.clone();
    for _ in 0..2 {
        let mut trainer = Trainer::<B>::start(config.clone(), Default::default(), false).unwrap();
        trainer.train_step(&Scripted, &ByteTokens).unwrap();
    }
    let steps: Vec<u64> = read_metrics(&out_dir).unwrap().iter().map(|r| r.step).collect();
    assert_eq!(steps, [1]);
}

/// Groups without signal are counted every step; with dynamic sampling on they are left out of
/// the update, and when every group is left out the policy does not move.
#[test]
fn dynamic_sampling_drops_groups_without_signal() {
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());

    let mut off = config.clone();
    off.run.out_dir = dir.path().join("off");
    let mut trainer = Trainer::<B>::start(off, Default::default(), false).unwrap();
    let record = trainer.train_step(&Scripted, &Constant).unwrap();
    // 3 questions × 4 episodes, every reward −1: 3 groups without signal, none dropped; the
    // update still runs (its advantages are all 0).
    assert_eq!((record.groups_no_signal, record.groups_dropped), (3, 0));
    assert!(record.optimizer_steps > 0);
    let json = serde_json::to_value(&record).unwrap();
    assert_eq!(json["batch/groups_no_signal"], 3);
    assert_eq!(json["batch/groups_dropped"], 0);

    let mut on = config.clone();
    on.run.out_dir = dir.path().join("on");
    on.rollout.dynamic_sampling = true;
    let mut trainer = Trainer::<B>::start(on.clone(), Default::default(), false).unwrap();
    let before = weights(&trainer);
    let record = trainer.train_step(&Scripted, &Constant).unwrap();
    assert_eq!((record.groups_no_signal, record.groups_dropped), (3, 3));
    assert_eq!(record.optimizer_steps, 0);
    assert_eq!(record.reward_mean, -1.0);
    assert_eq!(
        before,
        weights(&trainer),
        "no group left: the policy must not move"
    );

    // With a reward that varies, groups keep their signal and the update runs.
    on.run.out_dir = dir.path().join("on-varied");
    let mut trainer = Trainer::<B>::start(on, Default::default(), false).unwrap();
    let record = trainer.train_step(&Scripted, &ByteTokens).unwrap();
    assert_eq!(record.groups_dropped, record.groups_no_signal);
    assert!(record.groups_no_signal < 3);
    assert!(record.optimizer_steps > 0);
}

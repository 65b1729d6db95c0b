//! Greedy validation results, overall and per data source, as `metrics.jsonl` keys
//! (`val/<source>/<metric>`) and as a table.

use std::collections::BTreeMap;
use std::fmt;

use super::reward::EpisodeScore;

/// Means of one data source's validation episodes (failed ones excluded).
#[derive(Debug, Clone, PartialEq)]
pub struct SourceValidation {
    /// Episodes run, failed ones included.
    pub episodes: usize,
    /// Episodes dropped because the environment failed.
    pub env_failures: usize,
    /// Mean reward of the scored episodes (`None` when none was scored: every episode failed).
    pub reward_mean: Option<f32>,
    /// Mean capped format score (`None` for scorers without one, or no scored episode).
    pub format_mean: Option<f32>,
    /// Mean answer F1 (`None` for scorers without one, or no scored episode).
    pub f1_mean: Option<f32>,
}

/// Greedy validation results.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidationReport {
    /// Mean reward over every scored episode (`None` when every episode failed).
    pub reward_mean: Option<f32>,
    /// Mean F1 over every scored episode.
    pub f1_mean: Option<f32>,
    pub episodes: usize,
    pub env_failures: usize,
    /// Why the first failed episode failed (the environment client's error), when one did.
    pub first_failure: Option<String>,
    /// The same means per data source, sorted by name.
    pub by_source: BTreeMap<String, SourceValidation>,
}

/// Running sums of one data source (or of all).
#[derive(Default)]
struct Sums {
    episodes: usize,
    env_failures: usize,
    rewards: Vec<f32>,
    formats: Vec<f32>,
    f1s: Vec<f32>,
}

impl Sums {
    fn add(&mut self, score: Option<&EpisodeScore>) {
        self.episodes += 1;
        match score {
            None => self.env_failures += 1,
            Some(score) => {
                self.rewards.push(score.reward);
                self.formats.extend(score.format);
                self.f1s.extend(score.f1);
            }
        }
    }

    fn source(&self) -> SourceValidation {
        SourceValidation {
            episodes: self.episodes,
            env_failures: self.env_failures,
            reward_mean: mean(&self.rewards),
            format_mean: mean(&self.formats),
            f1_mean: mean(&self.f1s),
        }
    }
}

fn mean(values: &[f32]) -> Option<f32> {
    (!values.is_empty()).then(|| values.iter().sum::<f32>() / values.len() as f32)
}

impl ValidationReport {
    /// Aggregates `(data_source, score)` pairs; `None` is an episode the environment failed.
    pub fn from_scores<'a, I>(scores: I) -> Self
    where
        I: IntoIterator<Item = (&'a str, Option<EpisodeScore>)>,
    {
        let mut all = Sums::default();
        let mut sources: BTreeMap<String, Sums> = BTreeMap::new();
        for (source, score) in scores {
            all.add(score.as_ref());
            sources
                .entry(source.to_string())
                .or_default()
                .add(score.as_ref());
        }
        let overall = all.source();
        Self {
            reward_mean: overall.reward_mean,
            f1_mean: overall.f1_mean,
            episodes: overall.episodes,
            env_failures: overall.env_failures,
            first_failure: None,
            by_source: sources
                .iter()
                .map(|(name, sums)| (name.clone(), sums.source()))
                .collect(),
        }
    }

    /// Every per-source metric under its `metrics.jsonl` key: `val/<source>/reward` (unless
    /// every episode failed), `val/<source>/format`, `val/<source>/f1` (when the scorer gives
    /// them and an episode was scored) and `val/<source>/env_failures`.
    pub fn metrics(&self) -> BTreeMap<String, f32> {
        let mut out = BTreeMap::new();
        for (source, v) in &self.by_source {
            let mut put = |metric: &str, value: f32| {
                out.insert(format!("val/{source}/{metric}"), value);
            };
            if let Some(reward) = v.reward_mean {
                put("reward", reward);
            }
            if let Some(format) = v.format_mean {
                put("format", format);
            }
            if let Some(f1) = v.f1_mean {
                put("f1", f1);
            }
            put("env_failures", v.env_failures as f32);
        }
        out
    }
}

impl fmt::Display for ValidationReport {
    /// One line per data source, then `overall`: episodes, failures, reward, format, F1; then
    /// the first failure's cause, when an episode failed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .by_source
            .keys()
            .map(|name| name.chars().count())
            .chain(["data_source".len()])
            .max()
            .unwrap_or_default();
        let optional =
            |value: Option<f32>| value.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
        writeln!(
            f,
            "{:<width$} {:>6} {:>6} {:>8} {:>8} {:>8}",
            "data_source", "n", "failed", "reward", "format", "f1"
        )?;
        for (name, v) in &self.by_source {
            writeln!(
                f,
                "{name:<width$} {:>6} {:>6} {:>8} {:>8} {:>8}",
                v.episodes,
                v.env_failures,
                optional(v.reward_mean),
                optional(v.format_mean),
                optional(v.f1_mean)
            )?;
        }
        writeln!(
            f,
            "{:<width$} {:>6} {:>6} {:>8} {:>8} {:>8}",
            "overall",
            self.episodes,
            self.env_failures,
            optional(self.reward_mean),
            "",
            optional(self.f1_mean)
        )?;
        if let Some(cause) = &self.first_failure {
            writeln!(f, "{} of {} episodes failed; the first: {cause}", self.env_failures, self.episodes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(reward: f32, format: f32, f1: f32) -> Option<EpisodeScore> {
        Some(EpisodeScore {
            reward,
            format: Some(format),
            f1: Some(f1),
        })
    }

    #[test]
    fn means_per_source_and_over_all_episodes() {
        let report = ValidationReport::from_scores([
            ("hotpot", score(1.0, 1.0, 1.0)),
            ("hotpot", score(-0.6, 0.4, 0.0)),
            ("gsm8k", score(0.5, 1.0, 0.5)),
            ("gsm8k", None),
        ]);
        // hotpot: reward (1 − 0.6)/2 = 0.2, format (1 + 0.4)/2 = 0.7, F1 (1 + 0)/2 = 0.5.
        let hotpot = &report.by_source["hotpot"];
        assert_eq!((hotpot.episodes, hotpot.env_failures), (2, 0));
        assert!((hotpot.reward_mean.unwrap() - 0.2).abs() < 1e-6);
        assert!((hotpot.format_mean.unwrap() - 0.7).abs() < 1e-6);
        assert_eq!(hotpot.f1_mean, Some(0.5));
        // gsm8k: one failed episode, left out of the means.
        let gsm8k = &report.by_source["gsm8k"];
        assert_eq!(
            (gsm8k.episodes, gsm8k.env_failures, gsm8k.reward_mean),
            (2, 1, Some(0.5))
        );
        // overall over the 3 scored episodes: reward (1 − 0.6 + 0.5)/3 = 0.3, F1 1.5/3 = 0.5.
        assert_eq!((report.episodes, report.env_failures), (4, 1));
        assert!((report.reward_mean.unwrap() - 0.3).abs() < 1e-6);
        assert_eq!(report.f1_mean, Some(0.5));

        let metrics = report.metrics();
        assert_eq!(metrics["val/gsm8k/reward"], 0.5);
        assert_eq!(metrics["val/gsm8k/env_failures"], 1.0);
        assert_eq!(metrics["val/hotpot/f1"], 0.5);
        assert_eq!(metrics.len(), 8);

        let table = report.to_string();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[1].starts_with("gsm8k") && lines[1].contains("0.500"));
        assert!(lines[3].starts_with("overall") && lines[3].contains("0.300"));
    }

    /// A source whose every episode failed has no reward (not 0, which reads as a fair score),
    /// and the table says why the first one failed.
    #[test]
    fn a_source_that_only_failed_has_no_reward() {
        let mut report = ValidationReport::from_scores([("dead", None), ("dead", None)]);
        report.first_failure = Some("connection refused".into());
        assert_eq!((report.reward_mean, report.by_source["dead"].reward_mean), (None, None));
        let keys: Vec<String> = report.metrics().into_keys().collect();
        assert_eq!(keys, ["val/dead/env_failures"]);
        let table = report.to_string();
        assert!(table.lines().nth(1).unwrap().split_whitespace().eq(["dead", "2", "2", "-", "-", "-"]), "{table}");
        assert!(table.ends_with("2 of 2 episodes failed; the first: connection refused\n"), "{table}");
    }

    #[test]
    fn scorers_without_format_or_f1_report_reward_only() {
        let report = ValidationReport::from_scores([(
            "x",
            Some(EpisodeScore {
                reward: 1.0,
                format: None,
                f1: None,
            }),
        )]);
        let keys: Vec<String> = report.metrics().into_keys().collect();
        assert_eq!(keys, ["val/x/env_failures", "val/x/reward"]);
        assert_eq!(report.f1_mean, None);
    }
}

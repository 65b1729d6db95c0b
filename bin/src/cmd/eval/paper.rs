//! The results laid out like the paper's Tables 1 and 2: one line per data set and metric (EM and
//! F1 for the QA and math sets, F1 and SSim for the generation sets), in the paper's order, the
//! paper's Average lines, and this run's scores beside the published GPT-4o-mini baseline and
//! Prompt-R1 columns with the difference to each.
//!
//! `assets/paper_table.json` is the one place that maps our data-source ids to the paper's data
//! sets and holds the published figures, as the paper prints them, with the source cited.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};
use rewards::metrics::{MetricsReport, MetricsRow};
use serde::{Deserialize, Serialize};

/// The paper's layout and published columns, compiled in from `assets/paper_table.json`.
const PAPER_TABLE: &str = include_str!("../../../../assets/paper_table.json");

/// A metric the paper reports (×100).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    Em,
    F1,
    Ssim,
}

impl Metric {
    const ALL: [Self; 3] = [Self::Em, Self::F1, Self::Ssim];

    fn label(self) -> &'static str {
        match self {
            Self::Em => "EM",
            Self::F1 => "F1",
            Self::Ssim => "SSim",
        }
    }

    fn of(self, row: &MetricsRow) -> Option<f64> {
        match self {
            Self::Em => Some(row.em),
            Self::F1 => Some(row.f1),
            Self::Ssim => row.ssim,
        }
    }
}

/// In-distribution (Table 1) or out-of-distribution (Table 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    In,
    Out,
}

impl Split {
    fn title(self) -> &'static str {
        match self {
            Self::In => "Table 1: in-distribution",
            Self::Out => "Table 2: out-of-distribution",
        }
    }
}

/// One data set of the paper.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dataset {
    /// The paper's name.
    pub name: String,
    pub split: Split,
    /// The metrics the paper reports for it, in its order.
    pub metrics: Vec<Metric>,
    /// Our `data_source` ids of this data set.
    pub data_sources: Vec<String>,
}

/// Scores by metric.
type Scores = BTreeMap<Metric, f64>;

/// A column the paper published.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishedColumn {
    /// The short name shown in our table.
    name: String,
    /// The paper's column header.
    column: String,
    /// Per data set, per metric.
    values: BTreeMap<String, Scores>,
    /// The paper's Average lines, per split.
    averages: BTreeMap<Split, Scores>,
}

/// The contents of `assets/paper_table.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaperSpec {
    source: String,
    averaging: String,
    datasets: Vec<Dataset>,
    rows: Vec<PublishedColumn>,
}

impl PaperSpec {
    /// The layout compiled into the binary.
    pub fn reference() -> Result<Self> {
        Self::parse(PAPER_TABLE).context("assets/paper_table.json")
    }

    /// Parses and checks a layout: names and data sources unique, and every published column
    /// holding exactly the figures of the listed data sets and metrics and their averages.
    pub fn parse(text: &str) -> Result<Self> {
        let spec: Self = serde_json::from_str(text)?;
        let mut names = HashSet::new();
        let mut sources = HashSet::new();
        for dataset in &spec.datasets {
            if !names.insert(dataset.name.as_str()) {
                bail!("data set {:?} is listed twice", dataset.name);
            }
            if dataset.metrics.is_empty() {
                bail!("data set {:?} lists no metric", dataset.name);
            }
            for source in &dataset.data_sources {
                if !sources.insert(source.as_str()) {
                    bail!("data source {source:?} is mapped twice");
                }
            }
        }
        for row in &spec.rows {
            if let Some(unknown) = row.values.keys().find(|k| !names.contains(k.as_str())) {
                bail!(
                    "column {:?} has figures for {unknown:?}, which is not a listed data set",
                    row.name
                );
            }
            for dataset in &spec.datasets {
                let listed: Vec<Metric> = row
                    .values
                    .get(&dataset.name)
                    .map(|s| s.keys().copied().collect())
                    .unwrap_or_default();
                let mut wanted = dataset.metrics.clone();
                wanted.sort();
                if listed != wanted {
                    bail!(
                        "column {:?} gives {} for {:?}, which the layout reports as {}",
                        row.name,
                        labels(&listed),
                        dataset.name,
                        labels(&wanted)
                    );
                }
            }
            for split in spec.splits() {
                let listed: Vec<Metric> = row
                    .averages
                    .get(&split)
                    .map(|s| s.keys().copied().collect())
                    .unwrap_or_default();
                let wanted = spec.average_metrics(split);
                if listed != wanted {
                    bail!(
                        "column {:?} gives averages {} for {}, which reports {}",
                        row.name,
                        labels(&listed),
                        split.title(),
                        labels(&wanted)
                    );
                }
            }
        }
        Ok(spec)
    }

    /// The paper's data set of one of our data-source ids.
    pub fn dataset_of(&self, data_source: &str) -> Option<&Dataset> {
        self.datasets
            .iter()
            .find(|d| d.data_sources.iter().any(|s| s == data_source))
    }

    fn splits(&self) -> Vec<Split> {
        let mut splits: Vec<Split> = self.datasets.iter().map(|d| d.split).collect();
        splits.dedup();
        splits
    }

    /// The metrics of a split's Average lines, in the order EM, F1, SSim.
    fn average_metrics(&self, split: Split) -> Vec<Metric> {
        Metric::ALL
            .into_iter()
            .filter(|m| {
                self.datasets
                    .iter()
                    .any(|d| d.split == split && d.metrics.contains(m))
            })
            .collect()
    }

    /// The tables with the published columns and `name`'s scores from `report`.
    pub fn table(&self, report: &MetricsReport, name: &str) -> PaperTable {
        let tables = self
            .splits()
            .into_iter()
            .map(|split| {
                let mut lines = Vec::new();
                for dataset in self.datasets.iter().filter(|d| d.split == split) {
                    for &metric in &dataset.metrics {
                        let published = self
                            .rows
                            .iter()
                            .map(|row| row.values[&dataset.name][&metric])
                            .collect();
                        lines.push(Line::new(
                            &dataset.name,
                            metric,
                            published,
                            dataset_value(dataset, metric, report),
                            None,
                        ));
                    }
                }
                for metric in self.average_metrics(split) {
                    let averaged: Vec<&Dataset> = self
                        .datasets
                        .iter()
                        .filter(|d| d.split == split && d.metrics.contains(&metric))
                        .collect();
                    let covered: Vec<(&Dataset, f64)> = averaged
                        .iter()
                        .filter_map(|d| Some((*d, dataset_value(d, metric, report)?)))
                        .collect();
                    let ours: Vec<f64> = covered.iter().map(|(_, v)| *v).collect();
                    let of = averaged.len();
                    let mean = (!ours.is_empty()).then(|| ours.iter().sum::<f64>() / ours.len() as f64);
                    // Over part of the data sets, the published figure is the paper's mean over
                    // the same ones: the paper's whole average would compare unlike with unlike.
                    let published = self
                        .rows
                        .iter()
                        .map(|row| match covered.len() {
                            k if k == 0 || k == of => row.averages[&split][&metric],
                            k => covered.iter().map(|(d, _)| row.values[&d.name][&metric]).sum::<f64>() / k as f64,
                        })
                        .collect();
                    lines.push(Line::new(
                        AVERAGE,
                        metric,
                        published,
                        mean,
                        Some(Count {
                            datasets: ours.len(),
                            of,
                        }),
                    ));
                }
                SplitTable {
                    split,
                    title: split.title().to_string(),
                    lines,
                }
            })
            .collect();
        let unmapped = report
            .datasets
            .keys()
            .filter(|source| self.dataset_of(source).is_none())
            .cloned()
            .collect();
        PaperTable {
            source: self.source.clone(),
            averaging: self.averaging.clone(),
            columns: self
                .rows
                .iter()
                .map(|r| Column {
                    name: r.name.clone(),
                    paper_column: r.column.clone(),
                })
                .collect(),
            run: name.to_string(),
            tables,
            unmapped_data_sources: unmapped,
        }
    }
}

/// The name of the Average lines, as the paper prints it.
const AVERAGE: &str = "Average";

fn labels(metrics: &[Metric]) -> String {
    let names: Vec<&str> = metrics.iter().map(|m| m.label()).collect();
    format!("[{}]", names.join(", "))
}

/// The data set's metric over our data sources of it, weighted by their example counts;
/// `None` when none of them was evaluated, or the metric (SSim) was not computed.
fn dataset_value(dataset: &Dataset, metric: Metric, report: &MetricsReport) -> Option<f64> {
    let rows: Vec<&MetricsRow> = dataset
        .data_sources
        .iter()
        .filter_map(|source| report.datasets.get(source))
        .collect();
    let n: usize = rows.iter().map(|row| row.n).sum();
    if n == 0 {
        return None;
    }
    let mut sum = 0.0;
    for row in rows {
        sum += metric.of(row)? * row.n as f64;
    }
    Some(sum / n as f64)
}

/// How many data sets an average of this run covers, of those the paper averages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Count {
    pub datasets: usize,
    pub of: usize,
}

/// A published column of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Column {
    /// The short name shown in the table.
    pub name: String,
    /// The paper's column header.
    pub paper_column: String,
}

/// One line of a table: a data set (or the Average) and one metric.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Line {
    /// The paper's data-set name, or "Average".
    pub dataset: String,
    pub metric: Metric,
    /// The published figures, one per column of [`PaperTable::columns`].
    pub published: Vec<f64>,
    /// This run's score; `null` where the data set (or its SSim) was not evaluated.
    pub ours: Option<f64>,
    /// This run's score minus each published figure.
    pub difference: Vec<Option<f64>>,
    /// For Average lines: how many of the averaged data sets this run's average covers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub averaged: Option<Count>,
}

impl Line {
    fn new(
        dataset: &str,
        metric: Metric,
        published: Vec<f64>,
        ours: Option<f64>,
        averaged: Option<Count>,
    ) -> Self {
        let difference = published.iter().map(|p| ours.map(|o| o - p)).collect();
        Self {
            dataset: dataset.to_string(),
            metric,
            published,
            ours,
            difference,
            averaged,
        }
    }
}

/// One of the paper's tables.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitTable {
    pub split: Split,
    pub title: String,
    pub lines: Vec<Line>,
}

/// The paper-layout tables (`paper_table.json`; [`PaperTable::markdown`] is `paper_table.md`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PaperTable {
    pub source: String,
    /// How the Average lines are computed.
    pub averaging: String,
    pub columns: Vec<Column>,
    /// This run's column name.
    pub run: String,
    pub tables: Vec<SplitTable>,
    /// Our data sources that are none of the paper's data sets (left out of the tables).
    pub unmapped_data_sources: Vec<String>,
}

impl PaperTable {
    /// Markdown: each table with a line per data set and metric, the published columns, this
    /// run's and the differences; the source and notes below.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        for table in &self.tables {
            let _ = writeln!(out, "**{}**", table.title);
            let _ = writeln!(out);
            let mut header = vec!["Data set".to_string(), "Metric".to_string()];
            header.extend(self.columns.iter().map(|c| format!("{} (paper)", c.name)));
            header.push(self.run.clone());
            header.extend(self.columns.iter().map(|c| format!("Δ {}", c.name)));
            let mut rule = vec!["---".to_string(), "---".to_string()];
            rule.resize(header.len(), "---:".to_string());
            let _ = writeln!(out, "| {} |", header.join(" | "));
            let _ = writeln!(out, "|{}|", rule.join("|"));
            for line in &table.lines {
                let mut cells = vec![line.dataset.clone(), line.metric.label().to_string()];
                cells.extend(line.published.iter().map(|v| format!("{v:.2}")));
                cells.push(match (line.ours, line.averaged) {
                    (Some(v), Some(c)) if c.datasets < c.of => {
                        format!("{v:.2} ({} of {})", c.datasets, c.of)
                    }
                    (v, _) => v.map_or_else(|| "–".to_string(), |v| format!("{v:.2}")),
                });
                cells.extend(
                    line.difference
                        .iter()
                        .map(|d| d.map_or_else(|| "–".to_string(), |d| format!("{d:+.2}"))),
                );
                let _ = writeln!(out, "| {} |", cells.join(" | "));
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(out, "Scores ×100; Δ is this run minus the paper's figure.");
        let _ = writeln!(out, "- Published columns: {}", self.source);
        let _ = writeln!(out, "- {}", self.averaging);
        let partial = self
            .tables
            .iter()
            .flat_map(|t| &t.lines)
            .any(|l| l.averaged.is_some_and(|c| c.datasets < c.of));
        if partial {
            let _ = writeln!(
                out,
                "- \"(k of n)\": this run's average covers k of the n data sets the paper averages; the published figures on that line are the means of the paper's figures for the same k data sets, so that Δ compares like with like."
            );
        }
        let ssim_missing = self
            .tables
            .iter()
            .flat_map(|t| &t.lines)
            .any(|l| l.metric == Metric::Ssim && l.ours.is_none());
        if ssim_missing {
            let _ = writeln!(
                out,
                "- SSim needs `--ssim-model`; data sets not evaluated show –."
            );
        }
        if !self.unmapped_data_sources.is_empty() {
            let _ = writeln!(
                out,
                "- Not among the paper's data sets (left out): {}.",
                self.unmapped_data_sources.join(", ")
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use rewards::metrics::ExampleMetrics;

    fn m(em: f64, f1: f64, ssim: Option<f64>) -> ExampleMetrics {
        ExampleMetrics {
            em,
            sm: 0.0,
            f1,
            ssim,
        }
    }

    fn line<'a>(table: &'a PaperTable, split: Split, dataset: &str, metric: Metric) -> &'a Line {
        table
            .tables
            .iter()
            .find(|t| t.split == split)
            .and_then(|t| {
                t.lines
                    .iter()
                    .find(|l| l.dataset == dataset && l.metric == metric)
            })
            .unwrap_or_else(|| panic!("no line {dataset} {metric:?}"))
    }

    #[test]
    fn the_reference_layout_is_the_paper_s() {
        let spec = PaperSpec::reference().unwrap();
        let names: Vec<&str> = spec.datasets.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "2Wiki", "Hotpot", "GSM8K", "DAPO", "MusiQue", "PopQA", "BookSum", "W.P.",
                "TriviaQA", "MathQA", "SQuAD v2", "XSum"
            ]
        );
        let metrics = |name: &str| {
            spec.datasets
                .iter()
                .find(|d| d.name == name)
                .unwrap()
                .metrics
                .clone()
        };
        assert_eq!(metrics("Hotpot"), [Metric::Em, Metric::F1]);
        assert_eq!(metrics("XSum"), [Metric::F1, Metric::Ssim]);
        assert_eq!(spec.dataset_of("gsm8k-256-test").unwrap().name, "GSM8K");
        assert_eq!(spec.dataset_of("xum-128-eval_ood").unwrap().name, "XSum");
        assert!(spec.dataset_of("hotpotqa/hotpot_qa").is_none());
        let names: Vec<&str> = spec.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["GPT-4o-mini", "Prompt-R1"]);
    }

    /// The paper's Average lines are the means of its per-set figures under the stated rule,
    /// to the paper's rounding (two decimals).
    #[test]
    fn the_published_averages_follow_the_stated_rule() {
        let spec = PaperSpec::reference().unwrap();
        for row in &spec.rows {
            for split in spec.splits() {
                for metric in spec.average_metrics(split) {
                    let values: Vec<f64> = spec
                        .datasets
                        .iter()
                        .filter(|d| d.split == split && d.metrics.contains(&metric))
                        .map(|d| row.values[&d.name][&metric])
                        .collect();
                    let mean = values.iter().sum::<f64>() / values.len() as f64;
                    let printed = row.averages[&split][&metric];
                    assert!(
                        (mean - printed).abs() <= 0.006,
                        "{} {split:?} {metric:?}: mean {mean} printed {printed}",
                        row.name
                    );
                }
            }
        }
    }

    /// Our asset holds the same figures as the transcription of the paper in `../shared/paper/`.
    #[test]
    fn the_published_figures_equal_the_shared_transcription() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/paper/prompt_r1_tables.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            let reason = format!("{} is absent", path.display());
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("CI=true but {reason}");
            }
            println!("skipped: {reason}");
            return;
        };
        let shared: serde_json::Value = serde_json::from_str(&text).unwrap();
        let spec = PaperSpec::reference().unwrap();
        let mut compared = 0;
        for (key, split) in [
            ("table1_in_distribution", Split::In),
            ("table2_out_of_distribution", Split::Out),
        ] {
            let mut order = Vec::new();
            for entry in shared[key].as_array().unwrap() {
                let dataset = entry["dataset"].as_str().unwrap();
                let metric: Metric =
                    serde_json::from_value(entry["metric"].as_str().unwrap().to_lowercase().into())
                        .unwrap();
                for row in &spec.rows {
                    let expected = entry["values"][&row.column].as_f64().unwrap_or_else(|| {
                        panic!("no {:?} for {dataset} {metric:?}", row.column)
                    });
                    let ours = if dataset == AVERAGE {
                        row.averages[&split][&metric]
                    } else {
                        row.values[dataset][&metric]
                    };
                    assert_eq!(ours, expected, "{} {dataset} {metric:?}", row.name);
                    compared += 1;
                }
                if dataset != AVERAGE && order.last() != Some(&dataset) {
                    order.push(dataset);
                }
            }
            let ours: Vec<&str> = spec
                .datasets
                .iter()
                .filter(|d| d.split == split)
                .map(|d| d.name.as_str())
                .collect();
            assert_eq!(ours, order, "{key}: data sets or their order differ");
        }
        // 12 data sets × 2 metrics + 6 averages, for 2 columns.
        assert_eq!(compared, 2 * (24 + 6));
    }

    #[test]
    fn bad_layouts_are_named() {
        let twice = r#"{"source": "s", "averaging": "a", "rows": [], "datasets": [
            {"name": "A", "metrics": ["f1"], "split": "in", "data_sources": ["a"]},
            {"name": "B", "metrics": ["em"], "split": "in", "data_sources": ["a"]}]}"#;
        assert!(PaperSpec::parse(twice)
            .unwrap_err()
            .to_string()
            .contains("\"a\""));
        let unknown = r#"{"source": "s", "averaging": "a", "datasets": [], "rows": [
            {"name": "R", "column": "c", "values": {"Z": {"f1": 1.0}}, "averages": {}}]}"#;
        assert!(PaperSpec::parse(unknown)
            .unwrap_err()
            .to_string()
            .contains("\"Z\""));
        let missing = r#"{"source": "s", "averaging": "a",
            "datasets": [{"name": "A", "metrics": ["em", "f1"], "split": "in", "data_sources": ["a"]}],
            "rows": [{"name": "R", "column": "c", "values": {"A": {"em": 1.0}},
                      "averages": {"in": {"em": 1.0, "f1": 1.0}}}]}"#;
        let error = PaperSpec::parse(missing).unwrap_err().to_string();
        assert!(error.contains("[EM]") && error.contains("[EM, F1]"), "{error}");
    }

    #[test]
    fn both_metrics_per_data_set_averages_and_differences_by_hand() {
        let spec = PaperSpec::reference().unwrap();
        let report = MetricsReport::from_examples([
            // Hotpot: EM (1 + 0)/2 = 50, F1 (1 + 0.5)/2 = 75.
            ("hotpot-256-test".to_string(), m(1.0, 1.0, None)),
            ("hotpot-256-test".to_string(), m(0.0, 0.5, None)),
            // GSM8K: EM 0, F1 50.
            ("gsm8k-256-test".to_string(), m(0.0, 0.5, None)),
            // TriviaQA: EM and F1 100.
            ("triviaqa_train-128-eval_ood".to_string(), m(1.0, 1.0, None)),
            // XSum without a sentence model: F1 20, no SSim.
            ("xum-128-eval_ood".to_string(), m(0.0, 0.2, None)),
            ("my-own-set".to_string(), m(1.0, 1.0, None)),
        ]);
        let table = spec.table(&report, "this run");
        let hotpot_em = line(&table, Split::In, "Hotpot", Metric::Em);
        assert_eq!(hotpot_em.ours, Some(50.0));
        assert_eq!(hotpot_em.published, [33.59, 44.53]);
        assert!((hotpot_em.difference[0].unwrap() - (50.0 - 33.59)).abs() < 1e-9);
        assert!((hotpot_em.difference[1].unwrap() - (50.0 - 44.53)).abs() < 1e-9);
        assert_eq!(line(&table, Split::In, "Hotpot", Metric::F1).ours, Some(75.0));
        assert_eq!(line(&table, Split::In, "GSM8K", Metric::Em).ours, Some(0.0));
        assert_eq!(line(&table, Split::In, "GSM8K", Metric::F1).ours, Some(50.0));
        assert_eq!(line(&table, Split::In, "2Wiki", Metric::Em).ours, None);
        assert_eq!(line(&table, Split::In, "2Wiki", Metric::Em).difference, [None, None]);
        assert!((line(&table, Split::Out, "XSum", Metric::F1).ours.unwrap() - 20.0).abs() < 1e-9);
        assert_eq!(line(&table, Split::Out, "XSum", Metric::Ssim).ours, None);
        // Table 1: EM over Hotpot and GSM8K (2 of the 6 QA and math sets) = 25; F1 over the
        // same two (of all 8) = 62.5; no SSim.
        // The published figures of a partial average are the paper's over the same data sets:
        // GPT-4o-mini's EM (33.59 + 83.59) / 2 for Hotpot and GSM8K, not its 34.89 over six.
        let average = line(&table, Split::In, AVERAGE, Metric::Em);
        assert_eq!(average.ours, Some(25.0));
        assert_eq!(average.averaged, Some(Count { datasets: 2, of: 6 }));
        let same_two: Vec<f64> = ["Hotpot", "GSM8K"].iter().map(|d| line(&table, Split::In, d, Metric::Em).published[0]).collect();
        assert!((average.published[0] - (same_two[0] + same_two[1]) / 2.0).abs() < 1e-9, "{:?}", average.published);
        assert!((average.difference[0].unwrap() - (25.0 - average.published[0])).abs() < 1e-9);
        let average = line(&table, Split::In, AVERAGE, Metric::F1);
        assert_eq!(average.ours, Some(62.5));
        assert_eq!(average.averaged, Some(Count { datasets: 2, of: 8 }));
        assert_eq!(line(&table, Split::In, AVERAGE, Metric::Ssim).ours, None);
        // Table 2: F1 over TriviaQA and XSum = 60, of 4.
        let average = line(&table, Split::Out, AVERAGE, Metric::F1);
        assert!((average.ours.unwrap() - 60.0).abs() < 1e-9);
        assert_eq!(average.averaged, Some(Count { datasets: 2, of: 4 }));
        assert_eq!(table.unmapped_data_sources, ["my-own-set"]);
        // Table 1 has 16 lines and 3 averages; Table 2 8 and 3.
        let sizes: Vec<usize> = table.tables.iter().map(|t| t.lines.len()).collect();
        assert_eq!(sizes, [19, 11]);

        let md = table.markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines[0], "**Table 1: in-distribution**");
        assert_eq!(
            lines[2],
            "| Data set | Metric | GPT-4o-mini (paper) | Prompt-R1 (paper) | this run | \
             Δ GPT-4o-mini | Δ Prompt-R1 |"
        );
        assert_eq!(lines[4], "| 2Wiki | EM | 33.59 | 48.44 | – | – | – |");
        assert!(md.contains("| Hotpot | EM | 33.59 | 44.53 | 50.00 | +16.41 | +5.47 |"), "{md}");
        assert!(md.contains("| Average | EM | 58.59 | 71.09 | 25.00 (2 of 6) | -33.59 | -46.09 |"), "{md}");
        assert!(md.contains("**Table 2: out-of-distribution**"));
        assert!(md.contains("arXiv 2511.01016"));
        assert!(md.contains("SSim over the generation sets"));
        assert!(md.contains("--ssim-model"));
        assert!(md.contains("my-own-set"));

        let json = serde_json::to_value(&table).unwrap();
        assert_eq!(json["tables"][0]["lines"][2]["dataset"], "Hotpot");
        assert_eq!(json["tables"][0]["lines"][2]["ours"], 50.0);
        assert_eq!(json["tables"][0]["lines"][0]["ours"], serde_json::Value::Null);
        assert_eq!(json["columns"][1]["name"], "Prompt-R1");
        assert_eq!(json["tables"][1]["split"], "out");
    }

    #[test]
    fn several_sources_of_one_data_set_weigh_by_their_counts() {
        let dataset = Dataset {
            name: "D".into(),
            split: Split::In,
            metrics: vec![Metric::F1],
            data_sources: vec!["a".into(), "b".into()],
        };
        let report = MetricsReport::from_examples([
            ("a".to_string(), m(0.0, 1.0, None)),
            ("b".to_string(), m(0.0, 0.0, None)),
            ("b".to_string(), m(0.0, 0.0, None)),
        ]);
        // a: F1 100 over 1 example; b: 0 over 2: (100·1 + 0·2)/3.
        let value = dataset_value(&dataset, Metric::F1, &report).unwrap();
        assert!((value - 100.0 / 3.0).abs() < 1e-9);
    }
}

//! The results laid out like the paper's Tables 1–2: one metric per data set (F1, EM or SSim,
//! ×100), the in- and out-of-distribution averages, and the paper's published rows beside this
//! run's.
//!
//! `assets/paper_table.json` is the one place that maps our data-source ids to the paper's
//! data-set names, gives each its metric and split, and holds the published figures (null where
//! they could not be verified, with a note saying so).

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};
use rewards::metrics::{MetricsReport, MetricsRow};
use serde::{Deserialize, Serialize};

/// The paper's layout and published rows, compiled in from `assets/paper_table.json`.
const PAPER_TABLE: &str = include_str!("../../../../assets/paper_table.json");

/// The metric the paper reports for a data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    Em,
    F1,
    Ssim,
}

impl Metric {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    In,
    Out,
}

/// One data set of the paper.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dataset {
    /// The paper's name.
    pub name: String,
    pub metric: Metric,
    pub split: Split,
    /// Our `data_source` ids of this data set.
    pub data_sources: Vec<String>,
}

/// The two averages of a row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Averages {
    #[serde(rename = "in")]
    pub in_distribution: Option<f64>,
    #[serde(rename = "out")]
    pub out_of_distribution: Option<f64>,
}

/// A row the paper published.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishedRow {
    name: String,
    cite: String,
    values: BTreeMap<String, Option<f64>>,
    averages: Averages,
    note: Option<String>,
}

/// The contents of `assets/paper_table.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaperSpec {
    source: String,
    datasets: Vec<Dataset>,
    rows: Vec<PublishedRow>,
}

impl PaperSpec {
    /// The layout compiled into the binary.
    pub fn reference() -> Result<Self> {
        Self::parse(PAPER_TABLE).context("assets/paper_table.json")
    }

    /// Parses and checks a layout: names and data sources unique, published values only for
    /// the data sets it lists.
    pub fn parse(text: &str) -> Result<Self> {
        let spec: Self = serde_json::from_str(text)?;
        let mut names = HashSet::new();
        let mut sources = HashSet::new();
        for dataset in &spec.datasets {
            if !names.insert(dataset.name.as_str()) {
                bail!("data set {:?} is listed twice", dataset.name);
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
                    "row {:?} has a value for {unknown:?}, which is not a listed data set",
                    row.name
                );
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

    /// The table with the published rows and `name`'s row from `report`.
    pub fn table(&self, report: &MetricsReport, name: &str) -> PaperTable {
        let mut rows: Vec<TableRow> = self
            .rows
            .iter()
            .map(|published| {
                let values = self
                    .datasets
                    .iter()
                    .map(|d| published.values.get(&d.name).copied().flatten())
                    .collect();
                TableRow {
                    name: published.name.clone(),
                    published: true,
                    cite: Some(published.cite.clone()),
                    values,
                    averages: published.averages,
                    averaged: None,
                    note: published.note.clone(),
                }
            })
            .collect();
        let values: Vec<Option<f64>> = self
            .datasets
            .iter()
            .map(|d| dataset_value(d, report))
            .collect();
        let (in_distribution, in_count) = self.average(&values, Split::In);
        let (out_of_distribution, out_count) = self.average(&values, Split::Out);
        rows.push(TableRow {
            name: name.to_string(),
            published: false,
            cite: None,
            values,
            averages: Averages {
                in_distribution,
                out_of_distribution,
            },
            averaged: Some(Averaged {
                in_distribution: in_count,
                out_of_distribution: out_count,
            }),
            note: None,
        });
        let unmapped = report
            .datasets
            .keys()
            .filter(|source| self.dataset_of(source).is_none())
            .cloned()
            .collect();
        PaperTable {
            source: self.source.clone(),
            datasets: self.datasets.clone(),
            rows,
            unmapped_data_sources: unmapped,
        }
    }

    /// The mean of the values present in `split`, and over how many data sets (of how many).
    fn average(&self, values: &[Option<f64>], split: Split) -> (Option<f64>, Count) {
        let present: Vec<f64> = self
            .datasets
            .iter()
            .zip(values)
            .filter(|(d, _)| d.split == split)
            .filter_map(|(_, v)| *v)
            .collect();
        let of = self.datasets.iter().filter(|d| d.split == split).count();
        let mean =
            (!present.is_empty()).then(|| present.iter().sum::<f64>() / present.len() as f64);
        (
            mean,
            Count {
                datasets: present.len(),
                of,
            },
        )
    }
}

/// The data set's metric over our data sources of it, weighted by their example counts;
/// `None` when none of them was evaluated, or the metric (SSim) was not computed.
fn dataset_value(dataset: &Dataset, report: &MetricsReport) -> Option<f64> {
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
        sum += dataset.metric.of(row)? * row.n as f64;
    }
    Some(sum / n as f64)
}

/// How many data sets an average covers, of those of its split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Count {
    pub datasets: usize,
    pub of: usize,
}

/// The coverage of this run's averages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Averaged {
    #[serde(rename = "in")]
    pub in_distribution: Count,
    #[serde(rename = "out")]
    pub out_of_distribution: Count,
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TableRow {
    pub name: String,
    /// A row from the paper (else this run's).
    pub published: bool,
    /// Where in the paper the row comes from.
    pub cite: Option<String>,
    /// One value per data set, in the order of `datasets`; `null` where missing.
    pub values: Vec<Option<f64>>,
    pub averages: Averages,
    /// For this run's row: how many data sets each average covers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub averaged: Option<Averaged>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The paper-layout table (`paper_table.json`; [`PaperTable::markdown`] is `paper_table.md`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PaperTable {
    pub source: String,
    pub datasets: Vec<Dataset>,
    pub rows: Vec<TableRow>,
    /// Our data sources that are none of the paper's data sets (left out of the table).
    pub unmapped_data_sources: Vec<String>,
}

impl PaperTable {
    /// A Markdown table: the in-distribution data sets and their average, then the
    /// out-of-distribution ones and theirs; notes on missing figures below.
    pub fn markdown(&self) -> String {
        let order: Vec<(usize, &Dataset)> = [Split::In, Split::Out]
            .into_iter()
            .flat_map(|split| {
                self.datasets
                    .iter()
                    .enumerate()
                    .filter(move |(_, d)| d.split == split)
            })
            .collect();
        let mut header = vec!["Method".to_string()];
        let mut rule = vec!["---".to_string()];
        for split in [Split::In, Split::Out] {
            for (_, d) in order.iter().filter(|(_, d)| d.split == split) {
                header.push(format!("{} ({})", d.name, d.metric.label()));
                rule.push("---:".into());
            }
            header.push(match split {
                Split::In => "Avg. (ID)".into(),
                Split::Out => "Avg. (OOD)".into(),
            });
            rule.push("---:".into());
        }
        let mut out = String::new();
        let _ = writeln!(out, "| {} |", header.join(" | "));
        let _ = writeln!(out, "|{}|", rule.join("|"));
        let mut notes = Vec::new();
        for row in &self.rows {
            let mut cells = vec![match &row.cite {
                Some(_) => format!("{} (paper)", row.name),
                None => row.name.clone(),
            }];
            for split in [Split::In, Split::Out] {
                for (i, _) in order.iter().filter(|(_, d)| d.split == split) {
                    cells.push(cell(row.values[*i]));
                }
                let (average, count) = match split {
                    Split::In => (
                        row.averages.in_distribution,
                        row.averaged.map(|a| a.in_distribution),
                    ),
                    Split::Out => (
                        row.averages.out_of_distribution,
                        row.averaged.map(|a| a.out_of_distribution),
                    ),
                };
                cells.push(match count {
                    Some(c) if c.datasets < c.of && average.is_some() => {
                        format!("{} ({} of {})", cell(average), c.datasets, c.of)
                    }
                    _ => cell(average),
                });
            }
            let _ = writeln!(out, "| {} |", cells.join(" | "));
            if let (Some(cite), Some(note)) = (&row.cite, &row.note) {
                notes.push(format!("{} ({cite}): {note}.", row.name));
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "Scores ×100. Published rows: {}", self.source);
        for note in notes {
            let _ = writeln!(out, "- {note}");
        }
        let ours = self.rows.iter().filter(|r| !r.published);
        if ours
            .flat_map(|r| self.datasets.iter().zip(&r.values))
            .any(|(d, v)| d.metric == Metric::Ssim && v.is_none())
        {
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

fn cell(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_string(), |v| format!("{v:.2}"))
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn the_reference_layout_has_the_paper_s_twelve_data_sets() {
        let spec = PaperSpec::reference().unwrap();
        assert_eq!(spec.datasets.len(), 12);
        let count = |split| spec.datasets.iter().filter(|d| d.split == split).count();
        assert_eq!((count(Split::In), count(Split::Out)), (8, 4));
        let metric = |name: &str| {
            spec.datasets
                .iter()
                .find(|d| d.name == name)
                .unwrap()
                .metric
        };
        assert_eq!(metric("HotpotQA"), Metric::F1);
        assert_eq!(metric("GSM8K"), Metric::Em);
        assert_eq!(metric("XSum"), Metric::Ssim);
        assert_eq!(spec.dataset_of("gsm8k-256-test").unwrap().name, "GSM8K");
        assert_eq!(spec.dataset_of("xum-128-eval_ood").unwrap().name, "XSum");
        assert!(spec.dataset_of("hotpotqa/hotpot_qa").is_none());
        // Published figures that could not be verified are null, each row saying why.
        assert!(spec
            .rows
            .iter()
            .all(|r| r.note.is_some() || r.values.values().all(Option::is_some)));
    }

    #[test]
    fn bad_layouts_are_named() {
        let twice = r#"{"source": "s", "rows": [], "datasets": [
            {"name": "A", "metric": "f1", "split": "in", "data_sources": ["a"]},
            {"name": "B", "metric": "em", "split": "in", "data_sources": ["a"]}]}"#;
        assert!(PaperSpec::parse(twice)
            .unwrap_err()
            .to_string()
            .contains("\"a\""));
        let unknown = r#"{"source": "s", "datasets": [], "rows": [
            {"name": "R", "cite": "c", "values": {"Z": 1.0}, "averages": {"in": null, "out": null}, "note": null}]}"#;
        assert!(PaperSpec::parse(unknown)
            .unwrap_err()
            .to_string()
            .contains("\"Z\""));
    }

    #[test]
    fn one_metric_per_data_set_and_averages_by_hand() {
        let spec = PaperSpec::reference().unwrap();
        let report = MetricsReport::from_examples([
            // HotpotQA (F1): (1 + 0.5)/2 = 75.
            ("hotpot-256-test".to_string(), m(1.0, 1.0, None)),
            ("hotpot-256-test".to_string(), m(0.0, 0.5, None)),
            // GSM8K (EM): 0/1 = 0, though F1 is 50.
            ("gsm8k-256-test".to_string(), m(0.0, 0.5, None)),
            // TriviaQA (EM): 100.
            ("triviaqa_train-128-eval_ood".to_string(), m(1.0, 1.0, None)),
            // XSum (SSim) without a sentence model: no value.
            ("xum-128-eval_ood".to_string(), m(0.0, 0.2, None)),
            ("my-own-set".to_string(), m(1.0, 1.0, None)),
        ]);
        let table = spec.table(&report, "this run");
        let ours = table.rows.last().unwrap();
        let value = |name: &str| {
            let i = table.datasets.iter().position(|d| d.name == name).unwrap();
            ours.values[i]
        };
        assert_eq!(value("HotpotQA"), Some(75.0));
        assert_eq!(value("GSM8K"), Some(0.0));
        assert_eq!(value("TriviaQA"), Some(100.0));
        assert_eq!(value("XSum"), None);
        assert_eq!(value("2Wiki"), None);
        // In-distribution: (75 + 0)/2 over 2 of 8; out: 100 over 1 of 4 (XSum has no SSim).
        assert_eq!(ours.averages.in_distribution, Some(37.5));
        assert_eq!(ours.averages.out_of_distribution, Some(100.0));
        let averaged = ours.averaged.unwrap();
        assert_eq!(
            (
                averaged.in_distribution.datasets,
                averaged.in_distribution.of
            ),
            (2, 8)
        );
        assert_eq!(table.unmapped_data_sources, ["my-own-set"]);

        let md = table.markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert!(lines[0].starts_with("| Method | 2Wiki (F1) | HotpotQA (F1)"));
        assert!(
            lines[0].contains("| Avg. (ID) | SQuAD 2.0 (F1)") && lines[0].ends_with("Avg. (OOD) |")
        );
        // Two published rows, then ours.
        assert!(lines[2].starts_with("| GPT-4o-mini (paper) | – |"));
        assert!(lines[4].starts_with("| this run | – | 75.00 |"));
        assert!(lines[4].contains("| 37.50 (2 of 8) |"));
        assert!(md.contains("not found in stored sources"));
        assert!(md.contains("--ssim-model"));
        assert!(md.contains("my-own-set"));

        let json = serde_json::to_value(&table).unwrap();
        assert_eq!(json["rows"][2]["averages"]["in"], 37.5);
        assert_eq!(json["rows"][0]["values"][0], serde_json::Value::Null);
        assert_eq!(json["datasets"][0]["name"], "2Wiki");
    }

    #[test]
    fn several_sources_of_one_data_set_weigh_by_their_counts() {
        let dataset = Dataset {
            name: "D".into(),
            metric: Metric::F1,
            split: Split::In,
            data_sources: vec!["a".into(), "b".into()],
        };
        let report = MetricsReport::from_examples([
            ("a".to_string(), m(0.0, 1.0, None)),
            ("b".to_string(), m(0.0, 0.0, None)),
            ("b".to_string(), m(0.0, 0.0, None)),
        ]);
        // a: F1 100 over 1 example; b: 0 over 2: (100·1 + 0·2)/3.
        let value = dataset_value(&dataset, &report).unwrap();
        assert!((value - 100.0 / 3.0).abs() < 1e-9);
    }
}

//! `prompt-r1 metrics`: EM, SM, F1 and optionally SSim of a predictions file, per data source.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use clap::Args as ClapArgs;
use rewards::metrics::{ExampleMetrics, MetricsReport};
use rewards::ssim::SentenceEncoder;
use serde::Deserialize;

use crate::device::{run_on, DeviceChoice, OnBackend};

/// Compute the paper's metrics (means ×100) per data source and overall.
///
/// Each example scores the best over its reference answers. A missing, null or empty
/// prediction scores 0 on every metric (the reference script counts an empty prediction as a
/// substring match and gives it SSim 1.0). `overall` is the mean of the per-source means.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// JSONL file, one object per line:
    /// {"data_source": "...", "prediction": "...", "answers": ["...", ...]}; other fields are
    /// ignored.
    #[arg(long)]
    pub predictions: PathBuf,
    /// all-MiniLM-L6-v2 folder (config.json, tokenizer.json, model.safetensors); adds the SSim
    /// column. Without it there is no SSim column.
    #[arg(long)]
    pub ssim_model: Option<PathBuf>,
    /// Device for the SSim model: cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Print the report as JSON: {"datasets": {"<source>": {"n", "em", "sm", "f1", "ssim"}},
    /// "overall": {...}} instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file (written atomically).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One line of the predictions file.
#[derive(Debug, Deserialize)]
struct PredictionRow {
    /// An example id: of rows with the same data source and id, the last counts.
    #[serde(default)]
    id: Option<serde_json::Value>,
    data_source: String,
    #[serde(default)]
    prediction: Option<String>,
    answers: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    let rows = read_predictions(&args.predictions)?;
    if let Some(out) = &args.out {
        // Before the metrics are computed (with --ssim-model, minutes): not after.
        super::create_parent(out)?;
    }
    let examples = match &args.ssim_model {
        None => rows
            .iter()
            .map(|row| {
                (
                    row.data_source.clone(),
                    ExampleMetrics::text(prediction(row), &row.answers),
                )
            })
            .collect(),
        Some(dir) => run_on(
            args.device,
            WithSsim {
                model_dir: dir,
                rows: &rows,
            },
        )?,
    };
    let report = MetricsReport::from_examples(examples);
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(out) = &args.out {
        model::checkpoint::write_atomic(out, format!("{json}\n").as_bytes())
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{report}");
    }
    Ok(())
}

fn prediction(row: &PredictionRow) -> &str {
    row.prediction.as_deref().unwrap_or("")
}

/// Reads every non-blank line; a malformed line is an error naming the file and line, except an
/// unfinished last one (no newline after it: an interrupted eval's), dropped with a note as
/// `eval` drops it.
fn read_predictions(path: &Path) -> Result<Vec<PredictionRow>> {
    let text = data::read_text(path)?;
    let unfinished = (!text.ends_with('\n')).then(|| text.lines().count());
    let mut rows = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if unfinished == Some(index + 1) && serde_json::from_str::<PredictionRow>(line).is_err() {
            eprintln!("note: {} ends with an incomplete line (an interrupted run); leaving it out", path.display());
            continue;
        }
        let row: PredictionRow = serde_json::from_str(line).with_context(|| {
            format!(
                "{}: line {}: expected {{\"data_source\": string, \"prediction\": string, \"answers\": [string]}}",
                path.display(),
                index + 1
            )
        })?;
        if row.answers.is_empty() {
            bail!("{}: line {}: `answers` is an empty list", path.display(), index + 1);
        }
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("{}: no predictions", path.display());
    }
    let (rows, superseded) = latest_per_example(rows);
    if superseded > 0 {
        eprintln!(
            "note: {}: {superseded} rows are superseded by later rows of the same data_source and id (an eval that was resumed appends the questions it runs again); the last row of each counts",
            path.display()
        );
    }
    Ok(rows)
}

/// `rows` with only the last of those sharing a data source and an id (rows without an id each
/// count), and how many were dropped.
fn latest_per_example(rows: Vec<PredictionRow>) -> (Vec<PredictionRow>, usize) {
    let keys = rows.iter().map(|row| data::prediction_key(&row.data_source, row.id.as_ref()?));
    let superseded = data::superseded_rows(keys);
    let kept = rows.into_iter().enumerate().filter(|(i, _)| !superseded.contains(i)).map(|(_, row)| row).collect();
    (kept, superseded.len())
}

/// Scoring with the SSim model on the chosen backend.
struct WithSsim<'a> {
    model_dir: &'a Path,
    rows: &'a [PredictionRow],
}

impl OnBackend for WithSsim<'_> {
    type Output = Vec<(String, ExampleMetrics)>;

    fn run<B: Backend>(self, device: B::Device) -> Result<Self::Output> {
        let encoder = SentenceEncoder::<B>::load(self.model_dir, &device).with_context(|| {
            format!(
                "cannot load the SSim model from {}",
                self.model_dir.display()
            )
        })?;
        self.rows
            .iter()
            .enumerate()
            .map(|(i, row)| {
                let metrics =
                    ExampleMetrics::with_similarity(prediction(row), &row.answers, &encoder)
                        .with_context(|| format!("SSim of prediction {}", i + 1))?;
                Ok((row.data_source.clone(), metrics))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rows_ignoring_extra_fields_and_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(
            &path,
            "{\"data_source\": \"a\", \"prediction\": \"x\", \"answers\": [\"x\"], \"id\": 3}\n\n\
             {\"data_source\": \"b\", \"prediction\": null, \"answers\": [\"y\"]}\n\
             {\"data_source\": \"b\", \"answers\": [\"y\"]}\n",
        )
        .unwrap();
        let rows = read_predictions(&path).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(prediction(&rows[0]), "x");
        assert_eq!(prediction(&rows[1]), "");
        assert_eq!(prediction(&rows[2]), "");
    }

    /// Rows an eval ran again (same data source and id) count once, the last; rows without an
    /// id each count.
    #[test]
    fn the_last_row_of_an_example_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let row = |source: &str, id: &str, prediction: &str| {
            format!("{{\"data_source\": \"{source}\", {id}\"prediction\": \"{prediction}\", \"answers\": [\"x\"]}}\n")
        };
        let text = [
            row("a", "\"id\": \"1\", ", "old"),
            row("b", "\"id\": \"1\", ", "b1"),
            row("a", "", "no id"),
            row("a", "", "no id"),
            row("a", "\"id\": \"1\", ", "new"),
            row("a", "\"id\": 2, ", "two"),
        ];
        std::fs::write(&path, text.concat()).unwrap();
        let rows = read_predictions(&path).unwrap();
        let kept: Vec<&str> = rows.iter().map(prediction).collect();
        assert_eq!(kept, ["b1", "no id", "no id", "new", "two"]);
    }

    #[test]
    fn a_bad_line_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(&path, "{\"data_source\": \"a\", \"prediction\": \"x\", \"answers\": [\"x\"]}\n{\"prediction\": \"x\"}\n").unwrap();
        let err = format!("{:#}", read_predictions(&path).unwrap_err());
        assert!(err.contains("p.jsonl: line 2"), "{err}");
    }

    #[test]
    fn a_row_without_answers_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(&path, "{\"data_source\": \"a\", \"prediction\": \"x\", \"answers\": [\"x\"]}\n\n{\"data_source\": \"a\", \"prediction\": \"x\", \"answers\": []}\n").unwrap();
        let err = format!("{:#}", read_predictions(&path).unwrap_err());
        assert!(err.contains("p.jsonl: line 3: `answers` is an empty list"), "{err}");
    }
}

//! Loading a dataset file, with a chosen policy for malformed rows.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{BadRow, DataError, RowProblem};
use crate::example::Example;
use crate::{csv_file, jsonl_file, parquet_file};

/// What to do with a malformed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRow {
    /// Stop with an error naming the file and the row (the default).
    #[default]
    Fail,
    /// Leave the row out, count it, and warn once per file on stderr.
    Skip,
}

impl FromStr for OnBadRow {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fail" => Ok(Self::Fail),
            "skip" => Ok(Self::Skip),
            other => Err(format!("expected `fail` or `skip`, got `{other}`")),
        }
    }
}

impl fmt::Display for OnBadRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fail => "fail",
            Self::Skip => "skip",
        })
    }
}

/// The examples of one file, in file order, and the rows that were skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    path: PathBuf,
    examples: Vec<Example>,
    skipped: Vec<BadRow>,
}

impl Dataset {
    /// The file the examples were read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The examples, in file order.
    pub fn examples(&self) -> &[Example] {
        &self.examples
    }

    /// Takes the examples out.
    pub fn into_examples(self) -> Vec<Example> {
        self.examples
    }

    /// The malformed rows left out under [`OnBadRow::Skip`].
    pub fn skipped(&self) -> &[BadRow] {
        &self.skipped
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }
}

/// Loads a `.csv`, `.jsonl` or `.parquet` dataset (chosen by extension).
///
/// - CSV: header with `question` and `answers` (a JSON array of strings); `id` and
///   `data_source` are optional.
/// - JSONL: one object per line with the same fields (`answers` a JSON array of strings);
///   blank lines are ignored, extra fields too.
/// - Parquet (verl schema): `data_source`, `prompt` (one user message
///   `Question: {question}\n{instruction}`) and `reward_model.ground_truth`; the raw
///   question is recovered by removing the prefix and the reference instruction.
///
/// A missing `id` becomes `<file stem>-<row index from 0>`, a missing `data_source` the file
/// stem.
pub fn load(path: &Path, on_bad_row: OnBadRow) -> Result<Dataset, DataError> {
    let extension = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let mut rows = RowSink::new(path, on_bad_row);
    match extension.as_deref() {
        Some("csv") => csv_file::read(path, &mut rows)?,
        Some("jsonl") => jsonl_file::read(path, &mut rows)?,
        Some("parquet") => parquet_file::read(path, &mut rows)?,
        _ => {
            return Err(DataError::UnknownFormat {
                path: path.to_path_buf(),
            })
        }
    }
    Ok(rows.finish())
}

/// Receives the rows a reader produces and applies the bad-row policy.
pub(crate) struct RowSink {
    path: PathBuf,
    stem: String,
    on_bad_row: OnBadRow,
    examples: Vec<Example>,
    skipped: Vec<BadRow>,
}

impl RowSink {
    fn new(path: &Path, on_bad_row: OnBadRow) -> Self {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self {
            path: path.to_path_buf(),
            stem,
            on_bad_row,
            examples: Vec::new(),
            skipped: Vec::new(),
        }
    }

    /// The id of the row at 0-based `index` when the file gives none.
    pub(crate) fn default_id(&self, index: usize) -> String {
        format!("{}-{index}", self.stem)
    }

    /// The data source of rows when the file gives none.
    pub(crate) fn default_source(&self) -> &str {
        &self.stem
    }

    /// Takes one row: `row` numbers it as [`BadRow::row`] does, `line` is its first line when
    /// known.
    pub(crate) fn push(
        &mut self,
        row: usize,
        line: Option<u64>,
        example: Result<Example, RowProblem>,
    ) -> Result<(), DataError> {
        match example {
            Ok(example) => self.examples.push(example),
            Err(problem) => {
                let bad = BadRow {
                    path: self.path.clone(),
                    row,
                    line,
                    problem,
                };
                match self.on_bad_row {
                    OnBadRow::Fail => return Err(bad.into()),
                    OnBadRow::Skip => self.skipped.push(bad),
                }
            }
        }
        Ok(())
    }

    fn finish(self) -> Dataset {
        if let Some(first) = self.skipped.first() {
            eprintln!(
                "warning: {}: skipped {} malformed row(s); first: {first}",
                self.path.display(),
                self.skipped.len()
            );
        }
        Dataset {
            path: self.path,
            examples: self.examples,
            skipped: self.skipped,
        }
    }
}

/// Parses an `answers` value: a JSON array of strings.
pub(crate) fn answers_from_json(value: serde_json::Value) -> Result<Vec<String>, RowProblem> {
    let not_strings = RowProblem::WrongType {
        field: "answers",
        expected: "a JSON array of strings",
    };
    let serde_json::Value::Array(items) = value else {
        return Err(not_strings);
    };
    items
        .into_iter()
        .map(|item| match item {
            serde_json::Value::String(s) => Ok(s),
            _ => Err(not_strings.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses_and_prints() {
        assert_eq!("skip".parse::<OnBadRow>(), Ok(OnBadRow::Skip));
        assert_eq!("fail".parse::<OnBadRow>(), Ok(OnBadRow::Fail));
        assert!("ignore".parse::<OnBadRow>().is_err());
        assert_eq!(OnBadRow::default().to_string(), "fail");
    }

    #[test]
    fn unknown_extension_is_an_error() {
        let err = load(Path::new("data.txt"), OnBadRow::Fail).unwrap_err();
        assert!(matches!(err, DataError::UnknownFormat { .. }), "{err}");
        assert!(err.to_string().contains("data.txt"));
    }

    #[test]
    fn answers_must_be_an_array_of_strings() {
        assert_eq!(
            answers_from_json(serde_json::json!(["a", "b"])),
            Ok(vec!["a".to_string(), "b".to_string()])
        );
        assert!(answers_from_json(serde_json::json!("a")).is_err());
        assert!(answers_from_json(serde_json::json!(["a", 1])).is_err());
    }
}

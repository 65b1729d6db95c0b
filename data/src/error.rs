//! Errors of loading a dataset: whole-file errors and malformed rows.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

/// What is wrong with one row.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RowProblem {
    /// The question is empty or only whitespace.
    #[error("empty question")]
    EmptyQuestion,
    /// The list of reference answers is empty.
    #[error("`answers` is an empty list")]
    NoAnswers,
    /// A required field is absent or null.
    #[error("missing `{0}`")]
    MissingField(&'static str),
    /// A field holds the wrong kind of value.
    #[error("`{field}` must be {expected}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    /// The `answers` cell is not valid JSON.
    #[error("`answers` is not valid JSON: {0}")]
    AnswersNotJson(String),
    /// A JSONL line is not a JSON object.
    #[error("not a JSON object: {0}")]
    NotJsonObject(String),
    /// A CSV row has a different number of fields than the header.
    #[error("{found} fields where the header has {expected}")]
    FieldCount { expected: usize, found: usize },
    /// A CSV row has a different number of fields than the header, one of them over several
    /// lines: most often a quote left open, which runs on to the next quote in the file.
    #[error("{found} fields where the header has {expected}, one of them running over several lines: is a quote left open?")]
    FieldCountOverLines { expected: usize, found: usize },
    /// A CSV row is not valid UTF-8.
    #[error("not valid UTF-8")]
    NotUtf8,
    /// A parquet prompt is not one message whose content starts with `Question: `.
    #[error("`prompt` must be one user message starting with \"Question: \"")]
    PromptShape,
    /// A parquet prompt does not end with the reference agent instruction.
    #[error("`prompt` does not end with the reference agent instruction")]
    NoInstruction,
}

/// A malformed row, with the file and the row it was found in.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub struct BadRow {
    /// The file.
    pub path: PathBuf,
    /// The row: 1-based data row (header excluded) for CSV and parquet, line for JSONL.
    pub row: usize,
    /// The line the row starts on, for CSV (whose fields may span lines).
    pub line: Option<u64>,
    /// What is wrong.
    pub problem: RowProblem,
}

impl fmt::Display for BadRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: row {}", self.path.display(), self.row)?;
        if let Some(line) = self.line {
            write!(f, " (line {line})")?;
        }
        write!(f, ": {}", self.problem)
    }
}

/// Why a dataset could not be loaded.
#[derive(Debug, Error)]
pub enum DataError {
    /// The file could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line of a text file is not valid UTF-8 (the first such line).
    #[error("{}: line {line} is not valid UTF-8", path.display())]
    NotUtf8 { path: PathBuf, line: usize },
    /// The extension is not one of the supported formats.
    #[error("{}: unsupported dataset format (expected .csv, .jsonl or .parquet)", path.display())]
    UnknownFormat { path: PathBuf },
    /// The header or schema lacks a required column.
    #[error("{}: missing column `{column}`", path.display())]
    MissingColumn { path: PathBuf, column: &'static str },
    /// The header names a column the loader reads more than once (which would be read is a guess).
    #[error("{}: the header has more than one `{column}` column", path.display())]
    DuplicateColumn { path: PathBuf, column: &'static str },
    /// A malformed row, with [`OnBadRow::Fail`](crate::OnBadRow::Fail).
    #[error(transparent)]
    BadRow(#[from] BadRow),
    /// The CSV file itself could not be parsed.
    #[error("{}: CSV error: {source}", path.display())]
    Csv { path: PathBuf, source: csv::Error },
    /// The parquet file's columns are compressed with a codec this build does not read: zstd
    /// (its crate wraps the C library), brotli (a large crate for a rare codec) or LZO.
    #[error(
        "{}: its columns are compressed with {codec}, which this build does not read: write it again with snappy \
         (pyarrow's and pandas' default), gzip, lz4 or none, e.g. pandas `df.to_parquet(path, compression=\"snappy\")` \
         or polars `df.write_parquet(path, compression=\"snappy\")`",
        path.display()
    )]
    UnsupportedCompression { path: PathBuf, codec: String },
    /// The parquet file itself could not be read.
    #[error("{}: parquet error: {source}", path.display())]
    Parquet {
        path: PathBuf,
        source: parquet::errors::ParquetError,
    },
}

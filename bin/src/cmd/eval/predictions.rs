//! `OUT/predictions.jsonl`: one row per answered question, appended and flushed one line at a
//! time, read back to resume.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use data::Example;
use env::StopReason;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::modes::Mode;

/// One line of the predictions file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub id: String,
    pub data_source: String,
    pub question: String,
    /// Empty when there is no answer (it then scores 0).
    pub prediction: String,
    pub answers: Vec<String>,
    pub mode: Mode,
    /// Why the episode (or the single call) ended: `answer`, `no_call`, `turn_limit`,
    /// `token_limit`, `env_failure`, `agent_failure`.
    pub stop_reason: StopReason,
    /// The environment or the agent broke down.
    pub failed: bool,
    pub error: Option<String>,
    /// The agent's trajectory, or for `direct`/`cot` the messages and the reply.
    pub trajectory: Value,
}

/// A row's identity: the same id may appear in two data sources.
pub type Key = (String, String);

impl Row {
    pub fn new(
        example: &Example,
        mode: Mode,
        prediction: String,
        stop_reason: StopReason,
        error: Option<String>,
        trajectory: Value,
    ) -> Self {
        Self {
            id: example.id().to_string(),
            data_source: example.data_source().to_string(),
            question: example.question().to_string(),
            prediction,
            answers: example.answers().to_vec(),
            mode,
            stop_reason,
            failed: stop_reason.is_failure(),
            error,
            trajectory,
        }
    }

    pub fn key(&self) -> Key {
        (self.data_source.clone(), self.id.clone())
    }

    /// Failed rows (the large LLM or the agent broke down) are run again by the next `eval`;
    /// every other row is final.
    pub fn is_final(&self) -> bool {
        !self.failed
    }

    /// Whether this row is of `example` as the data now gives it (its question and answers: a
    /// row of an edited example is stale).
    pub fn is_of(&self, example: &Example) -> bool {
        self.question == example.question() && self.answers == example.answers()
    }

    /// Whether this row answers `example` for good: final, and of the example as it now is.
    pub fn answers_for(&self, example: &Example) -> bool {
        self.is_final() && self.is_of(example)
    }
}

/// The key of an example.
pub fn key_of(example: &Example) -> Key {
    (example.data_source().to_string(), example.id().to_string())
}

/// The predictions file, open for appending.
pub struct PredictionsFile {
    path: PathBuf,
    file: File,
}

impl PredictionsFile {
    /// Opens `path` (creating it), first cutting off an incomplete last line that an
    /// interruption left; returns the rows already there, the latest per key.
    pub fn open(path: &Path) -> Result<(Self, HashMap<Key, Row>)> {
        let mut rows = HashMap::new();
        if path.exists() {
            let bytes =
                std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            if complete < bytes.len() {
                eprintln!(
                    "note: {} ends with an incomplete line (an interrupted run); dropping it",
                    path.display()
                );
                let file = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .with_context(|| format!("cannot open {}", path.display()))?;
                file.set_len(complete as u64)
                    .with_context(|| format!("cannot truncate {}", path.display()))?;
            }
            for (index, line) in bytes[..complete].split(|&b| b == b'\n').enumerate() {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let row: Row = serde_json::from_slice(line).with_context(|| {
                    format!(
                        "{}: line {} is not a prediction row",
                        path.display(),
                        index + 1
                    )
                })?;
                rows.insert(row.key(), row);
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {} for appending", path.display()))?;
        Ok((
            Self {
                path: path.to_path_buf(),
                file,
            },
            rows,
        ))
    }

    /// Appends one row as one line and flushes it.
    pub fn append(&mut self, row: &Row) -> Result<()> {
        let mut line = serde_json::to_string(row)?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .with_context(|| format!("cannot append to {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(id: &str) -> Example {
        Example::new(id, "src", "q?", vec!["a".to_string()]).unwrap()
    }

    fn row(id: &str, prediction: &str, stop: StopReason) -> Row {
        Row::new(
            &example(id),
            Mode::Agent,
            prediction.into(),
            stop,
            None,
            Value::Null,
        )
    }

    #[test]
    fn appends_reads_back_and_drops_a_partial_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("predictions.jsonl");
        let (mut file, rows) = PredictionsFile::open(&path).unwrap();
        assert!(rows.is_empty());
        file.append(&row("1", "x", StopReason::Answer)).unwrap();
        file.append(&row("2", "", StopReason::EnvFailure)).unwrap();
        file.append(&row("2", "y", StopReason::NoCall)).unwrap();
        drop(file);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"id\": \"3\", \"data_");
        std::fs::write(&path, &text).unwrap();
        let (_, rows) = PredictionsFile::open(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[&key_of(&example("2"))].prediction, "y");
        assert!(std::fs::read_to_string(&path).unwrap().ends_with("}\n"));
    }

    #[test]
    fn failed_rows_are_not_final() {
        for stop in [StopReason::EnvFailure, StopReason::AgentFailure] {
            let failed = row("1", "", stop);
            assert!(failed.failed && !failed.is_final());
        }
        for stop in [
            StopReason::Answer,
            StopReason::NoCall,
            StopReason::TokenLimit,
        ] {
            assert!(row("1", "", stop).is_final());
        }
    }

    #[test]
    fn a_bad_line_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(&path, "{}\n").unwrap();
        let err = format!("{:#}", PredictionsFile::open(&path).err().unwrap());
        assert!(err.contains("p.jsonl: line 1"), "{err}");
    }
}

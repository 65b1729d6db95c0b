//! JSONL datasets: one JSON object per line with `question`, `answers` (array of strings)
//! and optional `id` and `data_source`.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{DataError, RowProblem};
use crate::example::Example;
use crate::load::{answers_from_json, RowSink};

pub(crate) fn read(path: &Path, sink: &mut RowSink) -> Result<(), DataError> {
    let io_error = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io_error)?);
    let mut bytes = Vec::new();
    let mut line_number = 0usize;
    let mut index = 0usize;
    loop {
        bytes.clear();
        if reader.read_until(b'\n', &mut bytes).map_err(io_error)? == 0 {
            return Ok(());
        }
        line_number += 1;
        if line_number == 1 && bytes.starts_with(UTF8_BOM) {
            bytes.drain(..UTF8_BOM.len());
        }
        let example = match std::str::from_utf8(&bytes) {
            Ok(line) if line.trim().is_empty() => continue,
            Ok(line) => parse_line(line, index, sink),
            Err(_) => Err(RowProblem::NotUtf8),
        };
        sink.push(line_number, None, example)?;
        index += 1;
    }
}

fn parse_line(line: &str, index: usize, sink: &RowSink) -> Result<Example, RowProblem> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| RowProblem::NotJsonObject(e.to_string()))?;
    let Value::Object(object) = value else {
        return Err(RowProblem::NotJsonObject("found another JSON value".into()));
    };
    let id = optional_id(&object)?.unwrap_or_else(|| sink.default_id(index));
    let data_source = optional_string(&object, "data_source")?
        .unwrap_or_else(|| sink.default_source().to_owned());
    let question =
        optional_string(&object, "question")?.ok_or(RowProblem::MissingField("question"))?;
    let answers = match object.get("answers") {
        None | Some(Value::Null) => return Err(RowProblem::MissingField("answers")),
        Some(value) => answers_from_json(value.clone())?,
    };
    Example::new(id, data_source, question, answers)
}

/// The byte order mark some editors write at a UTF-8 file's start (CSV files are read past it too).
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The `id` field: a string, or an integer (as many datasets number their rows) written out;
/// absent or null is `None`, another type is an error.
fn optional_id(object: &Map<String, Value>) -> Result<Option<String>, RowProblem> {
    match object.get("id") {
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Ok(Some(n.to_string())),
        Some(Value::Number(_)) => Err(RowProblem::WrongType { field: "id", expected: "a string or an integer" }),
        _ => optional_string(object, "id"),
    }
}

/// A string field; absent or null is `None`, another type is an error.
fn optional_string(
    object: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, RowProblem> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(RowProblem::WrongType {
            field,
            expected: "a string",
        }),
    }
}

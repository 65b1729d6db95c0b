//! The reference project's verl parquet files: `data_source`, `prompt` (one user message
//! `Question: {question}\n{instruction}`) and `reward_model.ground_truth` (list of strings).

use std::fs::File;
use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};

use crate::error::{DataError, RowProblem};
use crate::example::Example;
use crate::load::RowSink;

/// The agent instruction the reference appends to every question (verbatim).
const REFERENCE_INSTRUCTION: &str = include_str!("../../assets/prompts/instruction.txt");

const QUESTION_PREFIX: &str = "Question: ";

/// Top-level columns the loader needs.
const REQUIRED_COLUMNS: [&str; 3] = ["data_source", "prompt", "reward_model"];

pub(crate) fn read(path: &Path, sink: &mut RowSink) -> Result<(), DataError> {
    let parquet_error = |source| DataError::Parquet {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(parquet_error)?;
    check_compression(path, &reader)?;
    let schema = reader.metadata().file_metadata().schema();
    for column in REQUIRED_COLUMNS {
        if !schema.get_fields().iter().any(|f| f.name() == column) {
            return Err(DataError::MissingColumn {
                path: path.to_path_buf(),
                column,
            });
        }
    }
    for (index, row) in reader
        .get_row_iter(None)
        .map_err(parquet_error)?
        .enumerate()
    {
        let row = row.map_err(parquet_error)?;
        let example = parse_row(&row, sink.default_id(index));
        sink.push(index + 1, None, example)?;
    }
    Ok(())
}

/// Refuses a file whose columns use a codec this build leaves out, naming it, before any row is
/// read (parquet's own error only says "Disabled feature at compile time").
fn check_compression(path: &Path, reader: &SerializedFileReader<File>) -> Result<(), DataError> {
    use parquet::basic::Compression;
    let codecs = reader.metadata().row_groups().iter().flat_map(|group| group.columns().iter().map(|column| column.compression()));
    for codec in codecs {
        match codec {
            Compression::UNCOMPRESSED | Compression::SNAPPY | Compression::GZIP(_) | Compression::LZ4 | Compression::LZ4_RAW => {}
            other => {
                let name = match other {
                    Compression::ZSTD(_) => "zstd".to_owned(),
                    Compression::BROTLI(_) => "brotli".to_owned(),
                    other => format!("{other:?}"),
                };
                return Err(DataError::UnsupportedCompression { path: path.to_path_buf(), codec: name });
            }
        }
    }
    Ok(())
}

fn parse_row(row: &Row, id: String) -> Result<Example, RowProblem> {
    let data_source = match column(row, "data_source") {
        Some(Field::Str(s)) => s.clone(),
        None | Some(Field::Null) => return Err(RowProblem::MissingField("data_source")),
        Some(_) => {
            return Err(RowProblem::WrongType {
                field: "data_source",
                expected: "a string",
            })
        }
    };
    let content = prompt_content(row)?;
    let question = raw_question(content)?;
    let answers = ground_truth(row)?;
    Example::new(id, data_source, question, answers)
}

fn column<'a>(row: &'a Row, name: &str) -> Option<&'a Field> {
    row.get_column_iter()
        .find(|(column, _)| column.as_str() == name)
        .map(|(_, field)| field)
}

/// The content of the single user message of `prompt`.
fn prompt_content(row: &Row) -> Result<&str, RowProblem> {
    let messages = match column(row, "prompt") {
        Some(Field::ListInternal(messages)) => messages,
        None | Some(Field::Null) => return Err(RowProblem::MissingField("prompt")),
        Some(_) => return Err(RowProblem::WrongType { field: "prompt", expected: "a list of messages" }),
    };
    let [Field::Group(message)] = messages.elements() else {
        return Err(RowProblem::PromptShape);
    };
    match (column(message, "role"), column(message, "content")) {
        (Some(Field::Str(role)), Some(Field::Str(content))) if role == "user" => Ok(content),
        _ => Err(RowProblem::PromptShape),
    }
}

/// The question inside `Question: {question}\n{instruction}`.
fn raw_question(content: &str) -> Result<&str, RowProblem> {
    let rest = content
        .strip_prefix(QUESTION_PREFIX)
        .ok_or(RowProblem::PromptShape)?;
    rest.strip_suffix(REFERENCE_INSTRUCTION)
        .and_then(|q| q.strip_suffix('\n'))
        .ok_or(RowProblem::NoInstruction)
}

fn ground_truth(row: &Row) -> Result<Vec<String>, RowProblem> {
    const FIELD: &str = "reward_model.ground_truth";
    let reward_model = match column(row, "reward_model") {
        Some(Field::Group(reward_model)) => reward_model,
        None | Some(Field::Null) => return Err(RowProblem::MissingField(FIELD)),
        Some(_) => return Err(RowProblem::WrongType { field: "reward_model", expected: "a struct holding ground_truth" }),
    };
    let answers = match column(reward_model, "ground_truth") {
        Some(Field::ListInternal(answers)) => answers,
        None | Some(Field::Null) => return Err(RowProblem::MissingField(FIELD)),
        Some(_) => return Err(RowProblem::WrongType { field: FIELD, expected: "a list of strings" }),
    };
    answers
        .elements()
        .iter()
        .map(|answer| match answer {
            Field::Str(s) => Ok(s.clone()),
            _ => Err(RowProblem::WrongType {
                field: FIELD,
                expected: "a list of strings",
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_the_raw_question() {
        let content = format!("Question: Who? \n{REFERENCE_INSTRUCTION}");
        assert_eq!(raw_question(&content), Ok("Who? "));
        let multiline = format!("Question: line 1\n\nline 2\n{REFERENCE_INSTRUCTION}");
        assert_eq!(raw_question(&multiline), Ok("line 1\n\nline 2"));
    }

    #[test]
    fn rejects_other_prompts() {
        assert_eq!(
            raw_question(&format!("Q: Who?\n{REFERENCE_INSTRUCTION}")),
            Err(RowProblem::PromptShape)
        );
        assert_eq!(
            raw_question("Question: Who?\nAnswer briefly."),
            Err(RowProblem::NoInstruction)
        );
        assert_eq!(
            raw_question(&format!("Question: Who?{REFERENCE_INSTRUCTION}")),
            Err(RowProblem::NoInstruction)
        );
    }
}

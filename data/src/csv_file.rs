//! CSV datasets: `id,data_source,question,answers`, `answers` a JSON array of strings.

use std::fs::File;
use std::path::Path;

use csv::{ByteRecord, ReaderBuilder, StringRecord};

use crate::error::{DataError, RowProblem};
use crate::example::Example;
use crate::load::{answers_from_json, RowSink};

/// Column positions in the header.
struct Columns {
    count: usize,
    id: Option<usize>,
    data_source: Option<usize>,
    question: usize,
    answers: usize,
}

impl Columns {
    fn find(header: &StringRecord, path: &Path) -> Result<Self, DataError> {
        // Where `column` is, if anywhere; a header naming it twice is an error (which copy to
        // read would be a guess).
        let position = |column: &'static str| {
            let mut at = header.iter().enumerate().filter(|(_, h)| h.trim() == column).map(|(i, _)| i);
            let first = at.next();
            match at.next() {
                None => Ok(first),
                Some(_) => Err(DataError::DuplicateColumn { path: path.to_path_buf(), column }),
            }
        };
        let (id, data_source, question, answers) = (position("id")?, position("data_source")?, position("question")?, position("answers")?);
        let required = |at: Option<usize>, column: &'static str| at.ok_or_else(|| DataError::MissingColumn { path: path.to_path_buf(), column });
        Ok(Self {
            count: header.len(),
            id,
            data_source,
            question: required(question, "question")?,
            answers: required(answers, "answers")?,
        })
    }
}

pub(crate) fn read(path: &Path, sink: &mut RowSink) -> Result<(), DataError> {
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let csv_error = |source| DataError::Csv {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = ReaderBuilder::new().flexible(true).from_reader(file);
    let columns = Columns::find(reader.headers().map_err(csv_error)?, path)?;
    let mut record = ByteRecord::new();
    let mut index = 0usize;
    while reader.read_byte_record(&mut record).map_err(csv_error)? {
        let line = record.position().map(|p| p.line());
        let example = parse_row(&record, &columns, index, sink);
        sink.push(index + 1, line, example)?;
        index += 1;
    }
    Ok(())
}

fn parse_row(
    record: &ByteRecord,
    columns: &Columns,
    index: usize,
    sink: &RowSink,
) -> Result<Example, RowProblem> {
    if record.len() != columns.count {
        let (expected, found) = (columns.count, record.len());
        return Err(if record.iter().any(|field| field.contains(&b'\n')) {
            RowProblem::FieldCountOverLines { expected, found }
        } else {
            RowProblem::FieldCount { expected, found }
        });
    }
    let field = |i: usize| std::str::from_utf8(&record[i]).map_err(|_| RowProblem::NotUtf8);
    let id = match columns.id {
        Some(i) => field(i)?.to_owned(),
        None => sink.default_id(index),
    };
    let data_source = match columns.data_source {
        Some(i) => field(i)?.to_owned(),
        None => sink.default_source().to_owned(),
    };
    let question = field(columns.question)?;
    let answers_json = field(columns.answers)?;
    let answers = serde_json::from_str(answers_json)
        .map_err(|e| RowProblem::AnswersNotJson(e.to_string()))
        .and_then(answers_from_json)?;
    Example::new(id, data_source, question, answers)
}

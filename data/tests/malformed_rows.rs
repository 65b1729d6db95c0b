//! Malformed rows are reported with their file and row, or skipped and counted.

use std::fs;
use std::path::{Path, PathBuf};

use prompt_r1_data::{load, DataError, OnBadRow, RowProblem};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    path
}

/// The bad row of a failed load.
fn bad_row(
    result: Result<prompt_r1_data::Dataset, DataError>,
) -> (usize, Option<u64>, RowProblem, String) {
    match result {
        Err(DataError::BadRow(bad)) => {
            let message = bad.to_string();
            (bad.row, bad.line, bad.problem, message)
        }
        Err(other) => panic!("expected a bad row, got: {other}"),
        Ok(_) => panic!("expected a bad row, the load succeeded"),
    }
}

#[test]
fn csv_bad_answers_json_names_file_row_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "set.csv",
        "id,data_source,question,answers\n\
         a,s,\"multi\nline\",\"[\"\"x\"\"]\"\n\
         b,s,q2,\"[\"\"x\"\"\"\n",
    );
    let (row, line, problem, message) = bad_row(load(&path, OnBadRow::Fail));
    assert_eq!((row, line), (2, Some(4)));
    assert!(matches!(problem, RowProblem::AnswersNotJson(_)));
    assert!(
        message.contains("set.csv: row 2 (line 4): `answers` is not valid JSON"),
        "{message}"
    );
}

#[test]
fn csv_short_row_and_empty_question() {
    let dir = tempfile::tempdir().unwrap();
    let short = write(
        dir.path(),
        "short.csv",
        "id,data_source,question,answers\na,s,q\n",
    );
    let (row, _, problem, _) = bad_row(load(&short, OnBadRow::Fail));
    assert_eq!(row, 1);
    assert_eq!(
        problem,
        RowProblem::FieldCount {
            expected: 4,
            found: 3
        }
    );

    // A quote left open runs the row on over the next lines.
    let open = write(dir.path(), "open.csv", "id,data_source,question,answers\na,s,\"open question,[1]\nb,s,q2,[2]\n");
    let (row, _, problem, message) = bad_row(load(&open, OnBadRow::Fail));
    assert_eq!((row, problem), (1, RowProblem::FieldCountOverLines { expected: 4, found: 3 }));
    assert!(message.contains("is a quote left open?"), "{message}");

    let empty = write(
        dir.path(),
        "empty.csv",
        "question,answers\n\"  \",\"[\"\"x\"\"]\"\n",
    );
    let (_, _, problem, _) = bad_row(load(&empty, OnBadRow::Fail));
    assert_eq!(problem, RowProblem::EmptyQuestion);
}

#[test]
fn csv_without_a_required_column_fails_whatever_the_policy() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "noanswers.csv", "id,question\na,q\n");
    let err = load(&path, OnBadRow::Skip).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::MissingColumn {
                column: "answers",
                ..
            }
        ),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("noanswers.csv: missing column `answers`"));
}

/// A header naming a column twice is refused, naming it, rather than read from its first copy.
#[test]
fn csv_with_a_column_named_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "twice.csv", "question,answers,question\nq,\"[\"\"a\"\"]\",r\n");
    let err = load(&path, OnBadRow::Skip).unwrap_err();
    assert!(matches!(err, DataError::DuplicateColumn { column: "question", .. }), "{err}");
    assert!(err.to_string().contains("twice.csv: the header has more than one `question` column"), "{err}");
}

#[test]
fn csv_optional_columns_default_from_the_file_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "mine.csv",
        "question,answers\nq0,\"[\"\"a\"\"]\"\nq1,\"[\"\"b\"\", \"\"c\"\"]\"\n",
    );
    let dataset = load(&path, OnBadRow::Fail).unwrap();
    let ids: Vec<&str> = dataset.examples().iter().map(|e| e.id()).collect();
    assert_eq!(ids, ["mine-0", "mine-1"]);
    assert_eq!(dataset.examples()[1].data_source(), "mine");
    assert_eq!(
        dataset.examples()[1].answers(),
        ["b".to_string(), "c".to_string()]
    );
}

#[test]
fn skip_counts_bad_rows_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "mixed.jsonl",
        "{\"question\": \"q1\", \"answers\": [\"a\"]}\n\
         \n\
         {\"question\": \"q2\", \"answers\": \"a\"}\n\
         not json\n\
         {\"answers\": [\"a\"]}\n\
         {\"question\": \"q3\", \"answers\": [], \"extra\": 1}\n\
         {\"id\": \"x\", \"data_source\": \"d\", \"question\": \"q4\", \"answers\": [\"b\"], \"extra\": 1}\n",
    );
    let dataset = load(&path, OnBadRow::Skip).unwrap();
    let questions: Vec<&str> = dataset.examples().iter().map(|e| e.question()).collect();
    assert_eq!(questions, ["q1", "q4"]);
    // JSONL rows are numbered by line (the blank line 2 counts as a line).
    let skipped: Vec<(usize, &RowProblem)> = dataset
        .skipped()
        .iter()
        .map(|b| (b.row, &b.problem))
        .collect();
    assert_eq!(skipped.len(), 4);
    assert_eq!(skipped[0].0, 3);
    assert!(matches!(
        skipped[0].1,
        RowProblem::WrongType {
            field: "answers",
            ..
        }
    ));
    assert!(matches!(skipped[1], (4, RowProblem::NotJsonObject(_))));
    assert_eq!(skipped[2], (5, &RowProblem::MissingField("question")));
    assert_eq!(skipped[3], (6, &RowProblem::NoAnswers));
    assert_eq!(dataset.examples()[1].id(), "x");
    assert_eq!(dataset.examples()[0].id(), "mixed-0");

    let (row, _, _, message) = bad_row(load(&path, OnBadRow::Fail));
    assert_eq!(row, 3);
    assert!(message.contains("mixed.jsonl: row 3:"), "{message}");
}

#[test]
fn parquet_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "broken.parquet", "not a parquet file");
    let err = load(&path, OnBadRow::Fail).unwrap_err();
    assert!(matches!(err, DataError::Parquet { .. }), "{err}");
    assert!(err.to_string().contains("broken.parquet"));
    let missing = load(&dir.path().join("absent.csv"), OnBadRow::Fail).unwrap_err();
    assert!(matches!(missing, DataError::Io { .. }), "{missing}");
    assert!(missing.to_string().contains("absent.csv"));
}

/// JSONL as other tools write it: a byte order mark before the first line, integer ids.
#[test]
fn jsonl_with_a_byte_order_mark_and_integer_ids() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "bom.jsonl",
        "\u{feff}{\"id\": 7, \"question\": \"q1\", \"answers\": [\"a\"]}\n{\"id\": \"x\", \"question\": \"q2\", \"answers\": [\"b\"]}\n",
    );
    let dataset = load(&path, OnBadRow::Fail).unwrap();
    let ids: Vec<&str> = dataset.examples().iter().map(|e| e.id()).collect();
    assert_eq!(ids, ["7", "x"]);
    assert_eq!(dataset.examples()[0].question(), "q1");
    let bad = write(dir.path(), "float.jsonl", "{\"id\": 1.5, \"question\": \"q\", \"answers\": [\"a\"]}\n");
    let err = load(&bad, OnBadRow::Fail).unwrap_err().to_string();
    assert!(err.contains("float.jsonl") && err.contains("`id`"), "{err}");
}

//! Malformed rows of a verl parquet file (written here with the same nested schema as the
//! reference files) are reported with their row number.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use parquet::basic::{Compression, GzipLevel};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use prompt_r1_data::{load, DataError, OnBadRow, RowProblem};

const INSTRUCTION: &str = include_str!("../../assets/prompts/instruction.txt");

const VERL_SCHEMA: &str = "
message schema {
  optional binary data_source (STRING);
  optional group prompt (LIST) {
    repeated group list {
      optional group element {
        optional binary content (STRING);
        optional binary role (STRING);
      }
    }
  }
  optional group reward_model {
    optional group ground_truth (LIST) {
      repeated group list {
        optional binary element (STRING);
      }
    }
  }
}";

/// Writes one row per `(prompt content, answer)`, each with one user message and one answer.
fn write_verl(path: &Path, rows: &[(&str, &str)], schema: &str) {
    write_verl_compressed(path, rows, schema, Compression::UNCOMPRESSED);
}

/// [`write_verl`] with the columns compressed by `compression`.
fn write_verl_compressed(path: &Path, rows: &[(&str, &str)], schema: &str, compression: Compression) {
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(compression).build());
    let mut writer = SerializedFileWriter::new(File::create(path).unwrap(), schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let n = rows.len();
    let bytes = |texts: Vec<&str>| texts.into_iter().map(ByteArray::from).collect::<Vec<_>>();
    // (values, max definition level) of each leaf column, in schema order.
    let leaves: Vec<(Vec<ByteArray>, i16)> = vec![
        (bytes(vec!["src"; n]), 1),
        (bytes(rows.iter().map(|r| r.0).collect()), 4),
        (bytes(vec!["user"; n]), 4),
        (bytes(rows.iter().map(|r| r.1).collect()), 4),
    ];
    let mut leaves = leaves.into_iter();
    while let Some(mut column) = group.next_column().unwrap() {
        let (values, max_def) = leaves.next().unwrap();
        let definitions = vec![max_def; n];
        let repetitions = vec![0i16; n];
        let repetitions = (max_def > 1).then_some(repetitions.as_slice());
        column
            .typed::<ByteArrayType>()
            .write_batch(&values, Some(&definitions), repetitions)
            .unwrap();
        column.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn good_and_bad_rows_of_a_verl_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mine.parquet");
    let good = format!("Question: Who wrote it?\n{INSTRUCTION}");
    let blank = format!("Question:  \n{INSTRUCTION}");
    write_verl(
        &path,
        &[
            (&good, "Me"),
            ("Who wrote it?", "Me"),
            (&blank, "Me"),
            ("Question: Who?\nAnswer briefly.", "Me"),
        ],
        VERL_SCHEMA,
    );
    let dataset = load(&path, OnBadRow::Skip).unwrap();
    assert_eq!(dataset.len(), 1);
    let example = &dataset.examples()[0];
    assert_eq!(
        (example.id(), example.data_source(), example.question()),
        ("mine-0", "src", "Who wrote it?")
    );
    assert_eq!(example.answers(), ["Me".to_string()]);
    let skipped: Vec<(usize, &RowProblem)> = dataset
        .skipped()
        .iter()
        .map(|b| (b.row, &b.problem))
        .collect();
    assert_eq!(
        skipped,
        [
            (2, &RowProblem::PromptShape),
            (3, &RowProblem::EmptyQuestion),
            (4, &RowProblem::NoInstruction)
        ]
    );
    let err = load(&path, OnBadRow::Fail).unwrap_err();
    assert!(err.to_string().contains("mine.parquet: row 2:"), "{err}");
}

#[test]
fn a_file_without_the_verl_columns_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("partial.parquet");
    let schema = "message schema { optional binary data_source (STRING); }";
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().build());
    let writer = SerializedFileWriter::new(File::create(&path).unwrap(), schema, props).unwrap();
    writer.close().unwrap();
    let err = load(&path, OnBadRow::Skip).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::MissingColumn {
                column: "prompt",
                ..
            }
        ),
        "{err}"
    );
}

/// Snappy, gzip and LZ4 (pure-Rust crates) are read; a zstd file (polars' default; its crate
/// wraps the C library) is refused by name, with how to write it again, before any row is read.
#[test]
fn compressed_files_are_read_or_refused_by_codec() {
    let dir = tempfile::tempdir().unwrap();
    let good = format!("Question: Who wrote it?\n{INSTRUCTION}");
    for (name, compression) in [("snappy", Compression::SNAPPY), ("gzip", Compression::GZIP(GzipLevel::default())), ("lz4", Compression::LZ4), ("lz4 raw", Compression::LZ4_RAW)] {
        let path = dir.path().join(format!("{name}.parquet"));
        write_verl_compressed(&path, &[(&good, "Me")], VERL_SCHEMA, compression);
        let dataset = load(&path, OnBadRow::Fail).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(dataset.examples()[0].question(), "Who wrote it?", "{name}");
    }
    let zstd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/parquet/verl-zstd.parquet");
    let err = load(&zstd, OnBadRow::Skip).unwrap_err();
    assert!(matches!(&err, DataError::UnsupportedCompression { codec, .. } if codec == "zstd"), "{err}");
    assert!(err.to_string().contains("verl-zstd.parquet") && err.to_string().contains("compression=\"snappy\""), "{err}");
}

/// A column of the wrong type is named as such, not reported missing.
#[test]
fn a_column_of_the_wrong_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flat.parquet");
    let schema = "message schema {
      optional binary data_source (STRING);
      optional binary prompt (STRING);
      optional group reward_model { optional binary ground_truth (STRING); }
    }";
    let schema = Arc::new(parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(File::create(&path).unwrap(), schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for max_def in [1i16, 1, 2] {
        let mut column = group.next_column().unwrap().unwrap();
        column.typed::<ByteArrayType>().write_batch(&[ByteArray::from("x")], Some(&[max_def]), None).unwrap();
        column.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
    let dataset = load(&path, OnBadRow::Skip).unwrap();
    assert_eq!(dataset.skipped()[0].problem, RowProblem::WrongType { field: "prompt", expected: "a list of messages" });
}

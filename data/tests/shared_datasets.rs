//! The reference datasets in `../shared/data/prompt-r1/` load with the right row counts, and
//! the parquet and CSV versions hold the same questions and answers.

use std::path::{Path, PathBuf};

use prompt_r1_data::{load, OnBadRow};

const EVAL_SETS: [&str; 12] = [
    "2WikiMultihopQA",
    "BookSum",
    "DAPO-Math",
    "MathQA_ood",
    "MusiQue",
    "PopQA",
    "WritingPrompts",
    "Xsum_ood",
    "gsm8k",
    "hotpot",
    "squad_v2_ood",
    "triviaqa_ood",
];

/// `<workspace>/../shared/data/prompt-r1`, or `None` (with the reason printed) when absent
/// outside CI.
fn data_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/prompt-r1");
    if dir.is_dir() {
        return Some(dir);
    }
    assert_ne!(
        std::env::var("CI").as_deref(),
        Ok("true"),
        "{} is missing in CI",
        dir.display()
    );
    eprintln!("skipping: {} not found", dir.display());
    None
}

/// (relative path without extension, expected rows) of all 13 files.
fn all_files() -> Vec<(String, usize)> {
    EVAL_SETS
        .iter()
        .map(|name| (format!("eval_data/{name}"), 128))
        .chain([("train_data/validation".to_string(), 2048)])
        .collect()
}

#[test]
fn every_csv_and_parquet_file_loads_with_its_row_count() {
    let Some(dir) = data_dir() else { return };
    for (name, rows) in all_files() {
        for format in ["csv", "parquet"] {
            let path = dir.join(format).join(format!("{name}.{format}"));
            let dataset = load(&path, OnBadRow::Fail).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(dataset.len(), rows, "{}", path.display());
            assert!(dataset.skipped().is_empty());
        }
    }
}

#[test]
fn parquet_and_csv_give_the_same_examples() {
    let Some(dir) = data_dir() else { return };
    for (name, _) in all_files() {
        let csv = load(&dir.join(format!("csv/{name}.csv")), OnBadRow::Fail).unwrap();
        let parquet = load(&dir.join(format!("parquet/{name}.parquet")), OnBadRow::Fail).unwrap();
        for (c, p) in csv.examples().iter().zip(parquet.examples()) {
            assert_eq!(c.question(), p.question(), "{name} {}", c.id());
            assert_eq!(c.answers(), p.answers(), "{name} {}", c.id());
            assert_eq!(c.data_source(), p.data_source(), "{name} {}", c.id());
            // Parquet has no id column; the default id follows the CSV's naming.
            assert_eq!(c.id(), p.id());
        }
    }
}

#[test]
fn known_rows_read_back_verbatim() {
    let Some(dir) = data_dir() else { return };
    let hotpot = load(
        &dir.join("parquet/eval_data/hotpot.parquet"),
        OnBadRow::Fail,
    )
    .unwrap();
    let first = &hotpot.examples()[0];
    assert_eq!(first.id(), "hotpot-0");
    assert_eq!(first.data_source(), "hotpot-256-test");
    assert!(first
        .question()
        .starts_with("Which virus that causes respiratory problems"));
    assert_eq!(first.answers(), ["SARS coronavirus".to_string()]);
    // CSV quoting: an answer with escaped quotes.
    let csv = load(&dir.join("csv/eval_data/hotpot.csv"), OnBadRow::Fail).unwrap();
    assert_eq!(
        csv.examples()[3].answers(),
        ["Daniel Paul \"Dan\" Futterman".to_string()]
    );
    // The training set's multi-line questions survive both formats.
    let validation = load(
        &dir.join("parquet/train_data/validation.parquet"),
        OnBadRow::Fail,
    )
    .unwrap();
    assert!(validation.examples()[0].question().contains("\n\n"));
    assert!(validation.examples().iter().any(|e| e.answers().len() > 1));
}

//! Question/answer datasets of Prompt-R1.
//!
//! - [`load`] reads a CSV, JSONL or verl parquet file into a [`Dataset`] of [`Example`]s;
//!   malformed rows stop the load or are skipped and counted ([`OnBadRow`]).
//! - [`BatchSampler`] draws seeded, shuffled batches epoch after epoch; its [`Cursor`] is
//!   serialisable so that training resumes mid-epoch exactly.
//! - [`superseded_rows`] and [`prediction_key`]: of an eval's predictions rows for one example,
//!   the last counts.

#![forbid(unsafe_code)]

mod csv_file;
mod error;
mod example;
mod jsonl_file;
mod latest;
mod load;
mod parquet_file;
mod sampler;
mod shuffle;
mod text;

pub use error::{BadRow, DataError, RowProblem};
pub use example::Example;
pub use latest::{prediction_key, superseded_rows};
pub use load::{load, Dataset, OnBadRow};
pub use sampler::{Batch, BatchSampler, Cursor, SamplerConfig, SamplerError};
pub use text::read_text;

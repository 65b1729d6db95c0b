//! The metrics of the final rows: EM, SM, F1 and, with a sentence model, SSim.

use std::path::Path;

use anyhow::{Context, Result};
use burn::tensor::backend::Backend;
use rewards::metrics::{ExampleMetrics, MetricsReport};
use rewards::ssim::SentenceEncoder;

use super::predictions::Row;
use crate::device::{run_on, DeviceChoice, OnBackend};

/// The report over `rows`; SSim when `ssim_model` is given.
pub fn report(
    rows: &[&Row],
    ssim_model: Option<&Path>,
    device: DeviceChoice,
) -> Result<MetricsReport> {
    let examples = match ssim_model {
        None => rows
            .iter()
            .map(|row| {
                (
                    row.data_source.clone(),
                    ExampleMetrics::text(&row.prediction, &row.answers),
                )
            })
            .collect(),
        Some(dir) => run_on(device, WithSsim { dir, rows })?,
    };
    Ok(MetricsReport::from_examples(examples))
}

/// Loads the SSim model in `dir` once, so that a wrong `--ssim-model` fails before the questions
/// are run, not after.
pub fn check_ssim_model(dir: &Path) -> Result<()> {
    SentenceEncoder::<burn::backend::Flex>::load(dir, &Default::default())
        .map(drop)
        .with_context(|| format!("cannot load the SSim model from {}", dir.display()))
}

struct WithSsim<'a> {
    dir: &'a Path,
    rows: &'a [&'a Row],
}

impl OnBackend for WithSsim<'_> {
    type Output = Vec<(String, ExampleMetrics)>;

    fn run<B: Backend>(self, device: B::Device) -> Result<Self::Output> {
        let encoder = SentenceEncoder::<B>::load(self.dir, &device)
            .with_context(|| format!("cannot load the SSim model from {}", self.dir.display()))?;
        self.rows
            .iter()
            .map(|row| {
                let metrics =
                    ExampleMetrics::with_similarity(&row.prediction, &row.answers, &encoder)
                        .with_context(|| format!("SSim of {} {}", row.data_source, row.id))?;
                Ok((row.data_source.clone(), metrics))
            })
            .collect()
    }
}

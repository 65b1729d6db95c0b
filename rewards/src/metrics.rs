//! Evaluation metrics of predictions (EM, SM, F1 and optional SSim) and their aggregation
//! per data source, as the paper's tables report them (means ×100).

mod report;

pub use report::{MetricsReport, MetricsRow};

use crate::answer::AnswerScores;
use crate::normalize::normalize_answer;

/// A sentence-similarity model for the SSim metric.
pub trait Similarity {
    /// Why a similarity could not be computed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The highest similarity of `prediction` to any of `references`, in `[-1, 1]`.
    ///
    /// Only called with a non-empty prediction and at least one reference.
    fn max_similarity(&self, prediction: &str, references: &[String]) -> Result<f32, Self::Error>;
}

/// Per-example metrics, each in `[0, 1]`; `ssim` is `None` when no similarity model is used.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ExampleMetrics {
    /// Exact match, max over references.
    pub em: f64,
    /// Substring match, max over references.
    pub sm: f64,
    /// Token F1, max over references.
    pub f1: f64,
    /// Sentence similarity, max over references.
    pub ssim: Option<f64>,
}

impl ExampleMetrics {
    /// EM, SM and F1 of `prediction`; no SSim.
    pub fn text(prediction: &str, references: &[String]) -> Self {
        let AnswerScores { em, sm, f1 } = AnswerScores::best(prediction, references);
        Self {
            em,
            sm,
            f1,
            ssim: None,
        }
    }

    /// EM, SM, F1 and SSim of `prediction`.
    ///
    /// A prediction whose normal form is empty scores 0 on every metric, SSim included,
    /// without calling the model (the reference script scores it 1.0); so does an example
    /// without references.
    pub fn with_similarity<S: Similarity + ?Sized>(
        prediction: &str,
        references: &[String],
        similarity: &S,
    ) -> Result<Self, S::Error> {
        let text = Self::text(prediction, references);
        let ssim = if normalize_answer(prediction).is_empty() || references.is_empty() {
            0.0
        } else {
            f64::from(similarity.max_similarity(prediction, references)?)
        };
        Ok(Self {
            ssim: Some(ssim),
            ..text
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::fmt;

    #[derive(Debug)]
    struct Never;
    impl fmt::Display for Never {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("never")
        }
    }
    impl std::error::Error for Never {}

    /// Similarity = 1 when the prediction equals a reference, else 0.25; counts its calls.
    struct Equal {
        calls: Cell<usize>,
    }
    impl Similarity for Equal {
        type Error = Never;
        fn max_similarity(&self, prediction: &str, references: &[String]) -> Result<f32, Never> {
            self.calls.set(self.calls.get() + 1);
            Ok(if references.iter().any(|r| r == prediction) {
                1.0
            } else {
                0.25
            })
        }
    }

    fn refs(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn text_metrics_have_no_ssim() {
        let m = ExampleMetrics::text("Paris", &refs(&["paris"]));
        assert_eq!((m.em, m.sm, m.f1, m.ssim), (1.0, 1.0, 1.0, None));
    }

    #[test]
    fn ssim_comes_from_the_model() {
        let model = Equal {
            calls: Cell::new(0),
        };
        let m = ExampleMetrics::with_similarity("Rome", &refs(&["Paris", "Rome"]), &model).unwrap();
        assert_eq!(m.ssim, Some(1.0));
        let m = ExampleMetrics::with_similarity("Oslo", &refs(&["Paris"]), &model).unwrap();
        assert_eq!(m.ssim, Some(0.25));
        assert_eq!(model.calls.get(), 2);
    }

    #[test]
    fn empty_prediction_gets_zero_ssim_without_calling_the_model() {
        let model = Equal {
            calls: Cell::new(0),
        };
        for prediction in ["", "  ", "the ."] {
            let m = ExampleMetrics::with_similarity(prediction, &refs(&[""]), &model).unwrap();
            assert_eq!(
                m,
                ExampleMetrics {
                    ssim: Some(0.0),
                    ..Default::default()
                }
            );
        }
        let m = ExampleMetrics::with_similarity("x", &[], &model).unwrap();
        assert_eq!(m.ssim, Some(0.0));
        assert_eq!(model.calls.get(), 0);
    }
}

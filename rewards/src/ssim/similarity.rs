//! The SSim metric: [`Similarity`] for [`SentenceEncoder`].

use burn::tensor::backend::Backend;

use super::encoder::{cosine, SentenceEncoder};
use super::error::SsimError;
use crate::metrics::Similarity;

impl<B: Backend> Similarity for SentenceEncoder<B> {
    type Error = SsimError;

    /// Highest cosine similarity of `prediction` to any reference, all embedded in one batch.
    /// A blank prediction, or no reference, scores 0 (the reference script gives 1.0 to an
    /// empty prediction).
    fn max_similarity(&self, prediction: &str, references: &[String]) -> Result<f32, SsimError> {
        if prediction.trim().is_empty() || references.is_empty() {
            return Ok(0.0);
        }
        let texts: Vec<&str> = std::iter::once(prediction)
            .chain(references.iter().map(String::as_str))
            .collect();
        let embeddings = self.embed(&texts)?;
        let Some((prediction, references)) = embeddings.split_first() else {
            return Ok(0.0);
        };
        Ok(references
            .iter()
            .map(|reference| cosine(prediction, reference))
            .fold(f32::NEG_INFINITY, f32::max))
    }
}

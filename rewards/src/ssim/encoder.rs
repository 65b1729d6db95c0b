//! `SentenceEncoder`: all-MiniLM-L6-v2 sentence embeddings (mean pooling, L2 normalised).

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::bert::BertModel;
use super::config::BertConfig;
use super::error::SsimError;
use super::tokenize::{PaddedBatch, WordPiece};
use super::weights::WeightReader;

/// Longest input in tokens, `[CLS]` and `[SEP]` included (sentence-transformers' `max_seq_length`).
pub const MAX_TOKENS: usize = 256;

/// Texts embedded per forward pass; texts are grouped by length to keep padding small.
const BATCH_SIZE: usize = 32;

/// Floor of the token count in mean pooling, as sentence-transformers.
const MIN_TOKEN_COUNT: f32 = 1e-9;

/// Floor of the norm in L2 normalisation, as `torch.nn.functional.normalize`.
const MIN_NORM: f32 = 1e-12;

/// A BERT sentence encoder loaded from a sentence-transformers model folder.
pub struct SentenceEncoder<B: Backend> {
    tokenizer: WordPiece,
    model: BertModel<B>,
    hidden_size: usize,
    device: B::Device,
}

impl<B: Backend> SentenceEncoder<B> {
    /// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir`.
    pub fn load(dir: &Path, device: &B::Device) -> Result<Self, SsimError> {
        let config = BertConfig::load(&dir.join("config.json"))?;
        let max_tokens = MAX_TOKENS.min(config.max_position_embeddings);
        let tokenizer = WordPiece::load(&dir.join("tokenizer.json"), max_tokens)?;
        let weights = WeightReader::open(dir)?;
        let model = BertModel::load(&weights, &config, device)?;
        Ok(Self {
            tokenizer,
            model,
            hidden_size: config.hidden_size,
            device: device.clone(),
        })
    }

    /// Width of the embeddings (384 for MiniLM).
    pub fn dim(&self) -> usize {
        self.hidden_size
    }

    /// Token ids of `text` as the encoder sees them (`[CLS] ... [SEP]`, truncated).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, SsimError> {
        self.tokenizer.encode(text)
    }

    /// One L2-normalised embedding per text, in the order of `texts`.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, SsimError> {
        let ids = texts
            .iter()
            .map(|text| self.tokenizer.encode(text))
            .collect::<Result<Vec<_>, _>>()?;
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| ids[i].len());
        let mut embeddings = vec![Vec::new(); texts.len()];
        for chunk in order.chunks(BATCH_SIZE) {
            let sequences: Vec<&[u32]> = chunk.iter().map(|&i| ids[i].as_slice()).collect();
            let batch = self.embed_batch(&PaddedBatch::new(&sequences))?;
            for (&i, embedding) in chunk.iter().zip(batch) {
                embeddings[i] = embedding;
            }
        }
        Ok(embeddings)
    }

    /// Cosine similarity of the embeddings of `a` and `b`.
    pub fn similarity(&self, a: &str, b: &str) -> Result<f32, SsimError> {
        let embeddings = self.embed(&[a, b])?;
        Ok(cosine(&embeddings[0], &embeddings[1]))
    }

    fn embed_batch(&self, batch: &PaddedBatch) -> Result<Vec<Vec<f32>>, SsimError> {
        let shape = [batch.batch, batch.seq];
        let input_ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(batch.input_ids.clone(), shape),
            &self.device,
        );
        let mask = Tensor::<B, 2, Int>::from_data(
            TensorData::new(batch.attention_mask.clone(), shape),
            &self.device,
        );
        let hidden = self.model.forward(input_ids, mask.clone().equal_elem(0));
        let embeddings = l2_normalise(mean_pool(hidden, mask.float()));
        let values = embeddings
            .try_into_data()
            .map_err(|err| SsimError::Readback {
                reason: format!("{err:?}"),
            })?
            .convert::<f32>()
            .to_vec::<f32>()
            .map_err(|err| SsimError::Readback {
                reason: format!("{err:?}"),
            })?;
        Ok(values
            .chunks_exact(self.hidden_size)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

/// Mean of `hidden` `[batch, seq, width]` over the positions where `mask` `[batch, seq]` is 1.
fn mean_pool<B: Backend>(hidden: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 2> {
    let [batch, _, width] = hidden.dims();
    let counts = mask
        .clone()
        .sum_dim(1)
        .clamp_min(MIN_TOKEN_COUNT)
        .unsqueeze_dim::<3>(2);
    let sums = (hidden * mask.unsqueeze_dim::<3>(2)).sum_dim(1);
    (sums / counts).reshape([batch, width])
}

/// Divides every row of `x` `[batch, width]` by its L2 norm.
fn l2_normalise<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let norms = x
        .clone()
        .powi_scalar(2)
        .sum_dim(1)
        .sqrt()
        .clamp_min(MIN_NORM);
    x / norms
}

/// Cosine similarity of two vectors; 0 when either is all zeros.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm_a = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let norm_b = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm_a == 0.0 || norm_b == 0.0 {
        0.0
    } else {
        dot / (norm_a * norm_b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn::backend::Flex;

    fn values<const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
        x.into_data().convert::<f32>().to_vec::<f32>().unwrap()
    }

    #[test]
    fn mean_pool_ignores_padding() {
        let device = Default::default();
        let hidden = Tensor::<B, 3>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 100.0, 100.0], [1, 3, 2]),
            &device,
        );
        let mask = Tensor::<B, 2>::from_data([[1.0, 1.0, 0.0]], &device);
        assert_eq!(values(mean_pool(hidden, mask)), vec![2.0, 3.0]);
    }

    #[test]
    fn l2_normalise_gives_unit_rows_and_keeps_zero_rows() {
        let device = Default::default();
        let x = Tensor::<B, 2>::from_data([[3.0, 4.0], [0.0, 0.0]], &device);
        assert_eq!(values(l2_normalise(x)), vec![0.6, 0.8, 0.0, 0.0]);
    }

    #[test]
    fn cosine_of_known_vectors() {
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert_eq!(cosine(&[1.0, 2.0], &[-1.0, -2.0]), -1.0);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 2.0]), 0.0);
    }
}

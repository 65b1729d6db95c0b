//! SSim: sentence similarity with all-MiniLM-L6-v2 (BERT encoder in burn).
//!
//! [`SentenceEncoder`] loads a sentence-transformers folder (`config.json`, `tokenizer.json`,
//! `model.safetensors`), embeds texts (WordPiece, BERT, mean pooling over the attention mask,
//! L2 normalisation, at most [`MAX_TOKENS`] tokens) and compares them by cosine similarity.
//! It implements [`crate::metrics::Similarity`], the SSim column of the metrics.

mod bert;
mod config;
mod encoder;
mod error;
mod layers;
mod similarity;
mod tokenize;
mod weights;

pub use config::BertConfig;
pub use encoder::{cosine, SentenceEncoder, MAX_TOKENS};
pub use error::SsimError;

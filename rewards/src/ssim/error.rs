//! Errors of the SSim sentence encoder.

use std::path::PathBuf;

/// Everything that can go wrong loading or running the sentence encoder.
#[derive(Debug, thiserror::Error)]
pub enum SsimError {
    /// A model file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON or lacks a field.
    #[error("invalid model config {path}: {source}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// `config.json` describes a model this encoder does not implement.
    #[error("unsupported model config {path}: {reason}")]
    UnsupportedConfig {
        /// The config file.
        path: PathBuf,
        /// What is unsupported.
        reason: String,
    },
    /// `model.safetensors` cannot be read, or lacks a tensor of the shape the config implies
    /// (the error names the file and the tensor).
    #[error(transparent)]
    Weights(#[from] model::ModelError),
    /// `tokenizer.json` could not be loaded or configured.
    #[error("cannot load tokenizer {path}: {reason}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizers crate's message.
        reason: String,
    },
    /// A text could not be tokenized.
    #[error("cannot tokenize {text:?}: {reason}")]
    Encode {
        /// The start of the text.
        text: String,
        /// The tokenizers crate's message.
        reason: String,
    },
    /// The backend returned embeddings that could not be read back as f32.
    #[error("cannot read embeddings back from the backend: {reason}")]
    Readback {
        /// The backend's message.
        reason: String,
    },
}

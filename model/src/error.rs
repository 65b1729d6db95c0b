//! The model crate's error type: every variant names the file, tensor or key at fault.

use std::path::PathBuf;

/// Errors from loading configs and checkpoints, and from invalid model inputs.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: bad config: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{path}: not a valid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("{path}: bad shard index: {reason}")]
    ShardIndex { path: PathBuf, reason: String },
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("checkpoint {dir}: tensor \"{name}\" is missing")]
    MissingTensor { dir: PathBuf, name: String },
    #[error(
        "checkpoint {dir}: {count} tensor(s) that its config.json ({layers} layers) does not use, e.g. {examples}: \
         do the config and the weights belong together?"
    )]
    UnusedTensors {
        dir: PathBuf,
        count: usize,
        layers: usize,
        examples: String,
    },
    #[error("{path}: tensor \"{name}\" has shape {found:?}, the config expects {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: tensor \"{name}\" has dtype {dtype}, expected F32, BF16 or F16")]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error(
        "{path}: tensor \"{name}\" holds {count} non-finite value(s), the first ({value}) at flat index {index}: \
         the file is damaged or the run that wrote it diverged"
    )]
    NonFinite {
        path: PathBuf,
        name: String,
        count: usize,
        index: usize,
        value: &'static str,
    },
    #[error(
        "{path} holds {tokens} tokens, more than the model's vocabulary of {vocab_size} (vocab_size in config.json): \
         the tokenizer and the model do not belong together"
    )]
    TokenizerMismatch { path: PathBuf, tokens: usize, vocab_size: usize },
    #[error("invalid input: {0}")]
    Input(String),
    /// The weights alone take more memory than the machine they would be loaded into has.
    #[error(
        "the weights take {needed_gib:.1} GiB as {dtype:?}, more than this machine's {ram_gib:.1} GiB of memory{}",
        if *dtype == burn::tensor::DType::F32 { " (bf16 takes half)" } else { "" }
    )]
    TooLarge { needed_gib: f64, dtype: burn::tensor::DType, ram_gib: f64 },
    #[error("the device failed: {0}")]
    Device(String),
}

/// A setting out of range or not supported (a key of `config.json`, of `[lora]`, of a model's
/// [`crate::Compute`], or of a run's configuration); the message names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SettingError(pub String);

impl From<&str> for SettingError {
    fn from(message: &str) -> Self {
        Self(message.to_owned())
    }
}

impl From<String> for SettingError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

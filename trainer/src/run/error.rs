//! Errors of a training run.

use std::path::PathBuf;

/// Why a run could not start, step, save or resume.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{0}")]
    Invalid(String),
    /// A setting out of range; the message names the key.
    #[error(transparent)]
    Setting(#[from] model::SettingError),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] model::tokenizer::TokenizerError),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Sampler(#[from] data::SamplerError),
    #[error(transparent)]
    Grpo(#[from] crate::grpo::GrpoError),
    #[error(transparent)]
    Optim(#[from] crate::optim::OptimError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    /// A checkpoint of another kind of run than the configuration's (a whole model against
    /// `[lora]`, other adapters): the run's settings, not the checkpoint, are at fault.
    #[error("checkpoint {path}: {reason}")]
    Mismatch { path: PathBuf, reason: String },
    /// The checkpoint a run resumes from did not load; `hint` says how to resume from another.
    #[error("{error}; {hint}")]
    Resume { error: Box<TrainError>, hint: String },
    #[error("every episode of step {step} failed, in the environment or in the agent's generation (first error: {first})")]
    AllEpisodesFailed { step: u64, first: String },
    /// The rollout workers of `engine = "servers"` failed: none is left for a rollout, or none
    /// took the new policy.
    #[error("rollout servers: {0}")]
    Servers(String),
    /// The device reported a failure of work already queued (a GPU backend's execution error).
    #[error("the device failed: {0}")]
    Device(String),
}

impl TrainError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}

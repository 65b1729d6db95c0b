//! The optimiser's error type.

/// An optimiser setting out of range.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("invalid optimizer setting: {0}")]
    Config(String),
}

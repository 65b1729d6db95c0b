//! A training run: its TOML configuration, the GRPO step over rollouts against an environment,
//! validation, metrics, and checkpoints that resume exactly. The run's directory, its start or
//! resume, `metrics.jsonl` and the checkpoint cadence are a `session`, which SFT runs share.

mod base_model;
pub(crate) mod checkpoint;
pub(crate) mod config;
mod dynamic_sampling;
mod error;
pub(crate) mod learner;
mod memory;
pub(crate) mod metrics_log;
mod reward;
pub(crate) mod session;
mod trainer;
mod validation;

pub use base_model::{fingerprint_of, BaseModel};
pub use checkpoint::{checkpoint_at, latest_checkpoint, list_checkpoints, recorded_base_model, SetAside, BASE_MODEL_FILE, CHECKPOINTS_DIR, LATEST_FILE};
pub use config::{
    DataSection, EpisodeSection, InferenceDtype, ModelDtype, RolloutEngineKind, RolloutSection, RunSection, TrainConfig,
};
pub use error::TrainError;
pub(crate) use memory::gib;
pub use memory::{
    end_device_phase, peak_rss_mb, release_unused_device_memory, reset_peak_rss, total_ram_bytes, DeviceMemory,
    DeviceMemoryProbe,
};
pub use metrics_log::{read_metrics, StepRecord, METRICS_FILE};
pub use reward::{EpisodeScore, EpisodeScorer, PromptR1Scorer};
pub use session::{lock_dir, run_to_end, Resume, RunSession, SteppedRun, LOCK_FILE};
pub use dynamic_sampling::groups_without_signal;
pub use trainer::Trainer;
pub use validation::{SourceValidation, ValidationReport};

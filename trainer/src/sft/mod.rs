//! Supervised fine-tuning (SFT) of a Qwen3 checkpoint on chat transcripts or saved episodes,
//! with the loss on the tokens the model is to write (assistant messages, agent turns): the
//! cold start many agent-RL recipes run before GRPO, and the paper's SFT baseline.
//!
//! - [`config`]: the `sft.toml` settings (`assets/sft.example.toml` documents every key).
//! - [`data`], [`episode`]: rows (JSONL `messages`, `infer --json` episodes, `eval` rows) to
//!   token sequences with a loss mask.
//! - [`loss`]: the mean negative log-likelihood of the trained tokens.
//! - [`step`]: one optimiser step with micro-batches and gradient accumulation, AdamW and the
//!   global gradient clip of GRPO (`optim`), of the whole model or of LoRA adapters
//!   (`grpo::Trainable`); the held-out loss.
//! - [`run`]: a whole run with `metrics.jsonl` and checkpoints that resume exactly, in the
//!   layout of GRPO runs.

pub mod config;
pub mod data;
pub mod episode;
pub mod loss;
pub mod run;
pub mod step;

pub use config::{LrSchedule, SftConfig, SftData, SftRunSection, SftTrain};
pub use data::{DataSummary, RowEncoder, SftSequence};
pub use episode::{episode_sequence, SequenceError};
pub use loss::nll_loss;
pub use run::{is_sft_run, read_sft_metrics, SftRecord, SftRun, SFT_CONFIG_FILE};
pub use step::{sft_step, validation_loss, SftStepStats};

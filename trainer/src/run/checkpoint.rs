//! Checkpoints of a run: `checkpoints/step-NNNNNNN/` holds the policy in HF layout
//! (`config.json`, `model.safetensors` in f32, the tokenizer files), the optimiser state
//! (`optimizer.bin`) and `trainer_state.json` (step, data cursor, seed). A checkpoint is written
//! into a temporary folder, synced, renamed into place, and only then named in `latest`: a kill
//! at any moment leaves the previous checkpoint intact and loadable.

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use super::error::TrainError;
use super::learner::Learner;

/// Folder of the checkpoints inside the run directory.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// File naming the newest complete checkpoint (a folder name inside `checkpoints/`).
pub const LATEST_FILE: &str = "latest";
pub(crate) const STATE_FILE: &str = "trainer_state.json";
pub(crate) const OPTIMIZER_FILE: &str = "optimizer";

/// The non-tensor state of a run at a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct TrainerState {
    /// Steps completed.
    pub step: u64,
    /// Where the training data sampler stands.
    pub cursor: data::Cursor,
    /// The run's seed (sampling streams derive from it and the step).
    pub seed: u64,
}

/// The newest complete checkpoint of a run, if any.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<PathBuf>, TrainError> {
    let pointer = run_dir.join(CHECKPOINTS_DIR).join(LATEST_FILE);
    if !pointer.exists() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&pointer).map_err(TrainError::io(&pointer))?;
    let dir = run_dir.join(CHECKPOINTS_DIR).join(name.trim());
    if !dir.join(STATE_FILE).is_file() {
        return Err(TrainError::Checkpoint {
            path: dir,
            reason: format!("named by {} but incomplete", pointer.display()),
        });
    }
    Ok(Some(dir))
}

/// The folder name of the checkpoint after `step` steps.
pub(crate) fn checkpoint_name(step: u64) -> String {
    format!("step-{step:07}")
}

/// Makes the staged folder `tmp` the checkpoint `name`: syncs it, renames it into place, then
/// points `latest` at it. Older checkpoints beyond `keep` (0 = all) are removed afterwards.
pub(crate) fn publish(run_dir: &Path, tmp: &Path, name: &str, keep: usize) -> Result<PathBuf, TrainError> {
    let dir = run_dir.join(CHECKPOINTS_DIR);
    let target = dir.join(name);
    sync_dir(tmp)?;
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(TrainError::io(&target))?;
    }
    std::fs::rename(tmp, &target).map_err(TrainError::io(&target))?;
    sync_dir(&dir)?;
    model::checkpoint::write_atomic(&dir.join(LATEST_FILE), name.as_bytes()).map_err(|e| TrainError::Checkpoint {
        path: dir.join(LATEST_FILE),
        reason: e.to_string(),
    })?;
    sync_dir(&dir)?;
    if keep > 0 {
        let mut steps: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(TrainError::io(&dir))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
            .collect();
        steps.sort();
        let excess = steps.len().saturating_sub(keep);
        for old in &steps[..excess] {
            std::fs::remove_dir_all(old).map_err(TrainError::io(old))?;
        }
    }
    Ok(target)
}

/// A fresh staging folder for a checkpoint (a leftover from a killed save is removed).
pub(crate) fn staging_dir(run_dir: &Path, name: &str) -> Result<PathBuf, TrainError> {
    let tmp = run_dir.join(CHECKPOINTS_DIR).join(format!(".tmp-{name}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    Ok(tmp)
}

/// fsyncs a directory so that renames and new entries inside it are durable.
fn sync_dir(dir: &Path) -> Result<(), TrainError> {
    for entry in std::fs::read_dir(dir).map_err(TrainError::io(dir))? {
        let path = entry.map_err(TrainError::io(dir))?.path();
        if path.is_file() {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(TrainError::io(&path))?;
        }
    }
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(TrainError::io(dir))
}

/// Files copied from the initial model into every checkpoint, so that a checkpoint holds the
/// tokenizer beside the model (or the adapters).
const TOKENIZER_FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];

/// Writes the checkpoint after `state.step` steps of a run that started from the HF directory
/// `initial`: what `learner` trains with its optimiser state (see [`Learner::save_into`]),
/// `initial`'s tokenizer files and `state`, staged and then published (see the module docs),
/// keeping the newest `keep`.
pub(crate) fn write_checkpoint<B: AutodiffBackend>(
    run_dir: &Path,
    learner: &Learner<B>,
    initial: &Path,
    state: &TrainerState,
    keep: usize,
) -> Result<PathBuf, TrainError> {
    let name = checkpoint_name(state.step);
    let tmp = staging_dir(run_dir, &name)?;
    learner.save_into(&tmp, initial)?;
    for file in TOKENIZER_FILES {
        let from = initial.join(file);
        if from.is_file() {
            std::fs::copy(&from, tmp.join(file)).map_err(TrainError::io(&from))?;
        }
    }
    let json = serde_json::to_string_pretty(state).expect("state serialises");
    model::checkpoint::write_atomic(&tmp.join(STATE_FILE), json.as_bytes())?;
    publish(run_dir, &tmp, &name, keep)
}

/// The trainer state of the checkpoint `dir` (its model or adapters and optimiser state load
/// with [`Learner::start`]).
pub(crate) fn read_state(dir: &Path) -> Result<TrainerState, TrainError> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(TrainError::io(&path))?;
    serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint {
        path: path.clone(),
        reason: e.to_string(),
    })
}

//! Checkpoints of a run: `checkpoints/step-NNNNNNN/` holds the policy in HF layout
//! (`config.json`, `model.safetensors` in f32, the tokenizer files), the optimiser state
//! (`optimizer.bin`) and `trainer_state.json` (step, data cursor, seed). A checkpoint is written
//! into a temporary folder, synced, renamed into place, and only then named in `latest`: a kill
//! at any moment leaves the previous checkpoint intact and loadable.

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use super::base_model::BaseModel;
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
    /// The model the run trains from (absent in checkpoints written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<BaseModel>,
}

/// The newest complete checkpoint of a run, if any: the folder `checkpoints/latest` names. That
/// name must be a checkpoint of this run as `publish` writes it (`step-NNNNNNN`, a direct
/// child of `checkpoints/`, a folder with its trainer state); anything else (a path such as
/// `../..`, a missing or incomplete folder) is an error naming the file and what it holds.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<PathBuf>, TrainError> {
    let pointer = run_dir.join(CHECKPOINTS_DIR).join(LATEST_FILE);
    if !pointer.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(&pointer).map_err(TrainError::io(&pointer))?;
    let text = String::from_utf8_lossy(&bytes);
    let name = text.trim();
    let Some(step) = checkpoint_step(name) else {
        let shown: String = name.chars().take(80).collect();
        return Err(TrainError::Checkpoint {
            path: pointer.clone(),
            reason: format!(
                "holds {shown:?}, which is not a checkpoint of this run (the name of a folder \
                 step-NNNNNNN inside {})",
                run_dir.join(CHECKPOINTS_DIR).display()
            ),
        });
    };
    let dir = run_dir.join(CHECKPOINTS_DIR).join(checkpoint_name(step));
    let replaced = run_dir.join(CHECKPOINTS_DIR).join(format!("{REMOVING_PREFIX}{}", checkpoint_name(step)));
    if !dir.exists() && is_complete(&replaced) {
        // A kill between `publish`'s two renames: the checkpoint `latest` names is whole, aside.
        std::fs::rename(&replaced, &dir).map_err(TrainError::io(&replaced))?;
        eprintln!("note: {} was set aside by an interrupted save; it is back in place", dir.display());
    }
    if !is_complete(&dir) {
        return Err(TrainError::Checkpoint {
            path: dir,
            reason: format!("named by {} but missing or incomplete (no {STATE_FILE})", pointer.display()),
        });
    }
    Ok(Some(dir))
}

/// The checkpoint of this run after `step` steps (what `--resume-from STEP` continues); an error
/// listing the run's checkpoints when it has none such.
pub fn checkpoint_at(run_dir: &Path, step: u64) -> Result<PathBuf, TrainError> {
    let dir = run_dir.join(CHECKPOINTS_DIR).join(checkpoint_name(step));
    if is_complete(&dir) {
        return Ok(dir);
    }
    let steps = list_checkpoints(run_dir)?;
    let aside = match superseded_holding(run_dir, step) {
        Some(folder) => format!(
            "; {} holds one, set aside by an earlier resume from an earlier checkpoint: move it back into {} to resume it",
            folder.join(checkpoint_name(step)).display(),
            run_dir.join(CHECKPOINTS_DIR).display()
        ),
        None => String::new(),
    };
    Err(TrainError::Checkpoint {
        path: dir,
        reason: format!(
            "no complete checkpoint of step {step} in this run (its checkpoints: {}){aside}",
            steps_list(&steps)
        ),
    })
}

/// The complete checkpoints of a run (folders `checkpoints/step-NNNNNNN/` holding their trainer
/// state), by step.
pub fn list_checkpoints(run_dir: &Path) -> Result<Vec<u64>, TrainError> {
    let dir = run_dir.join(CHECKPOINTS_DIR);
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut steps = step_folders(&dir)?;
    steps.retain(|&step| is_complete(&dir.join(checkpoint_name(step))));
    Ok(steps)
}

/// The steps of the folders in `checkpoints_dir` named as [`checkpoint_name`] writes them,
/// complete or not, in order.
fn step_folders(checkpoints_dir: &Path) -> Result<Vec<u64>, TrainError> {
    let mut steps: Vec<u64> = std::fs::read_dir(checkpoints_dir)
        .map_err(TrainError::io(checkpoints_dir))?
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .filter_map(|e| checkpoint_step(&e.file_name().to_string_lossy()))
        .collect();
    steps.sort_unstable();
    Ok(steps)
}

/// "step 2", "steps 2, 4", or "none".
pub(crate) fn steps_list(steps: &[u64]) -> String {
    let list: Vec<String> = steps.iter().map(u64::to_string).collect();
    match steps.len() {
        0 => "none".into(),
        1 => format!("step {}", list[0]),
        _ => format!("steps {}", list.join(", ")),
    }
}

/// Whether `dir` is a checkpoint folder (itself, not a link) with its trainer state.
fn is_complete(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) && dir.join(STATE_FILE).is_file()
}

/// The folder name of the checkpoint after `step` steps.
pub(crate) fn checkpoint_name(step: u64) -> String {
    format!("step-{step:07}")
}

/// The step of the checkpoint folder `name`, if it is one as [`checkpoint_name`] writes it.
pub(crate) fn checkpoint_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step = digits.parse().ok()?;
    (checkpoint_name(step) == name).then_some(step)
}

/// Makes the staged folder `tmp` the checkpoint `name`: syncs it, renames it into place, then
/// points `latest` at it. A checkpoint already of that name is renamed aside first and removed
/// only once the new one is in place (after a kill between the two renames, [`latest_checkpoint`]
/// puts it back). Older checkpoints beyond `keep` (0 = all) are removed afterwards.
pub(crate) fn publish(run_dir: &Path, tmp: &Path, name: &str, keep: usize) -> Result<PathBuf, TrainError> {
    let dir = run_dir.join(CHECKPOINTS_DIR);
    let target = dir.join(name);
    sync_dir(tmp)?;
    let replaced = dir.join(format!("{REMOVING_PREFIX}{name}"));
    if target.exists() {
        if replaced.exists() {
            std::fs::remove_dir_all(&replaced).map_err(TrainError::io(&replaced))?;
        }
        std::fs::rename(&target, &replaced).map_err(TrainError::io(&target))?;
    }
    std::fs::rename(tmp, &target).map_err(TrainError::io(&target))?;
    sync_dir(&dir)?;
    point_latest(run_dir, name)?;
    if replaced.exists() {
        std::fs::remove_dir_all(&replaced).map_err(TrainError::io(&replaced))?;
    }
    if keep > 0 {
        // The newest `keep` by step, always with the one just published.
        let mut steps = step_folders(&dir)?;
        steps.retain(|&step| checkpoint_name(step) != name);
        let excess = (steps.len() + 1).saturating_sub(keep);
        for old in &steps[..excess.min(steps.len())] {
            remove_checkpoint(&dir, &checkpoint_name(*old))?;
        }
    }
    Ok(target)
}

/// Names the checkpoint folder `name` in `latest`, durably.
fn point_latest(run_dir: &Path, name: &str) -> Result<(), TrainError> {
    let dir = run_dir.join(CHECKPOINTS_DIR);
    model::checkpoint::write_atomic(&dir.join(LATEST_FILE), name.as_bytes()).map_err(|e| TrainError::Checkpoint {
        path: dir.join(LATEST_FILE),
        reason: e.to_string(),
    })?;
    sync_dir(&dir)
}

/// Removes the checkpoint folder `name` of `checkpoints_dir`: renamed first out of the
/// checkpoints' names, so that a kill while its files go leaves no part of it that looks
/// like a checkpoint (the next removal clears what is left).
fn remove_checkpoint(checkpoints_dir: &Path, name: &str) -> Result<(), TrainError> {
    let doomed = checkpoints_dir.join(format!("{REMOVING_PREFIX}{name}"));
    if doomed.exists() {
        std::fs::remove_dir_all(&doomed).map_err(TrainError::io(&doomed))?;
    }
    let folder = checkpoints_dir.join(name);
    std::fs::rename(&folder, &doomed).map_err(TrainError::io(&folder))?;
    std::fs::remove_dir_all(&doomed).map_err(TrainError::io(&doomed))?;
    remove_leftovers(checkpoints_dir)
}

/// What a checkpoint folder is renamed to while it is removed.
const REMOVING_PREFIX: &str = ".removing-";

/// Clears what killed removals left in `checkpoints_dir`.
fn remove_leftovers(checkpoints_dir: &Path) -> Result<(), TrainError> {
    for entry in std::fs::read_dir(checkpoints_dir).map_err(TrainError::io(checkpoints_dir))? {
        let path = entry.map_err(TrainError::io(checkpoints_dir))?.path();
        if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(REMOVING_PREFIX)) {
            std::fs::remove_dir_all(&path).map_err(TrainError::io(&path))?;
        }
    }
    Ok(())
}

/// The checkpoints a run resumed from an earlier one set aside ([`set_aside_after`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    /// The folder they went to.
    pub folder: PathBuf,
    /// Their steps.
    pub steps: Vec<u64>,
}

/// Sets aside the checkpoints of the steps after `step`, which a run resumed from the
/// checkpoint of `step` leaves behind: into the next free `checkpoints/superseded-K/`, made,
/// after `before_moving` has run on it (the caller writes those steps' metrics lines there).
/// `latest` is pointed at the checkpoint of `step` first, so that a kill at any moment leaves
/// the run continuing it. `None`, and nothing changed, when there are no such checkpoints.
pub(crate) fn set_aside_after(
    run_dir: &Path,
    step: u64,
    before_moving: impl FnOnce(&Path) -> Result<(), TrainError>,
) -> Result<Option<SetAside>, TrainError> {
    let dir = run_dir.join(CHECKPOINTS_DIR);
    let later: Vec<u64> = step_folders(&dir)?.into_iter().filter(|&s| s > step).collect();
    if later.is_empty() {
        return Ok(None);
    }
    point_latest(run_dir, &checkpoint_name(step))?;
    let folders = superseded_folders(run_dir);
    // A folder a killed set-aside made but moved no checkpoint into is taken again.
    let folder = match folders.last() {
        Some(last) if step_folders(last)?.is_empty() => last.clone(),
        _ => dir.join(format!("{SUPERSEDED_PREFIX}{}", folders.len() + 1)),
    };
    std::fs::create_dir_all(&folder).map_err(TrainError::io(&folder))?;
    before_moving(&folder)?;
    for s in &later {
        let name = checkpoint_name(*s);
        std::fs::rename(dir.join(&name), folder.join(&name)).map_err(TrainError::io(dir.join(&name)))?;
    }
    sync_dir(&folder)?;
    sync_dir(&dir)?;
    Ok(Some(SetAside { folder, steps: later }))
}

/// What the folders of set-aside checkpoints are named, followed by 1, 2, ...
const SUPERSEDED_PREFIX: &str = "superseded-";

/// The folders of set-aside checkpoints ([`set_aside_after`]), `superseded-1` on, in order.
fn superseded_folders(run_dir: &Path) -> Vec<PathBuf> {
    let dir = run_dir.join(CHECKPOINTS_DIR);
    (1..).map(|k| dir.join(format!("{SUPERSEDED_PREFIX}{k}"))).take_while(|f| f.exists()).collect()
}

/// The set-aside folder holding a checkpoint of `step`, if one does.
fn superseded_holding(run_dir: &Path, step: u64) -> Option<PathBuf> {
    superseded_folders(run_dir).into_iter().filter(|f| is_complete(&f.join(checkpoint_name(step)))).last()
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
pub(crate) fn sync_dir(dir: &Path) -> Result<(), TrainError> {
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

/// Copies `initial`'s tokenizer files ([`TOKENIZER_FILES`], those it has) into `dir`.
pub(crate) fn copy_tokenizer_files(initial: &Path, dir: &Path) -> Result<(), TrainError> {
    for file in TOKENIZER_FILES {
        let from = initial.join(file);
        if from.is_file() {
            // Read and written, not `fs::copy`: a read-only source must not make a read-only copy.
            let bytes = std::fs::read(&from).map_err(TrainError::io(&from))?;
            std::fs::write(dir.join(file), bytes).map_err(TrainError::io(dir.join(file)))?;
        }
    }
    Ok(())
}

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
    copy_tokenizer_files(initial, &tmp)?;
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

/// The file beside exported LoRA adapters that records their base model as their checkpoint
/// did ([`BaseModel`] as JSON), so that loading them onto another base can be refused.
pub const BASE_MODEL_FILE: &str = "prompt_r1_base_model.json";

/// The base model checkpoint `dir` records it was trained from (its trainer state, or the
/// [`BASE_MODEL_FILE`] of exported adapters): `None` for a folder with neither, or a checkpoint
/// written before the base was recorded.
pub fn recorded_base_model(dir: &Path) -> Result<Option<BaseModel>, TrainError> {
    if dir.join(STATE_FILE).is_file() {
        return Ok(read_state(dir)?.base_model);
    }
    let path = dir.join(BASE_MODEL_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(TrainError::io(&path))?;
    serde_json::from_str(&text).map(Some).map_err(|e| TrainError::Checkpoint { path: path.clone(), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint-like folder (with a trainer state file) at `dir`.
    fn fake(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(STATE_FILE), "{}").unwrap();
    }

    /// `latest` must name a checkpoint folder of this run: a path leading out of it, even to a
    /// complete checkpoint of another run, is an error naming the file and what it holds.
    #[test]
    fn latest_is_confined_to_the_run() {
        let root = tempfile::tempdir().unwrap();
        let run = root.path().join("run");
        let checkpoints = run.join(CHECKPOINTS_DIR);
        fake(&checkpoints.join("step-0000002"));
        fake(&root.path().join("elsewhere/step-0000001"));
        let pointer = checkpoints.join(LATEST_FILE);
        std::fs::write(&pointer, "step-0000002\n").unwrap();
        assert_eq!(latest_checkpoint(&run).unwrap(), Some(checkpoints.join("step-0000002")));
        for bad in ["../../elsewhere/step-0000001", "../..", "step-0000002/..", "/tmp", "step-2", "step-+000002"] {
            std::fs::write(&pointer, bad).unwrap();
            let err = latest_checkpoint(&run).unwrap_err().to_string();
            assert!(
                err.contains(&pointer.display().to_string()) && err.contains(&format!("{bad:?}")),
                "{bad}: {err}"
            );
        }
        std::fs::write(&pointer, "step-0000004").unwrap();
        let err = latest_checkpoint(&run).unwrap_err().to_string();
        assert!(err.contains("step-0000004") && err.contains("incomplete"), "{err}");
    }

    #[test]
    fn checkpoint_names_and_steps() {
        assert_eq!(checkpoint_step("step-0000012"), Some(12));
        assert_eq!(checkpoint_step("step-12345678"), Some(12_345_678));
        for name in ["step-12", "step-00000012 ", "step--000001", ".tmp-step-0000001", "latest"] {
            assert_eq!(checkpoint_step(name), None, "{name}");
        }
        assert_eq!(steps_list(&[]), "none");
        assert_eq!(steps_list(&[2, 4]), "steps 2, 4");
    }

    /// `--resume-from STEP` takes only a complete checkpoint of this run, and lists them when
    /// the one asked for is not.
    #[test]
    fn a_checkpoint_by_step() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = root.path().join(CHECKPOINTS_DIR);
        fake(&checkpoints.join("step-0000002"));
        fake(&checkpoints.join("step-0000004"));
        std::fs::create_dir_all(checkpoints.join("step-0000006")).unwrap();
        assert_eq!(list_checkpoints(root.path()).unwrap(), [2, 4]);
        assert_eq!(checkpoint_at(root.path(), 4).unwrap(), checkpoints.join("step-0000004"));
        let err = checkpoint_at(root.path(), 6).unwrap_err().to_string();
        assert!(err.contains("step-0000006") && err.contains("steps 2, 4"), "{err}");
    }

    /// Pruning keeps the newest checkpoints by step and never the one just published, which a
    /// run resumed from an earlier checkpoint writes below the later ones.
    #[test]
    fn publishing_keeps_the_new_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = root.path().join(CHECKPOINTS_DIR);
        for step in [2, 6, 8] {
            fake(&checkpoints.join(checkpoint_name(step)));
        }
        let tmp = staging_dir(root.path(), "step-0000004").unwrap();
        fake(&tmp);
        publish(root.path(), &tmp, "step-0000004", 2).unwrap();
        assert_eq!(list_checkpoints(root.path()).unwrap(), [4, 8]);
        assert_eq!(std::fs::read_to_string(checkpoints.join(LATEST_FILE)).unwrap(), "step-0000004");
    }

    /// Pruning keeps the newest by step with the one published, and a removal killed midway
    /// leaves nothing under a checkpoint's name (its rest goes at the next removal).
    #[test]
    fn pruned_checkpoints_go_whole() {
        let root = tempfile::tempdir().unwrap();
        let run = root.path();
        let checkpoints = run.join(CHECKPOINTS_DIR);
        for step in [1, 2, 3] {
            fake(&checkpoints.join(checkpoint_name(step)));
        }
        let half_removed = checkpoints.join(format!("{REMOVING_PREFIX}step-0000000"));
        std::fs::create_dir_all(&half_removed).unwrap();
        let tmp = staging_dir(run, "step-0000004").unwrap();
        std::fs::write(tmp.join(STATE_FILE), "{}").unwrap();
        publish(run, &tmp, "step-0000004", 2).unwrap();
        assert_eq!(list_checkpoints(run).unwrap(), [3, 4]);
        let mut left: Vec<String> =
            std::fs::read_dir(&checkpoints).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["latest", "step-0000003", "step-0000004"]);
    }

    /// A checkpoint published again under its name replaces the earlier one whole, through a
    /// folder out of the checkpoints' names.
    #[test]
    fn a_checkpoint_published_again_replaces_the_earlier() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = root.path().join(CHECKPOINTS_DIR);
        fake(&checkpoints.join("step-0000004"));
        std::fs::write(checkpoints.join("step-0000004/old.bin"), "old").unwrap();
        let tmp = staging_dir(root.path(), "step-0000004").unwrap();
        fake(&tmp);
        publish(root.path(), &tmp, "step-0000004", 0).unwrap();
        assert!(!checkpoints.join("step-0000004/old.bin").exists());
        assert!(checkpoints.join("step-0000004").join(STATE_FILE).is_file());
        let left: Vec<String> = std::fs::read_dir(&checkpoints).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(left.iter().all(|n| !n.starts_with(REMOVING_PREFIX)), "{left:?}");
        // Killed between the two renames: the earlier checkpoint, aside, is put back.
        std::fs::rename(checkpoints.join("step-0000004"), checkpoints.join(format!("{REMOVING_PREFIX}step-0000004"))).unwrap();
        assert_eq!(latest_checkpoint(root.path()).unwrap(), Some(checkpoints.join("step-0000004")));
        assert!(checkpoints.join("step-0000004").join(STATE_FILE).is_file());
    }
}

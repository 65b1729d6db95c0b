//! One run session, shared by GRPO runs ([`super::Trainer`]) and SFT runs
//! ([`crate::sft::SftRun`]): the run directory, the choice between a fresh start and a resume
//! (of the newest checkpoint or of an earlier one), the checkpoint's state, `metrics.jsonl` at
//! the start and as records come, and the checkpoint cadence. The two kinds of run supply only
//! their step and their record; [`run_to_end`] steps either.

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use data::{BatchSampler, SamplerConfig};
use serde::Serialize;

use super::base_model::BaseModel;
use super::checkpoint::{
    checkpoint_at, checkpoint_step, latest_checkpoint, list_checkpoints, read_state, set_aside_after, steps_list,
    write_checkpoint, SetAside, TrainerState, CHECKPOINTS_DIR, LATEST_FILE,
};
use super::error::TrainError;
use super::learner::Learner;
use super::metrics_log::{append_line, clear, move_lines_after, truncate_after, METRICS_FILE};

/// The file a run holds locked while it writes its directory, so that a second run into the
/// same directory is refused instead of interleaving its checkpoints and metrics.
pub const LOCK_FILE: &str = ".lock";

/// How a run starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Resume {
    /// A new run; refused when the run directory holds checkpoints.
    #[default]
    Fresh,
    /// Continue the newest checkpoint (the one `checkpoints/latest` names); a fresh start when
    /// the run has none.
    Latest,
    /// Continue the checkpoint after this many steps (`--resume-from STEP`), e.g. when the newest
    /// one is damaged.
    From(u64),
}

impl Resume {
    /// The choice the `--resume` and `--resume-from STEP` flags make (the second implies the
    /// first).
    pub fn from_flags(resume: bool, resume_from: Option<u64>) -> Self {
        match (resume, resume_from) {
            (_, Some(step)) => Resume::From(step),
            (true, None) => Resume::Latest,
            (false, None) => Resume::Fresh,
        }
    }
}

impl From<bool> for Resume {
    /// `--resume` or not.
    fn from(resume: bool) -> Self {
        Self::from_flags(resume, None)
    }
}

/// What a session is made from (the `run` sections of `run.toml` and `sft.toml`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionSettings<'a> {
    /// The run directory.
    pub out_dir: &'a Path,
    /// The initial model, whose tokenizer files every checkpoint copies.
    pub initial: &'a Path,
    /// The run's seed (recorded in checkpoints; seeds the data order and LoRA dropout).
    pub seed: u64,
    /// A checkpoint every this many steps (and at the last).
    pub save_every: u64,
    /// Checkpoints kept (0: all).
    pub keep_checkpoints: usize,
}

/// A run's directory and its life cycle: open it (`Self::open`), load what the run continues
/// (`Self::load`, `Self::sampler`), `Self::begin`, then `Self::record` each step and
/// `Self::save` when [`Self::checkpoint_due`].
#[derive(Debug)]
pub struct RunSession {
    dir: PathBuf,
    initial: PathBuf,
    seed: u64,
    save_every: u64,
    keep_checkpoints: usize,
    /// The checkpoint the run continues, with its state.
    resumed: Option<(PathBuf, TrainerState)>,
    /// The later checkpoints a resume from an earlier one set aside ([`Self::begin`]).
    set_aside: Option<SetAside>,
    /// Where a resume with other settings kept the earlier ones ([`Self::begin`]).
    earlier_config: Option<PathBuf>,
    /// See [`Self::earlier_metrics`].
    earlier_metrics: Option<PathBuf>,
    /// The model the run trains from, as its checkpoints record it (read once, at the start).
    base: Option<BaseModel>,
    /// [`LOCK_FILE`], locked while the session lives.
    _lock: std::fs::File,
}

impl RunSession {
    /// Opens the run directory (made if missing) as `resume` says: a fresh start is refused over
    /// a run with checkpoints; a resume picks the newest checkpoint (`checkpoints/latest`, which
    /// must name a checkpoint of this run) or the one `Resume::From` names, and reads its trainer
    /// state. An error about the checkpoint says how to resume from another one.
    pub(crate) fn open(settings: SessionSettings<'_>, resume: Resume) -> Result<Self, TrainError> {
        let dir = settings.out_dir.to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|source| TrainError::Invalid(format!("cannot make the run directory {} (run.out_dir): {source}", dir.display())))?;
        let lock = lock_dir(&dir, "run.out_dir")?;
        let mut session = Self {
            dir,
            initial: settings.initial.to_path_buf(),
            seed: settings.seed,
            save_every: settings.save_every,
            keep_checkpoints: settings.keep_checkpoints,
            resumed: None,
            set_aside: None,
            earlier_config: None,
            earlier_metrics: None,
            base: BaseModel::of(settings.initial),
            _lock: lock,
        };
        let checkpoint = match resume {
            Resume::Fresh => {
                if session.has_checkpoints()? {
                    return Err(TrainError::Invalid(format!(
                        "{} already holds checkpoints: pass --resume to continue it (--resume-from \
                         STEP for an earlier checkpoint), or choose another run.out_dir",
                        session.dir.display()
                    )));
                }
                None
            }
            Resume::Latest => {
                let latest =
                    latest_checkpoint(&session.dir).map_err(|e| session.with_hint(e, None))?;
                if latest.is_none() && !list_checkpoints(&session.dir)?.is_empty() {
                    let pointer = session.dir.join(CHECKPOINTS_DIR).join(LATEST_FILE);
                    let error = TrainError::Invalid(format!("{} is missing", pointer.display()));
                    return Err(session.with_hint(error, None));
                }
                latest
            }
            Resume::From(step) => Some(checkpoint_at(&session.dir, step)?),
        };
        if let Some(path) = checkpoint {
            let step = path
                .file_name()
                .and_then(|n| checkpoint_step(&n.to_string_lossy()))
                .expect("a checkpoint of this run");
            let state = read_state(&path).map_err(|e| session.with_hint(e, Some(step)))?;
            if state.step != step {
                let error = TrainError::Checkpoint {
                    path: path.clone(),
                    reason: format!("its trainer state is of step {}", state.step),
                };
                return Err(session.with_hint(error, Some(step)));
            }
            session.check_base_model(&path, &state)?;
            session.resumed = Some((path, state));
        }
        Ok(session)
    }

    /// Refuses a resume from another model than the one the checkpoint's run trained from
    /// (other weights or config; the same model moved elsewhere is the same): LoRA adapters
    /// would go on training on other base weights, and a KL reference would change.
    fn check_base_model(&self, checkpoint: &Path, state: &TrainerState) -> Result<(), TrainError> {
        let (Some(saved), Some(now)) = (&state.base_model, &self.base) else {
            return Ok(());
        };
        if saved.fingerprint == now.fingerprint {
            return Ok(());
        }
        let reason = if saved.path == now.path {
            format!(
                "the model at {} changed since the run trained from it (its config.json or weights differ): resume with the model the run began with, or start a new run",
                now.path
            )
        } else {
            format!(
                "model is {}, but the run trained from {} (their config.json or weights differ): resume with model = \"{}\", or start a new run",
                now.path, saved.path, saved.path
            )
        };
        Err(TrainError::Mismatch { path: checkpoint.to_path_buf(), reason })
    }

    /// Whether the run directory holds checkpoints (or a `latest` naming one).
    fn has_checkpoints(&self) -> Result<bool, TrainError> {
        Ok(self.dir.join(CHECKPOINTS_DIR).join(LATEST_FILE).exists()
            || !list_checkpoints(&self.dir)?.is_empty())
    }

    /// `error` (about the checkpoint of step `failed`, or about `latest`) with the way out: a
    /// resume from another checkpoint of this run. Errors of the run's settings (a checkpoint
    /// of another kind of run) are left as they are.
    fn with_hint(&self, error: TrainError, failed: Option<u64>) -> TrainError {
        if matches!(
            error,
            TrainError::Mismatch { .. } | TrainError::Resume { .. }
        ) {
            return error;
        }
        let others: Vec<u64> = list_checkpoints(&self.dir)
            .unwrap_or_default()
            .into_iter()
            .filter(|&s| Some(s) != failed)
            .collect();
        let hint = if others.is_empty() {
            "this run has no other complete checkpoint to pass to --resume-from STEP: start afresh \
             in another run.out_dir"
                .to_owned()
        } else {
            format!(
                "to continue another checkpoint of this run, pass --resume-from STEP (its other \
                 complete checkpoints: {})",
                steps_list(&others)
            )
        };
        TrainError::Resume {
            error: Box::new(error),
            hint,
        }
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The checkpoint the run continues, if it resumes.
    pub fn resumed_from(&self) -> Option<&Path> {
        self.resumed.as_ref().map(|(path, _)| path.as_path())
    }

    /// The later checkpoints this run set aside when it resumed from an earlier one.
    pub fn set_aside(&self) -> Option<&SetAside> {
        self.set_aside.as_ref()
    }

    /// Where the settings the run had before it resumed (or started again) with other ones were
    /// kept.
    pub fn earlier_config(&self) -> Option<&Path> {
        self.earlier_config.as_deref()
    }

    /// Where a fresh start kept the `metrics.jsonl` of an earlier start that stopped before its
    /// first checkpoint.
    pub fn earlier_metrics(&self) -> Option<&Path> {
        self.earlier_metrics.as_deref()
    }

    /// The steps completed when the run starts (0 on a fresh start).
    pub fn start_step(&self) -> u64 {
        self.resumed.as_ref().map_or(0, |(_, state)| state.step)
    }

    /// Runs `load` on the checkpoint the run continues (`None` on a fresh start): the learner
    /// loads its model and optimiser state so. An error loading a checkpoint (damaged weights,
    /// optimiser state) says how to resume from another one.
    pub(crate) fn load<T>(
        &self,
        load: impl FnOnce(Option<&Path>) -> Result<T, TrainError>,
    ) -> Result<T, TrainError> {
        let step = self.resumed.as_ref().map(|(_, state)| state.step);
        load(self.resumed_from()).map_err(|e| match step {
            Some(step) => self.with_hint(e, Some(step)),
            None => e,
        })
    }

    /// The training data sampler over `len` examples: where the checkpoint left it, or new (the
    /// run's seed, shuffled, `batch_size` a batch). A resumed run keeps its batch size, its seed
    /// and its data: a different `batch_size` (the config's `key`), seed (`seed_key`) or number
    /// of training examples is refused, not silently overridden.
    pub(crate) fn sampler(
        &self,
        len: usize,
        batch_size: usize,
        key: &str,
        seed_key: &str,
    ) -> Result<BatchSampler, TrainError> {
        let mismatch = |path: &Path, reason: String| TrainError::Mismatch { path: path.to_path_buf(), reason };
        Ok(match &self.resumed {
            Some((path, state)) if state.cursor.config.batch_size != batch_size => {
                return Err(mismatch(
                    path,
                    format!(
                        "{key} is {batch_size}, but the run drew {} examples a step: resume with {key} = {}, or start a new run",
                        state.cursor.config.batch_size, state.cursor.config.batch_size
                    ),
                ))
            }
            Some((path, state)) if state.seed != self.seed => {
                return Err(mismatch(
                    path,
                    format!(
                        "{seed_key} is {}, but the run was seeded {}: resume with {seed_key} = {}, or start a new run",
                        self.seed, state.seed, state.seed
                    ),
                ))
            }
            Some((path, state)) => BatchSampler::resume(state.cursor.clone(), len).map_err(|e| match e {
                data::SamplerError::DatasetChanged { saved, actual } => mismatch(
                    path,
                    format!(
                        "the run drew from {saved} training examples, but its training data now gives {actual}: resume with the same data, or start a new run"
                    ),
                ),
                e => e.into(),
            })?,
            None => BatchSampler::new(
                len,
                SamplerConfig {
                    batch_size,
                    seed: self.seed,
                    shuffle: true,
                    drop_last: false,
                },
            )?,
        })
    }

    /// Starts writing a run that will step up to `last_step`, once everything it needs has
    /// loaded (a start that fails leaves the directory as it was; so does a resumed run that is
    /// already at `last_step`, which has nothing to do): `metrics.jsonl` keeps the lines up to
    /// the resumed step (so no step appears twice) without an incomplete last line, or is
    /// emptied on a fresh start; `config` is written to `config_file` in the run directory. A
    /// resume from an earlier checkpoint than the newest sets the later checkpoints aside, with
    /// their steps' metrics lines ([`set_aside_after`], [`Self::set_aside`]): the run goes on
    /// from there, and what it leaves behind is kept, not mixed in. A resume whose `config`
    /// differs from the file's keeps the earlier one beside it ([`keep_earlier_config`]); so does
    /// a fresh start, which also keeps an earlier start's `metrics.jsonl` beside it.
    pub(crate) fn begin(
        &mut self,
        config_file: &str,
        config: &impl Serialize,
        last_step: u64,
    ) -> Result<(), TrainError> {
        match &self.resumed {
            Some((_, state)) if state.step >= last_step => return Ok(()),
            Some((_, state)) => {
                let (dir, step) = (&self.dir, state.step);
                self.set_aside = set_aside_after(dir, step, |folder| move_lines_after(dir, step, folder))?;
                if self.set_aside.is_none() {
                    truncate_after(dir, step)?;
                }
            }
            None => {
                // An earlier start that stopped before its first checkpoint: its lines are not
                // continued, but kept.
                let metrics = self.dir.join(METRICS_FILE);
                if std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0) {
                    self.earlier_metrics = Some(keep_aside(&metrics, "earlier-start")?);
                }
                clear(&self.dir)?;
            }
        }
        let json = serde_json::to_string_pretty(config).expect("config serialises");
        let path = self.dir.join(config_file);
        let label = match &self.resumed {
            // The earlier settings were in force up to the run's newest step, set aside or not.
            Some((_, state)) => {
                let newest = self.set_aside.iter().flat_map(|aside| aside.steps.iter().copied()).chain([state.step]).max();
                format!("up-to-step-{}", newest.unwrap_or(state.step))
            }
            None => "earlier-start".to_string(),
        };
        self.earlier_config = keep_earlier_config(&path, json.as_bytes(), &label)?;
        model::checkpoint::write_atomic(&path, json.as_bytes())?;
        Ok(())
    }

    /// Appends a step's record (or any line of the run) to `metrics.jsonl`, flushed.
    pub(crate) fn record(&self, record: &impl Serialize) -> Result<(), TrainError> {
        append_line(&self.dir, record)
    }

    /// Whether the run writes a checkpoint after `step`: every `save_every` steps and at
    /// `last_step`.
    pub fn checkpoint_due(&self, step: u64, last_step: u64) -> bool {
        step == last_step || (self.save_every > 0 && step % self.save_every == 0)
    }

    /// Writes the checkpoint after `step` steps: what `learner` trains, the sampler's `cursor`
    /// and the seed, staged, published atomically and named in `latest`, keeping the newest
    /// `keep_checkpoints` (see `checkpoint`).
    pub(crate) fn save<B: AutodiffBackend>(
        &self,
        learner: &Learner<B>,
        step: u64,
        cursor: data::Cursor,
    ) -> Result<PathBuf, TrainError> {
        let state = TrainerState {
            step,
            cursor,
            seed: self.seed,
            base_model: self.base.clone(),
        };
        write_checkpoint(
            &self.dir,
            learner,
            &self.initial,
            &state,
            self.keep_checkpoints,
        )
    }
}

/// A run's settings as its settings file holds them (`run_config.json`, `sft_config.json`): the
/// config's keys, and beside them the kernels the run's models run, which the binary chooses from
/// its flags and the environment rather than from a config key.
#[derive(Serialize)]
pub(crate) struct SettingsRecord<'a, C: Serialize> {
    #[serde(flatten)]
    pub settings: &'a C,
    pub kernels: model::qwen3::KernelsInUse,
}

/// Renames the settings file `path` aside ([`keep_aside`], as `NAME.LABEL.json`) when it differs
/// from `next`, the settings the run goes on with, so that the settings of the steps already
/// made (`up-to-step-N`, N the run's newest) or of an earlier start (`earlier-start`) are not
/// lost; gives the new name.
fn keep_earlier_config(path: &Path, next: &[u8], label: &str) -> Result<Option<PathBuf>, TrainError> {
    match std::fs::read(path) {
        Ok(earlier) if earlier == next => Ok(None),
        Ok(_) => keep_aside(path, label).map(Some),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(TrainError::io(path)(err)),
    }
}

/// Renames `path` (`NAME.EXT`) to `NAME.LABEL.EXT` beside it (`-2`, `-3`, ... after the label if
/// taken); gives the new name.
fn keep_aside(path: &Path, label: &str) -> Result<PathBuf, TrainError> {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("file");
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("json");
    let kept = (1..)
        .map(|n| match n {
            1 => format!("{stem}.{label}.{ext}"),
            n => format!("{stem}.{label}-{n}.{ext}"),
        })
        .map(|name| path.with_file_name(name))
        .find(|candidate| !candidate.exists())
        .expect("an unused name");
    std::fs::rename(path, &kept).map_err(TrainError::io(path))?;
    Ok(kept)
}

/// Opens and locks `dir`'s [`LOCK_FILE`] for as long as the returned file lives (the lock goes
/// with the process), so that two runs never write to `dir` at once; the refusal names `key`,
/// the setting that chose `dir`. On a file system that takes no locks (some network and cluster
/// mounts) the run goes on unlocked, with a note.
pub fn lock_dir(dir: &Path, key: &str) -> Result<std::fs::File, TrainError> {
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(TrainError::io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(TrainError::Invalid(format!(
            "another run is writing to {} (it holds {} locked): wait for it to end, or choose another {key}",
            dir.display(),
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => {
            eprintln!(
                "note: cannot lock {} ({e}): nothing keeps a second run from writing to {} at the same time",
                path.display(),
                dir.display()
            );
            Ok(file)
        }
    }
}

/// A run that steps under a [`RunSession`]: GRPO's [`super::Trainer`], SFT's
/// [`crate::sft::SftRun`].
pub trait SteppedRun {
    /// What a step writes to `metrics.jsonl`.
    type Record;
    /// The run's session.
    fn session(&self) -> &RunSession;
    /// Steps completed so far.
    fn step_count(&self) -> u64;
    /// The step the run ends at.
    fn last_step(&self) -> u64;
    /// Writes a checkpoint of the current state.
    fn save_checkpoint(&self) -> Result<PathBuf, TrainError>;
}

/// Steps `run` to its last step: `step` makes one step (the run writes its record), then the
/// checkpoint the session's cadence asks for is written; `after` sees the run, each record and
/// the checkpoint written after it, if any. Returns the records of the steps made.
pub fn run_to_end<R, E>(
    run: &mut R,
    mut step: impl FnMut(&mut R) -> Result<R::Record, E>,
    mut after: impl FnMut(&R, &R::Record, Option<&Path>),
) -> Result<Vec<R::Record>, E>
where
    R: SteppedRun,
    E: From<TrainError>,
{
    let mut records = Vec::new();
    while run.step_count() < run.last_step() {
        let record = step(run)?;
        let done = run.step_count();
        let saved = if run.session().checkpoint_due(done, run.last_step()) {
            Some(run.save_checkpoint()?)
        } else {
            None
        };
        after(run, &record, saved.as_deref());
        records.push(record);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &Path) -> SessionSettings<'_> {
        SessionSettings {
            out_dir: dir,
            initial: dir,
            seed: 0,
            save_every: 3,
            keep_checkpoints: 0,
        }
    }

    /// A checkpoint folder with a trainer state of `step`.
    fn fake_checkpoint(run: &Path, step: u64) {
        let dir = run
            .join(CHECKPOINTS_DIR)
            .join(super::super::checkpoint::checkpoint_name(step));
        std::fs::create_dir_all(&dir).unwrap();
        let state = TrainerState {
            step,
            cursor: BatchSampler::new(
                4,
                SamplerConfig {
                    batch_size: 2,
                    seed: 0,
                    shuffle: true,
                    drop_last: false,
                },
            )
            .unwrap()
            .cursor(),
            seed: 0,
            base_model: None,
        };
        std::fs::write(
            dir.join("trainer_state.json"),
            serde_json::to_string(&state).unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn flags_make_the_choice() {
        assert_eq!(Resume::from_flags(false, None), Resume::Fresh);
        assert_eq!(Resume::from_flags(true, None), Resume::Latest);
        assert_eq!(Resume::from_flags(false, Some(4)), Resume::From(4));
        assert_eq!(Resume::from(true), Resume::Latest);
    }

    #[test]
    fn checkpoints_every_save_every_steps_and_at_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let session = RunSession::open(settings(dir.path()), Resume::Fresh).unwrap();
        let due: Vec<u64> = (1..=7).filter(|&s| session.checkpoint_due(s, 7)).collect();
        assert_eq!(due, [3, 6, 7]);
    }

    /// A fresh start is refused over checkpoints; `--resume-from` picks the named checkpoint and
    /// names the others when it is missing; a damaged state names `--resume-from`.
    #[test]
    fn resume_picks_the_checkpoint_and_a_damaged_one_names_resume_from() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        for step in [2, 4] {
            fake_checkpoint(run, step);
        }
        std::fs::write(run.join("checkpoints/latest"), "step-0000004").unwrap();
        let err = RunSession::open(settings(run), Resume::Fresh)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--resume"), "{err}");
        assert_eq!(
            RunSession::open(settings(run), Resume::Latest)
                .unwrap()
                .start_step(),
            4
        );
        assert_eq!(
            RunSession::open(settings(run), Resume::From(2))
                .unwrap()
                .start_step(),
            2
        );
        let err = RunSession::open(settings(run), Resume::From(3))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("step-0000003") && err.contains("steps 2, 4"),
            "{err}"
        );

        std::fs::write(run.join("checkpoints/step-0000004/trainer_state.json"), "{").unwrap();
        let err = RunSession::open(settings(run), Resume::Latest)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("trainer_state.json") && err.contains("--resume-from STEP"),
            "{err}"
        );
        assert!(err.contains("step 2"), "{err}");
        // `latest` naming a folder outside the run: an error naming the file and its content,
        // with the way out.
        std::fs::write(run.join("checkpoints/latest"), "../../x").unwrap();
        let err = RunSession::open(settings(run), Resume::Latest)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("latest") && err.contains("\"../../x\"") && err.contains("--resume-from"),
            "{err}"
        );
    }

    /// A resume keeps the lines up to its step as they were written; a fresh start empties the
    /// file, keeping an earlier start's lines (and settings, where they differ) beside it.
    #[test]
    fn metrics_are_cut_to_the_resumed_step_or_emptied() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        fake_checkpoint(run, 2);
        std::fs::write(run.join("checkpoints/latest"), "step-0000002").unwrap();
        let lines = "{\"training/global_step\":0,\"val/reward/mean\":0.5}\n\
                     {\"training/global_step\":1,\"x\":1}\n{\"training/global_step\":2}\n\
                     {\"training/global_step\":3}\n{\"training/glo";
        std::fs::write(run.join("metrics.jsonl"), lines).unwrap();
        let mut session = RunSession::open(settings(run), Resume::Latest).unwrap();
        session.begin("config.json", &1, 10).unwrap();
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(
            text,
            lines
                .lines()
                .take(3)
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        );

        let fresh = tempfile::tempdir().unwrap();
        std::fs::write(fresh.path().join("metrics.jsonl"), lines).unwrap();
        std::fs::write(fresh.path().join("config.json"), "7").unwrap();
        let mut session = RunSession::open(settings(fresh.path()), Resume::Latest).unwrap();
        assert_eq!(session.start_step(), 0);
        session.begin("config.json", &1, 10).unwrap();
        assert_eq!(
            std::fs::read_to_string(fresh.path().join("metrics.jsonl")).unwrap(),
            ""
        );
        let kept = fresh.path().join("metrics.earlier-start.jsonl");
        assert_eq!(session.earlier_metrics(), Some(kept.as_path()));
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), lines);
        assert_eq!(session.earlier_config(), Some(fresh.path().join("config.earlier-start.json").as_path()));
        drop(session);
        // Starting afresh again keeps nothing more: the lines and settings are empty and equal.
        let mut session = RunSession::open(settings(fresh.path()), Resume::Fresh).unwrap();
        session.begin("config.json", &1, 10).unwrap();
        assert_eq!((session.earlier_metrics(), session.earlier_config()), (None, None));
    }

    /// A resume with other settings keeps the earlier ones beside the new; the same settings
    /// keep one file.
    #[test]
    fn a_resume_with_other_settings_keeps_the_earlier_ones() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        fake_checkpoint(run, 2);
        std::fs::write(run.join("checkpoints/latest"), "step-0000002").unwrap();
        std::fs::write(run.join("config.json"), "1").unwrap();
        for (config, earlier) in [(1, None), (5, Some("config.up-to-step-2.json")), (6, Some("config.up-to-step-2-2.json"))] {
            let mut session = RunSession::open(settings(run), Resume::Latest).unwrap();
            session.begin("config.json", &config, 10).unwrap();
            assert_eq!(session.earlier_config(), earlier.map(|name| run.join(name)).as_deref());
            assert_eq!(std::fs::read_to_string(run.join("config.json")).unwrap(), config.to_string());
        }
        assert_eq!(std::fs::read_to_string(run.join("config.up-to-step-2.json")).unwrap(), "1");
        assert_eq!(std::fs::read_to_string(run.join("config.up-to-step-2-2.json")).unwrap(), "5");
    }

    /// A second session on a run directory is refused while the first lives.
    #[test]
    fn one_run_at_a_time_writes_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunSession::open(settings(dir.path()), Resume::Fresh).unwrap();
        let err = RunSession::open(settings(dir.path()), Resume::Fresh).unwrap_err().to_string();
        assert!(err.contains("another run is writing") && err.contains(LOCK_FILE), "{err}");
        drop(first);
        RunSession::open(settings(dir.path()), Resume::Fresh).unwrap();
    }

    fn metrics_of_steps(steps: std::ops::RangeInclusive<u64>) -> String {
        steps.map(|s| format!("{{\"training/global_step\":{s}}}\n")).collect()
    }

    /// A resume from an earlier checkpoint moves `latest` to it and sets the later checkpoints
    /// aside with their metrics lines; a run already at its last step changes nothing.
    #[test]
    fn a_resume_from_an_earlier_checkpoint_keeps_the_later_ones_aside() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        for step in [2, 4, 6] {
            fake_checkpoint(run, step);
        }
        std::fs::write(run.join("checkpoints/latest"), "step-0000006").unwrap();
        std::fs::write(run.join("metrics.jsonl"), metrics_of_steps(0..=6)).unwrap();

        let mut done = RunSession::open(settings(run), Resume::From(4)).unwrap();
        done.begin("config.json", &1, 4).unwrap();
        assert!(done.set_aside().is_none());
        assert_eq!(list_checkpoints(run).unwrap(), [2, 4, 6]);
        assert_eq!(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(), metrics_of_steps(0..=6));
        drop(done);

        std::fs::write(run.join("config.json"), "0").unwrap();
        let mut session = RunSession::open(settings(run), Resume::From(2)).unwrap();
        session.begin("config.json", &1, 10).unwrap();
        // The settings the set-aside branch ran with are named by its newest step.
        assert_eq!(session.earlier_config(), Some(run.join("config.up-to-step-6.json").as_path()));
        let aside = session.set_aside().unwrap();
        assert_eq!(aside.folder, run.join("checkpoints/superseded-1"));
        assert_eq!(aside.steps, [4, 6]);
        assert_eq!(list_checkpoints(run).unwrap(), [2]);
        assert_eq!(latest_checkpoint(run).unwrap(), Some(run.join("checkpoints/step-0000002")));
        assert!(aside.folder.join("step-0000006/trainer_state.json").is_file());
        assert_eq!(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(), metrics_of_steps(0..=2));
        assert_eq!(std::fs::read_to_string(aside.folder.join("metrics.jsonl")).unwrap(), metrics_of_steps(3..=6));
        drop(session);

        // A second branch goes beside the first.
        fake_checkpoint(run, 3);
        std::fs::write(run.join("checkpoints/latest"), "step-0000003").unwrap();
        let mut session = RunSession::open(settings(run), Resume::From(2)).unwrap();
        session.begin("config.json", &1, 10).unwrap();
        assert_eq!(session.set_aside().unwrap().folder, run.join("checkpoints/superseded-2"));
        assert_eq!(list_checkpoints(run).unwrap(), [2]);
        drop(session);

        // A set-aside checkpoint is named where a resume asks for it.
        let err = RunSession::open(settings(run), Resume::From(6)).unwrap_err().to_string();
        assert!(err.contains("superseded-1/step-0000006") && err.contains("move it back"), "{err}");
        // A folder that a killed set-aside left without checkpoints is taken again.
        std::fs::create_dir_all(run.join("checkpoints/superseded-3")).unwrap();
        std::fs::write(run.join("checkpoints/superseded-3/metrics.jsonl"), "").unwrap();
        fake_checkpoint(run, 5);
        let mut session = RunSession::open(settings(run), Resume::From(2)).unwrap();
        session.begin("config.json", &1, 10).unwrap();
        assert_eq!(session.set_aside().unwrap().folder, run.join("checkpoints/superseded-3"));
        assert!(run.join("checkpoints/superseded-3/step-0000005").is_dir());
    }


    /// A resume keeps the run's batch size, seed and data: any other is refused, named.
    #[test]
    fn a_resume_keeps_the_runs_batch_seed_and_data() {
        let dir = tempfile::tempdir().unwrap();
        fake_checkpoint(dir.path(), 2);
        let session = RunSession::open(settings(dir.path()), Resume::From(2)).unwrap();
        session.sampler(4, 2, "train.batch_size", "train.seed").unwrap();
        let err = |len, batch| session.sampler(len, batch, "train.batch_size", "train.seed").unwrap_err().to_string();
        assert!(err(4, 3).contains("train.batch_size is 3"), "{}", err(4, 3));
        assert!(err(5, 2).contains("from 4 training examples, but its training data now gives 5"), "{}", err(5, 2));
        drop(session);
        let reseeded = RunSession::open(SessionSettings { seed: 7, ..settings(dir.path()) }, Resume::From(2)).unwrap();
        let err = reseeded.sampler(4, 2, "train.batch_size", "train.seed").unwrap_err().to_string();
        assert!(err.contains("train.seed is 7, but the run was seeded 0"), "{err}");
    }

    /// A resume from another model than the run's is refused, naming both; the same model
    /// elsewhere, and a checkpoint that recorded none, resume.
    #[test]
    fn a_resume_keeps_the_runs_model() {
        let dir = tempfile::tempdir().unwrap();
        let model = |name: &str, layers: u32| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::write(path.join("config.json"), format!("{{\"num_hidden_layers\": {layers}}}")).unwrap();
            std::fs::write(path.join("model.safetensors"), "weights").unwrap();
            path
        };
        let (trained, copy, other) = (model("trained", 2), model("copy", 2), model("other", 3));
        let run = dir.path().join("run");
        fake_checkpoint(&run, 2);
        let open = |initial: &Path| RunSession::open(SessionSettings { initial, ..settings(&run) }, Resume::Latest).map(drop);
        std::fs::write(run.join("checkpoints/latest"), "step-0000002").unwrap();
        open(&other).expect("a checkpoint without a recorded model resumes");
        let state_file = run.join("checkpoints/step-0000002").join(super::super::checkpoint::STATE_FILE);
        let mut state: TrainerState = serde_json::from_str(&std::fs::read_to_string(&state_file).unwrap()).unwrap();
        state.base_model = BaseModel::of(&trained);
        std::fs::write(&state_file, serde_json::to_string(&state).unwrap()).unwrap();
        open(&trained).unwrap();
        open(&copy).expect("the same model moved elsewhere");
        let err = open(&other).unwrap_err().to_string();
        let canonical = |path: &Path| std::fs::canonicalize(path).unwrap().display().to_string();
        assert!(err.contains(&format!("model is {}, but the run trained from {}", canonical(&other), canonical(&trained))), "{err}");
        std::fs::write(trained.join("model.safetensors"), "WEIGHTS").unwrap();
        let err = open(&trained).unwrap_err().to_string();
        assert!(err.contains(&format!("the model at {} changed since", canonical(&trained))), "{err}");
    }

}

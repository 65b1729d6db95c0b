//! Replacing a model directory's files as a whole. A writer holds the directory's write lock
//! ([`WriteLock`]), stages the new files in a hidden folder inside the directory and, once all
//! are written, writes that folder's journal: the files to move in and the earlier model's files
//! to remove ([`WriteLock::commit`]). A write killed before its journal leaves the directory as
//! it was; one killed after it (between two renames, with a mix of two models' files in place)
//! is finished by the next loader ([`finish_interrupted`], called by [`crate::load_pretrained`],
//! [`crate::lora::load_adapter`] and [`crate::lora::read_adapter_config`]) or writer, so that a
//! killed write is never loaded as a mix of two models.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::error::ModelError;

/// What a staging folder's name starts with.
pub const STAGING_PREFIX: &str = ".staging-";

/// The journal inside a staging folder: a line `move NAME` for each staged file, `remove NAME`
/// for each file of the earlier model that the new one does not replace. Every name is a file
/// directly in the directory.
const JOURNAL: &str = ".journal";

/// The file whose lock a writer holds (and a loader, while it finishes a killed write).
const LOCK_FILE: &str = ".prompt-r1-write.lock";

/// A model directory's write lock, held while the value lives (the lock goes with the process).
/// On a file system that takes no locks (some network mounts) it holds nothing.
#[derive(Debug)]
pub struct WriteLock {
    dir: PathBuf,
    _file: File,
}

impl WriteLock {
    /// Locks `dir` for writing; refused, naming the lock file, while another process writes it.
    pub fn try_acquire(dir: &Path) -> Result<WriteLock, ModelError> {
        let (path, file) = open_lock_file(dir)?;
        match file.try_lock() {
            Ok(()) | Err(TryLockError::Error(_)) => Ok(WriteLock { dir: dir.to_path_buf(), _file: file }),
            Err(TryLockError::WouldBlock) => Err(ModelError::Io {
                path,
                source: io::Error::new(io::ErrorKind::WouldBlock, "another process is writing this model directory (it holds this file locked): wait for it to end"),
            }),
        }
    }

    /// Locks `dir` for writing, waiting for a writer that holds it.
    fn acquire(dir: &Path) -> Result<WriteLock, ModelError> {
        let (path, file) = open_lock_file(dir)?;
        match file.lock() {
            Err(source) if source.kind() != io::ErrorKind::Unsupported => Err(ModelError::Io { path, source }),
            _ => Ok(WriteLock { dir: dir.to_path_buf(), _file: file }),
        }
    }

    /// Finishes the writes into the directory that were killed after their journal, and removes
    /// the staging folders of those killed before it (no other writer runs while the lock is
    /// held). Returns whether a write was finished.
    pub fn clear_interrupted(&self) -> Result<bool, ModelError> {
        self.finish_journals(true)
    }

    /// Carries out every staging folder's journal; removes the folders without one where
    /// `remove_unjournaled` (only a writer may: a loader could meet a live writer's). Returns
    /// whether a journal was carried out.
    fn finish_journals(&self, remove_unjournaled: bool) -> Result<bool, ModelError> {
        let mut finished = false;
        for staging in staging_folders(&self.dir)? {
            if staging.join(JOURNAL).is_file() {
                finished |= carry_out(&self.dir, &staging, false)?;
            } else if remove_unjournaled {
                std::fs::remove_dir_all(&staging).map_err(|source| ModelError::Io { path: staging.clone(), source })?;
            }
        }
        Ok(finished)
    }

    /// Records in `staging` (a folder inside the directory) that its files `staged` replace the
    /// directory's and that `stale` (files of the directory) go, then carries it out. The
    /// journal is written whole and synced (a temporary name, then a rename) before any file
    /// moves.
    pub fn commit(&self, staging: &Path, staged: &[String], stale: &[String]) -> Result<(), ModelError> {
        let mut journal = String::new();
        for (step, names) in [("move", staged), ("remove", stale)] {
            for name in names {
                check_name(name).map_err(|source| ModelError::Io { path: staging.join(name), source })?;
                journal.push_str(&format!("{step} {name}\n"));
            }
        }
        crate::checkpoint::write_atomic(&staging.join(JOURNAL), journal.as_bytes())?;
        carry_out(&self.dir, staging, true).map(drop)
    }
}

/// Finishes every write into `dir` that was killed after its journal (waiting for a writer
/// still at work), so that the directory holds one model's files. Staging folders without a
/// journal are left alone. Returns whether there was one to finish.
pub fn finish_interrupted(dir: &Path) -> Result<bool, ModelError> {
    let journaled = staging_folders(dir)?.iter().any(|s| s.join(JOURNAL).is_file());
    if !journaled {
        return Ok(false);
    }
    WriteLock::acquire(dir)?.finish_journals(false)
}

/// The staging folders in `dir` (none where `dir` cannot be listed: it holds no model either).
fn staging_folders(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut folders = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ModelError::Io { path: dir.to_path_buf(), source })?;
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && entry.file_name().to_string_lossy().starts_with(STAGING_PREFIX) {
            folders.push(entry.path());
        }
    }
    Ok(folders)
}

fn open_lock_file(dir: &Path) -> Result<(PathBuf, File), ModelError> {
    let path = dir.join(LOCK_FILE);
    match OpenOptions::new().create(true).truncate(false).write(true).open(&path) {
        Ok(file) => Ok((path, file)),
        Err(source) => Err(ModelError::Io { path, source }),
    }
}

/// A journal's name must be a file directly in the directory: one plain component.
fn check_name(name: &str) -> io::Result<()> {
    let mut components = Path::new(name).components();
    match (components.next(), components.next()) {
        (Some(Component::Normal(_)), None) => Ok(()),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, format!("\"{name}\" is not a file name of the model directory"))),
    }
}

/// Does what `staging`'s journal says, under the directory's write lock. A step of another's
/// journal may have been done already (by the write that was killed): a file already moved or
/// removed is passed over; the writer's `own` files must all be there to move. Returns whether
/// the journal was there (a loader may find it gone, finished by a writer it waited for).
fn carry_out(dir: &Path, staging: &Path, own: bool) -> Result<bool, ModelError> {
    let journal_path = staging.join(JOURNAL);
    let journal = match std::fs::read_to_string(&journal_path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && !own => return Ok(false),
        read => read.map_err(|source| ModelError::Io { path: journal_path.clone(), source })?,
    };
    for line in journal.lines() {
        let unreadable = || ModelError::Io {
            path: journal_path.clone(),
            source: io::Error::new(io::ErrorKind::InvalidData, format!("unreadable line \"{line}\"")),
        };
        let (step, name) = line.split_once(' ').ok_or_else(unreadable)?;
        check_name(name).map_err(|source| ModelError::Io { path: journal_path.clone(), source })?;
        let (target, done) = match step {
            "move" => (dir.join(name), std::fs::rename(staging.join(name), dir.join(name))),
            "remove" => (dir.join(name), std::fs::remove_file(dir.join(name))),
            _ => return Err(unreadable()),
        };
        match done {
            Err(e) if e.kind() == io::ErrorKind::NotFound && !(own && step == "move") => {}
            Err(source) => return Err(ModelError::Io { path: target, source }),
            Ok(()) => {}
        }
    }
    match std::fs::remove_dir_all(staging) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(ModelError::Io { path: staging.to_path_buf(), source: e }),
        _ => Ok(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.retain(|n| n != LOCK_FILE);
        names.sort();
        names
    }

    /// A write killed after its journal, with one of its files moved and none removed, is
    /// finished by the next reader: every new file in place, the earlier model's other files
    /// gone, the user's files kept; a staging folder without a journal is left alone.
    #[test]
    fn a_write_killed_between_its_renames_is_finished() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        for name in ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "notes.txt"] {
            std::fs::write(out.join(name), "old").unwrap();
        }
        let staging = out.join(format!("{STAGING_PREFIX}7"));
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(staging.join("model.safetensors"), "new").unwrap();
        std::fs::write(
            staging.join(JOURNAL),
            "move config.json\nmove model.safetensors\nremove model-00001-of-00002.safetensors\nremove model.safetensors.index.json\n",
        )
        .unwrap();
        std::fs::write(out.join("config.json"), "new").unwrap();
        let unfinished = out.join(format!("{STAGING_PREFIX}8"));
        std::fs::create_dir(&unfinished).unwrap();

        assert!(finish_interrupted(out).unwrap());
        assert_eq!(names(out), [format!("{STAGING_PREFIX}8").as_str(), "config.json", "model.safetensors", "notes.txt"]);
        assert_eq!(std::fs::read_to_string(out.join("model.safetensors")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "old");
        assert!(!finish_interrupted(out).unwrap(), "nothing left to finish");
    }

    /// A journal line that names no step, or a name outside the directory (a path, `..`), is an
    /// error naming the journal, and nothing outside the directory is touched.
    #[test]
    fn a_journal_touches_only_files_of_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("precious.txt");
        std::fs::write(&outside, "keep").unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        let staging = model.join(format!("{STAGING_PREFIX}1"));
        std::fs::create_dir(&staging).unwrap();
        for line in ["copy config.json", "remove ../precious.txt", &format!("remove {}", outside.display()), "move sub/config.json"] {
            std::fs::write(staging.join(JOURNAL), format!("{line}\n")).unwrap();
            let error = finish_interrupted(&model).unwrap_err().to_string();
            assert!(error.contains(".journal"), "{line}: {error}");
        }
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        let lock = WriteLock::try_acquire(&model).unwrap();
        assert!(lock.commit(&staging, &["../precious.txt".into()], &[]).is_err());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
    }

    /// One writer at a time: a second is refused while the first holds the lock, and may write
    /// once it is released; under the lock, a staging folder without a journal is a killed
    /// write's and is removed.
    #[test]
    fn one_writer_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let first = WriteLock::try_acquire(dir.path()).unwrap();
        let refused = WriteLock::try_acquire(dir.path()).unwrap_err().to_string();
        assert!(refused.contains(LOCK_FILE) && refused.contains("another process is writing"), "{refused}");
        drop(first);
        let second = WriteLock::try_acquire(dir.path()).unwrap();
        std::fs::create_dir(dir.path().join(format!("{STAGING_PREFIX}3"))).unwrap();
        assert!(!second.clear_interrupted().unwrap());
        assert!(names(dir.path()).is_empty());
    }
}

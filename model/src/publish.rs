//! Replacing a model directory's files as a whole. A writer stages the new files in a hidden
//! folder inside the directory and, once all are written, writes that folder's journal: the
//! files to move in and the earlier model's files to remove ([`commit`]). A write killed before
//! its journal leaves the directory as it was; one killed after it (between two renames, with a
//! mix of two models' files in place) is finished by the next loader ([`finish_interrupted`],
//! called by [`crate::load_pretrained`] and [`crate::lora::load_adapter`]) or writer, so that no
//! model is ever loaded from a mix.

use std::io;
use std::path::{Path, PathBuf};

/// What a staging folder's name starts with.
pub const STAGING_PREFIX: &str = ".staging-";

/// The journal inside a staging folder: a line `move NAME` for each staged file, `remove NAME`
/// for each file of the earlier model that the new one does not replace.
const JOURNAL: &str = ".journal";

/// Records in `staging` (a folder inside `dir`) that its files `staged` replace those of `dir`
/// and that `stale` (files of `dir`) go, then carries it out. The journal is written whole (a
/// temporary name, then a rename) before any file moves.
pub fn commit(dir: &Path, staging: &Path, staged: &[String], stale: &[String]) -> io::Result<()> {
    let mut journal = String::new();
    for name in staged {
        journal.push_str(&format!("move {name}\n"));
    }
    for name in stale {
        journal.push_str(&format!("remove {name}\n"));
    }
    let temporary = staging.join(format!("{JOURNAL}.tmp"));
    std::fs::write(&temporary, journal)?;
    std::fs::rename(&temporary, staging.join(JOURNAL))?;
    carry_out(dir, staging)
}

/// Finishes every write into `dir` that was killed after its journal ([`commit`]); staging
/// folders without one (a write killed earlier, or one still being written) are left alone.
/// Returns whether there was one.
pub fn finish_interrupted(dir: &Path) -> io::Result<bool> {
    let mut finished = false;
    for staging in staging_folders(dir)? {
        if staging.join(JOURNAL).is_file() {
            carry_out(dir, &staging)?;
            finished = true;
        }
    }
    Ok(finished)
}

/// The staging folders in `dir` (none where `dir` cannot be listed: it holds no model either).
pub fn staging_folders(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut folders = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.is_dir() && path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(STAGING_PREFIX)) {
            folders.push(path);
        }
    }
    Ok(folders)
}

/// Does what `staging`'s journal says. Each step may have been done already (by the write that
/// was killed, or by another reader at the same time): a file already moved or removed is
/// passed over.
fn carry_out(dir: &Path, staging: &Path) -> io::Result<()> {
    let journal = std::fs::read_to_string(staging.join(JOURNAL))?;
    for line in journal.lines() {
        let step = match line.split_once(' ') {
            Some(("move", name)) => std::fs::rename(staging.join(name), dir.join(name)),
            Some(("remove", name)) => std::fs::remove_file(dir.join(name)),
            _ => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{}: unreadable line \"{line}\"", staging.join(JOURNAL).display()))),
        };
        match step {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    match std::fs::remove_dir_all(staging) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
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

    /// A journal that names no step is an error naming it, not a skip.
    #[test]
    fn an_unreadable_journal_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let staging = dir.path().join(format!("{STAGING_PREFIX}1"));
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(staging.join(JOURNAL), "copy config.json\n").unwrap();
        let error = finish_interrupted(dir.path()).unwrap_err().to_string();
        assert!(error.contains(".journal") && error.contains("copy config.json"), "{error}");
    }
}

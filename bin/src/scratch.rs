//! Temporary directories that an interrupted command (Ctrl-C, SIGTERM) still removes: the random
//! checkpoints `bench` and `check-device` write can take gigabytes, and a signal skips the
//! destructors that would delete them.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

/// The scratch directories alive now, for the signal handler to remove.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static HANDLER: Once = Once::new();

/// A temporary directory, removed when dropped or when the process is interrupted.
pub struct ScratchDir {
    dir: tempfile::TempDir,
}

impl ScratchDir {
    /// Makes the directory under the system's temporary folder; the first one installs the
    /// handler that removes every live one and exits with status 130 on SIGINT or SIGTERM.
    pub fn new() -> std::io::Result<Self> {
        HANDLER.call_once(|| {
            let installed = ctrlc::set_handler(|| {
                for dir in LIVE.lock().map(|dirs| dirs.clone()).unwrap_or_default() {
                    let _ = std::fs::remove_dir_all(dir);
                }
                std::process::exit(130);
            });
            if let Err(err) = installed {
                eprintln!("note: an interrupted run will leave its temporary files ({err})");
            }
        });
        let dir = tempfile::Builder::new().prefix("prompt-r1-").tempdir()?;
        lock().push(dir.path().to_path_buf());
        Ok(Self { dir })
    }

    /// Where the directory is.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        lock().retain(|dir| dir != self.dir.path());
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_dir_is_listed_while_it_lives_and_removed_after() {
        let scratch = ScratchDir::new().unwrap();
        let path = scratch.path().to_path_buf();
        assert!(path.is_dir() && lock().contains(&path));
        drop(scratch);
        assert!(!path.exists() && !lock().contains(&path));
    }
}

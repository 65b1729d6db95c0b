//! Writing a model directory as a whole (`export`, `init-model`): the new files are staged in a
//! hidden folder inside it and replace the directory's model files only once all are written
//! ([`model::publish`]), so that a failed write leaves the directory as it was, no file of an
//! earlier model (a shard, its index, an adapter's config) stays behind to be loaded in place
//! of the new one, and a write killed between its renames is finished by the next load.

use std::path::Path;

use anyhow::{Context, Result};
use model::publish::STAGING_PREFIX;

/// Whether `name` is a model's or adapter's own file, what a loader reads as the model: its
/// config, weights in safetensors or PyTorch's format, shards and their index, an adapter's
/// config.
fn is_weights_or_config(name: &str) -> bool {
    matches!(name, "config.json" | "adapter_config.json" | "adapter_model.bin")
        || name.ends_with(".safetensors")
        || name.ends_with(".safetensors.index.json")
        || (name.starts_with("pytorch_model") && (name.ends_with(".bin") || name.ends_with(".bin.index.json")))
}

/// Whether `name` is a file of a model or adapter directory: its weights and config
/// ([`is_weights_or_config`]) and the tokenizer, chat template and generation files beside them.
pub fn is_model_file(name: &str) -> bool {
    is_weights_or_config(name)
        || matches!(
            name,
            "generation_config.json"
                | "tokenizer.json"
                | "tokenizer_config.json"
                | "special_tokens_map.json"
                | "added_tokens.json"
                | "vocab.json"
                | "merges.txt"
                | "chat_template.jinja"
                | "chat_template.json"
                | trainer::run::BASE_MODEL_FILE
        )
}

/// The first file in `dir` (by name) showing that it already holds a model or adapter, one that
/// [`write_model_dir`] would replace, so that writing there without `--force` is refused. A
/// directory with tokenizer files alone holds none.
pub fn existing_model(dir: &Path) -> Option<String> {
    let mut names: Vec<String> = file_names(dir).ok()?.into_iter().filter(|n| is_weights_or_config(n)).collect();
    names.sort();
    names.into_iter().next()
}

/// Makes `out` (and its parents), locks it for writing ([`model::publish::WriteLock`]) and has
/// `write` fill a staging folder inside it; then moves the staged files in (each rename replaces
/// its namesake at once) and removes `out`'s other model files ([`is_model_file`]), as the
/// staging folder's journal says ([`model::publish::WriteLock::commit`]). Other files of `out`
/// stay. A failed `write` removes the staging folder and leaves `out`'s files as they were. A
/// write killed earlier is finished first where it had written its journal, and its staging
/// folder removed where it had not.
pub fn write_model_dir(out: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    super::create_dir(out)?;
    let lock = model::publish::WriteLock::try_acquire(out)?;
    lock.clear_interrupted().with_context(|| format!("finishing an interrupted write of {}", out.display()))?;
    let staging = out.join(format!("{STAGING_PREFIX}{}", std::process::id()));
    std::fs::create_dir(&staging).with_context(|| format!("cannot write in {}", out.display()))?;
    if let Err(error) = write(&staging) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(error);
    }
    let staged = file_names(&staging)?;
    let stale: Vec<String> = file_names(out)?.into_iter().filter(|n| is_model_file(n) && !staged.contains(n)).collect();
    lock.commit(&staging, &staged, &stale).with_context(|| format!("moving the new files into {}", out.display()))
}

/// The names of the files (not folders) directly in `dir`.
fn file_names(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
        if entry.file_type().is_ok_and(|t| t.is_file()) {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.retain(|n| !n.ends_with(".lock"));
        names.sort();
        names
    }

    /// A new model replaces every file of the earlier one (its shards and index too) and leaves
    /// the user's other files; a failed write changes nothing.
    #[test]
    fn a_model_directory_is_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir_all(out.join(format!("{STAGING_PREFIX}1"))).unwrap();
        for name in ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "adapter_config.json", "chat_template.jinja", "notes.txt"] {
            std::fs::write(out.join(name), "old").unwrap();
        }
        let failed = write_model_dir(&out, |staging| {
            std::fs::write(staging.join("config.json"), "new")?;
            anyhow::bail!("no room")
        });
        assert!(failed.unwrap_err().to_string().contains("no room"));
        assert_eq!(
            names(&out),
            ["adapter_config.json", "chat_template.jinja", "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "notes.txt"]
        );
        write_model_dir(&out, |staging| {
            for name in ["config.json", "model.safetensors"] {
                std::fs::write(staging.join(name), "new")?;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(names(&out), ["config.json", "model.safetensors", "notes.txt"]);
        assert_eq!(std::fs::read_to_string(out.join("config.json")).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "old");

        // A write killed between its renames (its journal written) is finished before the next
        // one starts, even one that fails.
        let killed = out.join(format!("{STAGING_PREFIX}2"));
        std::fs::create_dir(&killed).unwrap();
        std::fs::write(killed.join("config.json"), "killed's").unwrap();
        model::publish::WriteLock::try_acquire(&out).unwrap().commit(&killed, &["config.json".into()], &["model.safetensors".into()]).unwrap();
        std::fs::create_dir(&killed).unwrap();
        std::fs::write(killed.join("config.json"), "newest").unwrap();
        std::fs::write(killed.join(".journal"), "move config.json\n").unwrap();
        let failed = write_model_dir(&out, |_| anyhow::bail!("no room"));
        assert!(failed.is_err());
        assert_eq!(names(&out), ["config.json", "notes.txt"]);
        assert_eq!(std::fs::read_to_string(out.join("config.json")).unwrap(), "newest");
    }

    /// Every file a new model would replace, other than tokenizer files, makes the directory one
    /// that holds a model (PyTorch weights and adapter configs too).
    #[test]
    fn a_directory_holds_a_model_when_a_write_would_replace_its_weights() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(existing_model(&dir.path().join("absent")), None);
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "").unwrap();
        assert_eq!(existing_model(dir.path()), None);
        for name in ["pytorch_model.bin", "adapter_config.json", "model.safetensors"] {
            let one = tempfile::tempdir().unwrap();
            std::fs::write(one.path().join(name), "").unwrap();
            assert_eq!(existing_model(one.path()).as_deref(), Some(name));
            assert!(is_model_file(name));
        }
    }
}

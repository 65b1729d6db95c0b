//! One module per subcommand: each has an `Args` (clap) and a `run(args) -> anyhow::Result<()>`.

pub mod env_check;
pub mod bench;
pub mod check_device;
pub mod demo;
pub mod export;
pub mod generate;
pub mod init_model;
pub mod model_out;
pub mod score;
pub mod reward;
pub mod metrics;
pub mod plan;
pub mod plot;
pub mod serve;
pub mod infer;
pub mod eval;
pub mod sft;
pub mod train;

/// Prints a line above a progress bar, or on stderr when the bar is hidden (stderr is not a
/// terminal), where indicatif's `println` would drop it: logs of redirected runs keep it.
pub fn say(bar: &indicatif::ProgressBar, line: impl Into<String>) {
    let line = line.into();
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

/// Whether `a` and `b` name the same existing directory.
pub fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
}

/// Creates directory `dir` and its parents; a file in the way is named as such (the system's
/// own error, "File exists", names no file).
pub fn create_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    if let Some(file) = dir.ancestors().find(|p| !p.as_os_str().is_empty() && p.is_file()) {
        anyhow::bail!("cannot create {}: {} is a file, not a directory", dir.display(), file.display());
    }
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))
}

/// Creates the directory `file` is to be written in, when it names one.
pub fn create_parent(file: &std::path::Path) -> anyhow::Result<()> {
    match file.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => create_dir(parent),
        None => Ok(()),
    }
}

/// What to say of the settings file `earlier` that a start after `step` steps set aside: it
/// differed from the settings now in force, or it was not JSON at all (damaged), which is not
/// the same news.
fn earlier_settings_note(step: u64, earlier: &std::path::Path) -> String {
    let whose = if step == 0 { "the earlier start's" } else { "the run's until now" };
    let readable = std::fs::read(earlier).is_ok_and(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).is_ok());
    if readable {
        format!("the settings differ from {whose}; the earlier ones are kept in {}", earlier.display())
    } else {
        format!("{whose} settings file was not readable JSON (damaged?); it is kept as it was in {}, and the settings in force now are written anew", earlier.display())
    }
}

/// Notes how a run (`step` steps done, in `session`) resumed: that `--resume` found no
/// checkpoint, so that a new run starts (a mistyped out_dir would otherwise go unnoticed), or
/// which later checkpoints a resume from an earlier one set aside, and where.
pub fn note_resume(resume: trainer::run::Resume, step: u64, session: &trainer::run::RunSession) {
    if resume == trainer::run::Resume::Latest && step == 0 {
        eprintln!("note: --resume: {} holds no checkpoint yet, so a new run starts", session.dir().display());
    }
    if let Some(aside) = session.set_aside() {
        let steps: Vec<String> = aside.steps.iter().map(u64::to_string).collect();
        eprintln!(
            "note: the run goes on from step {step}; its later checkpoints (steps {}) and their metrics lines are kept in {}",
            steps.join(", "),
            aside.folder.display()
        );
    }
    if let Some(earlier) = session.earlier_config() {
        eprintln!("note: {}", earlier_settings_note(step, earlier));
    }
    if let Some(earlier) = session.earlier_metrics() {
        eprintln!(
            "note: an earlier start of this run stopped before its first checkpoint; its metrics lines are kept in {}",
            earlier.display()
        );
    }
}

/// What to try when an optimiser step was skipped for a non-finite gradient norm.
pub const NAN_HINT: &str = "on a GPU, burn 0.21's kernel fusion can give NaNs: try --fusion off";

/// The progress bar of a run of `total` steps, `done` of them already made.
pub fn step_bar(total: u64, done: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total).with_position(done);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
            .expect("valid template"),
    );
    bar
}

/// Says how many parameters LoRA trains, against the frozen base's.
pub fn print_lora_share(trained: usize, base: usize, dtype: trainer::run::ModelDtype) {
    eprintln!(
        "LoRA: {trained} trainable parameters ({:.2}% of the base's {base}), base weights in {}",
        100.0 * trained as f64 / base as f64,
        match dtype {
            trainer::run::ModelDtype::F32 => "f32",
            trainer::run::ModelDtype::Bf16 => "bf16",
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_in_the_way_of_a_directory_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("results");
        std::fs::write(&file, "x").unwrap();
        for dir in [file.clone(), file.join("sub")] {
            let err = create_dir(&dir).unwrap_err().to_string();
            assert!(err.contains(&format!("{} is a file, not a directory", file.display())), "{err}");
        }
        let err = create_parent(&file.join("m.json")).unwrap_err().to_string();
        assert!(err.contains("is a file, not a directory"), "{err}");
        let nested = tmp.path().join("a/b/m.json");
        create_parent(&nested).unwrap();
        assert!(tmp.path().join("a/b").is_dir());
        create_parent(std::path::Path::new("m.json")).unwrap();
    }

    /// A settings file set aside is said to differ when it was JSON, and to be damaged when not.
    #[test]
    fn a_damaged_settings_file_is_not_said_to_differ() {
        let dir = tempfile::tempdir().unwrap();
        let earlier = dir.path().join("run_config.up-to-step-1.json");
        std::fs::write(&earlier, "{\"lr\": 1}").unwrap();
        let note = earlier_settings_note(1, &earlier);
        assert!(note.starts_with("the settings differ from the run's until now"), "{note}");
        std::fs::write(&earlier, "{").unwrap();
        let note = earlier_settings_note(1, &earlier);
        assert!(note.contains("not readable JSON") && note.contains("run_config.up-to-step-1.json"), "{note}");
    }
}

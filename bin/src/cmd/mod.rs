//! One module per subcommand: each has an `Args` (clap) and a `run(args) -> anyhow::Result<()>`.

pub mod env_check;
pub mod bench;
pub mod check_device;
pub mod demo;
pub mod export;
pub mod generate;
pub mod init_model;
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

/// What in `dir` shows that it already holds a model or adapter (a safetensors file, its shard
/// index, or a `config.json`), so that writing there without `--force` is refused.
pub fn existing_model(dir: &std::path::Path) -> Option<String> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut names: Vec<String> = entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name == "config.json" || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json"))
        .collect();
    names.sort();
    names.into_iter().next()
}

/// Whether `a` and `b` name the same existing directory.
pub fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
}

/// Says so when `--resume` (`resume`) found no checkpoint in `dir`, so that the run starts at
/// step `step` = 0 (a mistyped out_dir would otherwise go unnoticed).
pub fn note_nothing_to_resume(resume: trainer::run::Resume, step: u64, dir: &std::path::Path) {
    if resume == trainer::run::Resume::Latest && step == 0 {
        eprintln!("note: --resume: {} holds no checkpoint yet, so a new run starts", dir.display());
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
        "LoRA: {trained} trainable parameters ({:.2}% of the base's {base}), base weights in {dtype:?}",
        100.0 * trained as f64 / base as f64
    );
}

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

//! `prompt-r1 plot`: training curves of a run directory's `metrics.jsonl`, drawn to a PNG.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use trainer::run::{read_metrics, StepRecord, METRICS_FILE};
use trainer::sft::{is_sft_run, read_sft_metrics, SftRecord};

use crate::plot::chart::{BLUE, BROWN, GREEN, LIGHT_BLUE, ORANGE, PURPLE, RED};
use crate::plot::{Band, Figure, Panel, Series, Style};

/// Draw a run's training curves (from RUN_DIR/metrics.jsonl) as a grid of charts in a PNG.
///
/// Panels of a GRPO run: reward mean with a ±std band and validation points, format and F1
/// means, loss and policy-gradient loss, KL, clip fractions, gradient norm, entropy, response
/// tokens and turns, peak memory. Of an SFT run (`prompt-r1 sft`): training loss with the
/// validation points, learning rate, gradient norm, trained tokens per step and per second,
/// peak memory. A quantity the run did not record is drawn as an empty panel saying "n/a".
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Run directory holding metrics.jsonl.
    pub run_dir: PathBuf,
    /// PNG file to write (atomically; its name ends in .png); default RUN_DIR/curves.png.
    #[arg(long, value_parser = png_path)]
    pub out: Option<PathBuf>,
    /// Image width in pixels (300 to 8000).
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(300..=8000))]
    pub width: u32,
    /// Image height in pixels (200 to 8000).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(200..=8000))]
    pub height: u32,
}

/// A path for the PNG `plot` writes: one named otherwise (`.jpg`, `.svg`) would hold PNG bytes
/// under another format's name.
fn png_path(text: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(text);
    match path.extension().and_then(|e| e.to_str()) {
        Some(ext) if ext.eq_ignore_ascii_case("png") => Ok(path),
        _ => Err("plot writes PNG images: give a file name ending in .png".into()),
    }
}

pub fn run(args: Args) -> Result<()> {
    let metrics = args.run_dir.join(METRICS_FILE);
    if !metrics.is_file() {
        bail!(
            "{}: not found (is {} a training run directory?)",
            metrics.display(),
            args.run_dir.display()
        );
    }
    let figure = if is_sft_run(&args.run_dir) {
        let mut records = read_sft_metrics(&args.run_dir)?;
        if records.is_empty() {
            bail!("{}: no steps recorded", metrics.display());
        }
        records.sort_by_key(|r| r.step);
        let last = records.last().expect("records are not empty");
        Figure {
            title: format!(
                "SFT run {}: {}, last step {}, loss {:.4}",
                run_name(&args.run_dir),
                steps(records.len()),
                last.step,
                last.loss
            ),
            cols: 3,
            panels: sft_panels(&records),
        }
    } else {
        let mut records = read_metrics(&args.run_dir)?;
        // Step 0 holds only the validation before training, no training metrics.
        records.retain(|r| r.step > 0);
        if records.is_empty() {
            bail!("{}: no steps recorded", metrics.display());
        }
        records.sort_by_key(|r| r.step);
        Figure {
            title: figure_title(&args.run_dir, &records),
            cols: 3,
            panels: panels(&records),
        }
    };
    let png = figure.render_png(args.width, args.height)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| args.run_dir.join("curves.png"));
    super::create_parent(&out)?;
    model::checkpoint::write_atomic(&out, &png)
        .with_context(|| format!("cannot write {}", out.display()))?;
    println!(
        "wrote {} ({})",
        out.display(),
        steps(figure.panels[0].xs.len())
    );
    Ok(())
}

fn steps(n: usize) -> String {
    if n == 1 {
        "1 step".into()
    } else {
        format!("{n} steps")
    }
}

fn run_name(run_dir: &Path) -> String {
    run_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| run_dir.display().to_string())
}

fn figure_title(run_dir: &Path, records: &[StepRecord]) -> String {
    let last = records.last().expect("records are not empty");
    format!(
        "run {}: {}, last step {}, reward {:.3}",
        run_name(run_dir),
        steps(records.len()),
        last.step,
        last.reward_mean
    )
}

/// The six panels of an SFT run, in reading order.
pub fn sft_panels(records: &[SftRecord]) -> Vec<Panel> {
    let xs: Vec<f64> = records.iter().map(|r| r.step as f64).collect();
    let series =
        |f: fn(&SftRecord) -> Option<f64>| -> Vec<Option<f64>> { records.iter().map(f).collect() };
    let line = |name: &str, color, values| Series::new(name, color, Style::Line, values);
    let panel = |title: &str| Panel::new(title, xs.clone());
    vec![
        panel("loss")
            .left(line("train", BLUE, series(|r| Some(f64::from(r.loss)))))
            .left(Series::new(
                "validation",
                ORANGE,
                Style::Points,
                series(|r| r.validation_loss.map(f64::from)),
            )),
        panel("learning rate").left(line("lr", GREEN, series(|r| Some(r.lr)))),
        panel("grad norm").left(line(
            "grad norm",
            BLUE,
            series(|r| r.grad_norm.map(f64::from)),
        )),
        panel("trained tokens per step").left(line(
            "tokens",
            PURPLE,
            series(|r| Some(r.tokens as f64)),
        )),
        panel("trained tokens / s").left(line(
            "tokens/s",
            RED,
            series(|r| Some(f64::from(r.tokens_per_sec))),
        )),
        panel("peak RSS (MB)").left(line(
            "peak rss",
            BROWN,
            series(|r| r.peak_rss_mb.map(f64::from)),
        )),
    ]
}

/// The nine panels, in reading order.
pub fn panels(records: &[StepRecord]) -> Vec<Panel> {
    let xs: Vec<f64> = records.iter().map(|r| r.step as f64).collect();
    let req = |f: fn(&StepRecord) -> f32| -> Vec<Option<f64>> {
        records.iter().map(|r| Some(f(r) as f64)).collect()
    };
    let opt = |f: fn(&StepRecord) -> Option<f32>| -> Vec<Option<f64>> {
        records.iter().map(|r| f(r).map(|v| v as f64)).collect()
    };
    let line = |name: &str, color, values| Series::new(name, color, Style::Line, values);
    let points = |name: &str, color, values| Series::new(name, color, Style::Points, values);
    let panel = |title: &str| Panel::new(title, xs.clone());
    let band = Band {
        name: "\u{b1}std".into(),
        color: LIGHT_BLUE,
        lo: req(|r| r.reward_mean - r.reward_std),
        hi: req(|r| r.reward_mean + r.reward_std),
    };
    vec![
        panel("reward")
            .band(band)
            .left(line("mean", BLUE, req(|r| r.reward_mean)))
            .left(points("validation", ORANGE, opt(|r| r.validation_reward))),
        panel("format & F1")
            .left(line("format", GREEN, opt(|r| r.format_mean)))
            .left(line("f1", PURPLE, opt(|r| r.f1_mean)))
            .left(points("val f1", ORANGE, opt(|r| r.validation_f1))),
        panel("loss")
            .left(line("loss", BLUE, req(|r| r.loss)))
            .left(line("pg_loss", ORANGE, req(|r| r.pg_loss))),
        panel("KL").left(line("kl", RED, opt(|r| r.kl))).left(line(
            "approx_kl",
            PURPLE,
            req(|r| r.policy.approx_kl),
        )),
        panel("clip fraction")
            .left(line("clip", BLUE, req(|r| r.policy.clip_frac)))
            .left(line("dual clip", ORANGE, req(|r| r.policy.dual_clip_frac))),
        panel("grad norm").left(line("grad norm", BLUE, opt(|r| r.grad_norm))),
        panel("entropy").left(line("entropy", GREEN, opt(|r| r.entropy))),
        panel("tokens & turns")
            .left(line("tokens", BLUE, req(|r| r.mean_response_tokens)))
            .right(line("turns", ORANGE, req(|r| r.mean_turns))),
        panel("peak RSS (MB)").left(line("peak rss", BROWN, opt(|r| r.peak_rss_mb))),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records() -> Vec<StepRecord> {
        (1..=4)
            .map(|s| StepRecord {
                step: s,
                reward_mean: 0.1 * s as f32,
                reward_std: 0.05,
                kl: Some(0.01),
                validation_reward: (s % 2 == 0).then_some(0.5),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn panels_follow_the_records_and_missing_series_are_n_a() {
        let panels = panels(&records());
        assert_eq!(panels.len(), 9);
        let by_title = |t: &str| panels.iter().find(|p| p.title == t).unwrap();
        let reward = by_title("reward");
        assert_eq!(reward.xs, vec![1.0, 2.0, 3.0, 4.0]);
        assert!((reward.left[0].values[3].unwrap() - 0.4).abs() < 1e-6);
        assert_eq!(
            reward.left[1].values,
            vec![None, Some(0.5), None, Some(0.5)]
        );
        let band = reward.band.as_ref().unwrap();
        assert!((band.hi[0].unwrap() - band.lo[0].unwrap() - 0.1).abs() < 1e-6);
        assert!(by_title("KL").has_data());
        for t in ["format & F1", "grad norm", "entropy", "peak RSS (MB)"] {
            assert!(!by_title(t).has_data(), "{t} should be n/a");
        }
        assert_eq!(by_title("tokens & turns").right.len(), 1);
    }
}

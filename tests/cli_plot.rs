//! CLI tests: `prompt-r1 plot` on a hand-written metrics.jsonl.

use std::path::Path;
use std::process::{Command, Output};

fn plot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prompt-r1"))
        .arg("plot")
        .args(args)
        .output()
        .expect("run prompt-r1")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One metrics line per step, as the trainer writes them (verl's metric names); validation every 5 steps, no
/// entropy or peak RSS (those panels say n/a).
fn metrics_line(step: u64) -> String {
    let s = step as f32;
    let validation = if step % 5 == 0 {
        format!(
            r#","val/reward/mean":{},"val/f1/mean":{}"#,
            0.2 + 0.02 * s,
            0.3 + 0.02 * s
        )
    } else {
        String::new()
    };
    format!(
        concat!(
            r#"{{"training/global_step":{step},"training/epoch":0,"critic/score/mean":{rm},"#,
            r#""critic/score/std":{rs},"reward/format/mean":{fm},"reward/f1/mean":{f1},"#,
            r#""actor/loss":{loss},"actor/pg_loss":{pg},"actor/kl_loss":{kl},"actor/pg_clipfrac":{cf},"#,
            r#""actor/pg_clipfrac_lower":0.0,"actor/ppo_kl":{akl},"actor/grad_norm":{gn},"#,
            r#""actor/optimizer_steps":1,"actor/skipped_steps":0,"rollout/env_failures":0,"#,
            r#""rollout/episodes":8,"rollout/agent_tokens":1200,"response_length/mean":{tok},"#,
            r#""num_turns/mean":{turns},"timing_s/gen":3.5,"timing_s/update_actor":1.25,"#,
            r#""perf/gen_tokens_per_s":340.0{validation}}}"#
        ),
        step = step,
        rm = 0.1 + 0.03 * s,
        rs = 0.2 - 0.005 * s,
        fm = 0.5 + 0.02 * s,
        f1 = 0.05 + 0.025 * s,
        loss = 0.3 / s,
        pg = -0.1 + 0.2 / s,
        kl = 0.001 * s,
        cf = 0.02 * (s % 3.0),
        akl = 0.0005 * s,
        gn = 1.5 + (s * 0.7).sin(),
        tok = 150.0 + 4.0 * s,
        turns = 1.0 + 0.05 * s,
        validation = validation,
    )
}

fn write_metrics(dir: &Path, lines: &[String]) {
    let mut body = lines.join("\n");
    body.push('\n');
    std::fs::write(dir.join("metrics.jsonl"), body).unwrap();
}

fn twenty_steps(dir: &Path) {
    let lines: Vec<String> = (1..=20).map(metrics_line).collect();
    write_metrics(dir, &lines);
}

/// Decodes a PNG file: (width, height, RGB(A) bytes, bytes per pixel).
fn decode(path: &Path) -> (u32, u32, Vec<u8>, usize) {
    let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let mut reader = png::Decoder::new(file).read_info().expect("a PNG header");
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).expect("PNG image data");
    buf.truncate(info.buffer_size());
    let bpp = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("unexpected colour type {other:?}"),
    };
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    (info.width, info.height, buf, bpp)
}

fn distinct_colours(buf: &[u8], bpp: usize) -> usize {
    let set: std::collections::HashSet<&[u8]> = buf.chunks(bpp).collect();
    set.len()
}

#[test]
fn plot_writes_curves_png_in_the_run_dir() {
    let dir = tempfile::tempdir().unwrap();
    twenty_steps(dir.path());
    let output = plot(&[dir.path().to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let png_path = dir.path().join("curves.png");
    assert!(
        text(&output.stdout).contains("curves.png"),
        "{}",
        text(&output.stdout)
    );
    assert!(
        text(&output.stdout).contains("20 steps"),
        "{}",
        text(&output.stdout)
    );
    let (w, h, buf, bpp) = decode(&png_path);
    assert_eq!((w, h), (1500, 1000));
    assert_eq!(buf.len(), (w * h) as usize * bpp);
    // Background, axes, grid, several series colours, the band.
    assert!(
        distinct_colours(&buf, bpp) >= 8,
        "{} colours",
        distinct_colours(&buf, bpp)
    );
    // Mostly background, but well over a few pixels of ink.
    let white = buf
        .chunks(bpp)
        .filter(|p| p[..3] == [255, 255, 255])
        .count();
    let total = (w * h) as usize;
    assert!(
        white > total / 2 && white < total - 20_000,
        "{white} white of {total}"
    );
    // Written atomically: no temporary file is left behind.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, ["curves.png", "metrics.jsonl"], "{names:?}");
}

#[test]
fn plot_honours_out_and_size() {
    let dir = tempfile::tempdir().unwrap();
    twenty_steps(dir.path());
    let out = dir.path().join("figs").join("small.png");
    let output = plot(&[
        dir.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--width",
        "640",
        "--height",
        "420",
    ]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let (w, h, buf, bpp) = decode(&out);
    assert_eq!((w, h), (640, 420));
    assert!(distinct_colours(&buf, bpp) >= 5);
    assert!(!dir.path().join("curves.png").exists());
    // PNG bytes are not written under another format's name.
    let jpg = dir.path().join("small.jpg");
    let output = plot(&[dir.path().to_str().unwrap(), "--out", jpg.to_str().unwrap()]);
    assert!(!output.status.success() && text(&output.stderr).contains("ending in .png"), "{}", text(&output.stderr));
    assert!(!jpg.exists());
}

#[test]
fn a_single_step_still_plots() {
    let dir = tempfile::tempdir().unwrap();
    write_metrics(dir.path(), &[metrics_line(7)]);
    let output = plot(&[dir.path().to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let (_, _, buf, bpp) = decode(&dir.path().join("curves.png"));
    assert!(distinct_colours(&buf, bpp) >= 5);
}

#[test]
fn malformed_line_fails_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (1..=5).map(metrics_line).collect();
    lines[2] = r#"{"training/global_step": 3, "critic/score/mean": "#.into();
    write_metrics(dir.path(), &lines);
    let output = plot(&[dir.path().to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let err = text(&output.stderr);
    assert!(err.contains("metrics.jsonl"), "{err}");
    assert!(err.contains("line 3"), "{err}");
    assert!(!dir.path().join("curves.png").exists());
}

#[test]
fn missing_or_empty_metrics_fails() {
    let dir = tempfile::tempdir().unwrap();
    let output = plot(&[dir.path().to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let err = text(&output.stderr);
    assert!(
        err.contains("metrics.jsonl") && err.contains("not found"),
        "{err}"
    );
    assert!(!dir.path().join("curves.png").exists());

    std::fs::write(dir.path().join("metrics.jsonl"), "\n").unwrap();
    let output = plot(&[dir.path().to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let err = text(&output.stderr);
    assert!(
        err.contains("metrics.jsonl") && err.contains("no steps"),
        "{err}"
    );
}

#[test]
fn bad_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    twenty_steps(dir.path());
    for (flag, value, range) in [("--width", "10", "300..=8000"), ("--height", "9000", "200..=8000")] {
        let output = plot(&[dir.path().to_str().unwrap(), flag, value]);
        assert_eq!(output.status.code(), Some(2), "clap's usage error");
        let err = text(&output.stderr);
        assert!(err.contains(flag) && err.contains(range), "{err}");
    }
    assert!(!dir.path().join("curves.png").exists());
}

//! CLI tests: `prompt-r1 sft` on a tiny random model, as a user runs it, with `--resume`,
//! `plot` and `export` on its run, and the errors of a malformed row and of a run that exists.

use std::path::Path;
use std::process::{Command, Output};

fn prompt_r1(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prompt-r1"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn ok(args: &[&str]) -> Output {
    let out = prompt_r1(args);
    assert!(
        out.status.success(),
        "prompt-r1 {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A tiny model, six chats and a config: 4 steps of 4 rows, a checkpoint every 2 steps,
/// the chats also as validation rows.
fn setup(dir: &Path) -> String {
    let model = dir.join("tiny");
    ok(&[
        "init-model",
        "--preset",
        "tiny",
        "--out",
        model.to_str().unwrap(),
        "--seed",
        "2",
    ]);
    let rows: String = ["Oslo", "Lima", "Rome", "Bern", "Kyiv", "Riga"]
        .iter()
        .map(|city| {
            format!(
                "{{\"messages\": [{{\"role\": \"user\", \"content\": \"Where is {city}?\"}}, \
                 {{\"role\": \"assistant\", \"content\": \"{city} is a capital.\"}}], \"source\": \"demo\"}}\n"
            )
        })
        .collect();
    std::fs::write(dir.join("chats.jsonl"), rows).unwrap();
    let config = dir.join("sft.toml");
    std::fs::write(
        &config,
        "model = \"tiny\"\n[data]\ntrain = [\"chats.jsonl\"]\nvalidation = [\"chats.jsonl\"]\n\
         [train]\nsteps = 4\nbatch_size = 4\nmicro_batch_size = 2\n[optimizer]\nlr = 0.003\n\
         [run]\nout_dir = \"run\"\nsave_every = 2\nvalidate_every = 2\n",
    )
    .unwrap();
    config.to_str().unwrap().to_owned()
}

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A run writes its metrics under the documented names and checkpoints that `--resume`
/// continues; `plot` draws it and `export` writes a model that `generate` runs.
#[test]
fn sft_trains_resumes_plots_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let config = setup(tmp.path());
    // --resume with nothing to resume says that a new run starts.
    let out = ok(&["sft", "--config", &config, "--resume"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("training rows: 6 sequences (6 chats, 0 episodes)") && stderr.contains("holds no checkpoint yet, so a new run starts"),
        "{stderr}"
    );
    let run = tmp.path().join("run");
    let lines = metrics(&run);
    assert_eq!(lines.len(), 4);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["training/global_step"], i as u64 + 1);
        for key in [
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "train/tokens",
            "train/time(s)",
            "perf/tokens_per_s",
        ] {
            assert!(line[key].is_number(), "{key} in {line}");
        }
        assert_eq!(
            line["val/loss"].is_number(),
            i % 2 == 1,
            "validation every 2 steps: {line}"
        );
    }
    assert!(run.join("checkpoints/step-0000002/model.safetensors").is_file());
    assert_eq!(
        std::fs::read_to_string(run.join("checkpoints/latest")).unwrap(),
        "step-0000004"
    );

    let out = ok(&["sft", "--config", &config, "--resume", "--steps", "6"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("step-0000006") && !stderr.contains("no checkpoint yet"), "{stderr}");
    let steps: Vec<u64> = metrics(&run)
        .iter()
        .map(|l| l["training/global_step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    let err = prompt_r1(&["sft", "--config", &config]);
    assert!(!err.status.success() && String::from_utf8_lossy(&err.stderr).contains("--resume"));

    let out = ok(&["plot", run.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("6 steps"));
    assert!(run.join("curves.png").is_file());
    let exported = tmp.path().join("exported");
    ok(&["export", run.to_str().unwrap(), "--out", exported.to_str().unwrap()]);
    let text = ok(&[
        "generate",
        "--model",
        exported.to_str().unwrap(),
        "--prompt",
        "Where is Oslo?",
        "--chat",
        "--max-new-tokens",
        "4",
    ]);
    assert!(!text.stdout.is_empty());
}

/// `checkpoints/latest` naming a folder outside the run stops `--resume` with the file and its
/// content named; a damaged newest checkpoint stops it with `--resume-from` named, and
/// `--resume-from 2` continues the earlier checkpoint (its later metrics dropped).
#[test]
fn resume_from_an_earlier_checkpoint_when_the_newest_is_damaged() {
    let tmp = tempfile::tempdir().unwrap();
    let config = setup(tmp.path());
    ok(&["sft", "--config", &config]);
    let run = tmp.path().join("run");
    let latest = run.join("checkpoints/latest");

    // A checkpoint of another run, reachable by a relative path from this one's checkpoints.
    let outside = tmp.path().join("other/step-0000004");
    std::fs::create_dir_all(outside.parent().unwrap()).unwrap();
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    };
    copy(&run.join("checkpoints/step-0000004"), &outside);
    std::fs::write(&latest, "../../other/step-0000004").unwrap();
    let out = prompt_r1(&["sft", "--config", &config, "--resume", "--steps", "6"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("checkpoints/latest") && stderr.contains("\"../../other/step-0000004\""),
        "{stderr}"
    );
    std::fs::write(&latest, "step-0000004").unwrap();

    let optimizer = run.join("checkpoints/step-0000004/optimizer.bin");
    std::fs::write(&optimizer, b"damaged").unwrap();
    let out = prompt_r1(&["sft", "--config", &config, "--resume", "--steps", "6"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("optimizer.bin")
            && stderr.contains("--resume-from STEP")
            && stderr.contains("step 2"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = ok(&["sft", "--config", &config, "--resume-from", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("step-0000004"));
    let steps: Vec<u64> = metrics(&run)
        .iter()
        .map(|l| l["training/global_step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    assert_eq!(std::fs::read_to_string(&latest).unwrap(), "step-0000004");
    ok(&["sft", "--config", &config, "--resume", "--steps", "5"]);
    let out = prompt_r1(&["sft", "--config", &config, "--resume-from", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("step-0000003"), "{stderr}");
}

/// A malformed row stops the run before any step, naming the file and the line.
/// A row longer than the model's context is cut to it, and counted, when `data.max_length`
/// is unset or larger.
#[test]
fn rows_are_cut_to_the_models_context() {
    let tmp = tempfile::tempdir().unwrap();
    let config = setup(tmp.path());
    let model_config = tmp.path().join("tiny/config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&model_config).unwrap()).unwrap();
    json["max_position_embeddings"] = 96.into();
    std::fs::write(&model_config, json.to_string()).unwrap();
    let chats = tmp.path().join("chats.jsonl");
    let mut text = std::fs::read_to_string(&chats).unwrap();
    let long = "Oslo is a capital. ".repeat(40);
    text.push_str(&format!(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"Tell me of Oslo.\"}}, {{\"role\": \"assistant\", \"content\": \"{long}\"}}]}}\n"
    ));
    std::fs::write(&chats, text).unwrap();
    let out = ok(&["sft", "--config", &config, "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("training rows: 7 sequences (7 chats, 0 episodes)") && stderr.contains("1 cut to data.max_length or the model's context"),
        "{stderr}"
    );
}

#[test]
fn a_bad_row_is_named_by_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let config = setup(tmp.path());
    let chats = tmp.path().join("chats.jsonl");
    let mut text = std::fs::read_to_string(&chats).unwrap();
    text.push_str("{\"messages\": [{\"role\": \"user\", \"content\": \"no answer\"}]}\n");
    std::fs::write(&chats, text).unwrap();
    let out = prompt_r1(&["sft", "--config", &config]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("chats.jsonl: line 7: messages hold no assistant message"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!tmp.path().join("run/metrics.jsonl").exists());
}

/// LoRA adapters serve as an agent (`eval --agent` of the exported adapter, or of the run), as
/// their merged export does; `export` refuses a base model other than the one they were trained
/// on, as the checkpoint records it: another model passed with `--base`, or the base replaced in
/// place.
#[test]
fn lora_adapters_act_as_agents_and_refuse_another_base() {
    let tmp = tempfile::tempdir().unwrap();
    let config = setup(tmp.path());
    let text = std::fs::read_to_string(&config).unwrap().replace("steps = 4", "steps = 2");
    std::fs::write(&config, format!("{text}[lora]\nrank = 2\nalpha = 4\n")).unwrap();
    ok(&["sft", "--config", &config]);
    let (run, path) = (tmp.path().join("run"), |name: &str| tmp.path().join(name).to_str().unwrap().to_owned());
    // In f32, the merge `export` writes is the one an agent merges at load.
    ok(&["export", run.to_str().unwrap(), "--out", &path("merged"), "--merge", "--dtype", "f32"]);
    ok(&["export", run.to_str().unwrap(), "--out", &path("adapter")]);

    // The adapters as an agent (merged at load), or the run itself, answer as the merged model.
    std::fs::write(tmp.path().join("questions.jsonl"), "{\"id\": \"1\", \"data_source\": \"d\", \"question\": \"Where is Oslo?\", \"answers\": [\"Norway\"]}\n").unwrap();
    let answers = |agent: &str| {
        let out = path(&format!("eval-{agent}"));
        let args = ["eval", "--data", &path("questions.jsonl"), "--out", &out, "--mode", "agent-only", "--agent", &path(agent), "--max-turns", "1", "--max-turn-tokens", "8"];
        ok(&args);
        let row: serde_json::Value = serde_json::from_str(std::fs::read_to_string(Path::new(&out).join("predictions.jsonl")).unwrap().lines().next().unwrap()).unwrap();
        row["trajectory"]["token_ids"].clone()
    };
    let merged = answers("merged");
    assert!(merged.as_array().is_some_and(|ids| !ids.is_empty()));
    assert_eq!(answers("adapter"), merged);
    assert_eq!(answers("run"), merged);

    ok(&["init-model", "--preset", "tiny", "--seed", "9", "--out", &path("other")]);
    let out = prompt_r1(&["export", run.to_str().unwrap(), "--out", &path("onto-other"), "--merge", "--base", &path("other")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is not the base model") && stderr.contains("pass that model with --base"), "{stderr}");

    ok(&["init-model", "--preset", "tiny", "--seed", "9", "--out", &path("tiny"), "--force"]);
    for extra in [&["--merge"][..], &[][..]] {
        let out = prompt_r1(&[&["export", run.to_str().unwrap(), "--out", &path("onto-changed")][..], extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {stderr}");
        assert!(stderr.contains("changed since"), "{extra:?}: {stderr}");
    }
    assert!(!tmp.path().join("onto-changed").exists() && !tmp.path().join("onto-other").exists());
    let out = prompt_r1(&["eval", "--data", &path("questions.jsonl"), "--out", &path("eval-changed"), "--mode", "agent-only", "--agent", &path("adapter")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("changed since"), "{stderr}");
}

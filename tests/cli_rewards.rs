//! CLI tests: the `prompt-r1` binary's rewards commands, run as a user would run them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn prompt_r1(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prompt-r1"))
        .args(args)
        .output()
        .expect("run prompt-r1")
}

fn stdout_json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("stdout is JSON")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `<workspace>/../shared/<rel>`, or `None` (reason printed) when absent outside CI.
fn shared(rel: &str) -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared")
        .join(rel);
    if path.exists() {
        return Some(path);
    }
    assert_ne!(
        std::env::var("CI").as_deref(),
        Ok("true"),
        "{} is missing in CI",
        path.display()
    );
    eprintln!("skipping: {} not found", path.display());
    None
}

const CALL_THEN_ANSWER: &str = "<|im_start|>system\nYou are Qwen.<|im_end|>\n\
<|im_start|>user\nQuestion: What is the capital of France?<|im_end|>\n\
<|im_start|>assistant\n<think>Ask the model.</think>\n<interaction_prompt>{\"name\": \"prompt\", \"arguments\": {\"prompt\": \"Capital of France?\"}}</interaction_prompt><|im_end|>\n\
<|im_start|>user\n<interaction_response>\n{\"results\": [\"Paris.\"]}\n</interaction_response><|im_end|>\n\
<|im_start|>assistant\n<think>\nIt says Paris.</think>\n<answer>Paris, France</answer><|im_end|>\n";

#[test]
fn reward_json_of_a_call_then_answer() {
    let dir = tempfile::tempdir().unwrap();
    let episode = write(dir.path(), "episode.txt", CALL_THEN_ANSWER);
    let output = prompt_r1(&[
        "reward",
        "--episode",
        episode.to_str().unwrap(),
        "--answers",
        r#"["Paris"]"#,
        "--json",
    ]);
    let json = stdout_json(&output);
    // Format 0.4 + 0.25 + 0.25 + 0.1 = 1.0 → gate passed → reward = F1.
    // F1: [paris, france] vs [paris] → P 1/2, R 1 → 2/3.
    assert_eq!(json["format"], 1.0);
    assert_eq!(json["format_raw"], 1.0);
    assert_eq!(json["em"], 0.0);
    let f1 = json["f1"].as_f64().unwrap();
    assert!((f1 - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(json["reward"].as_f64().unwrap(), f1);
    assert_eq!(json.as_object().unwrap().len(), 5);
}

/// An episode as `infer --json` prints it, and an `eval` predictions row (answers included),
/// score as their decoded text does.
#[test]
fn reward_reads_saved_episodes_and_predictions_rows() {
    let dir = tempfile::tempdir().unwrap();
    let (prompt, response) = CALL_THEN_ANSWER.split_at(CALL_THEN_ANSWER.find("<|im_start|>assistant").unwrap());
    let trajectory = serde_json::json!({"question": "q", "prompt_text": prompt, "response_text": response, "turns": []});
    let saved = write(dir.path(), "episode.json", &trajectory.to_string());
    let row = serde_json::json!({"data_source": "nq", "id": "1", "answers": ["Paris"], "trajectory": trajectory});
    let row = write(dir.path(), "row.json", &format!("{row}\n"));
    let text = write(dir.path(), "episode.txt", CALL_THEN_ANSWER);
    let score = |file: &Path, answers: Option<&str>| {
        let mut args = vec!["reward", "--episode", file.to_str().unwrap(), "--json"];
        if let Some(answers) = answers {
            args.extend(["--answers", answers]);
        }
        stdout_json(&prompt_r1(&args))
    };
    let expected = score(&text, Some(r#"["Paris"]"#));
    assert!((expected["reward"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12, "{expected}");
    assert_eq!(score(&saved, Some(r#"["Paris"]"#)), expected);
    assert_eq!(score(&row, None), expected);
    assert_eq!(score(&row, Some(r#"["Paris, France"]"#))["reward"], 1.0);

    let needs_answers = prompt_r1(&["reward", "--episode", saved.to_str().unwrap()]);
    assert!(!needs_answers.status.success());
    assert!(String::from_utf8_lossy(&needs_answers.stderr).contains("--answers is needed"));
    let not_an_episode = write(dir.path(), "other.json", r#"{"messages": []}"#);
    let output = prompt_r1(&["reward", "--episode", not_an_episode.to_str().unwrap(), "--answers", r#"["x"]"#]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("other.json") && stderr.contains("`prompt_text`"), "{stderr}");
}

#[test]
fn reward_text_shows_the_terms_of_each_turn() {
    let dir = tempfile::tempdir().unwrap();
    let direct = "<|im_start|>assistant\n<think>Easy.</think><answer>Paris</answer><|im_end|>\n";
    let episode = write(dir.path(), "direct.txt", direct);
    let output = prompt_r1(&[
        "reward",
        "--episode",
        episode.to_str().unwrap(),
        "--answers",
        r#"["Paris"]"#,
    ]);
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    // No call: format 0.6, gate not passed → reward 0.6 − 1 = −0.4.
    assert!(text.contains("reward      -0.4000"), "{text}");
    assert!(text.contains("gate not passed"), "{text}");
    assert!(
        text.contains("turn 1 (final): answer_tag, answer_non_empty, think_answer_layout"),
        "{text}"
    );
}

#[test]
fn reward_config_file_changes_the_constants() {
    let dir = tempfile::tempdir().unwrap();
    let direct = "<|im_start|>assistant\n<think>Easy.</think><answer>Paris</answer><|im_end|>\n";
    let episode = write(dir.path(), "direct.txt", direct);
    // Final-turn terms 0.5 + 0.25 + 0.25 = 1.0 reach the gate → reward = F1 = 1.
    let config = write(
        dir.path(),
        "reward.json",
        r#"{"answer_tag": 0.5, "think_answer_layout": 0.25}"#,
    );
    let output = prompt_r1(&[
        "reward",
        "--episode",
        episode.to_str().unwrap(),
        "--answers",
        r#"["Paris"]"#,
        "--config",
        config.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(stdout_json(&output)["reward"], 1.0);
}

#[test]
fn reward_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let episode = write(dir.path(), "episode.txt", CALL_THEN_ANSWER);
    let bad_answers = prompt_r1(&[
        "reward",
        "--episode",
        episode.to_str().unwrap(),
        "--answers",
        "Paris",
    ]);
    assert!(!bad_answers.status.success());
    assert!(String::from_utf8_lossy(&bad_answers.stderr)
        .contains("--answers must be a JSON array of strings"));

    let missing = dir.path().join("absent.txt");
    let output = prompt_r1(&[
        "reward",
        "--episode",
        missing.to_str().unwrap(),
        "--answers",
        r#"["x"]"#,
    ]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("absent.txt"));
}

const PREDICTIONS: &str = r#"{"data_source": "hotpot", "prediction": "Paris", "answers": ["Paris"], "id": 1}
{"data_source": "hotpot", "prediction": "Paris, France", "answers": ["Lyon", "Paris"]}

{"data_source": "gsm8k", "prediction": "", "answers": ["3"]}
{"data_source": "gsm8k", "prediction": "The answer is 3", "answers": ["3"]}
"#;

#[test]
fn metrics_json_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let predictions = write(dir.path(), "predictions.jsonl", PREDICTIONS);
    let output = prompt_r1(&[
        "metrics",
        "--predictions",
        predictions.to_str().unwrap(),
        "--json",
    ]);
    let json = stdout_json(&output);
    // hotpot: EM (1 + 0)/2 = 50; SM (1 + 1)/2 = 100; F1 (1 + 2/3)/2 = 83.33…
    let hotpot = &json["datasets"]["hotpot"];
    assert_eq!(hotpot["n"], 2);
    assert_eq!(hotpot["em"], 50.0);
    assert_eq!(hotpot["sm"], 100.0);
    assert!((hotpot["f1"].as_f64().unwrap() - 250.0 / 3.0).abs() < 1e-9);
    assert!(hotpot.get("ssim").is_none());
    // gsm8k: empty prediction scores 0; "answer is 3" vs "3": EM 0, SM 1, F1 = 2·(1/3)·1/(4/3) = 1/2.
    let gsm8k = &json["datasets"]["gsm8k"];
    assert_eq!(
        (
            gsm8k["em"].as_f64(),
            gsm8k["sm"].as_f64(),
            gsm8k["f1"].as_f64()
        ),
        (Some(0.0), Some(50.0), Some(25.0))
    );
    // overall: mean of the two sources; n = 4.
    let overall = &json["overall"];
    assert_eq!(overall["n"], 4);
    assert_eq!(overall["em"], 25.0);
    assert_eq!(overall["sm"], 75.0);
    assert!(overall.get("ssim").is_none());
}

#[test]
fn metrics_table_and_out_file() {
    let dir = tempfile::tempdir().unwrap();
    let predictions = write(dir.path(), "predictions.jsonl", PREDICTIONS);
    let out = dir.path().join("report.json");
    let output = prompt_r1(&[
        "metrics",
        "--predictions",
        predictions.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(lines[0].starts_with("data_source") && !lines[0].contains("SSim"));
    assert!(
        lines[1].starts_with("gsm8k")
            && lines[2].starts_with("hotpot")
            && lines[3].starts_with("overall")
    );
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(written["overall"]["n"], 4);
    assert_eq!(written["datasets"]["hotpot"]["em"], 50.0);
}

#[test]
fn metrics_bad_line_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let predictions = write(dir.path(), "bad.jsonl", "{\"data_source\": \"a\", \"prediction\": \"x\", \"answers\": [\"x\"]}\n{\"data_source\": \"a\", \"answers\": \"x\"}\n");
    let output = prompt_r1(&["metrics", "--predictions", predictions.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad.jsonl: line 2"), "{stderr}");
}

#[test]
fn metrics_with_the_ssim_model() {
    let Some(minilm) = shared("minilm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let predictions = write(
        dir.path(),
        "predictions.jsonl",
        "{\"data_source\": \"a\", \"prediction\": \"The cat sits on the mat.\", \"answers\": [\"Stock markets fell sharply.\", \"The cat sits on the mat.\"]}\n\
         {\"data_source\": \"b\", \"prediction\": \"\", \"answers\": [\"anything\"]}\n\
         {\"data_source\": \"c\", \"prediction\": \"A dog runs in the park.\", \"answers\": [\"Quarterly earnings beat forecasts.\"]}\n",
    );
    let output = prompt_r1(&[
        "metrics",
        "--predictions",
        predictions.to_str().unwrap(),
        "--ssim-model",
        minilm.to_str().unwrap(),
        "--json",
    ]);
    let json = stdout_json(&output);
    // Identical sentences: cosine 1 → 100; empty prediction: 0; unrelated: well below.
    let a = json["datasets"]["a"]["ssim"].as_f64().unwrap();
    assert!((a - 100.0).abs() < 1e-3, "{a}");
    assert_eq!(json["datasets"]["b"]["ssim"], 0.0);
    let c = json["datasets"]["c"]["ssim"].as_f64().unwrap();
    assert!(c < 50.0, "{c}");
    assert!(json["overall"]["ssim"].is_number());
}

//! `prompt-r1 infer` and `prompt-r1 eval` end to end: `serve` on the tiny random model plays
//! the large LLM; the agent is the tiny model itself (it rarely writes the tags, so those tests
//! check structure) or a scripted chat server that makes one call and then answers "4".

#[path = "../env/tests/common/mod.rs"]
mod common;
#[path = "serve_harness/mod.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{Action, ScriptedServer};
use harness::{text, Server};
use serde_json::Value;

const STOP_REASONS: [&str; 6] = [
    "answer",
    "no_call",
    "turn_limit",
    "token_limit",
    "env_failure",
    "agent_failure",
];

const SCRIPTED_CALL: &str =
    "<think>I should ask.</think>\n<interaction_prompt>What is 2+2?</interaction_prompt>";
const SCRIPTED_ANSWER: &str = "<think>It answered.</think>\n<answer>4</answer>";

/// A served agent, on /v1/completions (the raw context) and /v1/chat/completions: its first
/// turn calls the large LLM, the next one answers "4".
fn scripted_agent() -> ScriptedServer {
    ScriptedServer::start_with(|request| {
        let body = request.json();
        if request.path.ends_with("/chat/completions") {
            let turns = body["messages"].as_array().map_or(0, Vec::len);
            return Action::ok(if turns <= 2 {
                SCRIPTED_CALL
            } else {
                SCRIPTED_ANSWER
            });
        }
        let prompt = body["prompt"].as_str().unwrap_or_default();
        // A reply in the context: the instruction itself names the tag, so look for the frame.
        let text = if prompt.contains("<|im_start|>user\n<interaction_response>") {
            SCRIPTED_ANSWER
        } else {
            SCRIPTED_CALL
        };
        let reply = serde_json::json!({
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
        });
        Action::json(200, reply.to_string())
    })
}

/// A base URL on which nothing listens.
fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("http://127.0.0.1:{port}/v1")
}

fn run(args: &[&str]) -> Output {
    std::process::Command::new(harness::bin())
        .args(args)
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("run prompt-r1")
}

fn ok(args: &[&str]) -> String {
    let output = run(args);
    assert!(
        output.status.success(),
        "{args:?} failed:\n{}\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
    text(&output.stdout)
}

fn env_flags(server: &Server) -> Vec<String> {
    [
        "--env-url",
        &server.base_url,
        "--env-model",
        "tiny",
        "--env-max-tokens",
        "24",
    ]
    .map(String::from)
    .to_vec()
}

fn with<'a>(base: &'a [&'a str], extra: &'a [String]) -> Vec<&'a str> {
    base.iter()
        .copied()
        .chain(extra.iter().map(String::as_str))
        .collect()
}

fn check_trajectory(value: &Value) {
    assert!(
        value["answer"].is_null() || value["answer"].is_string(),
        "{value}"
    );
    let reason = value["stop_reason"]
        .as_str()
        .unwrap_or_else(|| panic!("no stop_reason: {value}"));
    assert!(STOP_REASONS.contains(&reason), "{reason}");
    assert!(value["error"].is_null() || value["error"].is_string());
    let turns = value["turns"].as_array().expect("turns");
    assert!(!turns.is_empty());
    for turn in turns {
        for key in ["think", "prompt", "response"] {
            let field = turn
                .get(key)
                .unwrap_or_else(|| panic!("no {key} in {turn}"));
            assert!(field.is_null() || field.is_string(), "{turn}");
        }
    }
}

#[test]
fn infer_with_the_local_agent_against_serve() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start(&model, &[]);
    let env = env_flags(&server);
    let base = [
        "infer",
        "--agent",
        model.to_str().unwrap(),
        "--question",
        "What is 2+2?",
        "--max-turn-tokens",
        "48",
    ];
    let stdout = ok(&with(&base, &env)
        .into_iter()
        .chain(["--json"])
        .collect::<Vec<_>>());
    let trajectory: Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    check_trajectory(&trajectory);
    assert_eq!(trajectory["question"], "What is 2+2?");
    assert!(trajectory["token_ids"]
        .as_array()
        .is_some_and(|ids| !ids.is_empty()));
    // Greedy by default: the same episode again.
    let again: Value = serde_json::from_str(
        ok(&with(&base, &env)
            .into_iter()
            .chain(["--json"])
            .collect::<Vec<_>>())
        .trim(),
    )
    .unwrap();
    assert_eq!(again["turns"], trajectory["turns"]);

    let shown = ok(&with(&base, &env));
    assert!(shown.contains("── turn 1 ──"), "{shown}");
    assert!(
        shown.contains("\nanswer: ") && shown.contains("\nstop reason: "),
        "{shown}"
    );
}

#[test]
fn infer_shows_each_turn_and_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let agent = scripted_agent();
    let env = env_flags(&server);
    let base = [
        "infer",
        "--agent-url",
        &agent.base_url,
        "--agent-model",
        "scripted",
        "--question",
        "What is 2+2?",
    ];
    let shown = ok(&with(&base, &env));
    for expected in [
        "── turn 1 ──",
        "think:\n  I should ask.",
        "prompt:\n  What is 2+2?",
        "reply (",
        "── turn 2 ──",
        "answer: 4",
        "stop reason: answer (1 call to the large LLM",
    ] {
        assert!(
            shown.contains(expected),
            "missing {expected:?} in:\n{shown}"
        );
    }
    let json: Value = serde_json::from_str(
        ok(&with(&base, &env)
            .into_iter()
            .chain(["--json"])
            .collect::<Vec<_>>())
        .trim(),
    )
    .unwrap();
    check_trajectory(&json);
    assert_eq!(json["answer"], "4");
    assert_eq!(json["stop_reason"], "answer");
    assert_eq!(json["turns"][0]["prompt"], "What is 2+2?");
    assert!(json["turns"][0]["response"].is_string());
    assert_eq!(json["turns"][1]["think"], "It answered.");
    assert!(json["error"].is_null());

    // By default the agent got the raw context it was trained on: the second turn's prompt
    // holds the first turn whole, its `<think>` included, and the reply as the local agent's
    // context frames it.
    let requests = agent.requests();
    assert!(requests.iter().all(|r| r.path == "/v1/completions"));
    let second = requests[1].json()["prompt"].as_str().unwrap().to_string();
    assert!(
        second.starts_with("<|im_start|>system\n")
            && second.contains(&format!(
                "<|im_start|>assistant\n{SCRIPTED_CALL}<|im_end|>\n<|im_start|>user\n<interaction_response>\n"
            ))
            && second.ends_with("</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n"),
        "{second}"
    );
    // `--agent-api chat` sends messages instead, and the episode is the same.
    let chat: Value = serde_json::from_str(
        ok(&with(&base, &env)
            .into_iter()
            .chain(["--json", "--agent-api", "chat"])
            .collect::<Vec<_>>())
        .trim(),
    )
    .unwrap();
    assert_eq!(chat["answer"], "4");
    assert_eq!(chat["turns"][1]["think"], "It answered.");
    let requests = agent.requests();
    assert!(requests[requests.len() - 1]
        .path
        .ends_with("/chat/completions"));
}

/// A served agent (`serve` on the tiny model, greedy) writes the same first turn as the same
/// model run locally: the completions prompt is the local agent's context.
#[test]
fn a_served_agent_sees_the_local_agent_s_context() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let env_server = Server::start(&model, &[]);
    let agent_server = Server::start(&model, &[]);
    let env = env_flags(&env_server);
    let common = [
        "infer",
        "--question",
        "What is 2+2?",
        "--max-turn-tokens",
        "24",
        "--json",
    ];
    let local: Value = serde_json::from_str(
        ok(&with(&common, &env)
            .into_iter()
            .chain(["--agent", model.to_str().unwrap()])
            .collect::<Vec<_>>())
        .trim(),
    )
    .unwrap();
    let served: Value = serde_json::from_str(
        ok(&with(&common, &env)
            .into_iter()
            .chain([
                "--agent-url",
                &agent_server.base_url,
                "--agent-model",
                "tiny",
            ])
            .collect::<Vec<_>>())
        .trim(),
    )
    .unwrap();
    check_trajectory(&served);
    assert_eq!(served["turns"][0]["text"], local["turns"][0]["text"]);
}

#[test]
fn infer_reports_an_unreachable_environment() {
    let agent = scripted_agent();
    let dead = dead_url();
    let output = run(&[
        "infer",
        "--agent-url",
        &agent.base_url,
        "--agent-model",
        "scripted",
        "--question",
        "q?",
        "--env-url",
        &dead,
        "--env-model",
        "m",
        "--env-attempts",
        "1",
        "--json",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let json: Value = serde_json::from_str(text(&output.stdout).trim()).unwrap();
    check_trajectory(&json);
    assert_eq!(json["stop_reason"], "env_failure");
    assert!(
        json["error"]
            .as_str()
            .is_some_and(|e| e.contains("connection")),
        "{json}"
    );
    assert!(json["answer"].is_null());
    let stderr = text(&output.stderr);
    assert!(stderr.starts_with("error: the episode failed"), "{stderr}");
    // As text, the cause is told once: in the command's error, not also in the turn display.
    let output = run(&[
        "infer", "--agent-url", &agent.base_url, "--agent-model", "scripted", "--question", "q?", "--env-url", &dead,
        "--env-model", "m", "--env-attempts", "1",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(stdout.contains("stop reason: env_failure") && !stdout.contains("error:"), "{stdout}");
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
    assert!(stderr.contains("the episode failed") && stderr.contains("connection"), "{stderr}");
    // A retry is told as it begins, so that a user at a terminal knows why nothing happens.
    let output = run(&[
        "infer", "--agent-url", &agent.base_url, "--agent-model", "scripted", "--question", "q?", "--env-url", &dead,
        "--env-model", "m", "--env-attempts", "2",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    let notes: Vec<&str> = stderr.lines().filter(|l| l.starts_with("note: the large LLM: ")).collect();
    assert_eq!(notes.len(), 1, "{stderr}");
    assert!(notes[0].contains("connection") && notes[0].ends_with("(attempt 2 of 2)"), "{stderr}");
}

#[test]
fn infer_needs_an_agent_and_an_environment() {
    let output = run(&[
        "infer",
        "--question",
        "q",
        "--env-url",
        "http://127.0.0.1:1/v1",
        "--env-model",
        "m",
    ]);
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains("--agent"),
        "{}",
        text(&output.stderr)
    );
    let output = run(&["infer", "--question", "q", "--agent", "/nonexistent"]);
    assert!(
        text(&output.stderr).contains("--env-url"),
        "{}",
        text(&output.stderr)
    );
}

/// Three questions in two data sources.
fn questions(dir: &Path) -> PathBuf {
    let path = dir.join("questions.jsonl");
    let rows = [
        r#"{"id": "a", "data_source": "toy", "question": "What is 2+2?", "answers": ["4"]}"#,
        r#"{"id": "b", "data_source": "toy", "question": "Capital of France?", "answers": ["Paris"]}"#,
        r#"{"id": "c", "data_source": "toy2", "question": "Two plus two?", "answers": ["four", "4"]}"#,
    ];
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path
}

fn rows(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("predictions.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect()
}

fn check_rows(rows: &[Value], mode: &str) {
    for row in rows {
        for key in [
            "id",
            "data_source",
            "question",
            "prediction",
            "answers",
            "mode",
            "trajectory",
            "stop_reason",
            "failed",
        ] {
            assert!(row.get(key).is_some(), "no {key} in {row}");
        }
        assert_eq!(row["mode"], mode);
        assert!(row["prediction"].is_string());
        assert!(STOP_REASONS.contains(&row["stop_reason"].as_str().unwrap()));
    }
}

fn metrics(out: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("metrics.json")).unwrap()).unwrap()
}

#[test]
fn eval_writes_predictions_and_metrics_then_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let agent = scripted_agent();
    let data = questions(dir.path());
    let out = dir.path().join("out");
    let env = env_flags(&server);
    let base = [
        "eval",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--agent-url",
        &agent.base_url,
        "--agent-model",
        "scripted",
        "--batch-size",
        "2",
    ];
    let args = with(&base, &env);
    let stdout = ok(&args);
    assert!(
        stdout.contains("overall") && stdout.contains("3 answered now"),
        "{stdout}"
    );
    let first = rows(&out);
    assert_eq!(first.len(), 3);
    check_rows(&first, "agent");
    assert!(first
        .iter()
        .all(|r| r["prediction"] == "4" && r["stop_reason"] == "answer"));
    assert!(first.iter().all(|r| r["trajectory"]["env_calls"] == 1));
    let report = metrics(&out);
    // toy: "4" is right once in two (EM 50), toy2: right (EM 100); overall: their mean.
    assert_eq!(report["datasets"]["toy"]["em"], 50.0);
    assert_eq!(report["datasets"]["toy2"]["em"], 100.0);
    assert_eq!(report["overall"]["em"], 75.0);
    assert_eq!(report["overall"]["n"], 3);
    assert_eq!(report["failed"], 0);
    let metrics_text = std::fs::read_to_string(out.join("metrics.json")).unwrap();
    let predictions_text = std::fs::read_to_string(out.join("predictions.jsonl")).unwrap();

    // A second run has nothing to do.
    let asked = agent.count();
    let stdout = ok(&args);
    assert!(
        stdout.contains("0 answered now, 3 from earlier runs"),
        "{stdout}"
    );
    assert_eq!(agent.count(), asked);
    assert_eq!(
        std::fs::read_to_string(out.join("predictions.jsonl")).unwrap(),
        predictions_text
    );
    assert_eq!(
        std::fs::read_to_string(out.join("metrics.json")).unwrap(),
        metrics_text
    );

    // An interrupted run: one finished row and half a line. The next run keeps the row, drops
    // the half line and answers the other two (two agent turns each).
    let first_line = predictions_text.lines().next().unwrap();
    std::fs::write(
        out.join("predictions.jsonl"),
        format!("{first_line}\n{{\"id\": \"b\", \"data_so"),
    )
    .unwrap();
    // `metrics` leaves the unfinished line out too, with a note.
    let output = run(&["metrics", "--predictions", out.join("predictions.jsonl").to_str().unwrap(), "--json"]);
    assert!(output.status.success() && text(&output.stderr).contains("incomplete line"), "{}", text(&output.stderr));
    assert_eq!(serde_json::from_str::<Value>(&text(&output.stdout)).unwrap()["overall"]["n"], 1);
    let stdout = ok(&args);
    assert!(
        stdout.contains("2 answered now, 1 from earlier runs"),
        "{stdout}"
    );
    assert_eq!(agent.count(), asked + 4);
    let resumed = std::fs::read_to_string(out.join("predictions.jsonl")).unwrap();
    assert_eq!(resumed.lines().count(), 3);
    assert_eq!(resumed.lines().next(), Some(first_line));
    assert_eq!(
        std::fs::read_to_string(out.join("metrics.json")).unwrap(),
        metrics_text
    );
    // `metrics` on the resumed file counts each question once, as eval's metrics.json does.
    let recount: Value = serde_json::from_str(&ok(&["metrics", "--predictions", out.join("predictions.jsonl").to_str().unwrap(), "--json"])).unwrap();
    assert_eq!((&recount["overall"]["n"], &recount["overall"]["em"]), (&serde_json::json!(3), &serde_json::json!(75.0)));

    // With nothing left to answer, a run with other settings only scores again.
    let mut reseeded = args.clone();
    reseeded.extend(["--seed", "1"]);
    let output = run(&reseeded);
    assert!(output.status.success() && text(&output.stdout).contains("0 answered now, 3 from earlier runs"));
    let note = text(&output.stderr);
    assert!(note.contains("nothing is left to answer") && note.contains("--seed 0 (now 1)"), "{note}");
    // An example whose answers changed in the data is answered again; but not with another agent
    // seed, another setup, whose answers would join these.
    std::fs::write(&data, std::fs::read_to_string(&data).unwrap().replace(r#"["Paris"]"#, r#"["4"]"#)).unwrap();
    let output = run(&reseeded);
    let err = text(&output.stderr);
    assert!(!output.status.success() && err.contains("--seed 0 (now 1)") && err.contains("another --out"), "{err}");
    let output = run(&args);
    let stdout = text(&output.stdout);
    assert!(output.status.success() && stdout.contains("1 answered now, 2 from earlier runs"), "{stdout}");
    // Without a terminal, progress goes to stderr as lines.
    assert!(text(&output.stderr).contains("eval agent: 3/3 questions, 0 failed this run"), "{}", text(&output.stderr));
    assert_eq!(metrics(&out)["overall"]["em"], 100.0);

    // While another eval holds the directory (its lock), a second one is refused.
    let held = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(out.join(".lock")).unwrap();
    held.try_lock().unwrap();
    let output = run(&args);
    assert!(!output.status.success() && text(&output.stderr).contains("another run is writing"), "{}", text(&output.stderr));
    drop(held);

    // Another mode does not write into the same directory.
    let output = run(&with(
        &[
            "eval",
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--mode",
            "direct",
        ],
        &env,
    ));
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains("--mode agent"),
        "{}",
        text(&output.stderr)
    );
}

/// `eval` against `serve` lays the results out like the paper: the data sources map to the
/// paper's data sets, each scored with its own metric, with the averages and the published rows.
#[test]
fn eval_writes_the_paper_table_against_serve() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let agent = scripted_agent();
    let data = dir.path().join("paper.jsonl");
    let rows = [
        r#"{"id": "h", "data_source": "hotpot-256-test", "question": "Capital of France?", "answers": ["Paris"]}"#,
        r#"{"id": "g", "data_source": "gsm8k-256-test", "question": "What is 2+2?", "answers": ["4"]}"#,
        r#"{"id": "t", "data_source": "triviaqa_train-128-eval_ood", "question": "Two plus two?", "answers": ["four", "4"]}"#,
        r#"{"id": "x", "data_source": "not-in-the-paper", "question": "Two and two?", "answers": ["4"]}"#,
    ];
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let out = dir.path().join("out");
    let base = [
        "eval",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--agent-url",
        &agent.base_url,
        "--agent-model",
        "scripted",
        "--paper-table",
    ];
    let stdout = ok(&with(&base, &env_flags(&server)));
    // The agent answers "4" everywhere: Hotpot EM and F1 0, GSM8K and TriviaQA EM and F1 100.
    // Table 1's Average EM is (0 + 100)/2 = 50 over 2 of its 6 QA and math sets, its F1 50 over
    // 2 of 8; Table 2's EM is 100 over 1 of 3. The published figures beside them are the
    // paper's means over the same data sets: (33.59 + 83.59) / 2 = 58.59 for GPT-4o-mini's EM.
    let md = std::fs::read_to_string(out.join("paper_table.md")).unwrap();
    assert!(stdout.contains(md.lines().next().unwrap()), "{stdout}");
    assert!(
        md.contains("| Data set | Metric | GPT-4o-mini (paper) | Prompt-R1 (paper) | this run (agent, tiny) |"),
        "{md}"
    );
    assert!(md.contains("| Hotpot | EM | 33.59 | 44.53 | 0.00 | -33.59 | -44.53 |"), "{md}");
    assert!(md.contains("| GSM8K | EM | 83.59 | 97.66 | 100.00 | +16.41 | +2.34 |"), "{md}");
    assert!(md.contains("| Average | EM | 58.59 | 71.09 | 50.00 (2 of 6) | -8.59 | -21.09 |"), "{md}");
    assert!(md.contains("| Average | F1 | 63.39 | 74.98 | 50.00 (2 of 8) |"), "{md}");
    assert!(md.contains("| Average | EM | 63.28 | 70.31 | 100.00 (1 of 3) |"), "{md}");
    assert!(md.contains("not-in-the-paper"), "{md}");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("paper_table.json")).unwrap())
            .unwrap();
    let ours = |table: usize, dataset: &str, metric: &str| {
        json["tables"][table]["lines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["dataset"] == dataset && l["metric"] == metric)
            .unwrap_or_else(|| panic!("{dataset} {metric}: {json}"))["ours"]
            .clone()
    };
    assert_eq!(ours(0, "Hotpot", "f1"), 0.0);
    assert_eq!(ours(0, "GSM8K", "em"), 100.0);
    assert_eq!(ours(1, "TriviaQA", "em"), 100.0);
    assert!(ours(0, "2Wiki", "em").is_null());
    assert_eq!(ours(0, "Average", "em"), 50.0);
    assert_eq!(json["unmapped_data_sources"][0], "not-in-the-paper");
}

#[test]
fn eval_with_the_local_agent_and_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start(&model, &[]);
    let data = questions(dir.path());
    let env = env_flags(&server);
    let out = |name: &str| dir.path().join(name);
    let model = model.to_str().unwrap();
    let data = data.to_str().unwrap();

    let agent_out = out("agent");
    ok(&with(
        &[
            "eval",
            "--data",
            data,
            "--out",
            agent_out.to_str().unwrap(),
            "--agent",
            model,
            "--max-turn-tokens",
            "32",
        ],
        &env,
    ));
    let agent_rows = rows(&agent_out);
    assert_eq!(agent_rows.len(), 3);
    check_rows(&agent_rows, "agent");
    for row in &agent_rows {
        check_trajectory(&row["trajectory"]);
    }
    assert_eq!(metrics(&agent_out)["overall"]["n"], 3);
    // Two places for three questions: continuously (the default) the third begins as soon as
    // one ends, in batches once both have; the greedy answers are the same either way.
    let by_id = |rows: &[Value]| -> std::collections::BTreeMap<String, (Value, Value)> {
        rows.iter().map(|r| (format!("{}/{}", r["data_source"], r["id"]), (r["prediction"].clone(), r["trajectory"]["token_ids"].clone()))).collect()
    };
    let mut answers = Vec::new();
    for admission in ["continuous", "batches"] {
        let admission_out = out(admission);
        ok(&with(
            &[
                "eval",
                "--data",
                data,
                "--out",
                admission_out.to_str().unwrap(),
                "--agent",
                model,
                "--max-turn-tokens",
                "32",
                "--batch-size",
                "2",
                "--admission",
                admission,
            ],
            &env,
        ));
        let admission_rows = rows(&admission_out);
        assert_eq!(admission_rows.len(), 3, "--admission {admission}");
        check_rows(&admission_rows, "agent");
        answers.push(by_id(&admission_rows));
    }
    assert_eq!(answers[0], answers[1], "continuous admission answers as batches do");
    assert_eq!(answers[0], by_id(&agent_rows), "and as all three at once");

    for mode in ["direct", "cot"] {
        let mode_out = out(mode);
        ok(&with(
            &[
                "eval",
                "--data",
                data,
                "--out",
                mode_out.to_str().unwrap(),
                "--mode",
                mode,
            ],
            &env,
        ));
        let mode_rows = rows(&mode_out);
        assert_eq!(mode_rows.len(), 3);
        check_rows(&mode_rows, mode);
        for row in &mode_rows {
            let reply = row["trajectory"]["reply"].as_str().expect("the reply");
            assert_eq!(row["stop_reason"], "answer");
            if !reply.contains("<answer>") && !reply.contains("</think>") {
                assert_eq!(row["prediction"].as_str(), Some(reply.trim()));
            }
            let sent = row["trajectory"]["messages"][0]["content"]
                .as_str()
                .unwrap();
            assert_eq!(sent.contains("<answer>"), mode == "cot", "{sent}");
        }
        assert_eq!(metrics(&mode_out)["mode"], mode);
    }

    let alone = out("agent-only");
    ok(&[
        "eval",
        "--data",
        data,
        "--out",
        alone.to_str().unwrap(),
        "--mode",
        "agent-only",
        "--agent",
        model,
        "--max-turn-tokens",
        "32",
        "--limit",
        "2",
    ]);
    let alone_rows = rows(&alone);
    assert_eq!(alone_rows.len(), 2, "--limit 2");
    check_rows(&alone_rows, "agent-only");
    assert!(alone_rows.iter().all(|r| r["trajectory"]["env_calls"] == 0));
    assert!(no_responses(&alone_rows));
}

/// Agent-only rows never reach the large LLM: no turn has a response.
fn no_responses(rows: &[Value]) -> bool {
    rows.iter()
        .flat_map(|r| {
            r["trajectory"]["turns"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .all(|turn| turn["response"].is_null())
}

#[test]
fn eval_counts_failed_episodes_and_reruns_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = questions(dir.path());
    let out = dir.path().join("out");
    let dead = dead_url();
    let base = [
        "eval",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--mode",
        "direct",
        "--env-model",
        "tiny",
    ];
    // A large LLM nothing listens for is refused at once, before any question runs (no
    // retrying every question).
    let output = run(&with(&base, &["--env-url".into(), dead]));
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("cannot be used, so nothing was run") && stderr.contains("connection"), "{stderr}");
    assert!(!out.exists(), "a run that could not start leaves no --out behind");
    // One that answers 503 to everything passes that probe (a busy server may recover), and
    // every question fails after its attempt.
    let busy = ScriptedServer::start_with(|_| Action::json(503, r#"{"error": {"message": "overloaded"}}"#));
    let output = run(&with(
        &base,
        &[
            "--env-url".into(),
            busy.base_url.clone(),
            "--env-attempts".into(),
            "1".into(),
        ],
    ));
    assert_eq!(output.status.code(), Some(1), "every question failed");
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("every question of this run failed") && stderr.contains("503"),
        "{stderr}"
    );
    let failed = rows(&out);
    assert_eq!(failed.len(), 3);
    assert!(failed.iter().all(|r| r["failed"] == true
        && r["prediction"] == ""
        && r["stop_reason"] == "env_failure"
        && r["error"].is_string()));
    assert_eq!(metrics(&out)["failed"], 3);
    assert_eq!(metrics(&out)["overall"]["f1"], 0.0);

    // With the large LLM back, the failed rows are run again.
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let stdout = ok(&with(&base, &["--env-url".into(), server.base_url.clone()]));
    assert!(stdout.contains("3 answered now"), "{stdout}");
    assert_eq!(rows(&out).len(), 6);
    assert_eq!(metrics(&out)["failed"], 0);
    assert_eq!(metrics(&out)["stop_reasons"]["answer"], 3);
}

#[test]
fn eval_on_the_reference_datasets() {
    let Some(shared) = harness::shared_dir() else {
        return;
    };
    let csv = shared.join("data/prompt-r1/csv/eval_data/hotpot.csv");
    let parquet = shared.join("data/prompt-r1/parquet/eval_data/gsm8k.parquet");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let out = dir.path().join("out");
    let args = [
        "eval",
        "--data",
        csv.to_str().unwrap(),
        parquet.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--mode",
        "direct",
        "--limit",
        "2",
    ];
    let stdout = ok(&with(&args, &env_flags(&server)));
    assert!(stdout.contains("4 questions"), "{stdout}");
    let report = metrics(&out);
    assert_eq!(report["overall"]["n"], 4);
    assert_eq!(
        report["datasets"].as_object().map(|d| d.len()),
        Some(2),
        "{report}"
    );
    // The reference's data-source ids map to the paper's data sets.
    let paper: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("paper_table.json")).unwrap())
            .unwrap();
    assert_eq!(paper["unmapped_data_sources"], serde_json::json!([]));
    let lines = paper["tables"][0]["lines"].as_array().unwrap();
    for name in ["Hotpot", "GSM8K"] {
        for metric in ["em", "f1"] {
            let line = lines
                .iter()
                .find(|l| l["dataset"] == name && l["metric"] == metric)
                .unwrap();
            assert!(line["ours"].is_number(), "{name} {metric}: {paper}");
        }
    }
    let rows = rows(&out);
    assert!(rows
        .iter()
        .all(|r| r["answers"].as_array().is_some_and(|a| !a.is_empty())));
    assert!(
        rows.iter()
            .all(|r| !r["question"].as_str().unwrap().contains("<answer>")),
        "the raw question, without the agent instruction"
    );
}

#[test]
fn eval_explains_what_a_mode_needs() {
    let dir = tempfile::tempdir().unwrap();
    let data = questions(dir.path());
    let out = dir.path().join("out");
    let output = run(&[
        "eval",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        text(&output.stderr).contains("--mode agent needs the agent"),
        "{}",
        text(&output.stderr)
    );
    let output = run(&[
        "eval",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--mode",
        "cot",
    ]);
    assert!(
        text(&output.stderr).contains("--env-url"),
        "{}",
        text(&output.stderr)
    );
    let output = run(&[
        "eval",
        "--data",
        "missing.jsonl",
        "--out",
        out.to_str().unwrap(),
        "--mode",
        "cot",
    ]);
    assert!(
        text(&output.stderr).contains("missing.jsonl"),
        "{}",
        text(&output.stderr)
    );
}

/// Rows repeating an earlier row's data_source and id are left out with a note, which says when
/// one of them asks another question.
#[test]
fn eval_notes_rows_that_repeat_an_id() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let data = dir.path().join("repeats.csv");
    let row = |id: &str, question: &str| format!("{id},a,{question},\"[\"\"x\"\"]\"\n");
    let csv = ["id,data_source,question,answers\n".to_string(), row("1", "q1"), row("1", "q1"), row("2", "q2"), row("2", "other")].concat();
    std::fs::write(&data, csv).unwrap();
    let out = dir.path().join("out");
    let output = run(&[
        "eval", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--mode", "agent-only",
        "--agent", model.to_str().unwrap(), "--max-turns", "1", "--max-turn-tokens", "2",
    ]);
    let err = text(&output.stderr);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("left out 2 rows whose data_source and id appeared before"), "{err}");
    assert!(err.contains("1 of them asks another question") && err.contains("id \"2\""), "{err}");
    assert_eq!(rows(&out).len(), 2);
}

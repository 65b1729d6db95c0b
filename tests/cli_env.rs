//! CLI tests: the `prompt-r1` binary's env commands, run as a user would run them, against
//! scripted servers on loopback.

#[path = "../env/tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{Action, ScriptedServer};

const SECRET: &str = "sk-cli-test-secret-4242";

fn env_check(url: &str, extra: &[&str], key: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_prompt-r1"));
    command
        .args(["env-check", "--env-url", url, "--env-model", "test-model"])
        .args(extra);
    command.env_remove("OPENAI_API_KEY");
    if let Some(key) = key {
        command.env("OPENAI_API_KEY", key);
    }
    command.output().expect("run prompt-r1")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_secret_not_shown(output: &Output) {
    let all = format!("{}{}", text(&output.stdout), text(&output.stderr));
    assert!(!all.contains(SECRET), "the key was printed: {all}");
}

#[test]
fn env_check_reports_latency_and_reply_as_json() {
    let server = ScriptedServer::start(vec![Action::ok("OK")]);
    let output = env_check(&server.base_url, &["--json"], Some(SECRET));
    assert!(output.status.success(), "{}", text(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["ok"], true);
    assert_eq!(report["reply"], "OK");
    assert!(report["latency_ms"].is_u64());
    assert_eq!(report["api_key_set"], true);
    assert_eq!(
        report["endpoint"],
        format!("{}/chat/completions", server.base_url)
    );
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(
        requests[0].header("authorization"),
        Some(format!("Bearer {SECRET}").as_str())
    );
    assert_eq!(requests[0].json()["model"], "test-model");
    assert_eq!(requests[0].json()["max_tokens"], 16, "a short reply is asked for");
    assert_secret_not_shown(&output);
}

/// A server that refuses `max_tokens` (as some reasoning models do) is asked again without it.
#[test]
fn env_check_asks_again_without_max_tokens_when_refused() {
    let refused = Action::json(400, r#"{"error":{"message":"Unsupported parameter: 'max_tokens'"}}"#);
    let server = ScriptedServer::start(vec![refused, Action::ok("OK")]);
    let output = env_check(&server.base_url, &["--json"], None);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].json()["max_tokens"], 16);
    assert!(requests[1].json().get("max_tokens").is_none(), "{}", requests[1].json());
}

#[test]
fn env_check_reports_in_text() {
    let server = ScriptedServer::start(vec![Action::ok("OK")]);
    let output = env_check(&server.base_url, &[], None);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.starts_with("ok: ") && stdout.contains(" ms"),
        "{stdout}"
    );
    assert!(stdout.contains("reply: OK"), "{stdout}");
    assert!(
        stdout.contains("api key: $OPENAI_API_KEY not set"),
        "{stdout}"
    );
}

#[test]
fn env_check_explains_a_rejected_key_without_retrying() {
    let server = ScriptedServer::start(vec![Action::json(
        401,
        r#"{"error":{"message":"Incorrect API key provided"}}"#,
    )]);
    let output = env_check(
        &server.base_url,
        &["--api-key-env", "MY_KEY_VAR"],
        Some(SECRET),
    );
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("authentication failed (HTTP 401)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("check $MY_KEY_VAR (it is not set)"),
        "{stderr}"
    );
    assert_eq!(server.count(), 1);
    assert_secret_not_shown(&output);
}

#[test]
fn env_check_explains_an_unknown_model() {
    let server = ScriptedServer::start(vec![Action::json(
        404,
        r#"{"error":{"message":"model not found"}}"#,
    )]);
    let output = env_check(&server.base_url, &[], None);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("model \"test-model\" not found"),
        "{stderr}"
    );
}

#[test]
fn env_check_explains_an_unreachable_server() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let output = env_check(&format!("http://127.0.0.1:{port}/v1"), &["--json"], None);
    assert_eq!(output.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["ok"], false);
    assert_eq!(report["kind"], "connection");
    assert!(
        report["error"].as_str().unwrap().contains("refused"),
        "{report}"
    );
    assert!(text(&output.stderr).contains("connection refused"));
}

#[test]
fn env_check_explains_a_timeout() {
    let server = ScriptedServer::start(vec![Action::Stall(Duration::from_secs(3))]);
    let output = env_check(&server.base_url, &["--timeout", "0.3", "--json"], None);
    assert_eq!(output.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["kind"], "timeout");
    assert!(text(&output.stderr).contains("timed out"));
    assert_eq!(server.count(), 1);
}

#[test]
fn env_check_explains_a_malformed_reply() {
    let server = ScriptedServer::start(vec![Action::json(200, "<html>not an API</html>")]);
    let output = env_check(&server.base_url, &[], None);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("malformed reply"),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn env_check_refuses_a_timeout_of_zero() {
    let output = env_check("http://127.0.0.1:9/v1", &["--timeout", "0"], None);
    let stderr = text(&output.stderr);
    assert!(!output.status.success() && stderr.contains("--timeout") && stderr.contains("above 0"), "{stderr}");
}

#[test]
fn env_check_rejects_a_bad_url_before_sending() {
    let output = env_check("localhost:8000/v1", &[], None);
    assert_eq!(output.status.code(), Some(1));
    assert!(text(&output.stderr).contains("must start with http:// or https://"));
}

#[test]
fn env_check_help_offers_no_key_flag() {
    let output = Command::new(env!("CARGO_BIN_EXE_prompt-r1"))
        .args(["env-check", "--help"])
        .output()
        .unwrap();
    let help = text(&output.stdout);
    assert!(
        help.contains("--env-url") && help.contains("--api-key-env"),
        "{help}"
    );
    assert!(!help.contains("--api-key "), "{help}");
}

//! The HTTP client against scripted servers on loopback: rate limits, server errors, slow and
//! dropped replies, unreachable servers, malformed and oversized replies, refused keys, the
//! concurrency cap and the call deadline, each with the number of requests the server saw.

mod common;

use std::time::Duration;

use common::{completion, Action, ScriptedServer};
use prompt_r1_env::{
    ApiKey, ChatMessage, ClientConfig, EnvError, Environment, FailureKind, OpenAiClient,
    ParallelRunner, RetryPolicy, SamplingParams,
};

/// Short timeouts and tiny backoff so fault tests stay fast.
fn config(server: &ScriptedServer, max_attempts: u32) -> ClientConfig {
    ClientConfig {
        read_timeout_secs: 0.3,
        connect_timeout_secs: 0.5,
        retry: RetryPolicy {
            max_attempts,
            base_delay_secs: 0.01,
            max_delay_secs: 0.02,
            max_retry_after_secs: 5.0,
        },
        ..ClientConfig::new(&server.base_url, "test-model")
    }
}

fn client(config: ClientConfig) -> OpenAiClient {
    OpenAiClient::with_api_key(config, None).unwrap()
}

fn ask(client: &OpenAiClient) -> Result<String, EnvError> {
    client.complete(&[ChatMessage::user("hello")])
}

#[test]
fn sends_model_messages_parameters_and_key() {
    let server = ScriptedServer::start(vec![Action::ok("Hi there")]);
    let key = ApiKey::new("sk-test-123");
    let client = OpenAiClient::with_api_key(config(&server, 3), key).unwrap();
    let params = SamplingParams {
        temperature: Some(0.7),
        top_p: Some(0.9),
        max_tokens: Some(64),
        seed: Some(42),
        stop: vec!["</answer>".into()],
    };
    let messages = [ChatMessage::system("be brief"), ChatMessage::user("hello")];
    let reply = client.chat(&messages, &params).unwrap();
    assert_eq!(reply.content, "Hi there");
    assert_eq!(reply.usage.map(|u| u.completion_tokens), Some(5));

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert_eq!(
        (request.method.as_str(), request.path.as_str()),
        ("POST", "/v1/chat/completions")
    );
    assert_eq!(request.header("authorization"), Some("Bearer sk-test-123"));
    let body = request.json();
    assert_eq!(body["model"], "test-model");
    assert_eq!(
        body["messages"],
        serde_json::json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    );
    assert_eq!(body["temperature"], 0.7);
    assert_eq!(body["top_p"], 0.9);
    assert_eq!(body["max_tokens"], 64);
    assert_eq!(body["seed"], 42);
    assert_eq!(body["stop"], serde_json::json!(["</answer>"]));
    let stats = client.stats();
    assert_eq!(
        (stats.calls, stats.requests, stats.retries, stats.succeeded),
        (1, 1, 0, 1)
    );
}

#[test]
fn without_a_key_no_authorization_header_is_sent() {
    let server = ScriptedServer::start(vec![Action::ok("ok")]);
    assert_eq!(ask(&client(config(&server, 1))).unwrap(), "ok");
    assert_eq!(server.requests()[0].header("authorization"), None);
}

#[test]
fn rate_limits_are_retried_after_the_servers_retry_after() {
    let limited =
        Action::json(429, r#"{"error":{"message":"slow down"}}"#).with_header("Retry-After", "0");
    let server = ScriptedServer::start(vec![limited.clone(), limited, Action::ok("finally")]);
    let mut config = config(&server, 5);
    // A backoff this long would show in `backoff_ms`; Retry-After: 0 must win.
    config.retry.base_delay_secs = 2.0;
    config.retry.max_delay_secs = 2.0;
    let client = client(config);
    assert_eq!(ask(&client).unwrap(), "finally");
    assert_eq!(server.count(), 3);
    let stats = client.stats();
    assert_eq!((stats.requests, stats.retries, stats.backoff_ms), (3, 2, 0));
    assert_eq!(stats.failed_attempts_of(FailureKind::RateLimited), 2);
    assert_eq!(stats.failed(), 0);
}

#[test]
fn retry_after_seconds_set_the_wait() {
    let limited = Action::json(429, "{}").with_header("Retry-After", "1");
    let server = ScriptedServer::start(vec![limited, Action::ok("ok")]);
    let client = client(config(&server, 2));
    assert_eq!(ask(&client).unwrap(), "ok");
    assert_eq!(client.stats().backoff_ms, 1000);
}

#[test]
fn rate_limits_until_attempts_run_out() {
    let limited = Action::json(429, r#"{"error":{"message":"quota exceeded"}}"#)
        .with_header("Retry-After", "0");
    let server = ScriptedServer::start(vec![limited.clone(), limited.clone(), limited]);
    let client = client(config(&server, 3));
    let err = ask(&client).unwrap_err();
    assert_eq!(err.kind(), FailureKind::RateLimited);
    assert_eq!(err.attempts(), 3);
    assert!(err.to_string().contains("quota exceeded"), "{err}");
    assert_eq!(server.count(), 3);
    assert_eq!(
        client.stats().failed_calls.get(&FailureKind::RateLimited),
        Some(&1)
    );
}

#[test]
fn server_error_then_success() {
    let server =
        ScriptedServer::start(vec![Action::json(500, "internal"), Action::ok("recovered")]);
    let client = client(config(&server, 3));
    assert_eq!(ask(&client).unwrap(), "recovered");
    assert_eq!(server.count(), 2);
    let stats = client.stats();
    assert_eq!(stats.failed_attempts_of(FailureKind::ServerError), 1);
    assert_eq!(stats.retries, 1);
}

#[test]
fn server_errors_exhaust_the_attempts() {
    let down = Action::json(503, r#"{"error":{"message":"upstream overloaded"}}"#);
    let server = ScriptedServer::start(vec![down.clone(), down.clone(), down]);
    let client = client(config(&server, 3));
    let err = ask(&client).unwrap_err();
    assert!(
        matches!(
            err,
            EnvError::Http {
                status: 503,
                attempts: 3,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("upstream overloaded"), "{err}");
    assert_eq!(server.count(), 3);
}

#[test]
fn the_retry_hook_hears_each_retry_and_not_the_last_failure() {
    let server = ScriptedServer::start(vec![
        Action::json(503, r#"{"error":{"message":"warming up"}}"#),
        Action::Close,
        Action::json(503, r#"{"error":{"message":"still warming"}}"#),
    ]);
    let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = heard.clone();
    let client = client(config(&server, 3)).on_retry(move |notice| {
        log.lock().unwrap().push((
            notice.next_attempt,
            notice.max_attempts,
            notice.error.kind(),
            notice.to_string(),
        ));
    });
    let err = ask(&client).unwrap_err();
    assert_eq!(err.attempts(), 3);
    let heard = heard.lock().unwrap();
    let seen: Vec<_> = heard.iter().map(|(n, max, kind, _)| (*n, *max, *kind)).collect();
    assert_eq!(
        seen,
        [
            (2, 3, FailureKind::ServerError),
            (3, 3, FailureKind::Connection)
        ]
    );
    assert!(heard[0].3.contains("warming up"), "{}", heard[0].3);
    assert!(heard[0].3.contains("retrying in 0.0"), "{}", heard[0].3);
    assert!(heard[0].3.contains("(1 attempt); retrying in"), "{}", heard[0].3);
    assert!(heard[0].3.ends_with("(attempt 2 of 3)"), "{}", heard[0].3);
    assert!(heard[1].3.contains("(2 attempts); retrying in"), "the attempts so far: {}", heard[1].3);
    assert_eq!(client.stats().retries, 2);
}

#[test]
fn request_timeout_and_conflict_statuses_are_retried() {
    let server = ScriptedServer::start(vec![
        Action::json(408, ""),
        Action::json(409, ""),
        Action::ok("ok"),
    ]);
    assert_eq!(ask(&client(config(&server, 3))).unwrap(), "ok");
    assert_eq!(server.count(), 3);
}

#[test]
fn slow_replies_time_out_and_are_retried() {
    let slow = Action::Stall(Duration::from_secs(2));
    let server = ScriptedServer::start(vec![slow.clone(), slow]);
    let client = client(config(&server, 2));
    let err = ask(&client).unwrap_err();
    assert!(
        matches!(err, EnvError::Timeout { attempts: 2, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("0.3 s"), "{err}");
    assert_eq!(server.count(), 2);
    assert_eq!(client.stats().failed_attempts_of(FailureKind::Timeout), 2);
}

#[test]
fn a_slow_reply_then_a_fast_one_succeeds() {
    let server = ScriptedServer::start(vec![
        Action::Stall(Duration::from_secs(2)),
        Action::ok("fast"),
    ]);
    assert_eq!(ask(&client(config(&server, 2))).unwrap(), "fast");
    assert_eq!(server.count(), 2);
}

#[test]
fn dropped_connections_are_retried() {
    let server = ScriptedServer::start(vec![Action::Close, Action::ok("after drop")]);
    let client = client(config(&server, 3));
    assert_eq!(ask(&client).unwrap(), "after drop");
    assert_eq!(server.count(), 2);
    assert_eq!(
        client.stats().failed_attempts_of(FailureKind::Connection),
        1
    );
}

#[test]
fn dropped_connections_exhaust_the_attempts() {
    let server = ScriptedServer::start(vec![Action::Close, Action::Close]);
    let err = ask(&client(config(&server, 2))).unwrap_err();
    assert!(
        matches!(err, EnvError::Connection { attempts: 2, .. }),
        "{err:?}"
    );
    assert_eq!(server.count(), 2);
}

#[test]
fn unreachable_server_is_a_connection_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = ClientConfig {
        retry: RetryPolicy {
            max_attempts: 2,
            base_delay_secs: 0.01,
            max_delay_secs: 0.01,
            ..RetryPolicy::default()
        },
        connect_timeout_secs: 0.5,
        ..ClientConfig::new(format!("http://127.0.0.1:{port}/v1"), "m")
    };
    let client = client(config);
    let err = ask(&client).unwrap_err();
    assert_eq!(err.kind(), FailureKind::Connection);
    assert_eq!(err.attempts(), 2);
    assert!(err.to_string().contains("refused"), "{err}");
}

#[test]
fn malformed_replies_are_errors_and_not_retried() {
    for (body, expected) in [
        ("{\"choices\": [", "not JSON"),
        ("", "empty body"),
        ("{\"choices\": []}", "no choices"),
        ("{\"object\": \"list\"}", "no `choices`"),
        ("<html>login page</html>", "not JSON"),
    ] {
        let server = ScriptedServer::start(vec![Action::json(200, body)]);
        let client = client(config(&server, 3));
        let err = ask(&client).unwrap_err();
        assert!(
            matches!(err, EnvError::Malformed { attempts: 1, .. }),
            "{body:?}: {err:?}"
        );
        assert!(err.to_string().contains(expected), "{body:?}: {err}");
        assert_eq!(server.count(), 1, "{body:?}");
        assert_eq!(
            client.stats().failed_calls.get(&FailureKind::Malformed),
            Some(&1)
        );
    }
}

#[test]
fn unauthorized_is_reported_at_once() {
    let server = ScriptedServer::start(vec![Action::json(
        401,
        r#"{"error":{"message":"Incorrect API key provided"}}"#,
    )]);
    let config = ClientConfig {
        api_key_env: "MY_LLM_KEY".into(),
        ..config(&server, 5)
    };
    let client = OpenAiClient::with_api_key(config, ApiKey::new("sk-wrong")).unwrap();
    let err = ask(&client).unwrap_err();
    assert_eq!(server.count(), 1);
    assert_eq!(err.kind(), FailureKind::Unauthorized);
    let text = err.to_string();
    assert!(
        text.starts_with("authentication failed (HTTP 401)"),
        "{text}"
    );
    assert!(
        text.contains("Incorrect API key provided") && text.contains("check $MY_LLM_KEY"),
        "{text}"
    );
    assert!(!text.contains("sk-wrong"), "{text}");
}

#[test]
fn unknown_model_is_reported_at_once() {
    let server = ScriptedServer::start(vec![Action::json(
        404,
        r#"{"error":{"message":"The model `test-model` does not exist"}}"#,
    )]);
    let err = ask(&client(config(&server, 5))).unwrap_err();
    assert_eq!(server.count(), 1);
    assert!(matches!(err, EnvError::NotFound { .. }), "{err:?}");
    assert!(
        err.to_string().contains("model \"test-model\" not found"),
        "{err}"
    );
}

#[test]
fn other_client_errors_are_not_retried() {
    let server = ScriptedServer::start(vec![Action::json(
        400,
        r#"{"error":{"message":"max_tokens too large"}}"#,
    )]);
    let err = ask(&client(config(&server, 5))).unwrap_err();
    assert_eq!(server.count(), 1);
    assert_eq!(err.kind(), FailureKind::Rejected);
    assert!(err.to_string().contains("max_tokens too large"), "{err}");
}

#[test]
fn the_concurrency_cap_holds_across_threads() {
    let server = ScriptedServer::start_with(|_| {
        std::thread::sleep(Duration::from_millis(30));
        Action::ok("ok")
    });
    let config = ClientConfig {
        max_concurrency: 2,
        read_timeout_secs: 5.0,
        ..config(&server, 1)
    };
    let client = client(config);
    let replies = ParallelRunner::new(8).map(&[(); 8], |_, _| ask(&client));
    assert!(
        replies.iter().all(|r| r.as_deref() == Ok("ok")),
        "{replies:?}"
    );
    assert_eq!(server.count(), 8);
    assert!(
        server.peak_in_flight() <= 2,
        "peak {}",
        server.peak_in_flight()
    );
    assert_eq!(client.stats().succeeded, 8);
}

/// Retries and `Retry-After` waits stop at the call's deadline: without it, ten attempts each
/// told to wait 1 s would take 9 s.
#[test]
fn retries_stop_at_the_call_deadline() {
    let busy = Action::json(503, r#"{"error":{"message":"busy"}}"#).with_header("Retry-After", "1");
    let server = ScriptedServer::start(vec![busy; 10]);
    let mut config = config(&server, 10);
    config.call_timeout_secs = 1.5;
    let client = client(config);
    let started = std::time::Instant::now();
    let err = ask(&client).unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(
        matches!(err, EnvError::Timeout { attempts: 2, .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("deadline of 1.5 s") && text.contains("--env-call-timeout"),
        "{text}"
    );
    assert!(text.contains("busy"), "the last attempt's error is kept: {text}");
    assert_eq!(server.count(), 2);
    assert_eq!(client.stats().failed(), 1);
}

/// One attempt is cut at the call's deadline even when its own read timeout is longer.
#[test]
fn an_attempt_is_cut_at_the_call_deadline() {
    let server = ScriptedServer::start(vec![Action::Stall(Duration::from_secs(4)); 3]);
    let mut config = config(&server, 3);
    config.read_timeout_secs = 10.0;
    config.call_timeout_secs = 0.5;
    let client = client(config);
    let started = std::time::Instant::now();
    let err = ask(&client).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert!(matches!(err, EnvError::Timeout { attempts: 1, .. }), "{err:?}");
    assert!(err.to_string().contains("deadline of 0.5 s"), "{err}");
    assert_eq!(server.count(), 1);
}

/// A reply over the client's 10 MiB limit is named as such, not as a failed connection.
#[test]
fn an_oversized_reply_is_named() {
    let big = completion(&"x".repeat(11 * 1024 * 1024), None, "stop");
    let server = ScriptedServer::start(vec![Action::json(200, big)]);
    let client = client(config(&server, 3));
    let err = ask(&client).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, EnvError::Malformed { .. }), "{err:?}");
    assert!(text.contains("larger than 10 MiB"), "{text}");
    assert_eq!(server.count(), 1);
}

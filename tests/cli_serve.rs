//! `prompt-r1 serve` on the tiny random model, driven by a raw HTTP client: the OpenAI reply
//! shapes, streaming, stop strings, seeds, concurrent requests and errors.

#[path = "serve_harness/mod.rs"]
mod harness;

use std::io::{Read, Write};

use harness::{connect, Server};
use serde_json::{json, Value};

fn user(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

fn content(reply: &Value) -> String {
    reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content in {reply}"))
        .to_string()
}

/// The text, finish reason and usage of a streamed reply; checks the chunk framing.
fn streamed(server: &Server, body: &Value) -> (String, String, Option<Value>) {
    let reply = server.chat(body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply
        .header("content-type")
        .is_some_and(|v| v.starts_with("text/event-stream")));
    let events = reply.events();
    assert_eq!(events.last(), Some(&json!("[DONE]")), "{}", reply.body);
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for event in &events[..events.len() - 1] {
        assert_eq!(event["object"], "chat.completion.chunk", "{event}");
        assert_eq!(event["model"], "tiny");
        if let Some(choice) = event["choices"].get(0) {
            assert_eq!(finish, None, "a chunk after the finish reason: {event}");
            if let Some(piece) = choice["delta"]["content"].as_str() {
                text.push_str(piece);
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_string());
            }
        }
        if !event["usage"].is_null() {
            usage = Some(event["usage"].clone());
        }
    }
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    (text, finish.expect("a finish reason"), usage)
}

#[test]
fn health_models_and_unknown_routes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let health = server.get("/health");
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let models = server.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(server.get("/v1/models/tiny").json()["id"], "tiny");
    assert_eq!(server.get("/v1/models/other").status, 404);
    for (method, path, status) in [
        ("GET", "/nope", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
    ] {
        let reply = harness::request(&server.addr, method, path, None);
        assert_eq!(reply.status, status, "{method} {path}: {}", reply.body);
        let error = &reply.json()["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{error}"
        );
        assert_eq!(error["type"], "invalid_request_error");
    }
}

#[test]
fn chat_completion_has_the_openai_shape_and_limits() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let reply = server.chat(&json!({
        "model": "tiny", "messages": user("What is 2+2?"), "max_tokens": 7, "temperature": 0
    }));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply
        .header("content-type")
        .is_some_and(|v| v.contains("application/json")));
    let body = reply.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "tiny");
    assert!(body["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert!(body["created"].is_u64());
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(1));
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    let usage = &body["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(prompt > 5, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(prompt + completion));
    match body["choices"][0]["finish_reason"].as_str() {
        Some("length") => assert_eq!(completion, 7),
        Some("stop") => assert!(completion <= 7, "{usage}"),
        other => panic!("finish_reason {other:?}"),
    }

    // max_completion_tokens takes precedence, the model name may be left out, and a longer
    // conversation has more prompt tokens.
    let longer = server
        .chat(&json!({
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is 2+2?"}],
            "max_tokens": 50, "max_completion_tokens": 3, "temperature": 0
        }))
        .json();
    assert!(
        longer["usage"]["completion_tokens"].as_u64().unwrap() <= 3,
        "{longer}"
    );
    assert!(longer["usage"]["prompt_tokens"].as_u64().unwrap() > prompt);

    // A completion that would overflow the context is refused.
    let too_long = server.chat(&json!({"messages": user("hi"), "max_tokens": 100000}));
    assert_eq!(too_long.status, 400);
    assert_eq!(too_long.json()["error"]["code"], "context_length_exceeded");
    // The largest max_tokens a client can send is added to the prompt without wrapping around.
    let largest = server.chat(&json!({"messages": user("hi"), "max_tokens": u64::MAX}));
    assert_eq!(largest.status, 400);
    let message = largest.json()["error"]["message"].as_str().unwrap().to_string();
    let requested: u128 = message
        .split("you requested ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{message}"));
    assert!(requested > u128::from(u64::MAX), "{message}");
}

/// `/v1/completions` takes the raw ChatML text: the same context as the chat messages gives the
/// same greedy text, with the text-completion shape.
#[test]
fn text_completions_take_the_raw_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let chat = server
        .chat(&json!({
            "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
            "max_tokens": 12, "temperature": 0
        }))
        .json();
    let prompt =
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n";
    let reply = server.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}).to_string(),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let body = reply.json();
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(
        body["choices"][0]["text"],
        chat["choices"][0]["message"]["content"]
    );
    assert_eq!(
        body["choices"][0]["finish_reason"],
        chat["choices"][0]["finish_reason"]
    );
    assert_eq!(body["usage"], chat["usage"]);

    let error = |body: Value| {
        let reply = server.post("/v1/completions", &body.to_string());
        (reply.status, reply.json()["error"]["param"].clone())
    };
    assert_eq!(
        error(json!({"prompt": prompt, "stream": true})),
        (400, json!("stream"))
    );
    assert_eq!(error(json!({"max_tokens": 3})), (400, json!("prompt")));
    assert_eq!(
        error(json!({"prompt": prompt, "temperature": 9})),
        (400, json!("temperature"))
    );
    assert_eq!(server.get("/v1/completions").status, 405);
}

#[test]
fn streaming_sends_the_text_of_the_plain_reply() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    for temperature in [0.0, 1.0] {
        let request = json!({
            "model": "tiny", "messages": user("Tell me a story."), "max_tokens": 24,
            "temperature": temperature, "seed": 11
        });
        let plain = server.chat(&request).json();
        let mut streaming = request.clone();
        streaming["stream"] = json!(true);
        streaming["stream_options"] = json!({"include_usage": true});
        let (text, finish, usage) = streamed(&server, &streaming);
        assert_eq!(text, content(&plain), "temperature {temperature}");
        assert_eq!(finish, plain["choices"][0]["finish_reason"]);
        assert_eq!(usage, Some(plain["usage"].clone()));
        streaming["stream_options"] = json!(null);
        let (again, _, usage) = streamed(&server, &streaming);
        assert_eq!(again, text);
        assert_eq!(usage, None, "usage only when asked for");
    }
}

#[test]
fn seeds_make_sampling_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let ask = |seed: u64| {
        content(&server.chat(&json!({
            "messages": user("Name a color."), "max_tokens": 32, "temperature": 1.0, "seed": seed
        })).json())
    };
    let first = ask(5);
    assert_eq!(ask(5), first);
    assert_ne!(ask(6), first);
}

#[test]
fn concurrent_requests_match_sequential_ones() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &["--max-batch", "4"]);
    let requests: Vec<Value> = (0..6u64)
        .map(|i| {
            let temperature = [0.7, 0.9, 1.0][i as usize % 3];
            json!({
                "messages": user(&"Why is the sky blue? ".repeat(1 + i as usize)),
                "max_tokens": 10 + 4 * i,
                "temperature": temperature,
                "top_p": if i == 4 { json!(0.8) } else { json!(null) },
                "seed": 100 + i,
                "stream": i % 2 == 1,
            })
        })
        .collect();
    let run = |request: &Value| -> (String, String) {
        if request["stream"] == json!(true) {
            let (text, finish, _) = streamed(&server, request);
            (text, finish)
        } else {
            let body = server.chat(request).json();
            (
                content(&body),
                body["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        }
    };
    let sequential: Vec<(String, String)> = requests.iter().map(run).collect();
    for _ in 0..2 {
        let concurrent: Vec<(String, String)> = std::thread::scope(|scope| {
            let handles: Vec<_> = requests.iter().map(|r| scope.spawn(|| run(r))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(concurrent, sequential);
    }
}

/// The text, finish reason and completion tokens of a reply, streamed (with usage) or not.
fn answer(server: &Server, request: &Value) -> (String, String, u64) {
    if request["stream"] == json!(true) {
        let (text, finish, usage) = streamed(server, request);
        let usage = usage.unwrap_or_else(|| panic!("no usage for {request}"));
        (text, finish, usage["completion_tokens"].as_u64().unwrap())
    } else {
        let reply = server.chat(request);
        assert_eq!(reply.status, 200, "{}", reply.body);
        let body = reply.json();
        (
            content(&body),
            body["choices"][0]["finish_reason"].as_str().unwrap().to_string(),
            body["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    }
}

/// Continuous batching: 32 clients at once, each with its own greedy request (prompts of
/// different lengths, different token limits, some streamed), get the answers each request gets
/// alone, whether all of them decode together or at most 8 at a time (the others joining the
/// running batch as rows end), on the CPU kernels and on burn's portable ops (tokens chosen on
/// the device). The model's weights are scaled so that its greedy text depends on the whole
/// prompt and on every token before it.
#[test]
fn concurrent_requests_answer_as_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model_scaled(dir.path(), 10.0);
    let topics = ["the sea", "a red fox", "prime numbers", "bread", "Mars", "a quiet library", "rain", "chess"];
    let requests: Vec<Value> = (0..32usize)
        .map(|i| {
            let stream = i % 4 == 3;
            json!({
                "messages": user(&format!("Tell me about {}. ", topics[i % topics.len()]).repeat(1 + i % 5)),
                "max_tokens": 1 + (i * 7) % 40,
                "temperature": 0,
                "stream": stream,
                "stream_options": if stream { json!({"include_usage": true}) } else { json!(null) },
                "stop": if i % 3 == 1 { json!(["al"]) } else { json!(null) },
            })
        })
        .collect();
    let everyone = Server::start(&model, &["--max-batch", "32"]);
    let alone: Vec<(String, String, u64)> = requests.iter().map(|r| answer(&everyone, r)).collect();
    let texts: std::collections::BTreeSet<&str> = alone.iter().map(|a| a.0.as_str()).collect();
    let lengths: std::collections::BTreeSet<u64> = alone.iter().map(|a| a.2).collect();
    assert!(
        texts.len() > 24 && lengths.len() > 8 && alone.iter().any(|a| a.1 == "stop"),
        "the requests should answer differently and end at different steps: {alone:?}"
    );
    let eight = Server::start(&model, &["--max-batch", "8"]);
    let portable = Server::start_with_env(&model, &["--max-batch", "8"], &[("PROMPT_R1_PORTABLE_OPS", "1")]);
    for server in [&everyone, &eight, &portable] {
        let barrier = std::sync::Barrier::new(requests.len());
        let together: Vec<(String, String, u64)> = std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .map(|r| {
                    let barrier = &barrier;
                    scope.spawn(move || {
                        barrier.wait();
                        answer(server, r)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (got, want)) in together.iter().zip(&alone).enumerate() {
            assert_eq!(got, want, "request {i}: {}", requests[i]);
        }
    }
}

/// Off the CPU kernels (burn's portable ops, the GPU path) the worker chooses tokens on the device
/// from the rows' own draws: a batch of greedy and sampled rows at different temperatures gives
/// the texts the host's choice gives; a top-p row keeps the host path for its whole batch.
#[test]
fn tokens_chosen_on_the_device_match_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let requests: Vec<Value> = [(0.0, None), (1.0, None), (0.7, None), (1.3, Some(0.9))]
        .iter()
        .enumerate()
        .map(|(i, &(temperature, top_p))| {
            json!({
                "messages": user(&format!("Tell me about {i} cats.")), "max_tokens": 16,
                "temperature": temperature, "top_p": top_p, "seed": 40 + i,
            })
        })
        .collect();
    let texts = |server: &Server, batch: &[Value]| -> Vec<String> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = batch.iter().map(|r| scope.spawn(|| content(&server.chat(r).json()))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let host = Server::start(&model, &["--max-batch", "4"]);
    let device = Server::start_with_env(&model, &["--max-batch", "4"], &[("PROMPT_R1_PORTABLE_OPS", "1")]);
    // The first three alone (device path for every step), then all four (host path).
    for batch in [&requests[..3], &requests[..]] {
        assert_eq!(texts(&device, batch), texts(&host, batch));
    }
}

#[test]
fn stop_strings_cut_the_text() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let request = json!({
        "messages": user("Count to ten."), "max_tokens": 40, "temperature": 1.0, "seed": 3
    });
    let full = content(&server.chat(&request).json());
    // A stop string taken from the middle of the sampled text: two whole characters (neither
    // a replacement character) that do not occur earlier. The reply ends right before them.
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    let window = |i: usize| &full[chars[i].0..chars.get(i + 2).map_or(full.len(), |&(at, _)| at)];
    let at = (8..chars.len().saturating_sub(1))
        .find(|&i| {
            chars[i].1 != '\u{FFFD}'
                && chars[i + 1].1 != '\u{FFFD}'
                && full.find(window(i)) == Some(chars[i].0)
        })
        .unwrap_or_else(|| panic!("no stop string to take from {full:?}"));
    let stop = window(at);
    let cut = &full[..chars[at].0];
    let mut with_stop = request.clone();
    with_stop["stop"] = json!(["never-in-this-text", stop]);
    let body = server.chat(&with_stop).json();
    assert_eq!(content(&body), cut);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    with_stop["stop"] = json!(stop);
    assert_eq!(content(&server.chat(&with_stop).json()), cut);
    with_stop["stream"] = json!(true);
    let (text, finish, _) = streamed(&server, &with_stop);
    assert_eq!((text.as_str(), finish.as_str()), (cut, "stop"));
}

#[test]
fn bad_requests_get_openai_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let ok = user("hi");
    let cases: Vec<(String, u16, Option<&str>)> = vec![
        ("{not json".into(), 400, None),
        ("[]".into(), 400, None),
        ("{}".into(), 400, Some("messages")),
        (json!({"messages": "hi"}).to_string(), 400, Some("messages")),
        (json!({"messages": []}).to_string(), 400, Some("messages")),
        (
            json!({"messages": [{"role": "user"}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}).to_string(),
            400,
            Some("messages[0].role"),
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        (
            json!({"messages": ok, "temperature": "hot"}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            json!({"messages": ok, "temperature": -1}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            json!({"messages": ok, "top_p": 1.5}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            json!({"messages": ok, "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (json!({"messages": ok, "n": 2}).to_string(), 400, Some("n")),
        (
            json!({"messages": ok, "stop": [1, 2]}).to_string(),
            400,
            Some("stop"),
        ),
        (
            json!({"messages": ok, "stream": "yes"}).to_string(),
            400,
            Some("stream"),
        ),
        (
            json!({"messages": ok, "model": "gpt-4o"}).to_string(),
            404,
            Some("model"),
        ),
    ];
    for (body, status, param) in cases {
        let reply = server.post("/v1/chat/completions", &body);
        assert_eq!(reply.status, status, "{body}: {}", reply.body);
        let error = &reply.json()["error"];
        for key in ["message", "type", "param", "code"] {
            assert!(error.get(key).is_some(), "{body}: no {key} in {error}");
        }
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(error["param"].as_str(), param, "{body}");
    }
    let unknown = server.post(
        "/v1/chat/completions",
        &json!({"messages": ok, "model": "x"}).to_string(),
    );
    assert_eq!(unknown.json()["error"]["code"], "model_not_found");
    // The server still answers after all of that.
    assert_eq!(
        server
            .chat(&json!({"messages": ok, "max_tokens": 2}))
            .status,
        200
    );
}

#[test]
fn a_client_that_goes_away_does_not_disturb_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let reference = json!({"messages": user("Hello"), "max_tokens": 12, "temperature": 0});
    let expected = content(&server.chat(&reference).json());
    for stream in [true, false] {
        // Send a long request, read the start of the reply (streaming) or nothing, and hang up.
        let max_tokens = if stream { 4000 } else { 500 };
        let body = json!({"messages": user("Go on."), "max_tokens": max_tokens, "stream": stream, "seed": 1})
            .to_string();
        let mut socket = connect(&server.addr);
        write!(
            socket,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        if stream {
            let mut start = [0u8; 64];
            let n = socket.read(&mut start).unwrap();
            assert!(String::from_utf8_lossy(&start[..n]).starts_with("HTTP/1.1 200"));
        }
        drop(socket);
        // A half-sent request, then a hang-up.
        let mut partial = connect(&server.addr);
        partial
            .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"mess")
            .unwrap();
        drop(partial);
        assert_eq!(content(&server.chat(&reference).json()), expected);
    }
    assert!(server.is_running());
}

#[test]
fn serve_refuses_a_model_directory_it_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let output = harness::prompt_r1(&[
        "serve",
        "--model",
        dir.path().to_str().unwrap(),
        "--port",
        "0",
    ]);
    assert!(!output.status.success());
    let stderr = harness::text(&output.stderr);
    assert!(
        stderr.starts_with("error: ") && stderr.contains("config.json"),
        "{stderr}"
    );
    let model = harness::tiny_model(dir.path());
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    let output = harness::prompt_r1(&["serve", "--model", model.to_str().unwrap(), "--port", "0"]);
    assert!(
        harness::text(&output.stderr).contains("tokenizer"),
        "{}",
        harness::text(&output.stderr)
    );
}

/// With a key (`PROMPT_R1_API_KEY` or `--api-key`) the /v1 routes answer 401 unless the request
/// sends it as a Bearer token; /health stays open.
#[test]
fn an_api_key_is_required_when_set() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start_with_env(&model, &[], &[("PROMPT_R1_API_KEY", "sk-local-1")]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let send = |headers: &[(&str, &str)]| {
        harness::request_with_headers(&server.addr, "POST", "/v1/chat/completions", Some(&chat), headers)
    };
    let missing = send(&[]);
    assert_eq!(missing.status, 401, "{}", missing.body);
    assert_eq!(missing.json()["error"]["code"], "invalid_api_key");
    assert_eq!(send(&[("Authorization", "Bearer sk-local-2")]).status, 401);
    assert_eq!(send(&[("Authorization", "sk-local-1")]).status, 401);
    let allowed = send(&[("Authorization", "Bearer sk-local-1")]);
    assert_eq!(allowed.status, 200, "{}", allowed.body);
    assert_eq!(server.get("/v1/models").status, 401);
    assert_eq!(server.get("/health").status, 200);

    // The flag does the same.
    let flagged = Server::start(&model, &["--api-key", "sk-flag"]);
    assert_eq!(flagged.get("/v1/models").status, 401);
    let models = harness::request_with_headers(
        &flagged.addr,
        "GET",
        "/v1/models",
        None,
        &[("Authorization", "Bearer sk-flag")],
    );
    assert_eq!(models.status, 200);
}

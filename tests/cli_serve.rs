//! `prompt-r1 serve` on the tiny random model, driven by a raw HTTP client: the OpenAI reply
//! shapes, streaming, stop strings, seeds, concurrent requests and errors.

#[path = "serve_harness/mod.rs"]
mod harness;

use std::io::{Read, Write};
use std::time::Duration;

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
        if status == 405 {
            let allow = if path == "/v1/models" { "GET, OPTIONS" } else { "POST, OPTIONS" };
            assert_eq!(reply.header("allow"), Some(allow), "{method} {path}");
        }
    }
    // OPTIONS asks what a route takes (RFC 9110), of known routes only.
    for (path, allow) in [("/v1/chat/completions", "POST, OPTIONS"), ("/v1/models/tiny", "GET, OPTIONS")] {
        let reply = harness::request(&server.addr, "OPTIONS", path, None);
        assert_eq!((reply.status, reply.header("allow"), reply.body.as_str()), (200, Some(allow), ""), "OPTIONS {path}");
    }
    assert_eq!(harness::request(&server.addr, "OPTIONS", "/nope", None).status, 404);
    // No origin is allowed by default: a page of another site cannot read the replies.
    let from_page = [("Origin", "http://app.example"), ("Access-Control-Request-Method", "POST")];
    let reply = harness::request_with_headers(&server.addr, "OPTIONS", "/v1/chat/completions", None, &from_page);
    assert_eq!((reply.status, reply.header("access-control-allow-origin")), (200, None));
}

/// `--allowed-origins` lets the named sites' pages call the server (CORS, as vLLM's flag): a
/// browser's preflight learns what a route takes, even with an API key, and every reply to such
/// a page says it may read it; other origins get no such header.
#[test]
fn allowed_origins_answer_browsers() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_env(
        &harness::tiny_model(dir.path()),
        &["--allowed-origins", "http://app.example,http://localhost:3000"],
        &[("PROMPT_R1_API_KEY", "k")],
    );
    let preflight = [
        ("Origin", "http://app.example"),
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "authorization, content-type"),
    ];
    let reply = harness::request_with_headers(&server.addr, "OPTIONS", "/v1/chat/completions", None, &preflight);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("access-control-allow-origin"), Some("http://app.example"));
    assert_eq!(reply.header("access-control-allow-methods"), Some("POST, OPTIONS"));
    assert_eq!(reply.header("access-control-allow-headers"), Some("authorization, content-type"));
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let answered = harness::request_with_headers(
        &server.addr,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[("Origin", "http://localhost:3000"), ("Authorization", "Bearer k")],
    );
    assert_eq!(answered.status, 200, "{}", answered.body);
    assert_eq!(answered.header("access-control-allow-origin"), Some("http://localhost:3000"));
    // A refusal says so to the page too, so that it can read why.
    let refused = harness::request_with_headers(&server.addr, "POST", "/v1/chat/completions", Some(&body), &[("Origin", "http://app.example")]);
    assert_eq!((refused.status, refused.header("access-control-allow-origin")), (401, Some("http://app.example")));
    let other = harness::request_with_headers(&server.addr, "GET", "/health", None, &[("Origin", "https://elsewhere.example")]);
    assert_eq!((other.status, other.header("access-control-allow-origin")), (200, None));
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
    // A count past u64 (it arrives as a float) is reported as sent.
    let past = server.chat(&json!({"messages": user("hi"), "max_tokens": 1e20}));
    let message = past.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains(" 100000000000000000000 in the completion"), "{message}");
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

/// The value of metric `name` (with its labels) in a Prometheus text exposition.
fn metric(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{exposition}"))
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Bytes of one KV position of the f32 checkpoint in `model` (keys and values of every layer).
fn kv_position_bytes(model: &std::path::Path) -> u64 {
    let config: Value = serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    let number = |key: &str| config[key].as_u64().unwrap_or_else(|| panic!("{key} in {config}"));
    let head_dim = config["head_dim"].as_u64().unwrap_or_else(|| number("hidden_size") / number("num_attention_heads"));
    2 * number("num_hidden_layers") * number("num_key_value_heads") * head_dim * 4
}

/// Continuous batching: 32 clients at once, each with its own greedy request (prompts of
/// different lengths, different token limits, some streamed), get the answers each request gets
/// alone, whether all of them decode together or at most 8 at a time (the others joining the
/// running batch as rows end), on the CPU kernels and on burn's portable ops (tokens chosen on
/// the device), with steps of 16 tokens (prompts prefilled in chunks over several steps), and
/// within a KV budget of 256 positions (`--kv-cache-memory`: a few requests' worth; the others
/// wait, or are preempted and prefilled again), whose pool never goes past it where the unbounded
/// server's held several times as much. The model's weights are scaled so that its greedy text depends on the whole
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
    // Steps of at most 16 tokens: every prompt is prefilled in chunks over several steps
    // while the other rows decode.
    let chunked = Server::start(&model, &["--max-batch", "8", "--max-num-batched-tokens", "16"]);
    const BUDGET: u64 = 256;
    let budget_bytes = (BUDGET * kv_position_bytes(&model)).to_string();
    let bounded = Server::start(&model, &["--max-batch", "32", "--kv-cache-memory", &budget_bytes]);
    for server in [&everyone, &eight, &portable, &chunked, &bounded] {
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
    let unbounded = settled_metrics(&everyone);
    let within = settled_metrics(&bounded);
    assert_eq!(metric(&within, "prompt_r1:kv_cache_budget_tokens"), BUDGET as f64, "{within}");
    let peak = metric(&within, "prompt_r1:kv_cache_pool_peak_tokens");
    assert!(peak <= BUDGET as f64, "the pool held {peak} positions, over the budget of {BUDGET}");
    let unbounded_peak = metric(&unbounded, "prompt_r1:kv_cache_pool_peak_tokens");
    assert!(unbounded_peak > 2.0 * BUDGET as f64, "without a budget the pool held only {unbounded_peak}: the test's budget binds nothing");
}

/// A client that leaves before its reply has its request dropped (`abort` in `/metrics`), as
/// vLLM aborts it: with one row, a request abandoned while it waits behind another never
/// decodes, and one abandoned while it decodes stops there, its row free for the next.
#[test]
fn an_abandoned_request_holds_no_row() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start(&model, &["--max-batch", "1"]);
    // The random model's greedy reply runs to its length: long enough to leave during it.
    let long = json!({"messages": user("hello"), "max_tokens": 6000, "temperature": 0});
    let running = |count: f64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while metric(&server.get("/metrics").body, "prompt_r1:num_requests_running") < count {
            assert!(std::time::Instant::now() < deadline, "no request started");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    // Sends `body` and leaves `after` later, without reading the reply.
    let abandon = |after: Duration| {
        let body = long.to_string();
        let mut stream = connect(&server.addr);
        write!(
            stream,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        std::thread::sleep(after);
        drop(stream);
    };
    let kept = std::thread::scope(|scope| {
        let first = scope.spawn(|| server.chat(&long));
        running(1.0);
        // Waits behind the first (one row), then its client leaves.
        abandon(Duration::from_millis(200));
        first.join().unwrap()
    });
    assert_eq!(kept.status, 200, "{}", kept.body);
    let kept = kept.json();
    assert_eq!(kept["choices"][0]["finish_reason"], "length", "the test needs a reply that runs to its length: {kept}");
    let kept_tokens = kept["usage"]["completion_tokens"].as_f64().unwrap();
    let after_waiting = settled_metrics(&server);
    let aborted = |text: &str| metric(text, "prompt_r1:request_success_total{finished_reason=\"abort\"}");
    assert_eq!(aborted(&after_waiting), 1.0, "{after_waiting}");
    assert_eq!(metric(&after_waiting, "prompt_r1:generation_tokens_total"), kept_tokens, "the abandoned request decoded: {after_waiting}");
    // Abandoned while it decodes: it stops well before its 6,000 tokens.
    std::thread::scope(|scope| {
        let leaver = scope.spawn(|| abandon(Duration::from_millis(300)));
        running(1.0);
        leaver.join().unwrap();
    });
    let after_decoding = settled_metrics(&server);
    assert_eq!(aborted(&after_decoding), 2.0, "{after_decoding}");
    let decoded = metric(&after_decoding, "prompt_r1:generation_tokens_total") - kept_tokens;
    assert!(decoded < 6000.0, "the abandoned request decoded all its {decoded} tokens");
    assert_eq!(server.chat(&json!({"messages": user("hi"), "max_tokens": 2})).status, 200, "the row is free");
}

/// `GET /metrics` once the worker has recorded the end of the last request (it writes its state
/// just after it sends a request's end).
fn settled_metrics(server: &Server) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = server.get("/metrics");
        assert_eq!(reply.status, 200, "{}", reply.body);
        let busy = metric(&reply.body, "prompt_r1:num_requests_running") + metric(&reply.body, "prompt_r1:num_requests_waiting");
        if busy == 0.0 || std::time::Instant::now() > deadline {
            return reply.body;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET /metrics` (Prometheus's text format, vLLM's names under `prompt_r1:`, open as `/health`)
/// counts what the server did: the prompts' and the completions' tokens as the replies' usage
/// gives them, each request by its finish reason, the prefix cache's hits. With
/// `--kv-cache-memory` the budget shows, and bounds one request's tokens: a longer one is refused
/// as over the context, which `/v1/models` gives as `max_model_len`.
#[test]
fn metrics_count_what_the_server_did() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start(&model, &["--kv-cache-memory", &(64 * kv_position_bytes(&model)).to_string()]);
    let before = server.get("/metrics");
    assert_eq!(before.status, 200);
    assert_eq!(before.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
    assert_eq!(metric(&before.body, "prompt_r1:generation_tokens_total"), 0.0);
    assert_eq!(metric(&before.body, "prompt_r1:kv_cache_budget_tokens"), 64.0);
    // 64 positions hold three blocks of 16 and the scratch block: 47 tokens of prompt and
    // completion, the last sampled token never being fed back.
    assert_eq!(server.get("/v1/models").json()["data"][0]["max_model_len"], 47);
    let question = json!({"messages": user("hello"), "max_tokens": 6, "temperature": 0});
    let mut prompt_tokens = 0;
    let mut completion_tokens = 0;
    let mut cached_tokens = 0;
    let mut reasons = Vec::new();
    for _ in 0..2 {
        let reply = server.chat(&question);
        assert_eq!(reply.status, 200, "{}", reply.body);
        let body = reply.json();
        prompt_tokens += body["usage"]["prompt_tokens"].as_u64().unwrap();
        completion_tokens += body["usage"]["completion_tokens"].as_u64().unwrap();
        cached_tokens += body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        reasons.push(body["choices"][0]["finish_reason"].as_str().unwrap().to_string());
    }
    let too_long = server.chat(&json!({"messages": user("hello"), "max_tokens": 100}));
    assert_eq!(too_long.status, 400, "{}", too_long.body);
    assert_eq!(too_long.json()["error"]["code"], "context_length_exceeded", "{}", too_long.body);
    let after = settled_metrics(&server);
    assert_eq!(metric(&after, "prompt_r1:prompt_tokens_total"), prompt_tokens as f64, "{after}");
    assert_eq!(metric(&after, "prompt_r1:generation_tokens_total"), completion_tokens as f64, "{after}");
    assert_eq!(metric(&after, "prompt_r1:prefix_cache_hits_total"), cached_tokens as f64, "{after}");
    assert_eq!(metric(&after, "prompt_r1:prefix_cache_queries_total"), prompt_tokens as f64, "{after}");
    for reason in ["stop", "length"] {
        let count = reasons.iter().filter(|r| *r == reason).count();
        assert_eq!(metric(&after, &format!("prompt_r1:request_success_total{{finished_reason=\"{reason}\"}}")), count as f64, "{after}");
    }
    assert_eq!(metric(&after, "prompt_r1:request_failure_total"), 0.0, "{after}");
    assert!(metric(&after, "prompt_r1:kv_cache_pool_peak_tokens") <= 64.0, "{after}");
    // Served on the CPU: no device pool to report.
    assert!(!after.contains("device_memory"), "{after}");
}

/// `--kv-cache-memory auto` on the CPU: the budget is what this machine's RAM leaves after the
/// CPU's 20% margin, the tiny model's weights and a decoder step (about 300 MiB: the CPU
/// kernel's `[rows, 1, queries, keys]` mask of 8 rows' 1,024-token chunks over 8,192 positions),
/// and `/metrics` gives it; one request may then take the model's whole context.
#[test]
fn an_auto_kv_budget_is_what_the_machine_leaves() {
    let Some(ram) = trainer::run::total_ram_bytes() else {
        println!("skipped: this machine's RAM cannot be read (/proc/meminfo)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start(&model, &["--kv-cache-memory", "auto"]);
    let metrics = server.get("/metrics").body;
    let budget = metric(&metrics, "prompt_r1:kv_cache_budget_tokens") * kv_position_bytes(&model) as f64;
    let usable = ram as f64 * 0.8;
    assert!(budget <= usable && budget > usable - (1u64 << 30) as f64, "budget {budget} of {usable} usable\n{metrics}");
    let config: Value = serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(server.get("/v1/models").json()["data"][0]["max_model_len"], config["max_position_embeddings"]);
    let reply = server.chat(&json!({"messages": user("hello"), "max_tokens": 4, "temperature": 0}));
    assert_eq!(reply.status, 200, "{}", reply.body);
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
fn serve_refuses_fewer_step_tokens_than_rows() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_prompt-r1"))
        .args(["serve", "--model", model.to_str().unwrap(), "--max-batch", "8", "--max-num-batched-tokens", "4"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--max-num-batched-tokens (4) must be at least --max-batch (8)"), "{stderr}");
}

/// A KV cache larger than the machine's memory is refused before the model loads, not
/// accepted and run out of memory later.
#[test]
fn serve_refuses_a_kv_cache_larger_than_the_machine() {
    if trainer::run::total_ram_bytes().is_none() {
        println!("skipped: this machine's RAM cannot be read (/proc/meminfo)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_prompt-r1"))
        .args(["serve", "--model", model.to_str().unwrap(), "--kv-cache-memory", "1000TiB"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--kv-cache-memory 1024000.0 GiB is more than the") && stderr.contains("this machine's RAM"), "{stderr}");
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
    // The scheme is case-insensitive; a key with another scheme is not one.
    assert_eq!(send(&[("Authorization", "bearer sk-local-1")]).status, 200);
    assert_eq!(send(&[("Authorization", "Basic sk-local-1")]).status, 401);
    let allowed = send(&[("Authorization", "Bearer sk-local-1")]);
    assert_eq!(allowed.status, 200, "{}", allowed.body);
    assert_eq!(server.get("/v1/models").status, 401);
    assert_eq!(server.get("/health").status, 200);
    // The routes that change the policy too.
    for path in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update_weights_from_disk"] {
        assert_eq!(server.post(path, "{}").status, 401, "{path}");
        let reply = harness::request_with_headers(&server.addr, "POST", path, Some("{}"), &[("Authorization", "Bearer sk-local-1")]);
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
    }

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

/// A `/v1/completions` reply (200 expected).
fn complete(server: &Server, body: &Value) -> Value {
    let reply = server.post("/v1/completions", &body.to_string());
    assert_eq!(reply.status, 200, "{body}: {}", reply.body);
    reply.json()
}

/// The sampled ids of a completion's first choice.
fn ids(reply: &Value) -> Vec<u64> {
    reply["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {reply}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The rollout-worker protocol: a prompt of token ids gives the string prompt's completion and
/// `prompt-r1 generate`'s greedy ids, with one log-prob per id; a stop token id ends the row on
/// that id; ids out of the vocabulary are refused, naming the element.
#[test]
fn token_id_prompts_return_ids_and_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model_scaled(dir.path(), 10.0);
    let server = Server::start(&model, &[]);
    let ask = |prompt: Value, extra: Value| {
        let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                              "logprobs": 0, "return_token_ids": true});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        complete(&server, &body)
    };
    let by_text = ask(json!("Tell me about the sea."), json!({}));
    let prompt = by_text["choices"][0]["prompt_token_ids"].clone();
    let prompt_ids: Vec<u64> = prompt.as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert!(prompt_ids.len() > 3, "{by_text}");
    let by_ids = ask(prompt.clone(), json!({}));
    let choice = &by_ids["choices"][0];
    assert_eq!(choice["prompt_token_ids"], prompt);
    assert_eq!(choice["token_ids"], by_text["choices"][0]["token_ids"]);
    assert_eq!(choice["text"], by_text["choices"][0]["text"]);
    assert_eq!(choice["logprobs"], by_text["choices"][0]["logprobs"]);
    let greedy = ids(&by_ids);
    assert_eq!(greedy, harness::generate_ids(&model, None, &prompt_ids, 12));
    assert_eq!((choice["finish_reason"].as_str(), &choice["stop_reason"]), (Some("length"), &Value::Null));
    assert_eq!(by_ids["usage"]["prompt_tokens"], json!(prompt_ids.len()));
    assert_eq!(by_ids["usage"]["completion_tokens"], json!(12));
    let logprobs = &choice["logprobs"];
    let token_logprobs: Vec<f64> = logprobs["token_logprobs"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    assert_eq!(token_logprobs.len(), 12);
    assert!(token_logprobs.iter().all(|&l| l <= 0.0), "{logprobs}");
    assert_eq!(logprobs["tokens"].as_array().map(Vec::len), Some(12));
    assert_eq!(logprobs["text_offset"][0], 0);
    assert!(logprobs["top_logprobs"].is_null());

    // Without logprobs and return_token_ids the reply has neither.
    let plain = complete(&server, &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}));
    assert!(plain["choices"][0]["logprobs"].is_null());
    assert!(plain["choices"][0].get("token_ids").is_none() && plain["choices"][0].get("prompt_token_ids").is_none());
    assert_eq!(plain["choices"][0]["text"], choice["text"]);

    // A stop token id ends the row on it: the id is the last of token_ids, with its log-prob.
    let stop = greedy[6];
    let at = greedy.iter().position(|&t| t == stop).unwrap();
    let stopped = ask(prompt.clone(), json!({"stop_token_ids": [stop]}));
    let choice = &stopped["choices"][0];
    assert_eq!(ids(&stopped), greedy[..=at]);
    assert_eq!((choice["finish_reason"].as_str(), choice["stop_reason"].as_u64()), (Some("stop"), Some(stop)));
    assert_eq!(choice["logprobs"]["token_logprobs"].as_array().unwrap()[..], by_ids["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap()[..=at]);
    assert_eq!(stopped["usage"]["completion_tokens"], json!(at + 1));
    if at > 0 {
        let shorter = ask(prompt.clone(), json!({"max_tokens": at}));
        assert_eq!(choice["text"], shorter["choices"][0]["text"], "the stop token's text is left out");
    }

    // Ids out of the vocabulary, an empty prompt, a prompt too long for the context.
    let vocab = 512 * 1000;
    let error = |body: Value| {
        let reply = server.post("/v1/completions", &body.to_string());
        (reply.status, reply.json()["error"].clone())
    };
    let (status, err) = error(json!({"prompt": [1, 2, vocab], "max_tokens": 2}));
    assert_eq!((status, err["param"].as_str()), (400, Some("prompt")));
    assert!(err["message"].as_str().unwrap().contains("prompt[2]"), "{err}");
    assert_eq!(error(json!({"prompt": [], "max_tokens": 2})).0, 400);
    assert_eq!(error(json!({"prompt": [1, -2], "max_tokens": 2})).0, 400);
    let context = server.get("/v1/models").json()["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    let (status, err) = error(json!({"prompt": vec![5; context - 10], "max_tokens": 11}));
    assert_eq!((status, err["code"].as_str()), (400, Some("context_length_exceeded")));
    // A prompt past the context alone is refused too, whatever the completion's length.
    let (status, err) = error(json!({"prompt": vec![5; context + 1]}));
    assert_eq!((status, err["code"].as_str()), (400, Some("context_length_exceeded")), "{err}");
    assert_eq!(error(json!({"prompt": [1, 2], "model": "other"})).0, 404);
}

/// A completion's `logprobs` describe its text: each token's text is what it added to the
/// reply as it was decoded (empty for a skipped special token, for the first bytes of a
/// character a later token completes, and for the stop token that ended the row), joined they
/// are the text, and `text_offset` is where each starts in it, in characters.
#[test]
fn completion_logprobs_describe_the_text() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &[]);
    let ask = |extra: Value| {
        let mut body = json!({"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 200,
                              "temperature": 1.0, "seed": 7, "logprobs": 0, "return_token_ids": true});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        let reply = complete(&server, &body);
        let choice = &reply["choices"][0];
        let text = choice["text"].as_str().unwrap().to_string();
        let tokens: Vec<String> = choice["logprobs"]["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
        let offsets: Vec<u64> = choice["logprobs"]["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        assert_eq!((tokens.len(), offsets.len()), (ids(&reply).len(), ids(&reply).len()), "{reply}");
        assert_eq!(tokens.concat(), text, "{reply}");
        for (i, &offset) in offsets.iter().enumerate() {
            assert_eq!(offset, tokens[..i].concat().chars().count() as u64, "token {i}: {reply}");
        }
        (text, tokens, ids(&reply))
    };
    let (skipped, skipped_tokens, sampled) = ask(json!({}));
    let (kept, kept_tokens, kept_ids) = ask(json!({"skip_special_tokens": false}));
    assert_eq!(kept_ids, sampled);
    assert!(kept.contains("<|im_start|>") && kept.len() > skipped.len(), "no special token sampled: {kept:?}");
    let marks = |tokens: &[String]| tokens.iter().filter(|t| t.is_empty()).count();
    assert!(marks(&skipped_tokens) > marks(&kept_tokens), "{skipped_tokens:?} {kept_tokens:?}");
    let stop = sampled[sampled.len() / 2];
    let (cut, tokens, stopped) = ask(json!({"stop_token_ids": [stop]}));
    assert_eq!((stopped.last(), tokens.last().map(String::as_str)), (Some(&stop), Some("")));
    assert!(skipped.starts_with(&cut), "{cut:?} {skipped:?}");
}

/// Seeded sampled token-id requests give the same ids and log-probs when repeated, and when
/// sent together with others.
#[test]
fn seeded_token_id_requests_answer_as_alone() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&harness::tiny_model(dir.path()), &["--max-batch", "4"]);
    let requests: Vec<Value> = (0..6u64)
        .map(|i| {
            let prompt: Vec<u64> = (0..3 + 2 * i).map(|j| 10 + (7 * j + 3 * i) % 200).collect();
            let temperature = [0.7, 1.0, 1.3][i as usize % 3];
            json!({
                "prompt": prompt, "max_tokens": 8 + 3 * i, "temperature": temperature,
                "top_k": if i == 2 { json!(40) } else { json!(-1) }, "seed": 300 + i,
                "logprobs": 0, "return_token_ids": true,
            })
        })
        .collect();
    let answer = |body: &Value| {
        let reply = complete(&server, body);
        (ids(&reply), reply["choices"][0]["logprobs"]["token_logprobs"].clone())
    };
    let alone: Vec<_> = requests.iter().map(answer).collect();
    assert_eq!(alone, requests.iter().map(answer).collect::<Vec<_>>());
    let together: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = requests.iter().map(|r| scope.spawn(move || answer(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The same ids; the log-probs to rounding (a batch's matrix products round differently
    // from one row's).
    for (i, ((ids, logprobs), (alone_ids, alone_logprobs))) in together.iter().zip(&alone).enumerate() {
        assert_eq!(ids, alone_ids, "request {i}");
        let close = logprobs.as_array().unwrap().iter().zip(alone_logprobs.as_array().unwrap()).all(|(a, b)| {
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4
        });
        assert!(close, "request {i}: {logprobs} vs {alone_logprobs}");
    }
    let mut other_seed = requests[1].clone();
    other_seed["seed"] = json!(999);
    assert_ne!(answer(&other_seed), alone[1]);
}

/// `serve --merge-lora` serves a loaded adapter merged into the base: its greedy answer's first
/// token and log-prob are those of the adapter beside the base (the log-prob within 1e-4; the
/// later tokens may part at a near tie, since the sums round differently).
#[test]
fn merged_adapters_answer_as_the_adapter_beside_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model_scaled(dir.path(), 10.0);
    let adapter = dir.path().join("adapter");
    harness::write_adapter(&model, &adapter, 1, 0.5);
    let prompt: Vec<u64> = vec![40, 41, 42, 43, 44];
    let first = |args: &[&str]| -> (u64, f64) {
        let server = Server::start(&model, args);
        let body = json!({"lora_name": "policy", "lora_path": adapter.to_str().unwrap()}).to_string();
        assert_eq!(server.post("/v1/load_lora_adapter", &body).status, 200);
        let reply = complete(&server, &json!({"model": "policy", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                              "logprobs": 0, "return_token_ids": true}));
        (ids(&reply)[0], reply["choices"][0]["logprobs"]["token_logprobs"][0].as_f64().unwrap())
    };
    let (apart, merged) = (first(&[]), first(&["--merge-lora"]));
    assert_eq!(merged.0, apart.0);
    assert!((merged.1 - apart.1).abs() < 1e-4, "merged {merged:?}, apart {apart:?}");
}

/// `POST /v1/load_lora_adapter` adds a named adapter that requests ask for as their model (the
/// base's name still gives the base), listed by `/v1/models` with its path as `root`; a second
/// load under the name needs `load_inplace`; a directory that is not a PEFT adapter of the base
/// is refused, naming it, the served adapter unchanged; unloading makes the name unknown.
#[test]
fn lora_adapters_load_and_unload_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model_scaled(dir.path(), 10.0);
    let (first, second) = (dir.path().join("adapter-1"), dir.path().join("adapter-2"));
    harness::write_adapter(&model, &first, 1, 0.5);
    harness::write_adapter(&model, &second, 2, 0.5);
    let server = Server::start(&model, &[]);
    let prompt: Vec<u64> = vec![40, 41, 42, 43, 44];
    let greedy = |name: &str| ids(&complete(&server, &json!({"model": name, "prompt": prompt, "max_tokens": 10,
                                                            "temperature": 0, "return_token_ids": true})));
    let base = greedy("tiny");
    assert_eq!(base, harness::generate_ids(&model, None, &prompt, 10));
    let load = |name: &str, path: &std::path::Path, inplace: Value| {
        server.post(
            "/v1/load_lora_adapter",
            &json!({"lora_name": name, "lora_path": path.to_str().unwrap(), "load_inplace": inplace}).to_string(),
        )
    };
    let loaded = load("policy", &first, json!(null));
    assert_eq!(loaded.status, 200, "{}", loaded.body);
    assert!(loaded.body.contains("Success"), "{}", loaded.body);
    let adapted = greedy("policy");
    assert_ne!(adapted, base);
    assert_eq!(adapted, harness::generate_ids(&model, Some(&first), &prompt, 10));
    assert_eq!(greedy("tiny"), base);
    let chat = server.chat(&json!({"model": "policy", "messages": user("hi"), "max_tokens": 3}));
    assert_eq!((chat.status, chat.json()["model"].clone()), (200, json!("policy")));

    let models = server.get("/v1/models").json();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{models}");
    assert_eq!((data[0]["id"].as_str(), data[0]["root"].as_str()), (Some("tiny"), model.to_str()));
    assert!(data[0]["parent"].is_null());
    assert_eq!(data[1]["id"], "policy");
    assert_eq!((data[1]["root"].as_str(), data[1]["parent"].as_str()), (first.to_str(), Some("tiny")));
    assert_eq!(server.get("/v1/models/policy").json()["root"], first.to_str().unwrap());

    // The name is taken unless the load is in place; in place, the new adapter serves.
    let again = load("policy", &second, json!(false));
    assert_eq!((again.status, again.json()["error"]["param"].clone()), (400, json!("lora_name")));
    assert_eq!(greedy("policy"), adapted);
    assert_eq!(load("policy", &second, json!(true)).status, 200);
    let replaced = greedy("policy");
    assert_eq!(replaced, harness::generate_ids(&model, Some(&second), &prompt, 10));
    assert_ne!(replaced, adapted);
    assert_eq!(server.get("/v1/models").json()["data"][1]["root"], second.to_str().unwrap());

    // Refused loads name the path and what is wrong; the adapter being served stays.
    let wrong_rank = dir.path().join("wrong-rank");
    std::fs::create_dir(&wrong_rank).unwrap();
    for file in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(first.join(file), wrong_rank.join(file)).unwrap();
    }
    let config = std::fs::read_to_string(wrong_rank.join("adapter_config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["r"] = json!(8);
    std::fs::write(wrong_rank.join("adapter_config.json"), config.to_string()).unwrap();
    let missing = dir.path().join("no-such-adapter");
    for (path, why) in [(&model, "adapter_config.json"), (&missing, "not a directory"), (&wrong_rank, "shape")] {
        let reply = load("policy", path, json!(true));
        assert_eq!(reply.status, 400, "{}", reply.body);
        let error = &reply.json()["error"];
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(path.to_str().unwrap()) && message.contains(why), "{message}");
        assert_eq!(error["type"], "invalid_request_error");
    }
    assert_eq!(load("tiny", &first, json!(true)).status, 400);
    assert_eq!(greedy("policy"), replaced);

    // Unloading.
    let body = json!({"lora_name": "policy"}).to_string();
    let unloaded = server.post("/v1/unload_lora_adapter", &body);
    assert_eq!(unloaded.status, 200, "{}", unloaded.body);
    let gone = server.post("/v1/completions", &json!({"model": "policy", "prompt": prompt}).to_string());
    assert_eq!((gone.status, gone.json()["error"]["code"].clone()), (404, json!("model_not_found")));
    assert_eq!(server.post("/v1/unload_lora_adapter", &body).status, 404);
    assert_eq!(server.get("/v1/models").json()["data"].as_array().map(Vec::len), Some(1));
    assert_eq!(server.get("/v1/models/policy").status, 404);
    assert_eq!(greedy("tiny"), base);
    assert_eq!(server.get("/v1/load_lora_adapter").status, 405);
}

/// `POST /update_weights_from_disk` replaces the base weights with those of another directory
/// of the same config (`root` follows); a directory that is missing, of another config or
/// without weights is refused (400, `success: false`, naming it) and the weights stay.
#[test]
fn update_weights_from_disk_replaces_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let scaled = harness::tiny_model_scaled(dir.path(), 10.0);
    let tiny = dir.path().join("tiny");
    let server = Server::start(&tiny, &[]);
    let prompt: Vec<u64> = vec![40, 41, 42, 43, 44];
    let greedy = || ids(&complete(&server, &json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": true})));
    let root = || server.get("/v1/models").json()["data"][0]["root"].clone();
    let before = greedy();
    assert_eq!(root(), json!(tiny.to_str().unwrap()));

    // Special tokens stay in the text when asked. (At init's scale the greedy text repeats the
    // prompt's last token, here <|im_start|>.)
    let special = |skip: bool| {
        let body = json!({"prompt": "Hi<|im_start|>", "max_tokens": 3, "temperature": 0, "skip_special_tokens": skip,
                          "return_token_ids": true});
        complete(&server, &body)["choices"][0].clone()
    };
    let (kept, skipped) = (special(false), special(true));
    assert_eq!(kept["token_ids"], skipped["token_ids"]);
    assert_eq!(kept["token_ids"][0], kept["prompt_token_ids"].as_array().unwrap().last().unwrap().clone());
    assert!(kept["text"].as_str().unwrap().starts_with("<|im_start|>"), "{kept}");
    assert!(!skipped["text"].as_str().unwrap().contains("<|im_start|>"), "{skipped}");

    let update = |path: &std::path::Path| {
        let reply = server.post("/update_weights_from_disk", &json!({"model_path": path.to_str().unwrap()}).to_string());
        (reply.status, reply.json())
    };
    let (status, body) = update(&scaled);
    assert_eq!((status, body["success"].clone()), (200, json!(true)), "{body}");
    let after = greedy();
    assert_ne!(after, before);
    assert_eq!(after, harness::generate_ids(&scaled, None, &prompt, 10));
    assert_eq!(root(), json!(scaled.to_str().unwrap()));

    let other_config = dir.path().join("other-config");
    let no_weights = dir.path().join("no-weights");
    for out in [&other_config, &no_weights] {
        std::fs::create_dir(out).unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(tiny.join(file), out.join(file)).unwrap();
        }
    }
    std::fs::remove_file(no_weights.join("model.safetensors")).unwrap();
    let config = std::fs::read_to_string(other_config.join("config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["rms_norm_eps"] = json!(0.5);
    std::fs::write(other_config.join("config.json"), config.to_string()).unwrap();
    let missing = dir.path().join("missing");
    for (path, why) in [(&missing, "not a directory"), (&other_config, "rms_norm_eps"), (&no_weights, "safetensors")] {
        let (status, body) = update(path);
        assert_eq!((status, body["success"].clone()), (400, json!(false)), "{body}");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(path.to_str().unwrap()) && message.contains(why), "{message}");
        assert_eq!(body["error"]["message"], body["message"]);
    }
    assert_eq!(greedy(), after);
    assert_eq!(root(), json!(scaled.to_str().unwrap()));
    assert_eq!(update(&tiny).0, 200);
    assert_eq!(greedy(), before);
}

/// The status of the reply on `stream` (its status line), waiting at most `within`.
fn reply_status(stream: &mut std::net::TcpStream, within: Duration) -> std::io::Result<u16> {
    stream.set_read_timeout(Some(within))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        if stream.read(&mut byte)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        line.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&line);
    line.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))
}

/// The server's VmRSS in MiB and thread count; `None` (with `skipped:` printed) without /proc.
fn rss_and_threads(server: &Server) -> Option<(f64, u64)> {
    let rss = server.proc_status("VmRSS");
    let threads = server.proc_status("Threads");
    match (rss, threads) {
        (Some(rss), Some(threads)) => Some((rss as f64 / 1024.0, threads)),
        _ => {
            println!("skipped: /proc/{}/status is not readable here", server.pid());
            None
        }
    }
}

/// The HTTP front's limits on the real server: an endless header is refused (431 or closed)
/// with bounded memory, a 50 MB body gets 413, a slow body 408, and 1,000 idle sockets leave
/// the thread count bounded and a normal request answered.
#[test]
fn abusive_clients_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model(dir.path());
    let server = Server::start(&model, &["--max-connections", "1100"]);

    // An endless header line.
    let before = rss_and_threads(&server);
    let mut socket = connect(&server.addr);
    let _ = socket.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Endless: ");
    let line = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    while sent < 64 << 20 {
        match socket.write(&line) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    let status = reply_status(&mut socket, Duration::from_secs(5));
    let after = rss_and_threads(&server);
    println!("endless header: sent {} KiB, got {status:?}", sent >> 10);
    assert!(matches!(status, Ok(431) | Err(_)), "{status:?}");
    assert!(sent < 64 << 20, "the server read a 64 MiB header");
    if let (Some((rss0, _)), Some((rss1, _))) = (before, after) {
        println!("endless header: server RSS {rss0:.1} -> {rss1:.1} MiB");
        assert!(rss1 - rss0 < 64.0, "RSS grew {:.1} MiB", rss1 - rss0);
    }
    drop(socket);
    assert_eq!(server.get("/health").status, 200);

    // A 50 MB body: 413 (the body need not be read).
    let mut socket = connect(&server.addr);
    socket
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n")
        .unwrap();
    let mut writer = socket.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let chunk = vec![b' '; 1 << 20];
        let mut sent = 0usize;
        while sent < 50_000_000 && writer.write_all(&chunk).is_ok() {
            sent += chunk.len();
        }
        sent
    });
    let status = reply_status(&mut socket, Duration::from_secs(10));
    drop(socket);
    let sent = sender.join().unwrap();
    println!("50 MB body: sent {} MiB, got {status:?}", sent >> 20);
    assert_eq!(status.ok(), Some(413));
    assert_eq!(server.get("/health").status, 200);

    // 1,000 idle sockets, each with half a head.
    let baseline = rss_and_threads(&server);
    let mut sockets = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let mut socket = connect(&server.addr);
        socket.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ").unwrap();
        sockets.push(socket);
    }
    std::thread::sleep(Duration::from_millis(500));
    let during = rss_and_threads(&server);
    let started = std::time::Instant::now();
    assert_eq!(server.get("/health").status, 200);
    println!("1000 idle sockets: a normal request answered in {:?}", started.elapsed());
    if let (Some((rss0, threads0)), Some((rss1, threads1))) = (baseline, during) {
        println!("1000 idle sockets: server threads {threads0} -> {threads1}, RSS {rss0:.1} -> {rss1:.1} MiB");
        assert!(threads1 < 200, "{threads1} threads");
    }
    drop(sockets);

    // A slow body: 408 after --request-timeout.
    let quick = Server::start(&model, &["--request-timeout", "1"]);
    let mut socket = connect(&quick.addr);
    socket
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
        .unwrap();
    let started = std::time::Instant::now();
    let status = reply_status(&mut socket, Duration::from_secs(10));
    println!("slow body: {status:?} after {:?}", started.elapsed());
    assert_eq!(status.ok(), Some(408));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(quick.get("/health").status, 200);
}

/// A `/v1/completions` request of token ids returning its ids and log-probs.
fn id_request(prompt: &[u64], extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                          "logprobs": 0, "return_token_ids": true});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// The sampled log-probs of a completion.
fn token_logprobs(reply: &Value) -> Vec<f64> {
    reply["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect()
}

fn cached_tokens(reply: &Value) -> u64 {
    reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or_else(|| panic!("no cached_tokens in {reply}"))
}

/// Whether two replies sampled the same ids, with log-probs within 1e-4.
fn assert_same_answer(got: &Value, want: &Value, what: &str) {
    assert_eq!(ids(got), ids(want), "{what}");
    let (a, b) = (token_logprobs(got), token_logprobs(want));
    assert!(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4), "{what}: {a:?} vs {b:?}");
}

/// The next turn's prompt: the last prompt, the ids it returned and `reply` ids.
fn next_turn(prompt: &[u64], reply: &Value, env: &[u64]) -> Vec<u64> {
    let mut next = prompt.to_vec();
    next.extend(ids(reply));
    next.extend(env);
    next
}

/// The prefix cache (the rollout worker's multi-turn protocol): a turn whose prompt is the last
/// turn's prompt, its returned ids and more reuses the last turn's KV cache (`cached_tokens`:
/// all but the last returned id) and answers as a server without the cache, greedy and seeded
/// sampled, turn after turn; chat replies carry the field; a LoRA load or new base weights
/// drop the cache (cached_tokens 0, the new policy's answer); an adapter's turns hit its own.
#[test]
fn the_prefix_cache_answers_as_a_full_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model_scaled(dir.path(), 10.0);
    let tiny = dir.path().join("tiny");
    let adapter = dir.path().join("adapter");
    harness::write_adapter(&model, &adapter, 1, 0.5);
    let cached = Server::start(&model, &[]);
    let plain = Server::start(&model, &["--prefix-cache-memory", "0"]);
    for extra in [json!({}), json!({"temperature": 1.0, "seed": 7})] {
        let first: Vec<u64> = (40..52).collect();
        let one = complete(&cached, &id_request(&first, extra.clone()));
        assert_eq!(cached_tokens(&one), 0);
        assert_same_answer(&one, &complete(&plain, &id_request(&first, extra.clone())), "turn 1");
        let mut prompt = first.clone();
        let mut last = one;
        for turn in 2..5u64 {
            let held = prompt.len() + ids(&last).len() - 1;
            prompt = next_turn(&prompt, &last, &[60 + turn, 61, 62]);
            let reply = complete(&cached, &id_request(&prompt, extra.clone()));
            let want = complete(&plain, &id_request(&prompt, extra.clone()));
            assert_eq!((cached_tokens(&reply), cached_tokens(&want)), (held as u64, 0), "turn {turn}");
            assert_eq!(reply["usage"]["prompt_tokens"], json!(prompt.len()));
            assert_same_answer(&reply, &want, &format!("turn {turn} of {extra}"));
            last = reply;
        }
    }
    let chat = cached.chat(&json!({"messages": user("hi"), "max_tokens": 3})).json();
    assert_eq!(chat["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{chat}");
    let (_, _, usage) = streamed(&cached, &json!({"messages": user("hi"), "max_tokens": 3, "stream": true,
                                                  "stream_options": {"include_usage": true}}));
    assert!(usage.unwrap()["prompt_tokens_details"]["cached_tokens"].is_u64());

    // A policy change drops the cache.
    let first: Vec<u64> = (100..110).collect();
    let one = complete(&cached, &id_request(&first, json!({})));
    let second = next_turn(&first, &one, &[7, 8]);
    let loaded = cached.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "policy", "lora_path": adapter.to_str().unwrap()}).to_string(),
    );
    assert_eq!(loaded.status, 200, "{}", loaded.body);
    let base = complete(&cached, &id_request(&second, json!({})));
    assert_eq!((cached_tokens(&base), ids(&base)), (0, harness::generate_ids(&model, None, &second, 8)));
    // The adapter's turns reuse the adapter's sequences (not the base's).
    let adapted = complete(&cached, &id_request(&second, json!({"model": "policy"})));
    assert_eq!((cached_tokens(&adapted), ids(&adapted)), (0, harness::generate_ids(&model, Some(&adapter), &second, 8)));
    let third = next_turn(&second, &adapted, &[9]);
    let adapted_again = complete(&cached, &id_request(&third, json!({"model": "policy"})));
    assert_eq!(cached_tokens(&adapted_again) as usize, second.len() + 7);
    assert_eq!(ids(&adapted_again), harness::generate_ids(&model, Some(&adapter), &third, 8));
    let base_third = next_turn(&second, &base, &[9]);
    let update = cached.post("/update_weights_from_disk", &json!({"model_path": tiny.to_str().unwrap()}).to_string());
    assert_eq!(update.status, 200, "{}", update.body);
    let after = complete(&cached, &id_request(&base_third, json!({})));
    assert_eq!((cached_tokens(&after), ids(&after)), (0, harness::generate_ids(&tiny, None, &base_third, 8)));
}

/// Many clients' two-turn exchanges at once answer as alone on a server without the cache,
/// with the default cache and with one too small for more than one sequence (it evicts the
/// least recently used and fails no request).
#[test]
fn concurrent_turns_with_a_prefix_cache_answer_as_alone() {
    let dir = tempfile::tempdir().unwrap();
    let model = harness::tiny_model_scaled(dir.path(), 10.0);
    let plain = Server::start(&model, &["--prefix-cache-memory", "0"]);
    let firsts: Vec<Vec<u64>> = (0..8u64).map(|i| (0..10 + i).map(|j| 20 + 13 * i + j).collect()).collect();
    let exchange = |server: &Server, first: &Vec<u64>| {
        let one = complete(server, &id_request(first, json!({"max_tokens": 6})));
        let two = complete(server, &id_request(&next_turn(first, &one, &[5, 6]), json!({"max_tokens": 6})));
        (one, two)
    };
    let alone: Vec<(Value, Value)> = firsts.iter().map(|f| exchange(&plain, f)).collect();
    // Tiny's KV position is 512 bytes (f32, 2 layers, 2 KV heads of 16): 12 KiB hold 24.
    let small = Server::start(&model, &["--prefix-cache-memory", "12KiB", "--max-batch", "4"]);
    let roomy = Server::start(&model, &["--max-batch", "4"]);
    // Sequentially in the small cache: the second exchange's first turn evicts the first's.
    let (_, two) = exchange(&small, &firsts[0]);
    assert_eq!(cached_tokens(&two), 15);
    let one_b = complete(&small, &id_request(&firsts[1], json!({"max_tokens": 6})));
    let again = complete(&small, &id_request(&next_turn(&firsts[0], &alone[0].0, &[5, 6]), json!({"max_tokens": 6})));
    assert_eq!(cached_tokens(&again), 0);
    assert_same_answer(&again, &alone[0].1, "evicted");
    let two_b = complete(&small, &id_request(&next_turn(&firsts[1], &one_b, &[5, 6]), json!({"max_tokens": 6})));
    assert_same_answer(&two_b, &alone[1].1, "kept");
    for server in [&small, &roomy] {
        let together: Vec<(Value, Value)> = std::thread::scope(|scope| {
            let handles: Vec<_> = firsts.iter().map(|f| scope.spawn(move || exchange(server, f))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, ((one, two), (want_one, want_two))) in together.iter().zip(&alone).enumerate() {
            assert_same_answer(one, want_one, &format!("exchange {i}, turn 1"));
            assert_same_answer(two, want_two, &format!("exchange {i}, turn 2"));
        }
    }
    let hits: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = firsts.iter().map(|f| scope.spawn(|| cached_tokens(&exchange(&roomy, f).1))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert!(hits > 0, "the roomy cache should serve second turns");
}

//! Routes and replies: `/health`, `/metrics` (in Prometheus's format, see `metrics`), `/v1/models`, `/v1/chat/completions` (JSON or server-sent
//! events), `/v1/completions` (in `completions`), the policy's control routes (in `control`),
//! OpenAI-style errors for everything else.

use std::io;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Instant;

use model::chat_template::RenderOptions;
use model::tokenizer::Encoded;
use model::Sampling;
use serde_json::{json, Value};

use super::completions;
use super::control;
use super::engine::{Cancel, Event, Finish, Finished, GenParams, Job, Work};
use super::error::ApiError;
use super::listener::{Request, Responder, Stream};
use super::policy::Models;
use super::request::{self, CompletionRequest};
use super::stop::StopStrings;
use super::Shared;

/// The chat-completions endpoint.
const CHAT_ROUTE: &str = "/v1/chat/completions";
/// The worker's state and counts for Prometheus (open without the API key, as `/health`).
const METRICS_ROUTE: &str = "/metrics";
/// Answers one request (its body already read, within the listener's limits).
pub fn handle(request: Request, responder: Responder, shared: &Shared) {
    let method = request.method.as_str();
    let path = request.path.as_str();
    let allow = allowed_methods(path);
    if let (Some(allow), "OPTIONS") = (allow, method) {
        // What the route takes, before the key: a client (a browser's preflight) asks
        // without one.
        let responder = responder.with_headers(shared.allowed_origins.preflight_headers(&request, allow));
        return responder.send_with_headers(200, "text/plain; charset=utf-8", &[("allow", allow), SERVER_HEADER], Vec::new());
    }
    let responder = responder.with_headers(shared.allowed_origins.reply_headers(&request));
    if let Some(allow) = allow.filter(|allow| !allow.split(", ").any(|m| m == method)) {
        let err = ApiError::method_not_allowed(method, path);
        return responder.send_with_headers(err.status, "application/json", &[("allow", allow), SERVER_HEADER], err.body().to_string().into_bytes());
    }
    let guarded = path.starts_with("/v1") || path == control::UPDATE_WEIGHTS_ROUTE;
    if guarded && !authorized(&request, shared.api_key.as_deref()) {
        return respond_error(responder, &ApiError::unauthorized());
    }
    match (method, path) {
        ("GET", "/health") => respond_json(responder, 200, &json!({"status": "ok"})),
        ("GET", METRICS_ROUTE) => {
            let text = shared.metrics.snapshot().render();
            responder.send_with_headers(200, "text/plain; version=0.0.4; charset=utf-8", &[SERVER_HEADER], text.into_bytes())
        }
        ("GET", "/v1/models") => {
            let body = json!({"object": "list", "data": model_cards(shared)});
            respond_json(responder, 200, &body)
        }
        ("GET", p) if p.starts_with("/v1/models/") => {
            let name = &p["/v1/models/".len()..];
            match model_cards(shared).into_iter().find(|card| card["id"] == name) {
                Some(card) => respond_json(responder, 200, &card),
                None => respond_error(responder, &ApiError::unknown_model(name)),
            }
        }
        ("POST", CHAT_ROUTE) => chat(&request.body, responder, shared),
        ("POST", completions::ROUTE) => completions::handle(&request.body, responder, shared),
        ("POST", p) if control::ROUTES.contains(&p) => {
            control::handle(&request.body, responder, p, shared)
        }
        _ => respond_error(responder, &ApiError::not_found(method, path)),
    }
}

/// The methods route `path` answers (the value of a 405's `Allow` header, and of an `OPTIONS`
/// reply's); `None` for no route of the server.
fn allowed_methods(path: &str) -> Option<&'static str> {
    match path {
        "/health" | METRICS_ROUTE | "/v1/models" => Some("GET, OPTIONS"),
        p if p.starts_with("/v1/models/") => Some("GET, OPTIONS"),
        CHAT_ROUTE | completions::ROUTE => Some("POST, OPTIONS"),
        p if control::ROUTES.contains(&p) => Some("POST, OPTIONS"),
        _ => None,
    }
}

/// Whether `request` may use the `/v1` routes: always without a key; with one, when it sends
/// `Authorization: Bearer KEY` (compared in constant time).
fn authorized(request: &Request, key: Option<&str>) -> bool {
    let Some(key) = key else { return true };
    request
        .headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("authorization"))
        // The scheme is case-insensitive (RFC 9110): "bearer KEY" is sent by some clients.
        .filter_map(|(_, value)| value.split_once(' ').filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer")).map(|(_, given)| given))
        .any(|given| same_bytes(given.trim().as_bytes(), key.as_bytes()))
}

/// Equality of two byte strings whose time does not depend on where they first differ.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The served model, then each loaded adapter, as vLLM lists them: `root` is the directory
/// the weights were (last) loaded from, an adapter's `parent` the served model.
fn model_cards(shared: &Shared) -> Vec<Value> {
    let Models { base_root, adapters } = shared.models();
    let card = |id: &str, created: u64, root: &str, parent: Option<&str>| {
        json!({
            "id": id,
            "object": "model",
            "created": created,
            "owned_by": "prompt-r1",
            "root": root,
            "parent": parent,
            "max_model_len": shared.context_len,
        })
    };
    let mut cards = vec![card(&shared.model_name, shared.created, &base_root, None)];
    for (name, adapter) in &adapters {
        cards.push(card(name, adapter.created, &adapter.root, Some(&shared.model_name)));
    }
    cards
}

/// The adapter a request for model `name` runs with (`None`: the base alone, also when the
/// request names no model), or 404 when no such model is served.
pub(super) fn adapter_for(name: Option<&str>, shared: &Shared) -> Result<Option<String>, ApiError> {
    match name {
        None => Ok(None),
        Some(name) if name == shared.model_name => Ok(None),
        Some(name) if shared.models().adapters.contains_key(name) => Ok(Some(name.to_string())),
        Some(name) => Err(ApiError::unknown_model(name)),
    }
}

/// What the reply to an accepted request needs.
pub(super) struct Accepted {
    pub id: String,
    pub created: u64,
    /// The model as the request named it (the served name when it named none).
    pub model: String,
    pub prompt_tokens: usize,
    /// The prompt's ids, kept when the reply shows them (`return_token_ids`).
    pub prompt_ids: Option<Vec<u32>>,
    pub stream: bool,
    pub include_usage: bool,
}

fn chat(body: &[u8], responder: Responder, shared: &Shared) {
    let started = Instant::now();
    let (job, events, accepted) = match prepare(body, shared) {
        Ok(ok) => ok,
        Err(err) => {
            log(CHAT_ROUTE, shared, err.status, None, started);
            return respond_error(responder, &err);
        }
    };
    // A client that left while its request waited for a handler costs no generation.
    if responder.client_gone() {
        return log(CHAT_ROUTE, shared, 499, None, started);
    }
    let cancel = job.cancel.clone();
    if shared.work.send(Work::Job(job)).is_err() {
        let err = ApiError::internal("the generation worker has stopped");
        log(CHAT_ROUTE, shared, err.status, None, started);
        return respond_error(responder, &err);
    }
    let (status, completion) = if accepted.stream {
        stream(responder, &events, &accepted, &cancel)
    } else {
        complete(responder, &events, &accepted, &cancel)
    };
    log(
        CHAT_ROUTE,
        shared,
        status,
        completion.map(|c| (accepted.prompt_tokens, c)),
        started,
    );
}

/// Checks the request and turns it into a job for the worker.
fn prepare(body: &[u8], shared: &Shared) -> Result<(Job, Receiver<Event>, Accepted), ApiError> {
    let req: CompletionRequest = request::parse(body)?;
    adapter_for(req.model.as_deref(), shared)?;
    let thinking = req.enable_thinking.unwrap_or(shared.enable_thinking);
    let text = shared
        .template
        .render(&req.messages, RenderOptions::generation(thinking));
    job(&text, req, shared, "messages", "chatcmpl", false)
}

/// Tokenizes `text` (from the request's `param`) and makes the job for `req`'s sampling, with
/// an id starting with `id_prefix`; `keep_ids`: the reply shows the prompt ids.
pub(super) fn job(
    text: &str,
    req: CompletionRequest,
    shared: &Shared,
    param: &str,
    id_prefix: &str,
    keep_ids: bool,
) -> Result<(Job, Receiver<Event>, Accepted), ApiError> {
    let cannot = |err: model::tokenizer::TokenizerError| ApiError::internal(format!("cannot tokenize the {param}: {err}"));
    let prompt = match shared.tokenizer.encode_at_most(text, shared.context_len).map_err(cannot)? {
        Encoded::Ids(ids) => ids,
        Encoded::Longer(count) => {
            return Err(ApiError::invalid(
                format!(
                    "This model's maximum context length is {} tokens. However, your {param} came to more than {count} tokens.",
                    shared.context_len
                ),
                Some(param),
            )
            .with_code("context_length_exceeded"))
        }
    };
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= shared.vocab_size) {
        return Err(ApiError::invalid(
            format!(
                "The {param} gave token id {bad}, outside the model's vocabulary of {}.",
                shared.vocab_size
            ),
            Some(param),
        ));
    }
    job_for_ids(prompt, req, shared, param, id_prefix, keep_ids)
}

/// Makes the job for the prompt ids `prompt` (in the vocabulary) and `req`'s model and
/// sampling, with an id starting with `id_prefix`; `keep_ids`: the reply shows the prompt ids.
pub(super) fn job_for_ids(
    prompt: Vec<u32>,
    req: CompletionRequest,
    shared: &Shared,
    param: &str,
    id_prefix: &str,
    keep_ids: bool,
) -> Result<(Job, Receiver<Event>, Accepted), ApiError> {
    let adapter = adapter_for(req.model.as_deref(), shared)?;
    let room = shared.context_len.saturating_sub(prompt.len());
    let context_error = |wanted: u128| {
        ApiError::invalid(
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the {param}, {wanted} in the completion).",
                shared.context_len,
                (prompt.len() as u128).saturating_add(wanted),
                prompt.len()
            ),
            Some(param),
        )
        .with_code("context_length_exceeded")
    };
    if prompt.len() > shared.context_len {
        return Err(context_error(0));
    }
    let max_tokens = match req.max_tokens {
        Some(n) if n > room as u128 => return Err(context_error(n)),
        Some(n) => n as usize,
        None if room == 0 => return Err(context_error(1)),
        None => shared.default_max_tokens.min(room),
    };
    let defaults = &shared.defaults;
    let params = GenParams {
        max_tokens,
        sampling: Sampling {
            temperature: req.temperature.unwrap_or(defaults.temperature),
            top_p: req.top_p.or(defaults.top_p),
            top_k: req.top_k.or(defaults.top_k),
            seed: req.seed.unwrap_or_else(rand::random),
        },
        stop: StopStrings::new(req.stop),
        stop_token_ids: req.stop_token_ids,
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
        ignore_eos: req.ignore_eos,
    };
    let (sender, events) = mpsc::channel();
    let accepted = Accepted {
        id: format!(
            "{id_prefix}-{:016x}{:08x}",
            rand::random::<u64>(),
            rand::random::<u32>()
        ),
        created: unix_time(),
        model: req.model.unwrap_or_else(|| shared.model_name.clone()),
        prompt_tokens: prompt.len(),
        prompt_ids: keep_ids.then(|| prompt.clone()),
        stream: req.stream,
        include_usage: req.include_usage,
    };
    let job = Job {
        prompt,
        adapter,
        params,
        events: sender,
        cancel: Cancel::default(),
    };
    Ok((job, events, accepted))
}

/// Collects the whole reply; returns the status sent and the completion tokens.
fn complete(
    responder: Responder,
    events: &Receiver<Event>,
    accepted: &Accepted,
    cancel: &Cancel,
) -> (u16, Option<usize>) {
    let (content, done) = match collect(events, &responder, cancel) {
        Ok(ok) => ok,
        Err(err) => {
            respond_error(responder, &err);
            return (err.status, None);
        }
    };
    let (finish, completion_tokens) = (done.finish, done.completion_tokens());
    let body = json!({
        "id": accepted.id,
        "object": "chat.completion",
        "created": accepted.created,
        "model": accepted.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": null,
            "finish_reason": finish.as_str(),
        }],
        "usage": usage(accepted.prompt_tokens, completion_tokens, done.cached_tokens),
    });
    respond_json(responder, 200, &body);
    (200, Some(completion_tokens))
}

/// The whole text of a reply and how it ended; cancels the request (see [`Cancel`]) when its
/// client goes away first, which is looked at every [`CLIENT_CHECK`], text arriving or not.
pub(super) fn collect(events: &Receiver<Event>, responder: &Responder, cancel: &Cancel) -> Result<(String, Finished), ApiError> {
    let mut text = String::new();
    let mut next_check = Instant::now() + CLIENT_CHECK;
    loop {
        match events.recv_timeout(next_check.saturating_duration_since(Instant::now())) {
            Ok(Event::Text(piece)) => text.push_str(&piece),
            Ok(Event::Done(done)) => return Ok((text, done)),
            Ok(Event::Failed(message)) => return Err(ApiError::internal(message)),
            Ok(Event::Refused(err)) => return Err(err),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Err(ApiError::internal("generation stopped without a result")),
        }
        if Instant::now() >= next_check {
            if responder.client_gone() {
                cancel.cancel();
                return Err(ApiError::client_gone());
            }
            next_check = Instant::now() + CLIENT_CHECK;
        }
    }
}

/// How often a handler waiting for its reply looks whether its client is still there.
const CLIENT_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// A reply's `usage`; `cached_tokens`: prompt tokens not prefilled thanks to the prefix cache.
pub(super) fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Sends the reply as server-sent events while it is generated. A client that goes away
/// closes the event channel (dropped on return), which ends its row in the worker.
fn stream(
    responder: Responder,
    events: &Receiver<Event>,
    accepted: &Accepted,
    cancel: &Cancel,
) -> (u16, Option<usize>) {
    let mut out = EventStream {
        stream: Some(responder.stream_with_headers(
            200,
            "text/event-stream; charset=utf-8",
            &[("cache-control", "no-cache"), ("connection", "close"), SERVER_HEADER],
        )),
    };
    let mut completion = None;
    match write_events(&mut out, events, accepted, &mut completion) {
        Ok(()) if completion.is_some() => (200, completion),
        Ok(()) => (500, None),
        // The client went away: its request, waiting or decoding, is dropped.
        Err(_) => {
            cancel.cancel();
            (499, completion)
        }
    }
}

/// Writes the chunks of one reply: the role, the text as it comes, the finish reason, the
/// usage when asked for, `[DONE]`. Sets `completion` to the completion tokens once known.
fn write_events(
    out: &mut EventStream,
    events: &Receiver<Event>,
    accepted: &Accepted,
    completion: &mut Option<usize>,
) -> io::Result<()> {
    let chunk = |choices: Value| {
        let mut body = json!({
            "id": accepted.id,
            "object": "chat.completion.chunk",
            "created": accepted.created,
            "model": accepted.model,
            "choices": choices,
        });
        if accepted.include_usage {
            body["usage"] = Value::Null;
        }
        body
    };
    let delta = |delta: Value, finish: Option<Finish>| {
        chunk(json!([{
            "index": 0,
            "delta": delta,
            "logprobs": null,
            "finish_reason": finish.map(Finish::as_str),
        }]))
    };
    out.data(&delta(json!({"role": "assistant", "content": ""}), None))?;
    loop {
        let event = events.recv_timeout(CLIENT_CHECK);
        if matches!(event, Err(RecvTimeoutError::Timeout)) {
            // Nothing yet (the request waits for a row, or a long prefill runs): is the client
            // still there?
            out.raw(b"")?;
            continue;
        }
        match event {
            Ok(Event::Text(text)) => out.data(&delta(json!({"content": text}), None))?,
            Ok(Event::Done(done)) => {
                let completion_tokens = done.completion_tokens();
                *completion = Some(completion_tokens);
                out.data(&delta(json!({}), Some(done.finish)))?;
                if accepted.include_usage {
                    let mut last = chunk(json!([]));
                    last["usage"] = usage(accepted.prompt_tokens, completion_tokens, done.cached_tokens);
                    out.data(&last)?;
                }
                break;
            }
            Ok(Event::Failed(message)) => {
                out.data(&ApiError::internal(message).body())?;
                break;
            }
            Ok(Event::Refused(err)) => {
                out.data(&err.body())?;
                break;
            }
            Err(_) => {
                out.data(&ApiError::internal("generation stopped without a result").body())?;
                break;
            }
        }
    }
    out.done()
}

/// A `text/event-stream` body; the listener sends (and flushes) each event as it comes, chunked
/// (or, to an HTTP/1.0 client, until the connection closes).
struct EventStream {
    stream: Option<Stream>,
}

impl EventStream {
    fn data(&mut self, value: &Value) -> io::Result<()> {
        self.raw(format!("data: {value}\n\n").as_bytes())
    }

    fn done(&mut self) -> io::Result<()> {
        self.raw(b"data: [DONE]\n\n")?;
        if let Some(stream) = self.stream.take() {
            stream.finish();
        }
        Ok(())
    }

    /// Fails once the client is gone, so that generation stops.
    fn raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        match &mut self.stream {
            Some(stream) => stream.write(bytes),
            None => Err(io::Error::other("the stream has ended")),
        }
    }
}

/// Sent with every reply.
const SERVER_HEADER: (&str, &str) = ("server", "prompt-r1");

pub(super) fn respond_json(responder: Responder, status: u16, body: &Value) {
    // A client that went away needs no answer (the responder drops it).
    responder.send_with_headers(
        status,
        "application/json",
        &[SERVER_HEADER],
        body.to_string().into_bytes(),
    );
}

/// A plain-text reply (vLLM answers a LoRA load or unload so).
pub(super) fn respond_text(responder: Responder, status: u16, text: String) {
    responder.send_with_headers(
        status,
        "text/plain; charset=utf-8",
        &[SERVER_HEADER],
        text.into_bytes(),
    );
}

pub(super) fn respond_error(responder: Responder, err: &ApiError) {
    respond_json(responder, err.status, &err.body());
}

/// One line per request on stderr for `route` (never the request's headers or content).
pub(super) fn log(
    route: &str,
    shared: &Shared,
    status: u16,
    tokens: Option<(usize, usize)>,
    started: Instant,
) {
    if shared.quiet {
        return;
    }
    let ms = started.elapsed().as_millis();
    match tokens {
        Some((prompt, completion)) => eprintln!(
            "POST {route} {status} prompt_tokens={prompt} completion_tokens={completion} {ms} ms"
        ),
        None => eprintln!("POST {route} {status} {ms} ms"),
    }
}

/// Seconds since the Unix epoch.
pub fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

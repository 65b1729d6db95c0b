//! Routes and replies: `/health`, `/v1/models`, `/v1/chat/completions` (JSON or server-sent
//! events), `/v1/completions` (in `completions`), OpenAI-style errors for everything else.

use std::io::{self, Read, Write};
use std::sync::mpsc::{self, Receiver};
use std::time::Instant;

use model::chat_template::RenderOptions;
use model::Sampling;
use serde_json::{json, Value};
use tiny_http::{HTTPVersion, Header, Method, Request, Response};

use super::completions;
use super::engine::{Event, Finish, GenParams, Job};
use super::error::ApiError;
use super::request::{self, CompletionRequest};
use super::stop::StopStrings;
use super::Shared;


/// The chat-completions endpoint.
const CHAT_ROUTE: &str = "/v1/chat/completions";
/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 32 << 20;

/// Answers one request.
pub fn handle(request: Request, shared: &Shared) {
    let method = request.method().clone();
    let path = request
        .url()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_string();
    if path.starts_with("/v1") && !authorized(&request, shared.api_key.as_deref()) {
        return respond_error(request, &ApiError::unauthorized());
    }
    match (&method, path.as_str()) {
        (Method::Get, "/health") => respond_json(request, 200, &json!({"status": "ok"})),
        (Method::Get, "/v1/models") => {
            let body = json!({"object": "list", "data": [model_card(shared)]});
            respond_json(request, 200, &body)
        }
        (Method::Get, p) if p.starts_with("/v1/models/") => {
            let name = &p["/v1/models/".len()..];
            if name == shared.model_name {
                respond_json(request, 200, &model_card(shared))
            } else {
                respond_error(request, &ApiError::unknown_model(name))
            }
        }
        (Method::Post, CHAT_ROUTE) => chat(request, shared),
        (Method::Post, completions::ROUTE) => completions::handle(request, shared),
        (_, "/health" | "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            respond_error(
                request,
                &ApiError::method_not_allowed(method.as_str(), &path),
            )
        }
        _ => respond_error(request, &ApiError::not_found(method.as_str(), &path)),
    }
}

/// Whether `request` may use the `/v1` routes: always without a key; with one, when it sends
/// `Authorization: Bearer KEY` (compared in constant time).
fn authorized(request: &Request, key: Option<&str>) -> bool {
    let Some(key) = key else { return true };
    request
        .headers()
        .iter()
        .filter(|h| h.field.equiv("Authorization"))
        .filter_map(|h| h.value.as_str().strip_prefix("Bearer "))
        .any(|given| same_bytes(given.trim().as_bytes(), key.as_bytes()))
}

/// Equality of two byte strings whose time does not depend on where they first differ.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn model_card(shared: &Shared) -> Value {
    json!({
        "id": shared.model_name,
        "object": "model",
        "created": shared.created,
        "owned_by": "prompt-r1",
        "max_model_len": shared.context_len,
    })
}

/// What the reply to an accepted request needs.
pub(super) struct Accepted {
    pub id: String,
    pub created: u64,
    pub prompt_tokens: usize,
    pub stream: bool,
    pub include_usage: bool,
}

fn chat(mut request: Request, shared: &Shared) {
    let started = Instant::now();
    let accepted = read_body(&mut request).and_then(|body| prepare(&body, shared));
    let (job, events, accepted) = match accepted {
        Ok(ok) => ok,
        Err(err) => {
            log(CHAT_ROUTE, shared, err.status, None, started);
            return respond_error(request, &err);
        }
    };
    if shared.jobs.send(job).is_err() {
        let err = ApiError::internal("the generation worker has stopped");
        log(CHAT_ROUTE, shared, err.status, None, started);
        return respond_error(request, &err);
    }
    let (status, completion) = if accepted.stream {
        stream(request, &events, &accepted, shared)
    } else {
        complete(request, &events, &accepted, shared)
    };
    log(
        CHAT_ROUTE,
        shared,
        status,
        completion.map(|c| (accepted.prompt_tokens, c)),
        started,
    );
}

pub(super) fn read_body(request: &mut Request) -> Result<Vec<u8>, ApiError> {
    if request.body_length().is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(ApiError::too_large(MAX_BODY_BYTES));
    }
    let mut body = Vec::new();
    request
        .as_reader()
        .take(MAX_BODY_BYTES as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|err| ApiError::invalid(format!("cannot read the request body: {err}"), None))?;
    if body.len() > MAX_BODY_BYTES {
        return Err(ApiError::too_large(MAX_BODY_BYTES));
    }
    Ok(body)
}

/// Checks the request and turns it into a job for the worker.
fn prepare(body: &[u8], shared: &Shared) -> Result<(Job, Receiver<Event>, Accepted), ApiError> {
    let req: CompletionRequest = request::parse(body)?;
    if let Some(name) = req.model.as_deref().filter(|n| *n != shared.model_name) {
        return Err(ApiError::unknown_model(name));
    }
    let thinking = req.enable_thinking.unwrap_or(shared.enable_thinking);
    let text = shared
        .template
        .render(&req.messages, RenderOptions::generation(thinking));
    job(&text, req, shared, "messages", "chatcmpl")
}

/// Tokenizes `text` (from the request's `param`) and makes the job for `req`'s sampling, with
/// an id starting with `id_prefix`.
pub(super) fn job(
    text: &str,
    req: CompletionRequest,
    shared: &Shared,
    param: &str,
    id_prefix: &str,
) -> Result<(Job, Receiver<Event>, Accepted), ApiError> {
    let prompt = shared
        .tokenizer
        .encode(text)
        .map_err(|err| ApiError::internal(format!("cannot tokenize the {param}: {err}")))?;
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= shared.vocab_size) {
        return Err(ApiError::invalid(
            format!(
                "The {param} encode to token id {bad}, outside the model's vocabulary of {}.",
                shared.vocab_size
            ),
            Some(param),
        ));
    }
    let room = shared.context_len.saturating_sub(prompt.len());
    let context_error = |wanted: usize| {
        ApiError::invalid(
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the {param}, {wanted} in the completion).",
                shared.context_len,
                prompt.len() as u128 + wanted as u128,
                prompt.len()
            ),
            Some(param),
        )
        .with_code("context_length_exceeded")
    };
    let max_tokens = match req.max_tokens {
        Some(n) if n > room => return Err(context_error(n)),
        Some(n) => n,
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
    };
    let (sender, events) = mpsc::channel();
    let accepted = Accepted {
        id: format!(
            "{id_prefix}-{:016x}{:08x}",
            rand::random::<u64>(),
            rand::random::<u32>()
        ),
        created: unix_time(),
        prompt_tokens: prompt.len(),
        stream: req.stream,
        include_usage: req.include_usage,
    };
    let job = Job {
        prompt,
        params,
        events: sender,
    };
    Ok((job, events, accepted))
}

/// Collects the whole reply; returns the status sent and the completion tokens.
fn complete(
    request: Request,
    events: &Receiver<Event>,
    accepted: &Accepted,
    shared: &Shared,
) -> (u16, Option<usize>) {
    let mut content = String::new();
    let (finish, completion_tokens) = loop {
        match events.recv() {
            Ok(Event::Text(text)) => content.push_str(&text),
            Ok(Event::Done {
                finish,
                completion_tokens,
            }) => break (finish, completion_tokens),
            Ok(Event::Failed(message)) => {
                let err = ApiError::internal(message);
                respond_error(request, &err);
                return (err.status, None);
            }
            Err(_) => {
                let err = ApiError::internal("generation stopped without a result");
                respond_error(request, &err);
                return (err.status, None);
            }
        }
    };
    let body = json!({
        "id": accepted.id,
        "object": "chat.completion",
        "created": accepted.created,
        "model": shared.model_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": null,
            "finish_reason": finish.as_str(),
        }],
        "usage": usage(accepted.prompt_tokens, completion_tokens),
    });
    respond_json(request, 200, &body);
    (200, Some(completion_tokens))
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Sends the reply as server-sent events while it is generated. A client that goes away
/// closes the event channel (dropped on return), which ends its row in the worker.
fn stream(
    request: Request,
    events: &Receiver<Event>,
    accepted: &Accepted,
    shared: &Shared,
) -> (u16, Option<usize>) {
    let chunked = *request.http_version() != HTTPVersion(1, 0);
    let mut out = EventStream {
        writer: request.into_writer(),
        chunked,
    };
    let mut completion = None;
    match write_events(&mut out, events, accepted, shared, &mut completion) {
        Ok(()) if completion.is_some() => (200, completion),
        Ok(()) => (500, None),
        // The client went away.
        Err(_) => (499, completion),
    }
}

/// Writes the chunks of one reply: the role, the text as it comes, the finish reason, the
/// usage when asked for, `[DONE]`. Sets `completion` to the completion tokens once known.
fn write_events(
    out: &mut EventStream,
    events: &Receiver<Event>,
    accepted: &Accepted,
    shared: &Shared,
    completion: &mut Option<usize>,
) -> io::Result<()> {
    let chunk = |choices: Value| {
        let mut body = json!({
            "id": accepted.id,
            "object": "chat.completion.chunk",
            "created": accepted.created,
            "model": shared.model_name,
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
    out.head()?;
    out.data(&delta(json!({"role": "assistant", "content": ""}), None))?;
    loop {
        match events.recv() {
            Ok(Event::Text(text)) => out.data(&delta(json!({"content": text}), None))?,
            Ok(Event::Done {
                finish,
                completion_tokens,
            }) => {
                *completion = Some(completion_tokens);
                out.data(&delta(json!({}), Some(finish)))?;
                if accepted.include_usage {
                    let mut last = chunk(json!([]));
                    last["usage"] = usage(accepted.prompt_tokens, completion_tokens);
                    out.data(&last)?;
                }
                break;
            }
            Ok(Event::Failed(message)) => {
                out.data(&ApiError::internal(message).body())?;
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

/// A `text/event-stream` body written straight to the connection, each event flushed at once.
struct EventStream {
    writer: Box<dyn Write + Send>,
    chunked: bool,
}

impl EventStream {
    fn head(&mut self) -> io::Result<()> {
        let framing = if self.chunked {
            "Transfer-Encoding: chunked\r\n"
        } else {
            ""
        };
        write!(
            self.writer,
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n\
             Cache-Control: no-cache\r\nConnection: close\r\nServer: prompt-r1\r\n{framing}\r\n"
        )?;
        self.writer.flush()
    }

    fn data(&mut self, value: &Value) -> io::Result<()> {
        self.raw(format!("data: {value}\n\n").as_bytes())
    }

    fn done(&mut self) -> io::Result<()> {
        self.raw(b"data: [DONE]\n\n")?;
        if self.chunked {
            self.writer.write_all(b"0\r\n\r\n")?;
        }
        self.writer.flush()
    }

    fn raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.chunked {
            write!(self.writer, "{:x}\r\n", bytes.len())?;
            self.writer.write_all(bytes)?;
            self.writer.write_all(b"\r\n")?;
        } else {
            self.writer.write_all(bytes)?;
        }
        self.writer.flush()
    }
}

pub(super) fn respond_json(request: Request, status: u16, body: &Value) {
    let mut response = Response::from_string(body.to_string()).with_status_code(status);
    if let Ok(header) = Header::from_bytes("Content-Type", "application/json") {
        response = response.with_header(header);
    }
    // A client that went away needs no answer.
    let _ = request.respond(response);
}

pub(super) fn respond_error(request: Request, err: &ApiError) {
    respond_json(request, err.status, &err.body());
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

//! `POST /v1/completions`: a raw text prompt, tokenized as it is (special tokens such as
//! `<|im_start|>` included), with no chat template, or a prompt of token ids (vLLM's
//! `list[int]`). A served Prompt-R1 agent is asked this way so that it sees the context it was
//! trained on, earlier turns' `<think>` included (Qwen3's chat template drops those), and the
//! trainer's rollout workers so, with vLLM's extensions: `logprobs` (the sampled token's
//! log-prob; `top_logprobs` is null), `return_token_ids` (`prompt_token_ids` and `token_ids`, the
//! stop token a row ended on included), `skip_special_tokens`, `stop_token_ids`, and the
//! `stop_reason`. Non-streaming only; one prompt.

use std::sync::mpsc::Receiver;
use std::time::Instant;

use serde_json::{json, Map, Value};

use super::detokenize;
use super::engine::{Event, Finished, Job, StopReason, Work};
use super::error::ApiError;
use super::http::{self, Accepted};
use super::listener::Responder;
use super::request;
use super::Shared;

/// The text-completions endpoint.
pub(super) const ROUTE: &str = "/v1/completions";

/// Most alternatives a request may ask for with `logprobs` (vLLM's default `max_logprobs`).
const MAX_LOGPROBS: u64 = 20;

/// The prompt as sent.
#[derive(Debug, Clone, PartialEq)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// The completion fields the chat parser does not read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Extras {
    /// `logprobs`: `Some` when the reply carries them.
    logprobs: Option<u64>,
    return_token_ids: bool,
}

/// Answers one text-completion request.
pub fn handle(body: &[u8], responder: Responder, shared: &Shared) {
    let started = Instant::now();
    let prepared = prepare(body, shared);
    let (job, events, accepted, extras) = match prepared {
        Ok(ok) => ok,
        Err(err) => {
            http::log(ROUTE, shared, err.status, None, started);
            return http::respond_error(responder, &err);
        }
    };
    if responder.client_gone() {
        return http::log(ROUTE, shared, 499, None, started);
    }
    let skip_special_tokens = job.params.skip_special_tokens;
    let cancel = job.cancel.clone();
    if shared.work.send(Work::Job(job)).is_err() {
        let err = ApiError::internal("the generation worker has stopped");
        http::log(ROUTE, shared, err.status, None, started);
        return http::respond_error(responder, &err);
    }
    let replied = http::collect(&events, &responder, &cancel).and_then(|(text, done)| {
        let body = reply(&text, &done, &accepted, extras, skip_special_tokens, shared)?;
        Ok((body, done.completion_tokens()))
    });
    match replied {
        Ok((body, completion_tokens)) => {
            http::respond_json(responder, 200, &body);
            http::log(
                ROUTE,
                shared,
                200,
                Some((accepted.prompt_tokens, completion_tokens)),
                started,
            );
        }
        Err(err) => {
            http::log(ROUTE, shared, err.status, None, started);
            http::respond_error(responder, &err);
        }
    }
}

/// The reply body of a finished completion.
fn reply(
    text: &str,
    done: &Finished,
    accepted: &Accepted,
    extras: Extras,
    skip_special_tokens: bool,
    shared: &Shared,
) -> Result<Value, ApiError> {
    let logprobs = match extras.logprobs {
        Some(_) => logprobs(done, skip_special_tokens, shared)?,
        None => Value::Null,
    };
    let mut choice = json!({
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": done.finish.as_str(),
        "stop_reason": match &done.stop_reason {
            None => Value::Null,
            Some(StopReason::Token(id)) => json!(id),
            Some(StopReason::Text(stop)) => json!(stop),
        },
    });
    if extras.return_token_ids {
        choice["prompt_token_ids"] = json!(accepted.prompt_ids.as_deref().unwrap_or_default());
        choice["token_ids"] = json!(done.token_ids);
    }
    Ok(json!({
        "id": accepted.id,
        "object": "text_completion",
        "created": accepted.created,
        "model": accepted.model,
        "choices": [choice],
        "usage": http::usage(accepted.prompt_tokens, done.completion_tokens(), done.cached_tokens),
    }))
}

/// The completion's `logprobs`: each sampled token's log-prob and text, and where that text
/// starts in the reply's (in characters, as vLLM counts). A token's text is what it added to
/// the reply's as it was decoded a token at a time (as vLLM's detokenizer gives it): empty for
/// a skipped special token, for the first bytes of a character a later token completes (which
/// has the whole character), and for the EOS or stop token that ended the row. Joined, they are
/// the reply's text (followed, where a stop string cut it, by the rest of the last tokens' text).
fn logprobs(done: &Finished, skip_special_tokens: bool, shared: &Shared) -> Result<Value, ApiError> {
    let mut tokens = detokenize::token_texts(shared.tokenizer, done.text_ids(), skip_special_tokens)
        .map_err(|err| ApiError::internal(format!("cannot decode the sampled tokens for their logprobs: {err}")))?;
    tokens.resize(done.token_ids.len(), String::new());
    let mut offset = 0;
    let text_offset: Vec<usize> = tokens
        .iter()
        .map(|t| {
            let at = offset;
            offset += t.chars().count();
            at
        })
        .collect();
    Ok(json!({
        "tokens": tokens,
        "token_logprobs": done.logprobs,
        "top_logprobs": null,
        "text_offset": text_offset,
    }))
}

/// Checks the body and makes the job. The sampling fields are those of a chat request, so
/// the chat parser checks them, with the prompt standing in as the one user message.
fn prepare(body: &[u8], shared: &Shared) -> Result<(Job, Receiver<Event>, Accepted, Extras), ApiError> {
    let (prompt, extras, fields) = prompt_and_fields(body)?;
    let chat_body = serde_json::to_vec(&Value::Object(fields))
        .map_err(|err| ApiError::internal(format!("cannot re-encode the request: {err}")))?;
    let req = request::parse(&chat_body)?;
    if req.stream {
        return Err(ApiError::invalid_value(
            "Streaming is not supported on /v1/completions; use /v1/chat/completions to stream.",
            "stream",
        ));
    }
    http::adapter_for(req.model.as_deref(), shared)?;
    let keep = extras.return_token_ids;
    let (job, events, accepted) = match prompt {
        Prompt::Text(text) => http::job(&text, req, shared, "prompt", "cmpl", keep)?,
        Prompt::Ids(ids) => {
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= shared.vocab_size) {
                return Err(ApiError::invalid_value(
                    format!(
                        "prompt[{i}] is token id {id}, outside the model's vocabulary of {} tokens.",
                        shared.vocab_size
                    ),
                    "prompt",
                ));
            }
            http::job_for_ids(ids, req, shared, "prompt", "cmpl", keep)?
        }
    };
    Ok((job, events, accepted, extras))
}

/// The prompt, the completion's own fields, and the body's other fields with the prompt as one
/// user message (empty for token ids).
fn prompt_and_fields(body: &[u8]) -> Result<(Prompt, Extras, Map<String, Value>), ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request ({err})."),
            None,
        )
    })?;
    let Value::Object(mut fields) = value else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
        ));
    };
    let prompt = match fields.remove("prompt") {
        // A batch of one prompt (LangChain's client always sends a list).
        Some(Value::Array(mut items)) if items.len() == 1 && items[0].is_string() => items.pop(),
        other => other,
    };
    let prompt = match prompt {
        Some(Value::String(prompt)) if !prompt.is_empty() => Prompt::Text(prompt),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid_value("The prompt is empty.", "prompt"))
        }
        // A batch of one prompt of ids.
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_array() => Prompt::Ids(token_ids(&items[0])?),
        Some(items @ Value::Array(_)) if items.as_array().is_some_and(|a| a.iter().all(Value::is_number)) => {
            Prompt::Ids(token_ids(&items)?)
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "you must provide a prompt parameter",
                Some("prompt"),
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid_value(
                "Only one prompt is supported: a string (or a list of one), or an array of token ids.",
                "prompt",
            ))
        }
    };
    let logprobs = match fields.remove("logprobs") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= MAX_LOGPROBS) => n.as_u64(),
        Some(other) => {
            return Err(ApiError::invalid_value(
                format!("'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {other}."),
                "logprobs",
            ))
        }
    };
    let return_token_ids = match fields.remove("return_token_ids") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("Invalid type for 'return_token_ids': expected a boolean, got {other}."),
                Some("return_token_ids"),
            )
            .with_code("invalid_type"))
        }
    };
    if fields.remove("echo").is_some_and(|echo| echo == json!(true)) {
        return Err(ApiError::invalid_value("echo is not supported by this server.", "echo"));
    }
    let content = match &prompt {
        Prompt::Text(text) => text.clone(),
        Prompt::Ids(_) => String::new(),
    };
    fields.insert(
        "messages".into(),
        json!([{"role": "user", "content": content}]),
    );
    let extras = Extras {
        logprobs,
        return_token_ids,
    };
    Ok((prompt, extras, fields))
}

/// A non-empty array of token ids (integers that fit a `u32`); the error names the first bad
/// element.
fn token_ids(items: &Value) -> Result<Vec<u32>, ApiError> {
    let items = items.as_array().map(Vec::as_slice).unwrap_or_default();
    if items.is_empty() {
        return Err(ApiError::invalid_value("The prompt is empty.", "prompt"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                ApiError::invalid_value(
                    format!("prompt[{i}] must be a token id (an integer >= 0), got {item}."),
                    "prompt",
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(body: &str) -> (Option<String>, String) {
        let err = prompt_and_fields(body.as_bytes()).unwrap_err();
        (err.param, err.message)
    }

    #[test]
    fn the_prompt_becomes_the_user_message_for_the_field_checks() {
        let (prompt, extras, fields) =
            prompt_and_fields(br#"{"prompt": "<|im_start|>a", "max_tokens": 3}"#).unwrap();
        assert_eq!(prompt, Prompt::Text("<|im_start|>a".into()));
        assert_eq!(extras, Extras::default());
        assert_eq!(fields["messages"][0]["content"], "<|im_start|>a");
        assert_eq!(fields["max_tokens"], 3);
        assert!(fields.get("prompt").is_none());
        let param = |body: &[u8]| {
            prompt_and_fields(body).unwrap_err().body()["error"]["param"]
                .as_str()
                .map(str::to_string)
        };
        assert_eq!(
            param(br#"{"prompt": ["a", "b"]}"#).as_deref(),
            Some("prompt")
        );
        assert_eq!(param(br#"{"max_tokens": 3}"#).as_deref(), Some("prompt"));
        assert_eq!(param(br#"{"prompt": ""}"#).as_deref(), Some("prompt"));
        assert_eq!(param(br#"{"prompt": [""]}"#).as_deref(), Some("prompt"));
        // A batch of one text prompt is that prompt.
        let (one, _, fields) = prompt_and_fields(br#"{"prompt": ["hello"]}"#).unwrap();
        assert_eq!((one, &fields["messages"][0]["content"]), (Prompt::Text("hello".into()), &json!("hello")));
    }

    #[test]
    fn reads_a_prompt_of_token_ids_and_the_completion_fields() {
        let body = br#"{"prompt": [151644, 0, 7], "logprobs": 0, "return_token_ids": true,
            "skip_special_tokens": false, "stop_token_ids": [3], "echo": false}"#;
        let (prompt, extras, fields) = prompt_and_fields(body).unwrap();
        assert_eq!(prompt, Prompt::Ids(vec![151644, 0, 7]));
        assert_eq!(
            extras,
            Extras {
                logprobs: Some(0),
                return_token_ids: true
            }
        );
        assert_eq!(fields["messages"][0]["content"], "");
        assert!(fields.get("logprobs").is_none() && fields.get("return_token_ids").is_none());
        // The other fields go on to the chat parser, which reads the vLLM extensions.
        let req = request::parse(&serde_json::to_vec(&Value::Object(fields)).unwrap()).unwrap();
        assert_eq!((req.skip_special_tokens, req.stop_token_ids), (Some(false), vec![3]));
        let (batch, _, _) = prompt_and_fields(br#"{"prompt": [[4, 5]], "logprobs": null}"#).unwrap();
        assert_eq!(batch, Prompt::Ids(vec![4, 5]));
    }

    #[test]
    fn a_bad_token_id_prompt_names_the_element() {
        let (param, message) = error(r#"{"prompt": [1, 2, -3]}"#);
        assert_eq!(param.as_deref(), Some("prompt"));
        assert!(message.contains("prompt[2]") && message.contains("-3"), "{message}");
        let (_, message) = error(r#"{"prompt": [1, 4294967296]}"#);
        assert!(message.contains("prompt[1]"), "{message}");
        let (_, message) = error(r#"{"prompt": [1, 2.5]}"#);
        assert!(message.contains("prompt[1]"), "{message}");
        assert_eq!(error(r#"{"prompt": []}"#).0.as_deref(), Some("prompt"));
        assert_eq!(error(r#"{"prompt": [[]]}"#).0.as_deref(), Some("prompt"));
        assert_eq!(error(r#"{"prompt": [[1], [2]]}"#).0.as_deref(), Some("prompt"));
        assert_eq!(error(r#"{"prompt": [1, "a"]}"#).0.as_deref(), Some("prompt"));
        for bad in [r#""logprobs": -1"#, r#""logprobs": 21"#, r#""logprobs": true"#, r#""logprobs": 1.5"#] {
            let body = format!(r#"{{"prompt": [1], {bad}}}"#);
            assert_eq!(error(&body).0.as_deref(), Some("logprobs"), "{body}");
        }
        let body = r#"{"prompt": [1], "return_token_ids": "yes"}"#;
        assert_eq!(error(body).0.as_deref(), Some("return_token_ids"));
        assert_eq!(error(r#"{"prompt": [1], "echo": true}"#).0.as_deref(), Some("echo"));
    }
}

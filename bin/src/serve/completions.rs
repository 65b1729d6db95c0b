//! `POST /v1/completions`: a raw text prompt, tokenized as it is (special tokens such as
//! `<|im_start|>` included), with no chat template. A served Prompt-R1 agent is asked this way
//! so that it sees the context it was trained on, earlier turns' `<think>` included (Qwen3's
//! chat template drops those). Non-streaming only; one string prompt.

use std::sync::mpsc::Receiver;
use std::time::Instant;

use serde_json::{json, Map, Value};
use tiny_http::Request;

use super::engine::Event;
use super::error::ApiError;
use super::http::{self, Accepted};
use super::request;
use super::Shared;

/// The text-completions endpoint.
pub(super) const ROUTE: &str = "/v1/completions";

/// Answers one text-completion request.
pub fn handle(mut request: Request, shared: &Shared) {
    let started = Instant::now();
    let prepared = http::read_body(&mut request).and_then(|body| prepare(&body, shared));
    let (job, events, accepted) = match prepared {
        Ok(ok) => ok,
        Err(err) => {
            http::log(ROUTE, shared, err.status, None, started);
            return http::respond_error(request, &err);
        }
    };
    if shared.jobs.send(job).is_err() {
        let err = ApiError::internal("the generation worker has stopped");
        http::log(ROUTE, shared, err.status, None, started);
        return http::respond_error(request, &err);
    }
    match collect(&events) {
        Ok((text, finish, completion_tokens)) => {
            let body = json!({
                "id": accepted.id,
                "object": "text_completion",
                "created": accepted.created,
                "model": shared.model_name,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish,
                }],
                "usage": {
                    "prompt_tokens": accepted.prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": accepted.prompt_tokens + completion_tokens,
                },
            });
            http::respond_json(request, 200, &body);
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
            http::respond_error(request, &err);
        }
    }
}

/// Checks the body and makes the job. The sampling fields are those of a chat request, so
/// the chat parser checks them, with the prompt standing in as the one user message.
fn prepare(
    body: &[u8],
    shared: &Shared,
) -> Result<(super::engine::Job, Receiver<Event>, Accepted), ApiError> {
    let (prompt, fields) = prompt_and_fields(body)?;
    let chat_body = serde_json::to_vec(&Value::Object(fields))
        .map_err(|err| ApiError::internal(format!("cannot re-encode the request: {err}")))?;
    let req = request::parse(&chat_body)?;
    if req.stream {
        return Err(ApiError::invalid_value(
            "Streaming is not supported on /v1/completions; use /v1/chat/completions to stream.",
            "stream",
        ));
    }
    if let Some(name) = req.model.as_deref().filter(|n| *n != shared.model_name) {
        return Err(ApiError::unknown_model(name));
    }
    http::job(&prompt, req, shared, "prompt", "cmpl")
}

/// The prompt, and the body's other fields with the prompt as one user message.
fn prompt_and_fields(body: &[u8]) -> Result<(String, Map<String, Value>), ApiError> {
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
        Some(Value::String(prompt)) if !prompt.is_empty() => prompt,
        Some(Value::String(_)) => {
            return Err(ApiError::invalid_value("The prompt is empty.", "prompt"))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "you must provide a prompt parameter",
                Some("prompt"),
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid_value(
                "Only one string prompt is supported.",
                "prompt",
            ))
        }
    };
    fields.insert(
        "messages".into(),
        json!([{"role": "user", "content": prompt.clone()}]),
    );
    Ok((prompt, fields))
}

/// The whole generated text, the finish reason and the completion tokens.
fn collect(events: &Receiver<Event>) -> Result<(String, &'static str, usize), ApiError> {
    let mut text = String::new();
    loop {
        match events.recv() {
            Ok(Event::Text(piece)) => text.push_str(&piece),
            Ok(Event::Done {
                finish,
                completion_tokens,
            }) => return Ok((text, finish.as_str(), completion_tokens)),
            Ok(Event::Failed(message)) => return Err(ApiError::internal(message)),
            Err(_) => return Err(ApiError::internal("generation stopped without a result")),
        }
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_becomes_the_user_message_for_the_field_checks() {
        let (prompt, fields) =
            prompt_and_fields(br#"{"prompt": "<|im_start|>a", "max_tokens": 3}"#).unwrap();
        assert_eq!(prompt, "<|im_start|>a");
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
    }
}

//! Reading a `POST /v1/chat/completions` body: every field checked, with an OpenAI-style error
//! naming the first bad parameter.

use model::chat_template::{ChatMessage, Role};
use serde_json::{Map, Value};

use super::error::ApiError;

/// Most stop strings per request (OpenAI's limit).
const MAX_STOP_STRINGS: usize = 4;

/// A chat-completion request as this server understands it. Absent and `null` fields are
/// `None`; unknown fields are ignored.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Extension (vLLM, Ollama): sample among the k most likely tokens.
    pub top_k: Option<usize>,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Extension (vLLM): `chat_template_kwargs.enable_thinking`.
    pub enable_thinking: Option<bool>,
}

/// Parses and checks a request body.
pub fn parse(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request ({err})."),
            None,
        )
    })?;
    let Value::Object(fields) = value else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
        ));
    };
    let n = integer(&fields, "n", 1)?;
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_value("Only n = 1 is supported.", "n"));
    }
    if boolean(&fields, "logprobs")? == Some(true) {
        return Err(ApiError::invalid_value(
            "logprobs are not supported by this server.",
            "logprobs",
        ));
    }
    if fields
        .get("tools")
        .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()))
    {
        return Err(ApiError::invalid_value(
            "Tools are not supported by this server.",
            "tools",
        ));
    }
    let max_tokens = match integer(&fields, "max_completion_tokens", 1)? {
        Some(n) => Some(n),
        None => integer(&fields, "max_tokens", 1)?,
    };
    Ok(CompletionRequest {
        model: string(&fields, "model")?,
        messages: messages(&fields)?,
        temperature: number(&fields, "temperature", 0.0, 2.0, true)?,
        top_p: number(&fields, "top_p", 0.0, 1.0, false)?,
        top_k: integer(&fields, "top_k", 0)?.map(|k| k as usize),
        max_tokens: max_tokens.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        seed: seed(&fields)?,
        stop: stop(&fields)?,
        stream: boolean(&fields, "stream")?.unwrap_or(false),
        include_usage: match fields.get("stream_options") {
            None | Some(Value::Null) => false,
            Some(Value::Object(options)) => boolean(options, "include_usage")?.unwrap_or(false),
            Some(_) => return Err(type_error("stream_options", "an object")),
        },
        enable_thinking: match fields.get("chat_template_kwargs") {
            None | Some(Value::Null) => None,
            Some(Value::Object(kwargs)) => boolean(kwargs, "enable_thinking")?,
            Some(_) => return Err(type_error("chat_template_kwargs", "an object")),
        },
    })
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(
        format!("Invalid type for '{param}': expected {expected}."),
        Some(param),
    )
    .with_code("invalid_type")
}

fn present<'a>(fields: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    fields.get(key).filter(|v| !v.is_null())
}

fn string(fields: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match present(fields, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(type_error(key, "a string")),
    }
}

fn boolean(fields: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match present(fields, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(type_error(key, "a boolean")),
    }
}

/// A whole number `>= min`.
fn integer(fields: &Map<String, Value>, key: &str, min: u64) -> Result<Option<u64>, ApiError> {
    let Some(value) = present(fields, key) else {
        return Ok(None);
    };
    let n = match value {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0)
                .map(|f| f as u64)
        }),
        _ => return Err(type_error(key, "an integer")),
    };
    match n {
        Some(n) if n >= min => Ok(Some(n)),
        _ => Err(ApiError::invalid_value(
            format!("'{key}' must be an integer >= {min}, got {value}."),
            key,
        )),
    }
}

/// A number in `[min, max]` (`(min, max]` when `min_inclusive` is false).
fn number(
    fields: &Map<String, Value>,
    key: &str,
    min: f64,
    max: f64,
    min_inclusive: bool,
) -> Result<Option<f32>, ApiError> {
    let Some(value) = present(fields, key) else {
        return Ok(None);
    };
    let Some(x) = value.as_f64() else {
        return Err(type_error(key, "a number"));
    };
    let above = if min_inclusive { x >= min } else { x > min };
    if !(above && x <= max) {
        let open = if min_inclusive { '[' } else { '(' };
        return Err(ApiError::invalid_value(
            format!("'{key}' must be in {open}{min}, {max}], got {x}."),
            key,
        ));
    }
    Ok(Some(x as f32))
}

/// Any integer; negative seeds are taken bit for bit.
fn seed(fields: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    match present(fields, "seed") {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|i| i as u64))
            .map(Some)
            .ok_or_else(|| type_error("seed", "an integer")),
        Some(_) => Err(type_error("seed", "an integer")),
    }
}

/// A string or an array of at most four strings; empty strings are dropped.
fn stop(fields: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let stops = match present(fields, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                return Err(ApiError::invalid_value(
                    format!("'stop' holds at most {MAX_STOP_STRINGS} strings."),
                    "stop",
                ));
            }
            items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| type_error("stop", "a string or an array of strings"))
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => return Err(type_error("stop", "a string or an array of strings")),
    };
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

fn messages(fields: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match present(fields, "messages") {
        None => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'messages'.",
                Some("messages"),
            )
            .with_code("missing_required_parameter"))
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(type_error("messages", "an array")),
    };
    if items.is_empty() {
        return Err(ApiError::invalid_value(
            "'messages' must hold at least one message.",
            "messages",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| message(i, item))
        .collect()
}

fn message(index: usize, item: &Value) -> Result<ChatMessage, ApiError> {
    let param = |field: &str| format!("messages[{index}]{field}");
    let Value::Object(fields) = item else {
        return Err(type_error(&param(""), "an object"));
    };
    let role = match present(fields, "role") {
        Some(Value::String(role)) => match role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::invalid_value(
                    format!(
                    "Role '{other}' is not supported: use system, developer, user or assistant."
                ),
                    &param(".role"),
                ))
            }
        },
        Some(_) => return Err(type_error(&param(".role"), "a string")),
        None => {
            return Err(ApiError::invalid(
                format!("Missing required parameter: '{}'.", param(".role")),
                Some(&param(".role")),
            )
            .with_code("missing_required_parameter"))
        }
    };
    let content = match fields.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |part| match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text") | None, Some(Value::String(text))) => Ok(text.as_str()),
                    _ => Err(ApiError::invalid_value(
                        "Only text content parts are supported.",
                        &param(".content"),
                    )),
                },
            )
            .collect::<Result<String, _>>()?,
        Some(Value::Null) | None if role == Role::Assistant => String::new(),
        Some(Value::Null) | None => {
            return Err(ApiError::invalid(
                format!("Missing required parameter: '{}'.", param(".content")),
                Some(&param(".content")),
            )
            .with_code("missing_required_parameter"))
        }
        Some(_) => {
            return Err(type_error(
                &param(".content"),
                "a string or an array of text parts",
            ))
        }
    };
    let mut message = ChatMessage::new(role, content);
    if role == Role::Assistant {
        message.reasoning_content = string(fields, "reasoning_content")?;
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(body: &str) -> Result<CompletionRequest, ApiError> {
        parse(body.as_bytes())
    }

    fn param_of(body: &str) -> Option<String> {
        parse_str(body).unwrap_err().param
    }

    #[test]
    fn reads_every_supported_field() {
        let r = parse_str(
            r#"{"model": "m", "messages": [{"role": "developer", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}],
              "temperature": 0, "top_p": 0.5, "top_k": 3, "max_tokens": 7, "seed": -1,
              "stop": "x", "stream": true, "stream_options": {"include_usage": true},
              "chat_template_kwargs": {"enable_thinking": false}, "n": 1, "user": "ignored"}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.messages[0], ChatMessage::system("s"));
        assert_eq!(r.messages[1], ChatMessage::user("ab"));
        assert_eq!(r.messages[2], ChatMessage::assistant(""));
        assert_eq!(
            (r.temperature, r.top_p, r.top_k),
            (Some(0.0), Some(0.5), Some(3))
        );
        assert_eq!((r.max_tokens, r.seed), (Some(7), Some(u64::MAX)));
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.enable_thinking, Some(false));
    }

    #[test]
    fn max_completion_tokens_wins_and_nulls_are_absent() {
        let r = parse_str(
            r#"{"messages": [{"role": "user", "content": "q"}], "max_tokens": 9,
                "max_completion_tokens": 4, "temperature": null, "stop": ["a", ""]}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(4));
        assert_eq!(r.temperature, None);
        assert_eq!(r.stop, vec!["a".to_string()]);
        assert!(!r.stream);
    }

    #[test]
    fn names_the_bad_parameter() {
        let user = r#""messages": [{"role": "user", "content": "q"}]"#;
        assert_eq!(parse_str("{").unwrap_err().status, 400);
        assert_eq!(parse_str("[1]").unwrap_err().param, None);
        assert_eq!(param_of("{}").as_deref(), Some("messages"));
        assert_eq!(
            param_of(r#"{"messages": "hi"}"#).as_deref(),
            Some("messages")
        );
        assert_eq!(param_of(r#"{"messages": []}"#).as_deref(), Some("messages"));
        assert_eq!(
            param_of(r#"{"messages": [{"role": "tool", "content": "x"}]}"#).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param_of(r#"{"messages": [{"role": "user"}]}"#).as_deref(),
            Some("messages[0].content")
        );
        for (field, value) in [
            ("temperature", "\"hot\""),
            ("temperature", "3"),
            ("top_p", "0"),
            ("max_tokens", "0"),
            ("max_tokens", "1.5"),
            ("n", "2"),
            ("seed", "\"s\""),
            ("stop", "[1]"),
            ("stop", r#"["a","b","c","d","e"]"#),
            ("stream", "\"yes\""),
            ("model", "3"),
        ] {
            let body = format!("{{{user}, \"{field}\": {value}}}");
            assert_eq!(param_of(&body).as_deref(), Some(field), "{body}");
        }
    }
}

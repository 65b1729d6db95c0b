//! Reading a `POST /v1/chat/completions` body: deserialised by serde (with the path of the
//! value at fault from `serde_path_to_error`), then checked, with an OpenAI-style error naming
//! the first bad parameter.

use model::chat_template::{ChatMessage, Role};
use serde::Deserialize;
use serde_json::{Number, Value};

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
    /// Extension (vLLM, Ollama): sample among the k most likely tokens; 0 (or vLLM's -1, read
    /// as 0): among all, whatever the server's default.
    pub top_k: Option<usize>,
    /// `max_completion_tokens`, else `max_tokens`: as sent (up to `u128::MAX`), so that a
    /// context overflow reports the true sum.
    pub max_tokens: Option<u128>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Extension (vLLM): `chat_template_kwargs.enable_thinking`.
    pub enable_thinking: Option<bool>,
    /// Extension (vLLM): leave special tokens out of the text (default true).
    pub skip_special_tokens: Option<bool>,
    /// Extension (vLLM): token ids that end the completion besides the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Extension (vLLM): the model's EOS ids do not end the completion (`stop_token_ids` and
    /// `stop` still do), so that it runs to `max_tokens`, as benchmarks ask.
    pub ignore_eos: bool,
}

/// The request body as sent: the fields this server reads, typed but not yet checked.
#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    messages: Option<Vec<Message>>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<Number>,
    max_tokens: Option<Number>,
    max_completion_tokens: Option<Number>,
    n: Option<Number>,
    seed: Option<Number>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    chat_template_kwargs: Option<ChatTemplateKwargs>,
    logprobs: Option<bool>,
    tools: Option<Value>,
    skip_special_tokens: Option<bool>,
    stop_token_ids: Option<Vec<Number>>,
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct Message {
    role: Option<String>,
    content: Option<Content>,
    reasoning_content: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of text parts")]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One content part; only `{"type": "text", "text": ...}` is served.
#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct ChatTemplateKwargs {
    enable_thinking: Option<bool>,
}

/// Parses and checks a request body.
pub fn parse(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let body: Body =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(body))
            .map_err(deserialize_error)?;
    if integer(body.n.as_ref(), "n", 1)?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_value("Only n = 1 is supported.", "n"));
    }
    if body.logprobs == Some(true) {
        return Err(ApiError::invalid_value(
            "logprobs are not supported by this server.",
            "logprobs",
        ));
    }
    if body
        .tools
        .as_ref()
        .and_then(Value::as_array)
        .is_some_and(|tools| !tools.is_empty())
    {
        return Err(ApiError::invalid_value(
            "Tools are not supported by this server.",
            "tools",
        ));
    }
    let max_tokens = match integer(
        body.max_completion_tokens.as_ref(),
        "max_completion_tokens",
        1,
    )? {
        Some(n) => Some(n),
        None => integer(body.max_tokens.as_ref(), "max_tokens", 1)?,
    };
    Ok(CompletionRequest {
        model: body.model,
        messages: messages(body.messages)?,
        temperature: in_range(body.temperature, "temperature", 0.0, 2.0, true)?,
        top_p: in_range(body.top_p, "top_p", 0.0, 1.0, false)?,
        // vLLM's -1 turns top-k off, as 0 does (over a default from generation_config.json).
        top_k: match body.top_k.as_ref() {
            Some(k) if k.as_i64() == Some(-1) => Some(0),
            k => integer(k, "top_k", 0)?.map(|k| usize::try_from(k).unwrap_or(usize::MAX)),
        },
        max_tokens,
        seed: body.seed.map(|n| seed(&n)).transpose()?,
        stop: stop(body.stop)?,
        stream: body.stream.unwrap_or(false),
        include_usage: body
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        enable_thinking: body.chat_template_kwargs.and_then(|k| k.enable_thinking),
        skip_special_tokens: body.skip_special_tokens,
        stop_token_ids: stop_token_ids(body.stop_token_ids)?,
        ignore_eos: body.ignore_eos.unwrap_or(false),
    })
}

/// Token ids, each an integer that fits a `u32`.
fn stop_token_ids(ids: Option<Vec<Number>>) -> Result<Vec<u32>, ApiError> {
    ids.unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, n)| {
            n.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                ApiError::invalid_value(
                    format!("stop_token_ids[{i}] must be a token id (an integer >= 0), got {n}."),
                    "stop_token_ids",
                )
            })
        })
        .collect()
}

/// A deserialisation failure as an OpenAI error: unreadable JSON, a body that is not an
/// object, or the parameter (e.g. `messages[0].role`) whose value has the wrong type.
fn deserialize_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let param = e.path().to_string();
    let inner = e.into_inner();
    let message = inner.to_string();
    if let Some(name) = message.strip_prefix("duplicate field `").and_then(|rest| rest.split('`').next()) {
        let field = match param.as_str() {
            "." => name.to_string(),
            object => format!("{object}.{name}"),
        };
        return ApiError::invalid(format!("The request body gives '{field}' more than once."), Some(&field));
    }
    if inner.is_syntax() || inner.is_eof() {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request ({inner})."),
            None,
        )
    } else if param == "." || param.starts_with('[') {
        // serde would read a struct from an array too: a path into one means the body is one.
        ApiError::invalid("The request body must be a JSON object.", None)
    } else {
        type_error(&param, &inner.to_string())
    }
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(
        format!("Invalid type for '{param}': {expected}."),
        Some(param),
    )
    .with_code("invalid_type")
}

fn missing(param: &str) -> ApiError {
    ApiError::invalid(
        format!("Missing required parameter: '{param}'."),
        Some(param),
    )
    .with_code("missing_required_parameter")
}

/// A whole number `>= min` (`7.0` counts as 7).
fn integer(value: Option<&Number>, key: &str, min: u128) -> Result<Option<u128>, ApiError> {
    let Some(value) = value else {
        return Ok(None);
    };
    // A whole number past u64 arrives as f64; past u128::MAX it saturates.
    let n = value.as_u64().map(u128::from).or_else(|| {
        value
            .as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0)
            .map(|f| f as u128)
    });
    match n {
        Some(n) if n >= min => Ok(Some(n)),
        _ => Err(ApiError::invalid_value(
            format!("'{key}' must be an integer >= {min}, got {value}."),
            key,
        )),
    }
}

/// A number in `[min, max]` (`(min, max]` when `min_inclusive` is false).
fn in_range(
    value: Option<f64>,
    key: &str,
    min: f64,
    max: f64,
    min_inclusive: bool,
) -> Result<Option<f32>, ApiError> {
    let Some(x) = value else {
        return Ok(None);
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
fn seed(n: &Number) -> Result<u64, ApiError> {
    n.as_u64()
        .or_else(|| n.as_i64().map(|i| i as u64))
        .ok_or_else(|| type_error("seed", "expected an integer"))
}

/// At most four stop strings; empty strings are dropped.
fn stop(stop: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(items)) if items.len() > MAX_STOP_STRINGS => {
            return Err(ApiError::invalid_value(
                format!("'stop' holds at most {MAX_STOP_STRINGS} strings."),
                "stop",
            ))
        }
        Some(Stop::Many(items)) => items,
    };
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

fn messages(items: Option<Vec<Message>>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = items.ok_or_else(|| missing("messages"))?;
    if items.is_empty() {
        return Err(ApiError::invalid_value(
            "'messages' must hold at least one message.",
            "messages",
        ));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| message(i, item))
        .collect()
}

fn message(index: usize, item: Message) -> Result<ChatMessage, ApiError> {
    let param = |field: &str| format!("messages[{index}].{field}");
    let role =
        match item.role.as_deref() {
            Some("system" | "developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some(other) => return Err(ApiError::invalid_value(
                format!(
                    "Role '{other}' is not supported: use system, developer, user or assistant."
                ),
                &param("role"),
            )),
            None => return Err(missing(&param("role"))),
        };
    let content = match item.content {
        Some(Content::Text(text)) => text,
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|part| match (part.kind.as_deref(), &part.text) {
                (Some("text") | None, Some(Value::String(text))) => Ok(text.as_str()),
                _ => Err(ApiError::invalid_value(
                    "Only text content parts are supported.",
                    &param("content"),
                )),
            })
            .collect::<Result<String, _>>()?,
        None if role == Role::Assistant => String::new(),
        None => return Err(missing(&param("content"))),
    };
    let mut message = ChatMessage::new(role, content);
    if role == Role::Assistant {
        message.reasoning_content = item.reasoning_content;
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
              "chat_template_kwargs": {"enable_thinking": false}, "n": 1, "user": "ignored",
              "skip_special_tokens": false, "stop_token_ids": [7, 4294967295], "ignore_eos": true}"#,
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
        assert_eq!(r.skip_special_tokens, Some(false));
        assert_eq!(r.stop_token_ids, vec![7, u32::MAX]);
        assert!(r.ignore_eos);
        assert!(!parse_str(r#"{"messages": [{"role": "user", "content": "a"}]}"#).unwrap().ignore_eos, "off unless asked");
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
        let off = |k: &str| parse_str(&format!(r#"{{"messages": [{{"role": "user", "content": "q"}}], "top_k": {k}}}"#)).unwrap().top_k;
        assert_eq!((off("-1"), off("0"), off("5"), off("null")), (Some(0), Some(0), Some(5), None));
    }

    #[test]
    fn a_wrong_type_deep_in_the_body_names_its_path() {
        let body =
            r#"{"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": 5}]}"#;
        let err = parse_str(body).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[1].content"));
        assert_eq!(err.code, Some("invalid_type"));
        assert!(
            err.message.contains("a string or an array of text parts"),
            "{}",
            err.message
        );
        let body = r#"{"messages": [{"role": 3, "content": "q"}]}"#;
        assert_eq!(param_of(body).as_deref(), Some("messages[0].role"));
        let body = r#"{"messages": [{"role": "user", "content": "q"}], "stream_options": {"include_usage": 1}}"#;
        assert_eq!(
            param_of(body).as_deref(),
            Some("stream_options.include_usage")
        );
    }

    /// A field given twice is named, at the top level and inside a message.
    #[test]
    fn a_duplicated_field_is_named() {
        let err = parse_str(r#"{"messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "max_tokens": 3}"#).unwrap_err();
        assert_eq!((err.status, err.param.as_deref()), (400, Some("max_tokens")));
        assert!(err.message.contains("'max_tokens' more than once"), "{}", err.message);
        let err = parse_str(r#"{"messages": [{"role": "user", "role": "user", "content": "q"}]}"#).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[0].role"));
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
            ("stop_token_ids", "[1, -2]"),
            ("top_k", "-2"),
            ("stop_token_ids", "[4294967296]"),
            ("stop_token_ids", "3"),
            ("skip_special_tokens", "1"),
            ("ignore_eos", "\"yes\""),
        ] {
            let body = format!("{{{user}, \"{field}\": {value}}}");
            assert_eq!(param_of(&body).as_deref(), Some(field), "{body}");
        }
    }
}

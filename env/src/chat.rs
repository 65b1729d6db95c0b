//! The OpenAI chat-completions wire format: messages, sampling parameters, the request body
//! and the parsed reply.

pub use ::chat::{ChatMessage, Role};
use ::chat::SamplingError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::http::{error_message, excerpt};

/// Optional sampling parameters of a request; `None` (or an empty `stop`) leaves the server's
/// default in place and is not sent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Sampling temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus-sampling probability mass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Upper bound on generated tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Seed for servers that support reproducible sampling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Strings that end generation (the server leaves them out of the reply).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
}

impl SamplingParams {
    /// Checks the values against the ranges OpenAI's API accepts (temperature 0 to 2, top_p
    /// above 0 up to 1, at least one token), so that a bad value is named before a run starts
    /// rather than refused by the server on every call.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if let Some(t) = self.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
            return Err(SamplingError(format!("temperature {t} is out of range (0 to 2)")));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(SamplingError(format!("top_p {p} is out of range (above 0, up to 1)")));
        }
        if self.max_tokens == Some(0) {
            return Err(SamplingError("max_tokens must be at least 1 (or unset: the server's default)".into()));
        }
        Ok(())
    }
}

impl From<&::chat::Sampling> for SamplingParams {
    /// The request parameters that sample as `sampling` does: temperature, top_p (when set) and
    /// seed. OpenAI's API has no top-k, so `sampling.top_k` is not sent.
    fn from(sampling: &::chat::Sampling) -> Self {
        Self {
            temperature: Some(f64::from(sampling.temperature)),
            top_p: sampling.top_p.map(f64::from),
            seed: Some(sampling.seed),
            ..Self::default()
        }
    }
}

/// Token counts a server reports for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the request's messages.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
}

/// The first choice of a chat-completions reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatReply {
    /// The message text (`""` when the server sent an empty string).
    pub content: String,
    /// Reasoning text that servers with a reasoning parser (vLLM, Ollama, ...) return apart
    /// from `content` (`reasoning_content` or `reasoning`).
    pub reasoning: Option<String>,
    /// Why generation ended (`stop`, `length`, ...), when the server says.
    pub finish_reason: Option<String>,
    /// Token counts, when the server reports them.
    pub usage: Option<Usage>,
    /// The model that answered, when the server says.
    pub model: Option<String>,
}

/// The JSON body of `POST /chat/completions`.
#[derive(Serialize)]
pub(crate) struct ChatRequest<'a> {
    pub model: &'a str,
    pub messages: &'a [ChatMessage],
    #[serde(flatten)]
    pub params: &'a SamplingParams,
    pub stream: bool,
}

/// The body of a text-completion request (`POST …/completions`): the raw prompt, no chat
/// template.
#[derive(Serialize)]
pub(crate) struct CompletionRequest<'a> {
    pub model: &'a str,
    pub prompt: &'a str,
    #[serde(flatten)]
    pub params: &'a SamplingParams,
    pub stream: bool,
}

/// The reply object of a 2xx body, checked to hold at least one choice.
fn reply_object(body: &str) -> Result<Value, String> {
    if body.trim().is_empty() {
        return Err("empty body".to_string());
    }
    let value: Value = serde_json::from_str(body)
        .map_err(|err| format!("body is not JSON ({err}): {}", excerpt(body)))?;
    let Some(object) = value.as_object() else {
        return Err(format!("body is not a JSON object: {}", excerpt(body)));
    };
    if object.get("error").is_some_and(|e| !e.is_null()) {
        return Err(format!("server reported an error: {}", error_message(body)));
    }
    match object.get("choices") {
        Some(Value::Array(choices)) if choices.is_empty() => {
            Err("reply has no choices".to_string())
        }
        Some(Value::Array(_)) => Ok(value),
        Some(_) => Err("`choices` is not an array".to_string()),
        None => Err(format!("reply has no `choices`: {}", excerpt(body))),
    }
}

fn usage_and_model(object: &Value) -> (Option<Usage>, Option<String>) {
    let usage = object.get("usage").and_then(|usage| {
        Some(Usage {
            prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
            completion_tokens: usage.get("completion_tokens")?.as_u64()?,
        })
    });
    let model = object
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string);
    (usage, model)
}

/// Parses a 2xx reply body of a text completion: the first choice's `text`.
pub(crate) fn parse_completion_reply(body: &str) -> Result<ChatReply, String> {
    let value = reply_object(body)?;
    let choice = &value["choices"][0];
    let finish_reason = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .map(str::to_string);
    let content = match choice.get("text") {
        Some(Value::String(text)) => text.clone(),
        _ => return Err("first choice has no `text` string".to_string()),
    };
    let (usage, model) = usage_and_model(&value);
    Ok(ChatReply {
        content,
        reasoning: None,
        finish_reason,
        usage,
        model,
    })
}

/// Parses a 2xx reply body; the error says what is wrong with it.
pub(crate) fn parse_chat_reply(body: &str) -> Result<ChatReply, String> {
    let value = reply_object(body)?;
    let choice = &value["choices"][0];
    let message = choice
        .get("message")
        .and_then(Value::as_object)
        .ok_or_else(|| "first choice has no `message` object".to_string())?;
    let finish_reason = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .map(str::to_string);
    let reasoning = ["reasoning_content", "reasoning"]
        .iter()
        .find_map(|key| message.get(*key).and_then(Value::as_str))
        .filter(|text| !text.is_empty())
        .map(str::to_string);
    let content = match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        Some(Value::Null) | None if reasoning.is_some() => String::new(),
        Some(Value::Null) | None => {
            let reason = finish_reason.as_deref().unwrap_or("unknown");
            return Err(format!("message has no content (finish_reason: {reason})"));
        }
        Some(other) => {
            return Err(format!(
                "message content is not text: {}",
                excerpt(&other.to_string())
            ))
        }
    };
    let (usage, model) = usage_and_model(&value);
    Ok(ChatReply {
        content,
        reasoning,
        finish_reason,
        usage,
        model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_leaves_out_unset_parameters() {
        let messages = [ChatMessage::user("hi")];
        let params = SamplingParams {
            temperature: Some(0.5),
            ..Default::default()
        };
        let body = serde_json::to_value(ChatRequest {
            model: "m",
            messages: &messages,
            params: &params,
            stream: false,
        })
        .unwrap();
        assert_eq!(
            body,
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0.5, "stream": false})
        );
    }

    #[test]
    fn request_carries_every_set_parameter() {
        let params = SamplingParams {
            temperature: Some(1.0),
            top_p: Some(0.9),
            max_tokens: Some(7),
            seed: Some(3),
            stop: vec!["</answer>".into()],
        };
        let body = serde_json::to_value(ChatRequest {
            model: "m",
            messages: &[],
            params: &params,
            stream: false,
        })
        .unwrap();
        assert_eq!(body["top_p"], 0.9);
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["seed"], 3);
        assert_eq!(body["stop"], serde_json::json!(["</answer>"]));
    }

    #[test]
    fn parses_a_standard_reply() {
        let reply = parse_chat_reply(
            r#"{"model":"gpt","choices":[{"message":{"role":"assistant","content":"Paris"},
               "finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#,
        )
        .unwrap();
        assert_eq!(reply.content, "Paris");
        assert_eq!(reply.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            reply.usage,
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 1
            })
        );
        assert_eq!(reply.model.as_deref(), Some("gpt"));
        assert_eq!(reply.reasoning, None);
    }

    #[test]
    fn keeps_reasoning_apart_from_content() {
        let reply = parse_chat_reply(
            r#"{"choices":[{"message":{"content":"4","reasoning_content":"2+2"}}]}"#,
        )
        .unwrap();
        assert_eq!(reply.reasoning.as_deref(), Some("2+2"));
        assert_eq!(reply.content, "4");
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for (body, expected) in [
            ("", "empty body"),
            ("not json", "not JSON"),
            ("[1]", "not a JSON object"),
            ("{}", "no `choices`"),
            (r#"{"choices":[]}"#, "no choices"),
            (r#"{"choices":[{"finish_reason":"stop"}]}"#, "no `message`"),
            (
                r#"{"choices":[{"message":{"content":null},"finish_reason":"length"}]}"#,
                "no content",
            ),
            (r#"{"error":{"message":"overloaded"}}"#, "overloaded"),
        ] {
            let err = parse_chat_reply(body).unwrap_err();
            assert!(err.contains(expected), "{body:?} gave {err:?}");
        }
    }

    #[test]
    fn completion_requests_and_replies() {
        let params = SamplingParams {
            max_tokens: Some(9),
            ..SamplingParams::default()
        };
        let body = serde_json::to_value(CompletionRequest {
            model: "m",
            prompt: "<|im_start|>user\nq<|im_end|>\n",
            params: &params,
            stream: false,
        })
        .unwrap();
        assert_eq!(
            body,
            serde_json::json!({"model": "m", "prompt": "<|im_start|>user\nq<|im_end|>\n",
                "max_tokens": 9, "stream": false})
        );
        let reply = parse_completion_reply(
            r#"{"object":"text_completion","model":"a","choices":[{"index":0,"text":" Paris","finish_reason":"length"}],
               "usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}"#,
        )
        .unwrap();
        assert_eq!(reply.content, " Paris");
        assert_eq!(reply.finish_reason.as_deref(), Some("length"));
        assert_eq!(reply.usage.map(|u| u.completion_tokens), Some(2));
        let chat_shaped = r#"{"choices":[{"message":{"content":"x"}}]}"#;
        assert!(parse_completion_reply(chat_shaped)
            .unwrap_err()
            .contains("text"));
        assert!(parse_completion_reply(r#"{"choices":[]}"#).is_err());
    }
}

//! One chat message and its author.

use serde::{Deserialize, Serialize};

/// Author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the assistant; rendered first when it is the first message.
    System,
    /// A user turn (a query, or a tool result written as `<tool_response>…</tool_response>`).
    User,
    /// A model turn.
    Assistant,
}

impl Role {
    /// The role's name, as written after `<|im_start|>` and in the OpenAI wire format.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One chat message, in the shape of Hugging Face's message dicts and OpenAI's chat messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote the message.
    pub role: Role,
    /// The message text.
    pub content: String,
    /// Reasoning of an assistant message, apart from its content (Hugging Face templates and
    /// reasoning servers name it so); when `None`, a chat template takes it from
    /// `<think>…</think>` in `content`. Not serialised when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            reasoning_content: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message; `<think>…</think>` in the content is its reasoning.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// An assistant message with separate reasoning.
    pub fn assistant_with_reasoning(content: impl Into<String>, reasoning: impl Into<String>) -> Self {
        Self {
            reasoning_content: Some(reasoning.into()),
            ..Self::assistant(content)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialises_as_the_openai_wire_format() {
        let json = serde_json::to_string(&ChatMessage::user("hi")).unwrap();
        assert_eq!(json, r#"{"role":"user","content":"hi"}"#);
        let with = ChatMessage::assistant_with_reasoning("4", "2+2");
        let json = serde_json::to_string(&with).unwrap();
        assert_eq!(json, r#"{"role":"assistant","content":"4","reasoning_content":"2+2"}"#);
        assert_eq!(serde_json::from_str::<ChatMessage>(&json).unwrap(), with);
    }

    #[test]
    fn role_names_match_serde() {
        for role in [Role::System, Role::User, Role::Assistant] {
            assert_eq!(serde_json::to_string(&role).unwrap(), format!("\"{}\"", role.as_str()));
        }
    }
}

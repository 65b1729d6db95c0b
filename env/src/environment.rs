//! The environment (the large LLM) and the messages a call sends it.

use crate::agent::Exchange;
use crate::chat::ChatMessage;
use crate::client::OpenAiClient;
use crate::error::EnvError;

/// The environment's system message (the reference code ends it with one extra
/// space).
pub const ENV_SYSTEM_MESSAGE: &str = "You are a helpful assistant. Please read the provided content (including previous conversations and the current task) and help the user complete the task or answer the question.";

/// Something that answers the agent's prompts: the HTTP client, or a script in tests.
/// Calls of one turn run in parallel threads, hence `Sync`.
pub trait Environment: Sync {
    /// The reply text to `messages`, or why there is none.
    fn complete(&self, messages: &[ChatMessage]) -> Result<String, EnvError>;
}

impl Environment for OpenAiClient {
    /// Sends the messages with the sampling parameters of the client's configuration.
    fn complete(&self, messages: &[ChatMessage]) -> Result<String, EnvError> {
        self.chat(messages, &self.config().sampling)
            .map(|reply| reply.content)
    }
}

/// The messages of a call: the system message, every earlier prompt/reply pair of the episode
/// as user/assistant messages, then the new prompt. The agent's `<think>` text is never sent.
pub fn environment_messages(system: &str, earlier: &[Exchange], prompt: &str) -> Vec<ChatMessage> {
    let mut messages = Vec::with_capacity(2 + 2 * earlier.len());
    messages.push(ChatMessage::system(system));
    for exchange in earlier {
        messages.push(ChatMessage::user(&exchange.prompt));
        messages.push(ChatMessage::assistant(&exchange.reply));
    }
    messages.push(ChatMessage::user(prompt));
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_hold_system_earlier_pairs_and_the_new_prompt() {
        let earlier = vec![Exchange {
            turn_text: "<think>secret</think><interaction_prompt>p1</interaction_prompt>".into(),
            prompt: "p1".into(),
            reply: "r1".into(),
            shown_reply: "{\"results\": [\"r1\"]}".into(),
        }];
        let messages = environment_messages(ENV_SYSTEM_MESSAGE, &earlier, "p2");
        assert_eq!(
            messages,
            vec![
                ChatMessage::system(ENV_SYSTEM_MESSAGE),
                ChatMessage::user("p1"),
                ChatMessage::assistant("r1"),
                ChatMessage::user("p2"),
            ]
        );
        assert!(messages.iter().all(|m| !m.content.contains("secret")));
    }
}

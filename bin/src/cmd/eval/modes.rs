//! The four ways `eval` answers a question, and what each sends and keeps.
//!
//! - `agent`: the full Prompt-R1 loop (the agent prompts the large LLM, then answers).
//! - `direct`: the large LLM gets the bare question as its only message.
//! - `cot`: the large LLM gets `Question: …` and an instruction to think step by step and put
//!   the final answer in `<answer></answer>`.
//! - `agent-only`: the agent alone, with the same chain-of-thought instruction (and a plain
//!   system message instead of the one describing the large LLM), allowed no calls: its first
//!   turn must answer; a call ends the episode with `turn_limit` and no answer.
//!
//! `direct` and `cot` predict the content of the reply's first `<answer>…</answer>` when there
//! is one, else the whole reply; a `<think>…</think>` block before it is dropped first.
//! `agent` and `agent-only` predict the episode's answer, or nothing.

use std::time::Instant;

use clap::ValueEnum;
use data::Example;
use env::{ChatMessage, OpenAiClient, PromptTexts, StopReason, Trajectory, ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::predictions::Row;

/// How the questions are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The agent prompts the large LLM, then answers (Prompt-R1).
    Agent,
    /// The large LLM answers the bare question.
    Direct,
    /// The large LLM answers with a chain-of-thought instruction.
    Cot,
    /// The agent answers alone, without calling the large LLM.
    AgentOnly,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Agent => "agent",
            Mode::Direct => "direct",
            Mode::Cot => "cot",
            Mode::AgentOnly => "agent-only",
        }
    }

    pub fn uses_agent(self) -> bool {
        matches!(self, Mode::Agent | Mode::AgentOnly)
    }

    pub fn uses_env(self) -> bool {
        !matches!(self, Mode::AgentOnly)
    }
}

/// The chain-of-thought instruction of `cot` and `agent-only`, after `Question: …\n`.
pub const COT_INSTRUCTION: &str = "Think step by step, then give the final answer inside <answer> and </answer>, for example <answer>Paris</answer>.";

/// The agent's system message in `agent-only`.
pub const AGENT_ONLY_SYSTEM: &str = "You are a helpful assistant.";

/// The prompt texts of `agent-only`.
pub fn agent_only_prompts() -> PromptTexts {
    PromptTexts {
        system: AGENT_ONLY_SYSTEM.to_string(),
        instruction: COT_INSTRUCTION.to_string(),
    }
}

/// The messages `direct` and `cot` send.
pub fn llm_messages(mode: Mode, question: &str) -> Vec<ChatMessage> {
    match mode {
        Mode::Cot => vec![ChatMessage::user(format!(
            "Question: {}\n{COT_INSTRUCTION}",
            question.trim()
        ))],
        _ => vec![ChatMessage::user(question.trim())],
    }
}

/// The prediction in a reply of the large LLM: after its reasoning (`<think>…</think>`; none
/// when the reasoning was cut before it ended), the content of the first `<answer>…</answer>`
/// (empty if the tags hold nothing), or after an `<answer>` never closed (cut by the token
/// limit), else the whole visible reply; trimmed.
pub fn prediction_from_reply(reply: &str) -> String {
    let visible = match reply.rfind(THINK_CLOSE) {
        Some(at) => &reply[at + THINK_CLOSE.len()..],
        None if reply.trim_start().starts_with(THINK_OPEN) => return String::new(),
        None => reply,
    };
    let Some(open) = visible.find(ANSWER_OPEN) else {
        return visible.trim().to_string();
    };
    let content = &visible[open + ANSWER_OPEN.len()..];
    let content = content.find(ANSWER_CLOSE).map_or(content, |close| &content[..close]);
    content.trim().to_string()
}

/// Asks the large LLM one question (`direct` or `cot`).
pub fn ask_llm(client: &OpenAiClient, example: &Example, mode: Mode) -> Row {
    let messages = llm_messages(mode, example.question());
    let started = Instant::now();
    let result = client.chat(&messages, &client.config().sampling);
    let env_ms = started.elapsed().as_millis() as u64;
    let (prediction, stop_reason, error, trajectory) = match result {
        Ok(reply) => (
            prediction_from_reply(&reply.content),
            StopReason::Answer,
            None,
            json!({
                "messages": messages,
                "reply": reply.content,
                "reasoning": reply.reasoning,
                "finish_reason": reply.finish_reason,
                "usage": reply.usage,
                "env_ms": env_ms,
            }),
        ),
        Err(err) => (
            String::new(),
            StopReason::EnvFailure,
            Some(err.to_string()),
            json!({"messages": messages, "reply": null, "env_ms": env_ms}),
        ),
    };
    Row::new(example, mode, prediction, stop_reason, error, trajectory)
}

/// The row of an agent episode (`agent` or `agent-only`).
pub fn row_from_episode(example: &Example, mode: Mode, trajectory: &Trajectory) -> Row {
    Row::new(
        example,
        mode,
        trajectory.answer.clone().unwrap_or_default(),
        trajectory.stop_reason,
        trajectory.error.clone(),
        serde_json::to_value(trajectory).unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prediction_is_the_answer_tag_or_the_reply() {
        assert_eq!(
            prediction_from_reply("So. <answer> Paris </answer>"),
            "Paris"
        );
        assert_eq!(prediction_from_reply("  Paris.\n"), "Paris.");
        assert_eq!(
            prediction_from_reply(
                "<think>maybe <answer>Rome</answer></think>\n<answer>Paris</answer>"
            ),
            "Paris"
        );
        assert_eq!(prediction_from_reply("<think>x</think>\n\nParis"), "Paris");
        // Empty tags hold an empty answer; an unclosed answer is what follows its tag; reasoning
        // cut before its end leaves no answer.
        assert_eq!(prediction_from_reply("<answer></answer> J. Cole"), "");
        assert_eq!(prediction_from_reply("So: <answer> Ainslee's Magazine"), "Ainslee's Magazine");
        assert_eq!(prediction_from_reply(" <think>The film was directed by"), "");
    }

    #[test]
    fn cot_asks_for_the_answer_tag() {
        let direct = llm_messages(Mode::Direct, " What? ");
        assert_eq!(direct, vec![ChatMessage::user("What?")]);
        let cot = llm_messages(Mode::Cot, "What?");
        assert!(cot[0].content.starts_with("Question: What?\n"));
        assert!(cot[0].content.contains("<answer>"));
        assert_eq!(
            serde_json::to_value(Mode::AgentOnly).unwrap(),
            serde_json::json!("agent-only")
        );
    }
}

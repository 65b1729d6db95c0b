//! The record of one episode, for the trainer (tokens, mask, log-probs) and for users (turns,
//! answer, why it stopped).

use serde::{Deserialize, Serialize};

use crate::agent::TurnEnd;

/// Why an episode ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The agent gave an `<answer>`.
    Answer,
    /// A turn had neither a call nor an answer.
    NoCall,
    /// The agent called the environment again after using all its calls.
    TurnLimit,
    /// The turn or episode token budget ran out.
    TokenLimit,
    /// The environment failed (after retries); nothing of the failure reached the agent.
    EnvFailure,
    /// The agent failed to generate.
    AgentFailure,
}

impl StopReason {
    /// Whether the episode failed for a reason outside the agent's behaviour.
    pub fn is_failure(self) -> bool {
        matches!(self, StopReason::EnvFailure | StopReason::AgentFailure)
    }
}

/// One agent turn and, for a call, the environment's reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Content of `<think>`.
    pub think: Option<String>,
    /// The prompt the agent sent (or tried to send) to the environment.
    pub prompt: Option<String>,
    /// The environment's full reply (the agent saw it cut to the reply limit).
    pub response: Option<String>,
    /// Whether the reply the agent saw was cut.
    pub response_truncated: bool,
    /// The final answer, on the last turn.
    pub answer: Option<String>,
    /// The full assistant turn text (the `<think>\n` prefix after a reply included).
    pub text: String,
    /// Tokens the agent generated this turn.
    pub tokens: usize,
    /// How the turn ended.
    pub end: TurnEnd,
    /// Time the environment took to answer this turn's call, in milliseconds.
    pub env_ms: Option<u64>,
}

/// Where an episode's time went, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    /// From the episode's beginning to its end.
    pub total_ms: u64,
    /// Generation calls this episode took part in (batched calls count in full).
    pub agent_ms: u64,
    /// This episode's environment calls.
    pub env_ms: u64,
}

/// One episode.
///
/// `token_ids`, `loss_mask` and `logprobs` are aligned and empty for chat-API agents; for a
/// token-level agent they decode to `prompt_text + response_text`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// The question.
    pub question: String,
    /// The final answer, when the agent gave one.
    pub answer: Option<String>,
    /// Why the episode ended.
    pub stop_reason: StopReason,
    /// What failed, for failed episodes (never shown to the agent).
    pub error: Option<String>,
    /// The agent's turns in order.
    pub turns: Vec<TurnRecord>,
    /// The first prompt in ChatML, up to and including `<|im_start|>assistant\n`.
    pub prompt_text: String,
    /// Everything after the prompt: agent turns and environment texts, as the context holds them.
    pub response_text: String,
    /// Token ids of the whole context.
    pub token_ids: Vec<u32>,
    /// 1 for agent-sampled tokens, 0 for prompt and environment tokens.
    pub loss_mask: Vec<u8>,
    /// The agent's log-probabilities of its tokens; 0.0 where the mask is 0.
    pub logprobs: Vec<f32>,
    /// Number of prompt tokens at the start of `token_ids`.
    pub prompt_len: usize,
    /// Tokens after the prompt (agent and environment; estimated for chat-API agents).
    pub response_tokens: usize,
    /// Environment calls made (failed ones included).
    pub env_calls: usize,
    /// Timings.
    pub timings: Timings,
}

impl Trajectory {
    /// The whole context text: prompt and response.
    pub fn context_text(&self) -> String {
        format!("{}{}", self.prompt_text, self.response_text)
    }
}

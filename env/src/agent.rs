//! The agent side of an episode: the trait both agents implement (the local burn model in the
//! trainer crate and the remote chat endpoint here) and the per-episode context they work on.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::error::EnvError;
use crate::prompts::FirstPrompt;

/// Why the agent could not produce a turn.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AgentError {
    /// A remote agent's endpoint failed.
    #[error("agent endpoint failed: {0}")]
    Remote(#[from] EnvError),
    /// A local model failed (out of memory, context too long, ...).
    #[error("agent model failed: {0}")]
    Model(String),
}

/// How an agent turn ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnEnd {
    /// The agent sampled `<|im_end|>`. A token-level agent has recorded that token (loss mask 1);
    /// it is not part of [`TurnText::text`].
    ImEnd,
    /// Generation stopped at `</interaction_prompt>` or `</answer>` (a chat-API agent's stop
    /// strings) without `<|im_end|>`.
    StopString,
    /// The turn's token budget ran out.
    Length,
}

/// One generated turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnText {
    /// The text the agent generated this turn, after the turn prefix the context already held
    /// ([`AgentContext::turn_prefix`]) and without a final `<|im_end|>`.
    pub text: String,
    /// Tokens generated (for a chat-API agent: as the server reports, else an estimate).
    pub tokens: usize,
    /// How the turn ended.
    pub end: TurnEnd,
}

/// One completed call of an episode: what the agent wrote and what the environment answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    /// The full assistant turn text (turn prefix included).
    pub turn_text: String,
    /// The prompt sent to the environment.
    pub prompt: String,
    /// The environment's reply, trimmed.
    pub reply: String,
    /// The REPLY JSON text shown to the agent (possibly cut).
    pub shown_reply: String,
}

/// Token-level record of an episode's context, kept by token-level agents.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenTrace {
    ids: Vec<u32>,
    loss_mask: Vec<u8>,
    logprobs: Vec<f32>,
}

impl TokenTrace {
    /// Token ids of the whole context.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// 1 for tokens the agent sampled, 0 for prompt and environment tokens.
    pub fn loss_mask(&self) -> &[u8] {
        &self.loss_mask
    }

    /// The agent's log-probability of each token it sampled; 0.0 where the mask is 0.
    pub fn logprobs(&self) -> &[f32] {
        &self.logprobs
    }

    /// Tokens recorded.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether nothing was recorded (chat-API agents record nothing).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Everything one episode's agent needs: the question, the first prompt, earlier exchanges,
/// the budget of the coming turn, and (for token-level agents) the token record.
#[derive(Clone, Debug)]
pub struct AgentContext {
    index: usize,
    question: String,
    prompt: FirstPrompt,
    turn_prefix: &'static str,
    turn_budget: usize,
    exchanges: Vec<Exchange>,
    trace: TokenTrace,
}

impl AgentContext {
    /// The context of episode `index` of a batch.
    pub fn new(index: usize, question: impl Into<String>, prompt: FirstPrompt) -> Self {
        Self {
            index,
            question: question.into(),
            prompt,
            turn_prefix: "",
            turn_budget: 0,
            exchanges: Vec::new(),
            trace: TokenTrace::default(),
        }
    }

    /// Position of this episode in its batch (stable for the episode's life; agents may key
    /// per-episode state such as KV caches by it).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The question.
    pub fn question(&self) -> &str {
        &self.question
    }

    /// The first prompt (system and user message).
    pub fn prompt(&self) -> &FirstPrompt {
        &self.prompt
    }

    /// Text the context already holds at the start of the coming assistant turn: `""` for the
    /// first turn, `"<think>\n"` after an environment reply.
    pub fn turn_prefix(&self) -> &'static str {
        self.turn_prefix
    }

    /// Most tokens the coming turn may generate.
    pub fn turn_budget(&self) -> usize {
        self.turn_budget
    }

    /// Completed calls, oldest first.
    pub fn exchanges(&self) -> &[Exchange] {
        &self.exchanges
    }

    /// The token record.
    pub fn trace(&self) -> &TokenTrace {
        &self.trace
    }

    /// Records tokens the agent did not sample (the prompt, the environment's text): mask 0.
    pub fn record_context_tokens(&mut self, ids: &[u32]) {
        self.trace.ids.extend_from_slice(ids);
        self.trace
            .loss_mask
            .extend(std::iter::repeat_n(0, ids.len()));
        self.trace
            .logprobs
            .extend(std::iter::repeat_n(0.0, ids.len()));
    }

    /// Records one token the agent sampled, with its log-probability: mask 1.
    pub fn record_agent_token(&mut self, id: u32, logprob: f32) {
        self.trace.ids.push(id);
        self.trace.loss_mask.push(1);
        self.trace.logprobs.push(logprob);
    }

    pub(crate) fn set_turn_budget(&mut self, budget: usize) {
        self.turn_budget = budget;
    }

    pub(crate) fn push_exchange(&mut self, exchange: Exchange, next_prefix: &'static str) {
        self.exchanges.push(exchange);
        self.turn_prefix = next_prefix;
    }

    pub(crate) fn take_trace(&mut self) -> TokenTrace {
        std::mem::take(&mut self.trace)
    }
}

/// An agent that writes the turns of many episodes at once.
///
/// The episode loop ([`run_episodes`](crate::run_episodes)) calls
/// [`begin_episode`](Agent::begin_episode) once per episode as it begins (all at once, or as
/// [`Admission`](crate::Admission) lets them in, between other episodes' turns), then turn by
/// turn [`generate_turns`](Agent::generate_turns) with every episode still running, then
/// [`environment_tokens`](Agent::environment_tokens) for each episode whose call was answered
/// (the loop appends them where they fit the episode's response budget), and finally
/// [`end_episode`](Agent::end_episode).
///
/// A token-level agent (the local model) tokenises the first prompt's ChatML once in
/// `begin_episode` (recording it with [`AgentContext::record_context_tokens`]), records each
/// sampled token with [`AgentContext::record_agent_token`] (the final `<|im_end|>` too), and
/// tokenises only the appended environment text, never the whole context. A chat-API agent
/// records no tokens and rebuilds messages from [`AgentContext::exchanges`].
pub trait Agent {
    /// Prepares a new episode whose first prompt is `ctx.prompt()`.
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError>;

    /// Generates the next turn of every given episode, each within `ctx.turn_budget()` tokens,
    /// continuing after `ctx.turn_prefix()`. Returns one result per episode, in order.
    fn generate_turns(
        &mut self,
        episodes: &mut [&mut AgentContext],
    ) -> Vec<Result<TurnText, AgentError>>;

    /// The environment's `text` (see [`environment_text`](crate::environment_text)) as this
    /// agent's context would hold it. The episode loop appends it with loss mask 0 where it fits
    /// the episode's response budget, and ends the episode otherwise.
    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError>;

    /// Called once the episode is over, to free per-episode state.
    fn end_episode(&mut self, _ctx: &mut AgentContext) {}

    /// Whether the agent decodes continuously ([`start_turns`](Agent::start_turns) and
    /// [`advance`](Agent::advance)): the episode loop then sends each call as soon as its turn
    /// ends, while the other episodes keep decoding, instead of turn by turn over the batch.
    fn continuous(&self) -> bool {
        false
    }

    /// Continuous agents: the given episodes start their next turn (each within
    /// `ctx.turn_budget()` tokens), joining those already generating. One result per episode.
    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), AgentError>> {
        episodes
            .iter()
            .map(|_| Err(AgentError::Model("this agent does not decode continuously".into())))
            .collect()
    }

    /// Continuous agents: one step for every episode generating a turn (`episodes` holds each
    /// of them, in any order); returns the turns that ended, by [`AgentContext::index`].
    fn advance(&mut self, _episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<TurnText, AgentError>)> {
        Vec::new()
    }
}

/// [`Agent::generate_turns`] for a continuous agent: starts every given episode's turn, then
/// advances until each has ended, or until `idle` says the agent has nothing left in progress
/// (a turn still missing then fails). One result per episode, in order.
pub fn turns_by_advancing<A: Agent + ?Sized>(
    agent: &mut A,
    episodes: &mut [&mut AgentContext],
    idle: impl Fn(&A) -> bool,
) -> Vec<Result<TurnText, AgentError>> {
    let slots: std::collections::HashMap<usize, usize> =
        episodes.iter().enumerate().map(|(slot, c)| (c.index(), slot)).collect();
    let mut results: Vec<Option<Result<TurnText, AgentError>>> =
        agent.start_turns(episodes).into_iter().map(|started| started.err().map(Err)).collect();
    while results.iter().any(Option::is_none) {
        let ended = agent.advance(episodes);
        if ended.is_empty() && idle(agent) {
            break;
        }
        for (index, result) in ended {
            if let Some(&slot) = slots.get(&index) {
                results[slot] = Some(result);
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(AgentError::Model("the turn was not generated".into()))))
        .collect()
}

/// The environment's text in an agent's context ([`Agent::environment_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvironmentTokens {
    /// A token-level agent's token ids, recorded in the episode's [`TokenTrace`].
    Ids(Vec<u32>),
    /// A text-level agent's estimate of their number (nothing is recorded).
    Estimated(usize),
}

impl EnvironmentTokens {
    /// How many tokens the text takes in the context.
    pub fn len(&self) -> usize {
        match self {
            Self::Ids(ids) => ids.len(),
            Self::Estimated(n) => *n,
        }
    }

    /// Whether the text takes no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A rough token count for text whose tokens are unknown (about four characters per token).
pub fn estimate_tokens(text: &str) -> usize {
    text.chars().count().div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_keeps_ids_mask_and_logprobs_aligned() {
        let prompt = FirstPrompt {
            system: "s".into(),
            user: "u".into(),
        };
        let mut ctx = AgentContext::new(0, "q", prompt);
        ctx.record_context_tokens(&[1, 2, 3]);
        ctx.record_agent_token(4, -0.5);
        ctx.record_context_tokens(&[5]);
        let trace = ctx.trace();
        assert_eq!(trace.ids(), &[1, 2, 3, 4, 5]);
        assert_eq!(trace.loss_mask(), &[0, 0, 0, 1, 0]);
        assert_eq!(trace.logprobs(), &[0.0, 0.0, 0.0, -0.5, 0.0]);
        assert_eq!(trace.len(), 5);
    }

    #[test]
    fn token_estimate() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("abcde"), 2);
    }
}

//! The environment side of Prompt-R1.
//!
//! - [`OpenAiClient`]: a blocking client for OpenAI-compatible chat APIs that survives faults
//!   (timeouts, retries with jittered backoff and `Retry-After`, concurrency and rate caps,
//!   failure counters). It is the [`Environment`] of real runs.
//! - The episode protocol: the agent's [`FirstPrompt`], [`parse_turn`],
//!   [`environment_messages`], and how replies enter the agent's context ([`ReplyFormat`],
//!   [`environment_text`]).
//! - The episode loop [`run_episodes`], shared by inference and training, over any [`Agent`]:
//!   the local burn model (trainer crate) or a [`RemoteAgent`] behind a chat API.
//! - [`http`]: the helpers that the trainer's client of its rollout workers shares with
//!   [`OpenAiClient`] (error replies, excerpts, loopback hosts), and the [`ApiKey`] both send.

#![forbid(unsafe_code)]

mod agent;
mod backoff;
mod chat;
mod client;
mod config;
mod environment;
mod episode;
mod error;
pub mod http;
mod parallel;
mod prompts;
mod remote_agent;
mod reply;
mod secret;
mod stats;
mod throttle;
mod trajectory;
mod turn;

pub use agent::{
    estimate_tokens, turns_by_advancing, Agent, AgentContext, AgentError, EnvironmentTokens, Exchange, TokenTrace,
    TurnEnd, TurnText,
};
pub use crate::chat::{ChatMessage, ChatReply, Role, SamplingParams, Usage};
pub use client::{OpenAiClient, RetryNotice};
pub use config::{ClientConfig, RetryPolicy, DEFAULT_API_KEY_ENV};
pub use environment::{environment_messages, Environment, ENV_SYSTEM_MESSAGE};
pub use episode::{
    run_episodes, run_episodes_admitted, run_episodes_observed, Admission, EpisodeConfig, EpisodeObserver, NoObserver,
};
pub use error::{EnvError, FailureKind};
pub use parallel::ParallelRunner;
pub use prompts::{
    FirstPrompt, PromptFileError, PromptTexts, REFERENCE_INSTRUCTION, REFERENCE_SYSTEM,
};
pub use remote_agent::{AgentApi, RemoteAgent};
pub use reply::{
    environment_text, response_message, ReplyFormat, ShownReply, IM_END, NEXT_TURN_PREFIX,
    RESPONSE_CLOSE, RESPONSE_OPEN,
};
pub use secret::ApiKey;
pub use stats::{ClientStats, StatsSnapshot};
pub use throttle::{Permit, RateLimiter, Semaphore};
pub use trajectory::{StopReason, Timings, Trajectory, TurnRecord};
pub use turn::{
    parse_turn, Call, CallFormat, ParsedTurn, TurnAction, ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE,
    CALL_OPEN, THINK_CLOSE, THINK_OPEN,
};

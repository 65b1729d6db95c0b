//! The conversation vocabulary that the model (chat template, generation), the environment
//! client (the OpenAI wire format) and the CLI share, so that a message or a sampling setting
//! has one type on both sides of the `model` / `env` boundary:
//! - [`ChatMessage`] and [`Role`]: one message, in the shape of Hugging Face's message dicts
//!   and OpenAI's chat messages;
//! - [`Sampling`]: how an LLM chooses its tokens (temperature, top-k, top-p, seed);
//! - [`tags`]: the protocol tags of the agent's turns (`<think>`, `<interaction_prompt>`,
//!   `<answer>`), which the environment parses and the rewards score.

#![forbid(unsafe_code)]

mod message;
mod sampling;
pub mod tags;

pub use message::{ChatMessage, Role};
pub use sampling::{Sampling, SamplingError, GREEDY_BELOW};

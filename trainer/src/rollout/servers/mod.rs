//! Rollouts on a list of OpenAI-compatible workers (`prompt-r1 serve`, vLLM): `[rollout]
//! engine = "servers"`. The wire protocol is vLLM's (token-id prompts to `/v1/completions` with
//! `logprobs` and `return_token_ids`, runtime LoRA loading) plus SGLang's
//! `/update_weights_from_disk` for full weights:
//!
//! - [`ServerAgent`] is the episode agent: each turn sends the episode's whole token context as
//!   the prompt, with the turn's seed ([`crate::rollout::turn_seed`]), and records the ids and
//!   log-probs that come back exactly as sampled. An episode stays on the worker of its first
//!   turn (its prefix cache); a worker that fails is left for the rest of the rollout and the
//!   turn is sent again to another (same seed, same tokens: nothing lost or repeated).
//! - [`ServerEngine`] is the trainer's engine: it pushes each new policy to every worker (LoRA
//!   adapters with `/v1/load_lora_adapter`, full weights with `/update_weights_from_disk`, both
//!   written atomically under `policy_dir`) and checks with `/v1/models` that each took it.

mod agent;
mod engine;
#[doc(hidden)]
pub mod fake;
mod http;
mod pool;
mod settings;
#[cfg(test)]
mod tests;

pub use agent::ServerAgent;
pub use engine::ServerEngine;
pub use pool::ServerPool;
pub use settings::ServerSettings;

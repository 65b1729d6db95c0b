//! Rollouts: the engines that turn a batch of questions into episodes ([`RolloutEngine`]).
//! The local burn model as an episode agent ([`LocalAgent`], [`LocalEngine`]), or a list of
//! OpenAI-compatible rollout workers (`prompt-r1 serve`, vLLM) given token-id prompts
//! ([`ServerAgent`], [`ServerEngine`]); either is driven by the `env` crate's episode loop
//! against an environment.

mod engine;
mod local_agent;
pub mod servers;

pub use engine::{engine_for, LocalEngine, RolloutBatch, RolloutEngine, RolloutStats};
pub(crate) use engine::longest_first_prompt;
pub use local_agent::{LocalAgent, StepTimes};
pub use servers::{ServerAgent, ServerEngine, ServerPool, ServerSettings};

use model::generation::row_seed;

/// The seed of one agent turn: episode `episode` (its place in the whole rollout batch) of
/// the batch `stream` (e.g. the training step), turn `turn` (from 0), under the base seed
/// `sampling.seed`. Both agents use it: the local one seeds the turn's generator with
/// `StdRng::seed_from_u64(row_seed(turn_seed, 0))`, and the server agent sends it as the
/// request's `seed`, which `prompt-r1 serve` seeds its row with the same way; so the same
/// policy samples the same tokens either way.
pub fn turn_seed(base: u64, stream: u64, episode: usize, turn: u64) -> u64 {
    let batch = row_seed(base, stream);
    row_seed(row_seed(batch, episode as u64), turn)
}

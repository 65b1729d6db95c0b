//! The seam between the trainer and whatever generates its episodes: the trainer asks an
//! engine for a batch of episodes and tells it when the policy changed.

use burn::tensor::backend::Backend;
use env::{EpisodeConfig, Environment, Trajectory};
use model::tokenizer::Qwen3Tokenizer;
use model::{DecoderStats, LoraModel, Sampling};

use super::local_agent::LocalAgent;
use super::servers::ServerEngine;
use crate::run::{RolloutEngineKind, TrainConfig, TrainError};

/// One batch of episodes to roll out.
pub struct RolloutBatch<'a, B: Backend> {
    /// The current policy (the model with its adapters): what the local engine samples from,
    /// in `rollout.dtype`. An engine whose workers hold the policy themselves does not use it
    /// (beyond its configuration, e.g. the vocabulary size).
    pub policy: LoraModel<'a, B>,
    pub tokenizer: &'a Qwen3Tokenizer,
    pub env: &'a dyn Environment,
    /// One episode per question, in order (a GRPO group's episodes are consecutive).
    pub questions: &'a [&'a str],
    pub episode: &'a EpisodeConfig,
    /// Distinguishes batches (the training step; 0 for validation): with `sampling.seed`, the
    /// episode's place in `questions` and the turn, it seeds every turn ([`super::turn_seed`]).
    pub stream: u64,
    pub sampling: &'a Sampling,
    /// Tokens of the longest first prompt the run may send, beyond this batch's questions (the
    /// trainer's over all its questions; 0: only this batch counts): what a KV budget must hold
    /// from the run's first episode on.
    pub longest_prompt: usize,
}

/// What an engine reports about a rollout besides its trajectories.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RolloutStats {
    /// The local decoder's counters (prefill tokens, peak KV positions, preemptions); for
    /// engines that decode elsewhere, the prefill tokens their workers report and zero for the
    /// rest.
    pub decoder: DecoderStats,
    /// Turns sent again to another worker after one failed (`rollout/server_retries`).
    pub server_retries: u64,
    /// The workers left out by the rollout's end, each as `url (why)`: unreachable, or did not
    /// take the policy (`rollout/workers_left_out`); empty for the local engine.
    pub workers_left_out: Vec<String>,
    /// The local decoder's steps and their time, by kind; zero for engines that decode
    /// elsewhere.
    pub steps: super::StepTimes,
}

/// Generates episodes for the trainer.
pub trait RolloutEngine<B: Backend>: Send {
    /// Whether the engine samples from [`RolloutBatch::policy`] itself (then the trainer
    /// hands it the policy in `rollout.dtype`); engines whose workers hold their own copy of
    /// the policy get the trainer's model as it is.
    fn samples_locally(&self) -> bool;

    /// One episode per question, in order, sampled from the current policy.
    fn rollouts(&mut self, batch: RolloutBatch<'_, B>) -> Result<(Vec<Trajectory>, RolloutStats), TrainError>;

    /// The policy changed (`step` optimiser steps done; called before the first rollout too):
    /// the engine's next rollout must sample from `policy`.
    fn policy_changed(&mut self, step: u64, policy: LoraModel<'_, B>) -> Result<(), TrainError>;
}

/// The engine `[rollout] engine` names for a run (`config` validated).
pub fn engine_for<B: Backend>(config: &TrainConfig) -> Result<Box<dyn RolloutEngine<B>>, TrainError> {
    match config.rollout.engine {
        RolloutEngineKind::Local => Ok(Box::new(LocalEngine::new(config))),
        RolloutEngineKind::Servers => Ok(Box::new(ServerEngine::from_config(config)?)),
    }
}

/// Rollouts on the trainer's own device: the [`LocalAgent`] decoding at most
/// `generation_batch` episodes in flight (as `rollout.admission` begins them) within the decoder
/// limits of `[rollout]`.
pub struct LocalEngine {
    rollout: crate::run::RolloutSection,
}

impl LocalEngine {
    /// The engine of `config`'s `[rollout]` settings.
    pub fn new(config: &TrainConfig) -> Self {
        Self { rollout: config.rollout.clone() }
    }
}

impl<B: Backend> RolloutEngine<B> for LocalEngine {
    fn samples_locally(&self) -> bool {
        true
    }

    /// Runs one episode per question, at most `generation_batch` in flight (beginning as
    /// `rollout.admission` says), and counts the tokens run through prefill, the peak KV positions and the
    /// preemptions. Every episode samples from its own stream of `sampling.seed`, `stream` and
    /// its place among the questions, so `generation_batch` changes how fast, not what (to the
    /// float rounding of a batch's products: see `model::decode`).
    fn rollouts(&mut self, batch: RolloutBatch<'_, B>) -> Result<(Vec<Trajectory>, RolloutStats), TrainError> {
        let model = batch.policy;
        // The cache holds keys and values in the dtype of the weights the rollouts run on.
        let cache_dtype = model.base.model.embed_tokens.weight.val().dtype();
        let limits = self.rollout.decoder_limits(&model.base.config, cache_dtype)?;
        if let Some(budget) = limits.kv_budget {
            check_budget_holds_an_episode(budget, batch.tokenizer, batch.questions, batch.episode, batch.longest_prompt)?;
        }
        let mut agent = LocalAgent::new(model.base, batch.tokenizer, batch.sampling.clone())
            .with_adapters(model.adapters)
            .with_limits(limits)
            .with_continuous_batching(self.rollout.continuous_batching);
        agent.set_batch_stream(batch.stream);
        let out = env::run_episodes_admitted(&mut agent, batch.env, batch.questions, batch.episode, self.rollout.admission(), &mut env::NoObserver);
        Ok((out, RolloutStats { decoder: agent.decoder_stats(), server_retries: 0, workers_left_out: Vec::new(), steps: agent.step_times() }))
    }

    /// Nothing to do: every rollout samples from the policy it is handed.
    fn policy_changed(&mut self, _step: u64, _policy: LoraModel<'_, B>) -> Result<(), TrainError> {
        Ok(())
    }
}

/// Refuses, before any episode starts, a `kv_budget` of `budget` positions that could not hold
/// the longest episode of `questions` alone (its first prompt, or one of `longest_elsewhere`
/// tokens if longer, plus `max_response_tokens`, at the capacity the cache grows to), as vLLM
/// refuses a KV cache smaller than one `max_model_len` sequence: otherwise such an episode
/// would fail once it grew past the budget.
fn check_budget_holds_an_episode(
    budget: usize,
    tokenizer: &Qwen3Tokenizer,
    questions: &[&str],
    episode: &EpisodeConfig,
    longest_elsewhere: usize,
) -> Result<(), TrainError> {
    let (longest, _) = longest_first_prompt(tokenizer, questions.iter().copied(), episode)?;
    let longest = longest.max(longest_elsewhere);
    let needed = model::decode::positions_to_hold(longest + episode.max_response_tokens + 1);
    if budget < needed {
        return Err(TrainError::Invalid(format!(
            "rollout.kv_budget holds {budget} KV positions, but one episode may need {needed}: its \
             {longest}-token first prompt plus episode.max_response_tokens = {} (in blocks of \
             {}, with the cache's scratch block); raise rollout.kv_budget or lower episode.max_response_tokens",
            episode.max_response_tokens,
            model::qwen3::BLOCK_SIZE
        )));
    }
    Ok(())
}

/// The most tokens a first prompt of `questions` takes (each distinct question tokenised once: a
/// GRPO group repeats its question `n` times), with that question; `(0, "")` for none.
pub(crate) fn longest_first_prompt<'q>(
    tokenizer: &Qwen3Tokenizer,
    questions: impl IntoIterator<Item = &'q str>,
    episode: &EpisodeConfig,
) -> Result<(usize, &'q str), TrainError> {
    let distinct: std::collections::BTreeSet<&str> = questions.into_iter().collect();
    let mut longest = (0, "");
    for question in distinct {
        let tokens = tokenizer.encode(&episode.prompts.first_prompt(question).chatml())?.len();
        if tokens > longest.0 {
            longest = (tokens, question);
        }
    }
    Ok(longest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};

    /// A budget that cannot hold the longest episode alone is refused, naming the key and the
    /// positions; one that can is accepted.
    #[test]
    fn a_kv_budget_below_one_episode_is_refused_before_any_episode() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let episode = EpisodeConfig { max_response_tokens: 64, ..EpisodeConfig::default() };
        let questions = ["Paris?", "Which river runs through the capital of France, and how long is it?"];
        let longest = questions
            .iter()
            .map(|q| tokenizer.encode(&episode.prompts.first_prompt(q).chatml()).unwrap().len())
            .max()
            .unwrap();
        let needed = model::decode::positions_to_hold(longest + 64 + 1);
        let err = check_budget_holds_an_episode(needed - 1, &tokenizer, &questions, &episode, 0).unwrap_err().to_string();
        assert!(err.contains("rollout.kv_budget") && err.contains(&needed.to_string()) && err.contains(&format!("{longest}-token")), "{err}");
        assert!(check_budget_holds_an_episode(needed, &tokenizer, &questions, &episode, 0).is_ok());
    }
}

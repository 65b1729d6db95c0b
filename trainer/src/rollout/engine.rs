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
}

/// What an engine reports about a rollout besides its trajectories.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RolloutStats {
    /// The local decoder's counters (prefill tokens, peak KV positions, preemptions); zero for
    /// engines that decode elsewhere.
    pub decoder: DecoderStats,
    /// Turns sent again to another worker after one failed (`rollout/server_retries`).
    pub server_retries: u64,
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

/// Rollouts on the trainer's own device: the [`LocalAgent`] decoding `generation_batch`
/// episodes at a time within the decoder limits of `[rollout]`.
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

    /// Runs one episode per question, `generation_batch` at a time, and counts the tokens run
    /// through prefill, the peak KV positions and the preemptions. Every episode samples from
    /// its own stream of `sampling.seed`, `stream` and its place among the questions, so
    /// `generation_batch` changes how fast, not what.
    fn rollouts(&mut self, batch: RolloutBatch<'_, B>) -> Result<(Vec<Trajectory>, RolloutStats), TrainError> {
        let model = batch.policy;
        // The cache holds keys and values in the dtype of the weights the rollouts run on.
        let cache_dtype = model.base.model.embed_tokens.weight.val().dtype();
        let limits = self.rollout.decoder_limits(&model.base.config, cache_dtype)?;
        let mut agent = LocalAgent::new(model.base, batch.tokenizer, batch.sampling.clone())
            .with_adapters(model.adapters)
            .with_limits(limits);
        let mut out = Vec::with_capacity(batch.questions.len());
        agent.set_batch_stream(batch.stream);
        let generation_batch = self.rollout.generation_batch.max(1);
        for (c, chunk) in batch.questions.chunks(generation_batch).enumerate() {
            agent.set_episode_offset(c * generation_batch);
            out.extend(env::run_episodes(&mut agent, batch.env, chunk, batch.episode));
        }
        Ok((out, RolloutStats { decoder: agent.decoder_stats(), server_retries: 0 }))
    }

    /// Nothing to do: every rollout samples from the policy it is handed.
    fn policy_changed(&mut self, _step: u64, _policy: LoraModel<'_, B>) -> Result<(), TrainError> {
        Ok(())
    }
}

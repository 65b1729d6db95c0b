//! The GRPO learning step on prepared sequences, independent of how they were collected: one
//! pass over the batch in mini-batches (one optimiser step each), every mini-batch split into
//! micro-batches whose gradients are accumulated so that the step sees exactly the gradient of
//! the whole mini-batch's loss. What is trained is the whole model ([`learn_step`]) or LoRA
//! adapters beside a frozen base ([`learn_step_lora`]), by one code path ([`Trainable`]).

use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::{backend::AutodiffBackend, backend::Backend, Tensor, TensorData};
use model::lora::CausalLm;
use model::{
    last_hidden_state, LoraAdapters, LoraModel, MatmulPrecision, Padding,
    Qwen3ForCausalLM, TokenBatch,
};
use serde::{Deserialize, Serialize};

use super::batch::{PolicyBatch, PolicySequence};
use super::checkpointing::checkpointed_gradients;
use super::head::head_gradients;
use super::error::GrpoError;
use super::loss::{grpo_loss, GrpoLossConfig, LossInputs, LossStats};
use super::policy_loss::{PolicyLossStats, TokenWeighted};
use crate::optim::{clip_and_step, OptimizerConfig, StepOutcome};

/// Padding fills short rows of a micro-batch; it is hidden by the attention mask and the loss
/// mask, so any in-vocabulary id does.
const PAD_ID: u32 = 0;

/// Settings of [`learn_step`]. Sizes count sequences (episodes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LearnConfig {
    /// Sequences per optimiser step (the reference run: 64).
    pub mini_batch_size: usize,
    /// Sequences per forward/backward pass; bounds activation memory, not the result.
    pub micro_batch_size: usize,
    /// Compute the policy's entropy for the statistics even when `entropy_coef` is 0 (without
    /// gradients; costs one more pass over each chunk of logits).
    pub track_entropy: bool,
    /// The precision of the policy's f32 matrix products in the update: `f32`, or `bf16`
    /// (operands rounded to bf16, f32 sums; f32 weights, gradients and optimiser state). The
    /// trainer scores the old log-probs at the same precision, so a step's first ratio is 1.
    pub matmul: MatmulPrecision,
    /// Keep only each decoder layer's input in the forward pass and recompute the layer in
    /// the backward pass (the same gradients, one more forward pass of compute, a fraction of
    /// the activation memory; see [`super::checkpointing`]).
    pub activation_checkpointing: bool,
    pub loss: GrpoLossConfig,
    pub optimizer: OptimizerConfig,
}

impl Default for LearnConfig {
    fn default() -> Self {
        Self {
            mini_batch_size: 64,
            micro_batch_size: 8,
            track_entropy: true,
            matmul: MatmulPrecision::F32,
            activation_checkpointing: false,
            loss: GrpoLossConfig::default(),
            optimizer: OptimizerConfig::default(),
        }
    }
}

impl LearnConfig {
    /// Both sizes at least 1, and the loss and optimiser settings in range.
    pub fn validate(&self) -> Result<(), GrpoError> {
        if self.mini_batch_size == 0 || self.micro_batch_size == 0 {
            return Err(GrpoError::Config(format!(
                "mini_batch_size ({}) and micro_batch_size ({}) must be at least 1",
                self.mini_batch_size, self.micro_batch_size
            )));
        }
        self.loss.validate()?;
        self.optimizer.validate()?;
        Ok(())
    }
}

/// What one learning step did. Loss terms are means over mini-batches of each mini-batch's
/// aggregated value; the `policy` statistics (clip fractions, `approx_kl`) are means over all
/// agent tokens (and read as fields of the step's stats too: `stats.clip_frac`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepStats {
    pub loss: f32,
    pub pg_loss: f32,
    /// `None` when the KL term is off.
    pub kl: Option<f32>,
    /// `None` when the entropy was not computed.
    pub entropy: Option<f32>,
    pub policy: PolicyLossStats,
    /// The gradient norm before clipping, one per mini-batch that had agent tokens.
    pub grad_norms: Vec<f32>,
    /// Optimiser steps applied.
    pub optimizer_steps: usize,
    /// Mini-batches whose gradient norm was not finite (no update).
    pub skipped_steps: usize,
    /// Applied steps whose gradient was scaled down to the clip norm.
    pub clipped_steps: usize,
    /// Agent tokens and sequences in the batch.
    pub n_tokens: usize,
    pub n_sequences: usize,
}

impl StepStats {
    /// Mean of the finite gradient norms (`None` if there are none).
    pub fn mean_grad_norm(&self) -> Option<f32> {
        let finite: Vec<f32> = self
            .grad_norms
            .iter()
            .copied()
            .filter(|n| n.is_finite())
            .collect();
        (!finite.is_empty()).then(|| finite.iter().sum::<f32>() / finite.len() as f32)
    }
}

/// What a learning step trains: the whole model, or LoRA adapters beside a frozen base. Either
/// way the loss, micro-batching, clipping and optimiser step are the same code; only the
/// parameters that get gradients (and optimiser state) differ.
pub trait Trainable<B: AutodiffBackend>: AutodiffModule<B> {
    /// What stays fixed beside it: nothing for the whole model, the base for adapters.
    type Frozen;
    /// The policy whose loss is minimised: this module with `frozen`.
    fn policy<'a>(&'a self, frozen: &'a Self::Frozen) -> LoraModel<'a, B>;
}

impl<B: AutodiffBackend> Trainable<B> for Qwen3ForCausalLM<B> {
    type Frozen = ();

    fn policy<'a>(&'a self, _: &'a ()) -> LoraModel<'a, B> {
        LoraModel::new(self, None)
    }
}

impl<B: AutodiffBackend> Trainable<B> for LoraAdapters<B> {
    type Frozen = Qwen3ForCausalLM<B>;

    fn policy<'a>(&'a self, base: &'a Qwen3ForCausalLM<B>) -> LoraModel<'a, B> {
        LoraModel::new(base, Some(self))
    }
}

/// One GRPO update of `model` (every weight) on `batch`, its products at `config.matmul`;
/// see [`learn`] for the step itself.
pub fn learn_step<B, O>(
    model: Qwen3ForCausalLM<B>,
    optimizer: &mut O,
    batch: &PolicyBatch,
    config: &LearnConfig,
) -> Result<(Qwen3ForCausalLM<B>, StepStats), GrpoError>
where
    B: AutodiffBackend,
    O: Optimizer<Qwen3ForCausalLM<B>, B>,
{
    learn(
        model.with_matmul_precision(config.matmul),
        &(),
        optimizer,
        batch,
        config,
    )
}

/// One GRPO update of LoRA `adapters` beside `base` on `batch`: only the adapters get
/// gradients and optimiser state; the base (any dtype) is used with no gradient whatever its
/// parameters' setting, its products at `config.matmul`. See [`learn`] for the step itself.
pub fn learn_step_lora<B, O>(
    base: &Qwen3ForCausalLM<B>,
    adapters: LoraAdapters<B>,
    optimizer: &mut O,
    batch: &PolicyBatch,
    config: &LearnConfig,
) -> Result<(LoraAdapters<B>, StepStats), GrpoError>
where
    B: AutodiffBackend,
    O: Optimizer<LoraAdapters<B>, B>,
{
    let base = base.clone().no_grad().with_matmul_precision(config.matmul);
    learn(adapters, &base, optimizer, batch, config)
}

/// One GRPO update of `module` (within `frozen`) on `batch`: the sequences are taken in order (shuffle before if
/// wanted), `mini_batch_size` at a time, one epoch. Each mini-batch's loss is the aggregate of
/// [`grpo_loss`] over all its agent tokens; it is evaluated `micro_batch_size` sequences at a
/// time, each micro-batch's loss weighted by its share of the mini-batch's aggregation
/// denominator ([`super::aggregate::AggMode::denominator`]: agent tokens for token-mean), and
/// the gradients summed. The sum is clipped to the global norm and applied, or skipped when
/// its norm is not finite. Mini-batches without agent tokens are passed over.
///
/// Errors (bad settings, token ids outside the vocabulary, missing reference log-probs with the
/// KL term on) are detected before the first forward pass.
pub fn learn<B, M, O>(
    mut module: M,
    frozen: &M::Frozen,
    optimizer: &mut O,
    batch: &PolicyBatch,
    config: &LearnConfig,
) -> Result<(M, StepStats), GrpoError>
where
    B: AutodiffBackend,
    M: Trainable<B>,
    O: Optimizer<M, B>,
{
    let _autodiff = crate::autodiff_lock::exclusive_autodiff();
    config.validate()?;
    if config.loss.uses_kl() && !batch.has_ref_logprobs() {
        return Err(GrpoError::Input(
            "kl_coef ≠ 0 but some sequences have no reference log-probs".into(),
        ));
    }
    for s in batch.sequences() {
        module.policy(frozen).base.check_token_ids(&s.tokens)?;
    }
    let mode = config.loss.agg_mode;
    let mut totals = Totals::default();
    for mini in batch.sequences().chunks(config.mini_batch_size) {
        let mini_units = mode.denominator(mini.iter().map(PolicySequence::n_agent_tokens));
        if mini_units == 0 {
            continue;
        }
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut mini_terms = Terms::default();
        for micro in mini.chunks(config.micro_batch_size) {
            let units = mode.denominator(micro.iter().map(PolicySequence::n_agent_tokens));
            if units == 0 {
                continue;
            }
            let weight = units as f32 / mini_units as f32;
            let policy = module.policy(frozen);
            let stats = if config.activation_checkpointing {
                let (grads, stats) = checkpointed_gradients(&policy, &module, micro, weight, config)?;
                accumulator.accumulate(&module, grads);
                stats
            } else {
                let base = policy.base();
                let batch = token_batch(micro, &base.device())?;
                let hidden = last_hidden_state(&policy, &batch);
                let head = head_gradients(base, &module, &hidden, &batch, micro, weight, config)?;
                // The decoder's backward pass from the head's gradient at its output.
                let grads = (hidden * head.hidden_grad).sum().backward();
                accumulator.accumulate(&module, GradientsParams::from_grads(grads, &module));
                accumulator.accumulate(&module, head.grads);
                head.stats
            };
            mini_terms.add(&stats, weight);
            totals.add_tokens(&stats);
        }
        let (next, outcome) = clip_and_step(
            optimizer,
            config.optimizer.lr,
            module,
            accumulator.grads(),
            config.optimizer.grad_clip,
        );
        module = next;
        totals.add_mini_batch(mini_terms, outcome);
    }
    Ok((module, totals.finish(batch)))
}

/// The micro-batch's sequences as one right-padded batch.
pub(super) fn token_batch<B: Backend>(
    micro: &[PolicySequence],
    device: &B::Device,
) -> Result<TokenBatch<B>, GrpoError> {
    let tokens: Vec<Vec<u32>> = micro.iter().map(|s| s.tokens.clone()).collect();
    Ok(TokenBatch::new(&tokens, Padding::Right, PAD_ID, device)?)
}

/// The loss of one micro-batch from its tokens' log-probs `logp` and, when computed, the
/// entropies `entropy` (both `[b, len − 1]`, column `j` for token `j + 1` of `micro`'s
/// right-padded batch of `len` tokens): [`grpo_loss`] over the agent tokens.
pub(super) fn loss_from_logprobs<B: Backend>(
    logp: Tensor<B, 2>,
    entropy: Option<Tensor<B, 2>>,
    micro: &[PolicySequence],
    config: &LearnConfig,
) -> Result<(Tensor<B, 1>, LossStats), GrpoError> {
    let device = logp.device();
    let grid = TokenGrid {
        sequences: micro,
        width: logp.dims()[1],
        device: &device,
    };
    let inputs = LossInputs {
        logp,
        old_logp: grid.agent_values(|s, t| s.old_logprobs[t]),
        ref_logp: config
            .loss
            .uses_kl()
            .then(|| grid.agent_values(|s, t| s.ref_logprobs.as_ref().map_or(0.0, |r| r[t]))),
        advantages: grid.agent_values(|s, _| s.advantage),
        mask: grid.agent_values(|_, _| 1.0),
        entropy,
    };
    grpo_loss(inputs, &config.loss)
}

/// Builds `[b, width]` tensors whose column `j` is token `j + 1` of each sequence, as
/// [`model::token_logprobs`] with `start = 1` lays out its result.
struct TokenGrid<'a, B: Backend> {
    sequences: &'a [PolicySequence],
    width: usize,
    device: &'a B::Device,
}

impl<B: Backend> TokenGrid<'_, B> {
    /// `value(s, t)` at agent tokens, 0 everywhere else (so nothing stored at prompt,
    /// environment or padding positions can reach the loss).
    fn agent_values(&self, value: impl Fn(&PolicySequence, usize) -> f32) -> Tensor<B, 2> {
        let mut data = vec![0.0f32; self.sequences.len() * self.width];
        for (i, s) in self.sequences.iter().enumerate() {
            for t in 1..s.tokens.len() {
                if s.loss_mask[t] == 1 {
                    data[i * self.width + t - 1] = value(s, t);
                }
            }
        }
        Tensor::from_data(
            TensorData::new(data, [self.sequences.len(), self.width]),
            self.device,
        )
    }
}

/// Loss terms of one mini-batch: the weighted sum of its micro-batches' terms.
#[derive(Default)]
struct Terms {
    loss: f32,
    pg_loss: f32,
    kl: Option<f32>,
    entropy: Option<f32>,
}

impl Terms {
    fn add(&mut self, stats: &LossStats, weight: f32) {
        self.loss += weight * stats.loss;
        self.pg_loss += weight * stats.pg_loss;
        let add = |acc: &mut Option<f32>, v: Option<f32>| {
            if let Some(v) = v {
                *acc = Some(acc.unwrap_or(0.0) + weight * v);
            }
        };
        add(&mut self.kl, stats.kl);
        add(&mut self.entropy, stats.entropy);
    }
}

/// Running sums for [`StepStats`].
#[derive(Default)]
struct Totals {
    mini_batches: Vec<Terms>,
    policy: TokenWeighted,
    outcomes: Vec<StepOutcome>,
}

impl Totals {
    fn add_tokens(&mut self, stats: &LossStats) {
        self.policy.add(&stats.policy, stats.n_tokens);
    }

    fn add_mini_batch(&mut self, terms: Terms, outcome: StepOutcome) {
        self.mini_batches.push(terms);
        self.outcomes.push(outcome);
    }

    fn finish(self, batch: &PolicyBatch) -> StepStats {
        let n = self.mini_batches.len().max(1) as f32;
        let mean = |f: fn(&Terms) -> f32| self.mini_batches.iter().map(f).sum::<f32>() / n;
        let mean_opt = |f: fn(&Terms) -> Option<f32>| {
            let values: Vec<f32> = self.mini_batches.iter().filter_map(f).collect();
            (!values.is_empty()).then(|| values.iter().sum::<f32>() / values.len() as f32)
        };
        StepStats {
            loss: mean(|t| t.loss),
            pg_loss: mean(|t| t.pg_loss),
            kl: mean_opt(|t| t.kl),
            entropy: mean_opt(|t| t.entropy),
            policy: self.policy.mean(),
            grad_norms: self.outcomes.iter().map(StepOutcome::grad_norm).collect(),
            optimizer_steps: self.outcomes.iter().filter(|o| !o.is_skipped()).count(),
            skipped_steps: self.outcomes.iter().filter(|o| o.is_skipped()).count(),
            clipped_steps: self
                .outcomes
                .iter()
                .filter(|o| matches!(o, StepOutcome::Applied { clipped: true, .. }))
                .count(),
            n_tokens: batch.n_agent_tokens(),
            n_sequences: batch.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpo::aggregate::AggMode;

    #[test]
    fn config_defaults_and_nested_sections() {
        let c: LearnConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, LearnConfig::default());
        assert_eq!((c.mini_batch_size, c.micro_batch_size), (64, 8));
        let c: LearnConfig = serde_json::from_str(
            r#"{"micro_batch_size": 2, "loss": {"kl_coef": 0.0, "agg_mode": "seq-mean-token-mean"},
                "optimizer": {"lr": 1e-5}}"#,
        )
        .unwrap();
        assert_eq!(
            (c.micro_batch_size, c.loss.kl_coef, c.optimizer.lr),
            (2, 0.0, 1e-5)
        );
        assert_eq!(
            (c.loss.agg_mode, c.optimizer.eps),
            (AggMode::SeqMeanTokenMean, 1e-8)
        );
        assert!(c.validate().is_ok());
        assert!(serde_json::from_str::<LearnConfig>(r#"{"epochs": 2}"#).is_err());
    }

    #[test]
    fn validation_covers_sizes_and_sections() {
        let zero = LearnConfig {
            mini_batch_size: 0,
            ..Default::default()
        };
        assert!(zero.validate().is_err());
        let mut bad_loss = LearnConfig::default();
        bad_loss.loss.dual_clip = 0.5;
        assert!(matches!(bad_loss.validate(), Err(GrpoError::Config(_))));
        let mut bad_optim = LearnConfig::default();
        bad_optim.optimizer.eps = -1.0;
        assert!(matches!(bad_optim.validate(), Err(GrpoError::Optimizer(_))));
    }

    #[test]
    fn mean_grad_norm_ignores_skipped_steps() {
        let stats = StepStats {
            grad_norms: vec![1.0, f32::NAN, 3.0],
            ..Default::default()
        };
        assert_eq!(stats.mean_grad_norm(), Some(2.0));
        assert_eq!(StepStats::default().mean_grad_norm(), None);
    }
}

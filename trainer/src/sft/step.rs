//! One SFT optimiser step on a batch of sequences, micro-batch by micro-batch with the
//! gradients accumulated, and the held-out loss without autodiff.

use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use model::lora::CausalLm;
use model::{token_logprobs, Padding, TokenBatch};

use super::data::SftSequence;
use super::loss::nll_loss;
use crate::grpo::Trainable;
use crate::optim::{clip_and_step, StepOutcome};
use crate::run::TrainError;

/// Padding fills short rows of a micro-batch; the attention and loss masks hide it, so any
/// in-vocabulary id does.
const PAD_ID: u32 = 0;

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SftStepStats {
    /// The batch's mean NLL per trained token, before the update.
    pub loss: f32,
    /// Applied (with the gradient norm before clipping) or skipped (a non-finite norm).
    pub outcome: StepOutcome,
    /// Trained tokens and sequences in the batch.
    pub tokens: usize,
    pub sequences: usize,
}

/// One AdamW step of `model` (the whole model, or LoRA adapters beside the frozen base
/// `frozen`: see [`Trainable`]) on `batch` at learning rate `lr`: the loss is [`nll_loss`] over
/// all the batch's trained tokens, evaluated `micro_batch_size` sequences at a time, each
/// micro-batch's loss weighted by its share of the batch's trained tokens and the gradients
/// summed (so the step sees exactly the whole batch's gradient); clipped to the global norm
/// `grad_clip`, or skipped when that norm is not finite ([`clip_and_step`]).
pub fn sft_step<B, M, O>(
    model: M,
    frozen: &M::Frozen,
    optimizer: &mut O,
    batch: &[SftSequence],
    micro_batch_size: usize,
    lr: f64,
    grad_clip: f32,
) -> Result<(M, SftStepStats), TrainError>
where
    B: AutodiffBackend,
    M: Trainable<B>,
    O: Optimizer<M, B>,
{
    let _autodiff = crate::autodiff_lock::exclusive_autodiff();
    let tokens: usize = batch.iter().map(SftSequence::n_loss_tokens).sum();
    if tokens == 0 || micro_batch_size == 0 {
        return Err(TrainError::Invalid(
            "an SFT step needs trained tokens and a micro-batch size of at least 1".into(),
        ));
    }
    for s in batch {
        model.policy(frozen).base.check_token_ids(&s.tokens)?;
    }
    let mut accumulator = GradientsAccumulator::<M>::new();
    let mut loss_sum = 0.0f64;
    for micro in batch.chunks(micro_batch_size) {
        let units: usize = micro.iter().map(SftSequence::n_loss_tokens).sum();
        if units == 0 {
            continue;
        }
        let weight = units as f32 / tokens as f32;
        let loss = micro_batch_loss(&model.policy(frozen), micro)?;
        loss_sum += f64::from(loss.clone().into_scalar().elem::<f32>()) * units as f64;
        let grads = loss.mul_scalar(weight).backward();
        accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
    }
    let (model, outcome) = clip_and_step(optimizer, lr, model, accumulator.grads(), grad_clip);
    let stats = SftStepStats {
        loss: (loss_sum / tokens as f64) as f32,
        outcome,
        tokens,
        sequences: batch.len(),
    };
    Ok((model, stats))
}

/// The mean NLL per trained token of `sequences` under `model` (a model, or a base with
/// adapters; run it on the plain backend, `valid()`, so no autodiff graph is built),
/// `micro_batch_size` sequences at a time. `None` when they hold no trained token.
pub fn validation_loss<B: Backend>(
    model: &impl CausalLm<B>,
    sequences: &[SftSequence],
    micro_batch_size: usize,
) -> Result<Option<f32>, TrainError> {
    let mut sum = 0.0f64;
    let mut tokens = 0usize;
    for micro in sequences.chunks(micro_batch_size.max(1)) {
        let units: usize = micro.iter().map(SftSequence::n_loss_tokens).sum();
        if units == 0 {
            continue;
        }
        for s in micro {
            model.base().check_token_ids(&s.tokens)?;
        }
        let loss: f32 = micro_batch_loss(model, micro)?.into_scalar().elem();
        sum += f64::from(loss) * units as f64;
        tokens += units;
    }
    Ok((tokens > 0).then(|| (sum / tokens as f64) as f32))
}

/// The loss of one micro-batch, averaged over its own trained tokens.
fn micro_batch_loss<B: Backend>(
    model: &impl CausalLm<B>,
    micro: &[SftSequence],
) -> Result<Tensor<B, 1>, TrainError> {
    let device = model.base().device();
    let ids: Vec<Vec<u32>> = micro.iter().map(|s| s.tokens.clone()).collect();
    let batch = TokenBatch::<B>::new(&ids, Padding::Right, PAD_ID, &device)?;
    let logp = token_logprobs(model, &batch, 1)?;
    // Column j predicts token j + 1, as `token_logprobs` lays out its result.
    let width = batch.len - 1;
    let mut mask = vec![0.0f32; micro.len() * width];
    for (i, s) in micro.iter().enumerate() {
        for (t, &m) in s.loss_mask.iter().enumerate().skip(1) {
            mask[i * width + t - 1] = f32::from(m);
        }
    }
    let mask = Tensor::from_data(TensorData::new(mask, [micro.len(), width]), &device);
    Ok(nll_loss(logp, mask))
}

//! One SFT optimiser step on a batch of sequences, micro-batch by micro-batch with the
//! gradients accumulated, and the held-out loss without autodiff.

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use model::{ModelError, Padding, Qwen3ForCausalLM, TokenBatch};

use super::data::SftSequence;
use super::loss::nll_loss;
use crate::optim::{clip_and_step, StepOutcome};
use crate::run::TrainError;

/// Padding fills short rows of a micro-batch; the attention and loss masks hide it, so any
/// in-vocabulary id does.
const PAD_ID: u32 = 0;

/// What SFT trains: a module that scores tokens. The Qwen3 model implements it (full
/// fine-tuning); a model with LoRA adapters, the adapters being the trained parameters, is
/// meant to implement it too, so that [`sft_step`] and [`validation_loss`] serve both.
pub trait TokenScorer<B: Backend> {
    /// `out[b, j] = log p(ids[b, j + 1] | ids[b, ..=j])` for a right-padded batch (values at
    /// padding are meaningless); under autodiff, differentiable in the trained parameters.
    fn token_logprobs(&self, batch: &TokenBatch<B>) -> Result<Tensor<B, 2>, ModelError>;
    /// An error naming the first id outside the vocabulary.
    fn check_token_ids(&self, ids: &[u32]) -> Result<(), ModelError>;
    /// Where the module's tensors live.
    fn device(&self) -> B::Device;
}

impl<B: Backend> TokenScorer<B> for Qwen3ForCausalLM<B> {
    fn token_logprobs(&self, batch: &TokenBatch<B>) -> Result<Tensor<B, 2>, ModelError> {
        model::token_logprobs(self, batch, 1)
    }

    fn check_token_ids(&self, ids: &[u32]) -> Result<(), ModelError> {
        Qwen3ForCausalLM::check_token_ids(self, ids)
    }

    fn device(&self) -> B::Device {
        Qwen3ForCausalLM::device(self)
    }
}

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

/// One AdamW step of `model` on `batch` at learning rate `lr`: the loss is [`nll_loss`] over
/// all the batch's trained tokens, evaluated `micro_batch_size` sequences at a time, each
/// micro-batch's loss weighted by its share of the batch's trained tokens and the gradients
/// summed (so the step sees exactly the whole batch's gradient); clipped to the global norm
/// `grad_clip`, or skipped when that norm is not finite ([`clip_and_step`]).
pub fn sft_step<B, M, O>(
    model: M,
    optimizer: &mut O,
    batch: &[SftSequence],
    micro_batch_size: usize,
    lr: f64,
    grad_clip: f32,
) -> Result<(M, SftStepStats), TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + TokenScorer<B>,
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
        model.check_token_ids(&s.tokens)?;
    }
    let mut accumulator = GradientsAccumulator::<M>::new();
    let mut loss_sum = 0.0f64;
    for micro in batch.chunks(micro_batch_size) {
        let units: usize = micro.iter().map(SftSequence::n_loss_tokens).sum();
        if units == 0 {
            continue;
        }
        let weight = units as f32 / tokens as f32;
        let loss = micro_batch_loss(&model, micro)?;
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

/// The mean NLL per trained token of `sequences` (run it on the plain backend, `model.valid()`,
/// so no autodiff graph is built), `micro_batch_size` sequences at a time. `None` when they
/// hold no trained token.
pub fn validation_loss<B: Backend, M: TokenScorer<B>>(
    model: &M,
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
            model.check_token_ids(&s.tokens)?;
        }
        let loss: f32 = micro_batch_loss(model, micro)?.into_scalar().elem();
        sum += f64::from(loss) * units as f64;
        tokens += units;
    }
    Ok((tokens > 0).then(|| (sum / tokens as f64) as f32))
}

/// The loss of one micro-batch, averaged over its own trained tokens.
fn micro_batch_loss<B: Backend, M: TokenScorer<B>>(
    model: &M,
    micro: &[SftSequence],
) -> Result<Tensor<B, 1>, TrainError> {
    let device = model.device();
    let ids: Vec<Vec<u32>> = micro.iter().map(|s| s.tokens.clone()).collect();
    let batch = TokenBatch::<B>::new(&ids, Padding::Right, PAD_ID, &device)?;
    let logp = model.token_logprobs(&batch)?;
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

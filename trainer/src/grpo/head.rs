//! The update's language-model head, a chunk of positions at a time in the backward pass too:
//! no phase holds `[tokens, vocab]` logits.
//!
//! Recorded as one graph, the head's chunks would each keep their logits-sized tensors until the
//! backward pass (for a micro-batch of 8 × 9,216 tokens of Qwen3 that is 42 GiB in f32). Here the
//! chain rule is applied at the final hidden states `h` instead:
//!
//! 1. the tokens' log-probs and entropies, chunk by chunk, with no graph;
//! 2. the loss from them as leaves: its backward gives `∂loss/∂logp` and `∂loss/∂H` per token,
//!    and the loss's statistics;
//! 3. per chunk, the head again with a graph from a leaf slice of `h`, and the backward of
//!    `Σ logp·∂loss/∂logp + Σ H·∂loss/∂H` (a vector-Jacobian product): the head's weight
//!    gradients and `∂loss/∂h` for the chunk's positions.
//!
//! The caller then runs the decoder's backward pass from `h` with `∂loss/∂h` (the backward of
//! `Σ h ⊙ ∂loss/∂h`). The gradients are those of the same loss up to the order of f32 sums; the
//! log-probs are computed by the same code as before (the chosen-token kernels included), so the
//! first PPO ratio stays exactly 1. The price is the head's product once more.

use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use model::logprobs::{chosen_logprobs, logits_chunks};
use model::{token_logprobs_from_hidden, Qwen3ForCausalLM, TokenBatch};

use super::batch::PolicySequence;
use super::entropy::{chunk_logprobs_and_entropy, token_logprobs_and_entropy_from_hidden, EntropyGrad};
use super::error::GrpoError;
use super::loss::LossStats;
use super::step::{loss_from_logprobs, LearnConfig};

/// What the head's pass gives the rest of the backward pass.
pub struct HeadPass<B: AutodiffBackend> {
    /// The gradients of `module`'s parameters in the head (the embedding or `lm_head` when
    /// they are trained; none for LoRA adapters).
    pub grads: GradientsParams,
    /// `∂(weight · loss)/∂h`, `[b, len, hidden]`, no graph.
    pub hidden_grad: Tensor<B, 3>,
    pub stats: LossStats,
}

/// The head's part of `weight · loss(micro)` from the final hidden states `hidden` of `batch`
/// (see the module docs). `hidden` may carry a graph; it is not consumed.
pub fn head_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &Qwen3ForCausalLM<B>,
    module: &M,
    hidden: &Tensor<B, 3>,
    batch: &TokenBatch<B>,
    micro: &[PolicySequence],
    weight: f32,
    config: &LearnConfig,
) -> Result<HeadPass<B>, GrpoError> {
    let values = hidden.clone().detach();
    // Whether the loss takes the entropy's gradient (an entropy bonus), not only its value.
    let entropy_in_loss = config.loss.uses_entropy();

    // 1. The log-probs and entropies, with no graph (the head's weights frozen for the pass).
    let frozen = model.clone().no_grad();
    let (logp, entropy) = if entropy_in_loss || config.track_entropy {
        let (logp, entropy) = token_logprobs_and_entropy_from_hidden(&frozen, values.clone(), batch, 1, EntropyGrad::Detached)?;
        (logp, Some(entropy))
    } else {
        (token_logprobs_from_hidden(&frozen, values.clone(), batch, 1)?, None)
    };

    // 2. The loss from them as leaves.
    let logp = logp.detach().require_grad();
    let entropy = entropy.map(|e| if entropy_in_loss { e.detach().require_grad() } else { e.detach() });
    let (loss, stats) = loss_from_logprobs(logp.clone(), entropy.clone(), micro, config)?;
    let grads = loss.mul_scalar(weight).backward();
    let logp_grad = logp.grad(&grads).map(Tensor::from_inner);
    let entropy_grad = entropy.as_ref().filter(|_| entropy_in_loss).and_then(|e| e.grad(&grads)).map(Tensor::from_inner);
    drop(grads);

    // 3. The head again, chunk by chunk, as a vector-Jacobian product with those gradients.
    let [b, len, width] = values.dims();
    let (device, dtype) = (values.device(), values.dtype());
    let mut accumulator = GradientsAccumulator::<M>::new();
    let mut pieces = Vec::new();
    let mut covered = 0;
    let chunks = if logp_grad.is_some() || entropy_grad.is_some() {
        logits_chunks(b, model.config.vocab_size, 1, len)
    } else {
        Vec::new()
    };
    for (from, to) in chunks {
        let leaf = values.clone().narrow(1, from, to - from).require_grad();
        let targets = batch.input_ids.clone().narrow(1, from + 1, to - from);
        let logits = model.logits(leaf.clone());
        let (chunk_logp, chunk_entropy) = if entropy_in_loss {
            let (lp, h) = chunk_logprobs_and_entropy(model.compute().cpu_kernels, logits, targets, EntropyGrad::Tracked);
            (lp, Some(h))
        } else {
            (chosen_logprobs(model.compute().cpu_kernels, logits, targets), None)
        };
        let slice = |g: &Tensor<B, 2>| g.clone().narrow(1, from, to - from);
        let terms = [
            logp_grad.as_ref().map(|g| (chunk_logp * slice(g)).sum()),
            chunk_entropy.zip(entropy_grad.as_ref()).map(|(h, g)| (h * slice(g)).sum()),
        ];
        let product = terms.into_iter().flatten().reduce(|a, b| a + b).expect("a gradient to follow");
        let mut grads = product.backward();
        let piece = leaf.grad(&grads).map(Tensor::<B, 3>::from_inner);
        pieces.push(piece.unwrap_or_else(|| Tensor::zeros([b, to - from, width], (&device, dtype))));
        accumulator.accumulate(module, GradientsParams::from_module(&mut grads, module));
        covered = to;
    }
    if covered < len {
        // The last position predicts nothing.
        pieces.push(Tensor::zeros([b, len - covered, width], (&device, dtype)));
    }
    let hidden_grad = Tensor::cat(pieces, 1);
    Ok(HeadPass { grads: accumulator.grads(), hidden_grad, stats })
}

//! Per-token log-probabilities of given tokens, the quantity GRPO's ratios and KL are built from.
//! Logits are formed a chunk of positions at a time and reduced at once to
//! `logit[chosen] - logsumexp(logits)`, so a full `[b, len, vocab]` log-softmax never exists.

use burn::tensor::{backend::Backend, DType, Int, Tensor};
use cpu_kernels::Kernels;

use crate::batch::{Padding, TokenBatch};
use crate::error::ModelError;
use crate::lora::CausalLm;
use crate::qwen3::Qwen3ForCausalLM;

/// Upper bound on the logits materialised at once (elements), 512 MiB in f32.
pub const LOGITS_CHUNK_ELEMENTS: usize = 128 * 1024 * 1024;

/// `out[b, j] = log p(ids[b, start + j] | ids[b, ..start + j])` for `j in 0..len - start`, for a
/// right-padded batch (values at padding are meaningless; mask them). Works under autodiff.
/// `model` is a Qwen3 model, or a base with LoRA adapters ([`crate::LoraModel`]).
pub fn token_logprobs<B: Backend>(
    model: &impl CausalLm<B>,
    batch: &TokenBatch<B>,
    start: usize,
) -> Result<Tensor<B, 2>, ModelError> {
    let kernels = model.base().compute().cpu_kernels;
    let pieces = map_logits_chunks(model, batch, start, |logits, targets| chosen_logprobs(kernels, logits, targets))?;
    Ok(Tensor::cat(pieces, 1))
}

/// [`token_logprobs`] from the decoder's final hidden states `[b, len, hidden]` of `batch` (the
/// output of `model.model`, final norm included), for callers that ran the decoder themselves.
pub fn token_logprobs_from_hidden<B: Backend>(
    model: &Qwen3ForCausalLM<B>,
    hidden: Tensor<B, 3>,
    batch: &TokenBatch<B>,
    start: usize,
) -> Result<Tensor<B, 2>, ModelError> {
    let kernels = model.compute().cpu_kernels;
    let pieces = map_hidden_chunks(model, hidden, batch, start, |logits, targets| chosen_logprobs(kernels, logits, targets))?;
    Ok(Tensor::cat(pieces, 1))
}

/// Runs the decoder once over a right-padded batch and hands `f` the logits that predict tokens
/// `start..len`, a chunk of positions at a time, with those tokens: `f(logits [b, c, vocab],
/// targets [b, c])`. Returns `f`'s results in position order. Only one chunk's logits exist at a
/// time outside autodiff (under autodiff, whatever `f` keeps for backward stays alive).
pub fn map_logits_chunks<B: Backend, T>(
    model: &impl CausalLm<B>,
    batch: &TokenBatch<B>,
    start: usize,
    f: impl FnMut(Tensor<B, 3>, Tensor<B, 2, Int>) -> T,
) -> Result<Vec<T>, ModelError> {
    check_scored_positions(batch, start)?;
    map_hidden_chunks(model.base(), last_hidden_state(model, batch), batch, start, f)
}

/// The decoder's final hidden states `[b, len, hidden]` (final norm included, `model`'s adapters
/// applied) over a right-padded batch: what the head turns into logits, for
/// [`map_hidden_chunks`] and the like.
pub fn last_hidden_state<B: Backend>(model: &impl CausalLm<B>, batch: &TokenBatch<B>) -> Tensor<B, 3> {
    model
        .base()
        .model
        .forward_with_adapters(
            batch.input_ids.clone(),
            batch.position_ids.clone(),
            batch.mask(),
            None,
            false,
            model.adapters(),
        )
        .last_hidden_state
}

/// [`map_logits_chunks`] from the decoder's final hidden states `[b, len, hidden]` of `batch`
/// (the output of `model.model`, final norm included, with or without adapters) instead of
/// running the decoder; `model` gives the head.
pub fn map_hidden_chunks<B: Backend, T>(
    model: &Qwen3ForCausalLM<B>,
    hidden: Tensor<B, 3>,
    batch: &TokenBatch<B>,
    start: usize,
    mut f: impl FnMut(Tensor<B, 3>, Tensor<B, 2, Int>) -> T,
) -> Result<Vec<T>, ModelError> {
    check_scored_positions(batch, start)?;
    let b = batch.batch_size();
    if hidden.dims()[..2] != [b, batch.len] {
        return Err(ModelError::Input(format!(
            "hidden states {:?} do not match the batch [{b}, {}]",
            hidden.dims(),
            batch.len
        )));
    }
    let mut out = Vec::new();
    for (from, to) in logits_chunks(b, model.config.vocab_size, start, batch.len) {
        let h = hidden.clone().narrow(1, from, to - from);
        let targets = batch.input_ids.clone().narrow(1, from + 1, to - from);
        out.push(f(model.logits(h), targets));
    }
    Ok(out)
}

/// The chunks of positions `(from, to)` whose logits [`map_hidden_chunks`] forms at once for
/// `batch` sequences of `len` tokens scored from token `start`: positions `start − 1 .. len − 1`
/// (each predicts the token after it), at most [`LOGITS_CHUNK_ELEMENTS`] logits a chunk.
pub fn logits_chunks(batch: usize, vocab: usize, start: usize, len: usize) -> Vec<(usize, usize)> {
    let chunk = (LOGITS_CHUNK_ELEMENTS / (batch * vocab).max(1)).max(1);
    let last = len.saturating_sub(1);
    (start.saturating_sub(1)..last).step_by(chunk).map(|from| (from, (from + chunk).min(last))).collect()
}

/// Scoring needs a right-padded batch and a start inside it.
fn check_scored_positions<B: Backend>(batch: &TokenBatch<B>, start: usize) -> Result<(), ModelError> {
    if batch.padding != Padding::Right {
        return Err(ModelError::Input("scoring needs a right-padded batch".into()));
    }
    if start == 0 || start >= batch.len {
        return Err(ModelError::Input(format!(
            "scored positions must start in 1..{} (got {start})",
            batch.len
        )));
    }
    Ok(())
}

/// `logits[.., target] - logsumexp(logits)` over the vocabulary, in f32: `[b, n, vocab]`,
/// `[b, n]` → `[b, n]`, by a CPU kernel where `cpu_kernels` run one.
pub fn chosen_logprobs<B: Backend>(cpu_kernels: Kernels, logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 2> {
    if let Some(fused) = crate::kernels::chosen_logprobs(cpu_kernels, &logits, &targets) {
        return fused;
    }
    let logits = if logits.dtype() == DType::F32 {
        logits
    } else {
        logits.cast(DType::F32)
    };
    let [b, n, _] = logits.dims();
    let max = logits.clone().max_dim(2).detach();
    let lse = (logits.clone() - max.clone()).exp().sum_dim(2).log() + max;
    let chosen = logits.gather(2, targets.reshape([b, n, 1]));
    (chosen - lse).reshape([b, n])
}

/// The entropy of each position's next-token distribution, `[b, n]` f32, from f32 logits
/// `[b, n, vocab]`, as a value without gradient, in one parallel pass when the backend is
/// burn-flex (plain or under autodiff) and `cpu_kernels` run; `None` otherwise, for the caller's
/// tensor formula.
pub fn entropy_without_grad<B: Backend>(cpu_kernels: Kernels, logits: &Tensor<B, 3>) -> Option<Tensor<B, 2>> {
    if logits.dtype() != DType::F32 {
        return None;
    }
    crate::kernels::entropy(cpu_kernels, logits)
}

/// The log-probs of each completion given its prompt, for pairs of different lengths: one
/// right-padded forward pass; returns one vector per pair.
pub fn completion_logprobs<B: Backend>(
    model: &impl CausalLm<B>,
    pairs: &[(Vec<u32>, Vec<u32>)],
    pad_id: u32,
) -> Result<Vec<Vec<f32>>, ModelError> {
    if let Some(i) = pairs.iter().position(|(p, c)| p.is_empty() || c.is_empty()) {
        return Err(ModelError::Input(format!(
            "pair {i}: prompt and completion must both be non-empty"
        )));
    }
    let sequences: Vec<Vec<u32>> = pairs
        .iter()
        .map(|(p, c)| p.iter().chain(c).copied().collect())
        .collect();
    for s in &sequences {
        model.base().check_token_ids(s)?;
    }
    let batch = TokenBatch::new(&sequences, Padding::Right, pad_id, &model.base().device())?;
    // Positions before the shortest prompt's last token need no logits.
    let start = pairs.iter().map(|(p, _)| p.len()).min().unwrap_or(1);
    let logprobs = token_logprobs(model, &batch, start)?;
    let width = batch.len - start;
    let values: Vec<f32> = logprobs
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| ModelError::Input(format!("reading log-probs: {e:?}")))?;
    Ok(pairs
        .iter()
        .enumerate()
        .map(|(i, (p, c))| {
            let row = &values[i * width..(i + 1) * width];
            row[p.len() - start..p.len() - start + c.len()].to_vec()
        })
        .collect())
}

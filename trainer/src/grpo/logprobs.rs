//! Per-token log-probs of whole sequences on a plain (non-autodiff) backend: the old policy's
//! and the frozen reference's inputs to the loss.

use burn::tensor::backend::Backend;
use model::lora::CausalLm;
use model::{token_logprobs, Padding, TokenBatch};

use super::error::GrpoError;

/// `out[i][t] = log p(sequences[i][t] | sequences[i][..t])` for `t ≥ 1`, and `out[i][0] = 0`:
/// aligned with the tokens, as [`super::batch::PolicySequence`] wants. Runs right-padded
/// batches of up to `batch_size` sequences. Run it on the inner backend (`model.valid()`) so no
/// autodiff graph is built. `model` is a Qwen3 model or a base with LoRA adapters.
pub fn sequence_logprobs<B: Backend>(
    model: &impl CausalLm<B>,
    sequences: &[Vec<u32>],
    pad_id: u32,
    batch_size: usize,
) -> Result<Vec<Vec<f32>>, GrpoError> {
    if batch_size == 0 {
        return Err(GrpoError::Input("batch_size must be at least 1".into()));
    }
    if let Some(i) = sequences.iter().position(Vec::is_empty) {
        return Err(GrpoError::Input(format!("sequence {i} is empty")));
    }
    let base = model.base();
    for s in sequences {
        base.check_token_ids(s)?;
    }
    base.check_token_ids(&[pad_id])?;
    let device = base.device();
    let mut out = Vec::with_capacity(sequences.len());
    for chunk in sequences.chunks(batch_size) {
        let batch = TokenBatch::<B>::new(chunk, Padding::Right, pad_id, &device)?;
        if batch.len < 2 {
            out.extend(chunk.iter().map(|_| vec![0.0]));
            continue;
        }
        let width = batch.len - 1;
        let values: Vec<f32> = token_logprobs(model, &batch, 1)?
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| GrpoError::Input(format!("reading log-probs: {e:?}")))?;
        for (i, s) in chunk.iter().enumerate() {
            let mut row = Vec::with_capacity(s.len());
            row.push(0.0);
            row.extend_from_slice(&values[i * width..i * width + s.len() - 1]);
            out.push(row);
        }
    }
    Ok(out)
}

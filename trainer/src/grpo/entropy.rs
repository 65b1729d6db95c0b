//! Entropy of the policy's next-token distribution, for the entropy bonus and its metric. It
//! needs the whole distribution, so it is formed from logits a chunk of positions at a time,
//! in the same forward pass as the chosen tokens' log-probs.

use burn::tensor::{backend::Backend, DType, Tensor};
use model::logprobs::{chosen_logprobs, map_logits_chunks};
use model::{ModelError, Qwen3ForCausalLM, TokenBatch};

/// Whether gradients flow through the entropy (only needed when it is part of the loss).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntropyGrad {
    Tracked,
    Detached,
}

/// `H = logsumexp(z) − Σ_v softmax(z)_v · z_v` over the vocabulary, in f32: `[b, n, vocab]` →
/// `[b, n]` (computed with `z − max z`, which leaves `H` unchanged).
pub fn entropy_from_logits<B: Backend>(logits: Tensor<B, 3>) -> Tensor<B, 2> {
    let logits = if logits.dtype() == DType::F32 {
        logits
    } else {
        logits.cast(DType::F32)
    };
    let [b, n, _] = logits.dims();
    let shifted = logits.clone() - logits.max_dim(2).detach();
    let exp = shifted.clone().exp();
    let total = exp.clone().sum_dim(2);
    let mean_z = (exp * shifted).sum_dim(2) / total.clone();
    (total.log() - mean_z).reshape([b, n])
}

/// Like [`model::token_logprobs`], and also the entropy of the distribution each scored token
/// was drawn from: both `[b, len − start]`, column `j` for token `start + j` of a right-padded
/// batch (values at padding are meaningless; mask them).
pub fn token_logprobs_and_entropy<B: Backend>(
    model: &Qwen3ForCausalLM<B>,
    batch: &TokenBatch<B>,
    start: usize,
    entropy_grad: EntropyGrad,
) -> Result<(Tensor<B, 2>, Tensor<B, 2>), ModelError> {
    let pieces = map_logits_chunks(model, batch, start, |logits, targets| {
        let entropy = entropy_from_logits(match entropy_grad {
            EntropyGrad::Tracked => logits.clone(),
            EntropyGrad::Detached => logits.clone().detach(),
        });
        (chosen_logprobs(logits, targets), entropy)
    })?;
    let (logprobs, entropies): (Vec<_>, Vec<_>) = pieces.into_iter().unzip();
    Ok((Tensor::cat(logprobs, 1), Tensor::cat(entropies, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[test]
    fn entropy_of_known_distributions() {
        // Row 0: logits [0, ln 3] → p = [1/4, 3/4], H = 0.25·ln 4 + 0.75·ln(4/3) = 0.562335.
        // Row 1: logits [7, 7] → uniform over 2, H = ln 2 = 0.693147.
        // Row 2: logits [1000, 0] (a naive exp overflows) → H ≈ 0.
        let logits = Tensor::<Flex, 3>::from_data(
            TensorData::new(vec![0.0, 3f32.ln(), 7.0, 7.0, 1000.0, 0.0], [1, 3, 2]),
            &Default::default(),
        );
        let h: Vec<f32> = entropy_from_logits(logits)
            .into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap();
        let want = [0.562335, std::f32::consts::LN_2, 0.0];
        for (g, w) in h.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{h:?}");
        }
    }
}

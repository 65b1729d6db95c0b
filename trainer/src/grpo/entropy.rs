//! Entropy of the policy's next-token distribution, for the entropy bonus and its metric. It
//! needs the whole distribution, so it is formed from logits a chunk of positions at a time,
//! in the same forward pass as the chosen tokens' log-probs.

use burn::tensor::{backend::Backend, DType, Int, Tensor};
use model::logprobs::{chosen_logprobs, entropy_without_grad, map_hidden_chunks, map_logits_chunks};
use model::lora::CausalLm;
use model::cpu_kernels::Kernels;
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
    model: &impl CausalLm<B>,
    batch: &TokenBatch<B>,
    start: usize,
    entropy_grad: EntropyGrad,
) -> Result<(Tensor<B, 2>, Tensor<B, 2>), ModelError> {
    let kernels = model.base().compute().cpu_kernels;
    let pieces = map_logits_chunks(model, batch, start, |logits, targets| {
        chunk_logprobs_and_entropy(kernels, logits, targets, entropy_grad)
    })?;
    Ok(join(pieces))
}

/// [`token_logprobs_and_entropy`] from the decoder's final hidden states `[b, len, hidden]` of
/// `batch` (see [`model::map_hidden_chunks`]).
pub fn token_logprobs_and_entropy_from_hidden<B: Backend>(
    model: &Qwen3ForCausalLM<B>,
    hidden: Tensor<B, 3>,
    batch: &TokenBatch<B>,
    start: usize,
    entropy_grad: EntropyGrad,
) -> Result<(Tensor<B, 2>, Tensor<B, 2>), ModelError> {
    let kernels = model.compute().cpu_kernels;
    let pieces = map_hidden_chunks(model, hidden, batch, start, |logits, targets| {
        chunk_logprobs_and_entropy(kernels, logits, targets, entropy_grad)
    })?;
    Ok(join(pieces))
}

/// The chosen tokens' log-probs and the entropy of one chunk of logits, by the CPU kernels
/// where `cpu_kernels` run them.
pub(super) fn chunk_logprobs_and_entropy<B: Backend>(
    cpu_kernels: Kernels,
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    entropy_grad: EntropyGrad,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let entropy = match entropy_grad {
        EntropyGrad::Tracked => entropy_from_logits(logits.clone()),
        EntropyGrad::Detached => entropy_without_grad(cpu_kernels, &logits)
            .unwrap_or_else(|| entropy_from_logits(logits.clone().detach())),
    };
    (chosen_logprobs(cpu_kernels, logits, targets), entropy)
}

/// The chunks' results joined along the positions.
fn join<B: Backend>(pieces: Vec<(Tensor<B, 2>, Tensor<B, 2>)>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (logprobs, entropies): (Vec<_>, Vec<_>) = pieces.into_iter().unzip();
    (Tensor::cat(logprobs, 1), Tensor::cat(entropies, 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    /// The one-pass kernel (plain burn-flex and under autodiff, where it is outside the graph)
    /// agrees with the tensor formula.
    #[test]
    fn one_pass_entropy_matches_the_formula() {
        use burn::backend::Autodiff;
        let (b, n, vocab) = (2, 3, 301);
        let values: Vec<f32> = (0..b * n * vocab).map(|i| (i as f32 * 0.173).sin() * 5.0).collect();
        let data = TensorData::new(values, [b, n, vocab]);
        let plain = |t: Tensor<Flex, 2>| t.into_data().to_vec::<f32>().unwrap();
        let logits = Tensor::<Flex, 3>::from_data(data.clone(), &Default::default());
        let want = plain(entropy_from_logits(logits.clone()));
        let close = |got: Vec<f32>| got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-4);
        assert!(close(plain(entropy_without_grad(Kernels::default(), &logits).unwrap())));
        let tracked = Tensor::<Autodiff<Flex>, 3>::from_data(data, &Default::default()).require_grad();
        let entropy = entropy_without_grad(Kernels::default(), &tracked).unwrap();
        assert!(!entropy.is_require_grad());
        assert!(close(plain(entropy.inner())));
    }

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

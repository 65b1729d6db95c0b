//! The SFT objective: the negative log-likelihood of the trained tokens, averaged over them
//! (verl's SFT loss, cross-entropy on the response tokens; TRL's `assistant_only_loss`).

use burn::tensor::{backend::Backend, Tensor};

use crate::grpo::{agg_loss, AggMode};

/// `Σ m·(−log p) / Σ m` over `[b, t]` log-probs and loss mask. Masked-out entries are selected
/// away, so whatever they hold (padding, prompt tokens, even inf or NaN) contributes nothing,
/// to the loss or to its gradient. An all-zero mask gives 0.
pub fn nll_loss<B: Backend>(logp: Tensor<B, 2>, mask: Tensor<B, 2>) -> Tensor<B, 1> {
    agg_loss(logp.neg(), mask, AggMode::TokenMean)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    fn t2(rows: [[f32; 3]; 2]) -> Tensor<Flex, 2> {
        Tensor::from_data(TensorData::new(rows.concat(), [2, 3]), &Default::default())
    }

    /// (0.5 + 1.0 + 2.5) / 3 over the three masked tokens; the NaN and −inf sit under mask 0.
    #[test]
    fn mean_over_masked_tokens_only() {
        let logp = t2([[-0.5, f32::NAN, -1.0], [f32::NEG_INFINITY, -2.5, -7.0]]);
        let mask = t2([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]);
        let loss: f32 = nll_loss(logp, mask).into_scalar();
        assert!((loss - 4.0 / 3.0).abs() < 1e-6, "{loss}");
        let none: f32 = nll_loss(t2([[-1.0; 3]; 2]), t2([[0.0; 3]; 2])).into_scalar();
        assert_eq!(none, 0.0);
    }
}

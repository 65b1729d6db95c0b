//! Reducing a per-token loss `[b, t]` to a scalar over the tokens of the loss mask (verl's
//! `agg_loss`). The mask is 1 at agent-sampled tokens and 0 at prompt, environment and padding
//! tokens; masked-out entries are replaced by 0 before any sum, so whatever they hold (even
//! inf or NaN) contributes nothing.

use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

/// How per-token losses are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AggMode {
    /// `Σ_{b,t} m·l / Σ_{b,t} m`: every agent token of the batch weighs the same.
    #[default]
    TokenMean,
    /// `mean_b ( Σ_t m·l / Σ_t m )`: every sequence weighs the same.
    SeqMeanTokenMean,
    /// `mean_b ( Σ_t m·l )`: sequences weigh by their token sum (Dr. GRPO uses a constant
    /// divisor instead; this is verl's mode of the same name).
    SeqMeanTokenSum,
}

impl AggMode {
    /// The divisor of the aggregate over a batch whose sequences hold `tokens_per_sequence`
    /// mask-1 tokens: the token count for [`AggMode::TokenMean`], the number of sequences with at
    /// least one token otherwise. A batch split into parts has `agg(batch) = Σ_parts agg(part) ·
    /// denominator(part) / denominator(batch)`, which is how micro-batches are weighted.
    pub fn denominator(self, tokens_per_sequence: impl IntoIterator<Item = usize>) -> usize {
        let counts = tokens_per_sequence.into_iter();
        match self {
            AggMode::TokenMean => counts.sum(),
            AggMode::SeqMeanTokenMean | AggMode::SeqMeanTokenSum => {
                counts.filter(|&n| n > 0).count()
            }
        }
    }
}

/// `m ? l : 0`, element-wise (a select, not a product, so inf·0 cannot make NaN).
pub fn masked<B: Backend>(loss: Tensor<B, 2>, mask: Tensor<B, 2>) -> Tensor<B, 2> {
    loss.mask_fill(mask.equal_elem(0.0), 0.0)
}

/// The scalar loss `[1]` of `loss` `[b, t]` under `mask` `[b, t]` (see [`AggMode`]). Sequences
/// without mask-1 tokens are left out of the sequence means; an all-zero mask gives 0.
pub fn agg_loss<B: Backend>(loss: Tensor<B, 2>, mask: Tensor<B, 2>, mode: AggMode) -> Tensor<B, 1> {
    let loss = masked(loss, mask.clone());
    match mode {
        AggMode::TokenMean => loss.sum() / mask.sum().clamp_min(1.0),
        AggMode::SeqMeanTokenMean => {
            let tokens = mask.sum_dim(1);
            let sequences = tokens
                .clone()
                .greater_elem(0.0)
                .float()
                .sum()
                .clamp_min(1.0);
            (loss.sum_dim(1) / tokens.clamp_min(1.0)).sum() / sequences
        }
        AggMode::SeqMeanTokenSum => {
            let sequences = mask
                .sum_dim(1)
                .greater_elem(0.0)
                .float()
                .sum()
                .clamp_min(1.0);
            loss.sum() / sequences
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type B = Flex;

    fn t2(rows: &[&[f32]]) -> Tensor<B, 2> {
        let values: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_data(
            TensorData::new(values, [rows.len(), rows[0].len()]),
            &Default::default(),
        )
    }

    fn scalar(t: Tensor<B, 1>) -> f32 {
        t.into_scalar()
    }

    /// Row 0 keeps {1, 2}, row 1 keeps {4}, row 2 keeps nothing (and holds NaN and inf).
    fn example() -> (Tensor<B, 2>, Tensor<B, 2>) {
        let loss = t2(&[
            &[1.0, 2.0, 3.0],
            &[4.0, 5.0, f32::INFINITY],
            &[f32::NAN, 7.0, 8.0],
        ]);
        let mask = t2(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        (loss, mask)
    }

    #[test]
    fn token_mean() {
        // (1 + 2 + 4) / 3 tokens = 2.333333
        let (loss, mask) = example();
        assert!((scalar(agg_loss(loss, mask, AggMode::TokenMean)) - 7.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn seq_mean_token_mean() {
        // ((1 + 2)/2 + 4/1) / 2 non-empty rows = (1.5 + 4) / 2 = 2.75
        let (loss, mask) = example();
        assert!((scalar(agg_loss(loss, mask, AggMode::SeqMeanTokenMean)) - 2.75).abs() < 1e-6);
    }

    #[test]
    fn seq_mean_token_sum() {
        // ((1 + 2) + 4) / 2 non-empty rows = 3.5
        let (loss, mask) = example();
        assert!((scalar(agg_loss(loss, mask, AggMode::SeqMeanTokenSum)) - 3.5).abs() < 1e-6);
    }

    #[test]
    fn empty_mask_gives_zero() {
        for mode in [
            AggMode::TokenMean,
            AggMode::SeqMeanTokenMean,
            AggMode::SeqMeanTokenSum,
        ] {
            let v = scalar(agg_loss(t2(&[&[1.0, f32::NAN]]), t2(&[&[0.0, 0.0]]), mode));
            assert_eq!(v, 0.0, "{mode:?}");
        }
    }

    #[test]
    fn denominators_split_batches_exactly() {
        // Tokens per sequence 2, 1, 0: token-mean divides by 3, the sequence means by 2.
        assert_eq!(AggMode::TokenMean.denominator([2, 1, 0]), 3);
        assert_eq!(AggMode::SeqMeanTokenMean.denominator([2, 1, 0]), 2);
        assert_eq!(AggMode::SeqMeanTokenSum.denominator([2, 1, 0]), 2);
    }
}

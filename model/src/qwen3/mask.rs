//! The additive attention bias: causal and padding masks folded into one `[b, 1, q, k]` tensor of
//! 0 (attend) and a large finite negative (masked). A row with every key masked (a pad query of a
//! left-padded batch) stays finite, so no NaN can leak through `0 * NaN` in `probs @ V`.

use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor};

/// The value added to masked scores: large and finite (HF uses the dtype's minimum).
pub const MASK_VALUE: f32 = -1.0e9;

/// Builds the bias for `q_len` queries at absolute positions `past_len..past_len + q_len` over
/// `past_len + q_len` keys. `key_mask` is `[b, past_len + q_len]` with 1 for real tokens and 0 for
/// padding; `None` means no padding.
pub fn attention_bias<B: Backend>(
    key_mask: Option<&Tensor<B, 2, Int>>,
    batch: usize,
    past_len: usize,
    q_len: usize,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 4> {
    let k_len = past_len + q_len;
    let causal = Tensor::<B, 2, Bool>::tril_mask([q_len, k_len], past_len as i64, device)
        .reshape([1, 1, q_len, k_len])
        .expand([batch, 1, q_len, k_len]);
    let bias = Tensor::<B, 4>::zeros([batch, 1, q_len, k_len], (device, dtype)).mask_fill(causal, MASK_VALUE);
    match key_mask {
        None => bias,
        Some(mask) => {
            let padding = mask
                .clone()
                .equal_elem(0)
                .reshape([batch, 1, 1, k_len])
                .expand([batch, 1, q_len, k_len]);
            bias.mask_fill(padding, MASK_VALUE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn causal_and_padding() {
        let device = Default::default();
        let mask = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 1]], &device);
        let bias: Vec<f32> = attention_bias(Some(&mask), 1, 0, 3, DType::F32, &device)
            .into_data()
            .to_vec()
            .unwrap();
        let m = MASK_VALUE;
        assert_eq!(bias, vec![m, m, m, m, 0.0, m, m, 0.0, 0.0]);
        // One new query after two cached keys sees all three.
        let bias: Vec<f32> = attention_bias::<Flex>(None, 1, 2, 1, DType::F32, &device)
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(bias, vec![0.0, 0.0, 0.0]);
    }
}

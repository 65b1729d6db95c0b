//! Rotary position embedding in HF's "rotate_half" layout (the first half of each head pairs
//! with the second half), not burn's interleaved `RotaryEncoding`.

use burn::tensor::{backend::Backend, DType, Int, Tensor};

/// The inverse frequencies `1 / theta^(2i/d)` of the default RoPE.
#[derive(Debug, Clone)]
pub struct Qwen3RotaryEmbedding {
    inv_freq: Vec<f32>,
}

impl Qwen3RotaryEmbedding {
    /// Frequencies for heads of `head_dim` with base `rope_theta`.
    pub fn new(head_dim: usize, rope_theta: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| (1.0 / rope_theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        Self { inv_freq }
    }

    /// `(cos, sin)` of shape `[batch, 1, seq, head_dim]` for the given positions, in `dtype`.
    pub fn cos_sin<B: Backend>(
        &self,
        position_ids: Tensor<B, 2, Int>,
        dtype: DType,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let device = position_ids.device();
        let half = self.inv_freq.len();
        let inv_freq = Tensor::<B, 1>::from_data(self.inv_freq.as_slice(), (&device, DType::F32))
            .reshape([1, 1, half]);
        let positions = position_ids.float().cast(DType::F32).unsqueeze_dim::<3>(2);
        let freqs = positions * inv_freq;
        let emb = Tensor::cat(vec![freqs.clone(), freqs], 2).unsqueeze_dim::<4>(1);
        let (cos, sin) = (emb.clone().cos(), emb.sin());
        if dtype == DType::F32 {
            (cos, sin)
        } else {
            (cos.cast(dtype), sin.cast(dtype))
        }
    }
}

/// Rotates half the hidden dims: `cat(-x[..., d/2:], x[..., :d/2])`.
pub fn rotate_half<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.narrow(3, d / 2, d / 2);
    Tensor::cat(vec![x2.neg(), x1], 3)
}

/// Applies RoPE to queries `[b, heads, seq, d]` and keys `[b, kv_heads, seq, d]`.
pub fn apply_rotary_pos_emb<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    sin: &Tensor<B, 4>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let q_embed = q.clone() * cos.clone() + rotate_half(q) * sin.clone();
    let k_embed = k.clone() * cos.clone() + rotate_half(k) * sin.clone();
    (q_embed, k_embed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn rotate_half_swaps_and_negates() {
        let x = Tensor::<Flex, 1>::from_floats([1.0, 2.0, 3.0, 4.0], &Default::default())
            .reshape([1, 1, 1, 4]);
        let r: Vec<f32> = rotate_half(x).into_data().to_vec().unwrap();
        assert_eq!(r, vec![-3.0, -4.0, 1.0, 2.0]);
    }

    #[test]
    fn position_zero_is_identity() {
        let rope = Qwen3RotaryEmbedding::new(4, 10_000.0);
        let pos = Tensor::<Flex, 2, Int>::from_ints([[0, 1]], &Default::default());
        let (cos, sin) = rope.cos_sin(pos, DType::F32);
        let cos: Vec<f32> = cos.into_data().to_vec().unwrap();
        let sin: Vec<f32> = sin.into_data().to_vec().unwrap();
        assert_eq!(&cos[..4], &[1.0; 4]);
        assert_eq!(&sin[..4], &[0.0; 4]);
        // position 1, frequency index 0: angle 1 rad; index 1: 1/100 rad.
        assert!((sin[4] - 1f32.sin()).abs() < 1e-6 && (sin[5] - 0.01f32.sin()).abs() < 1e-6);
        assert_eq!(sin[4], sin[6]);
    }
}

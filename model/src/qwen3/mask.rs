//! Which keys each query may attend to: causal (query `i` of a pass sees the cached keys and the
//! new ones up to its own) and key padding. [`AttentionMask`] keeps only the padding of the keys,
//! `[b, k]`; the eager formula and the CPU kernels take it as one additive bias `[b, 1, q, k]` of
//! 0 (attend) and a large finite negative (masked), and the memory-efficient attention builds it a
//! block at a time. A row with every key masked (a pad query of a left-padded batch) stays
//! finite, so no NaN can leak through `0 * NaN` in `probs @ V`.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor};

/// The value added to masked scores: large and finite (HF uses the dtype's minimum).
pub const MASK_VALUE: f32 = -1.0e9;

/// The mask of one forward pass: `q_len` queries at indices `past..past + q_len` over
/// `past + q_len` keys, causal, with optional key padding.
#[derive(Debug, Clone)]
pub struct AttentionMask<B: Backend> {
    /// `[b, past + q_len]`, 1 for a real key and 0 for padding, f32; `None` when nothing is padded.
    key_padding: Option<Tensor<B, 2>>,
    batch: usize,
    past: usize,
    q_len: usize,
    device: B::Device,
}

impl<B: Backend> AttentionMask<B> {
    /// `key_mask` is `[b, past + q_len]` with 1 for real tokens and 0 for padding (`None`: no
    /// padding).
    pub fn new(key_mask: Option<&Tensor<B, 2, Int>>, batch: usize, past: usize, q_len: usize, device: &B::Device) -> Self {
        let key_padding = key_mask.map(|m| m.clone().float().cast(DType::F32));
        Self { key_padding, batch, past, q_len, device: device.clone() }
    }

    /// Keys cached before this pass's queries.
    pub fn past(&self) -> usize {
        self.past
    }

    /// The additive bias `[b, 1, q, k]` in `dtype` (see [`attention_bias`]).
    pub fn bias(&self, dtype: DType) -> Tensor<B, 4> {
        let k_len = self.past + self.q_len;
        let causal = Tensor::<B, 2, Bool>::tril_mask([self.q_len, k_len], self.past as i64, &self.device)
            .reshape([1, 1, self.q_len, k_len])
            .expand([self.batch, 1, self.q_len, k_len]);
        let bias = Tensor::<B, 4>::zeros([self.batch, 1, self.q_len, k_len], (&self.device, dtype)).mask_fill(causal, MASK_VALUE);
        match &self.key_padding {
            None => bias,
            Some(valid) => {
                let padding = valid.clone().equal_elem(0.0).reshape([self.batch, 1, 1, k_len]).expand([self.batch, 1, self.q_len, k_len]);
                bias.mask_fill(padding, MASK_VALUE)
            }
        }
    }

    /// The additive f32 bias of keys `k0..k1` for queries `q0..q1` of each of `groups` heads
    /// stacked along the rows (row `r` is query `q0 + r % (q1 − q0)`): `[b or 1, 1, groups ·
    /// (q1 − q0), k1 − k0]`; `None` when no key of the block is masked for any of them.
    pub(crate) fn block_bias(&self, groups: usize, (q0, q1): (usize, usize), (k0, k1): (usize, usize)) -> Option<Tensor<B, 4>> {
        let (rows, cols) = (q1 - q0, k1 - k0);
        // Query i sees keys 0..=past + i: the block needs the causal mask when its last key lies
        // after the first query's position.
        let causal = (k1 - 1 > self.past + q0).then(|| {
            let index = |from: usize, to: usize| Tensor::<B, 1, Int>::arange(from as i64..to as i64, &self.device).float().cast(DType::F32);
            let queries = index(self.past + q0, self.past + q1).reshape([1, rows]).repeat_dim(0, groups).reshape([groups * rows, 1]);
            let keys = index(k0, k1).reshape([1, cols]);
            // 1 where the key comes after the query (the differences are whole numbers).
            (keys - queries).clamp(0.0, 1.0).mul_scalar(MASK_VALUE).reshape([1, 1, groups * rows, cols])
        });
        let padding = self.key_padding.as_ref().map(|valid| {
            (valid.clone().narrow(1, k0, cols).neg().add_scalar(1.0))
                .mul_scalar(MASK_VALUE)
                .reshape([self.batch, 1, 1, cols])
        });
        match (causal, padding) {
            (Some(c), Some(p)) => Some(c + p),
            (c, p) => c.or(p),
        }
    }
}

impl<I: Backend, C: CheckpointStrategy> AttentionMask<Autodiff<I, C>> {
    /// The same mask on the inner backend.
    pub(crate) fn inner(&self) -> AttentionMask<I> {
        AttentionMask {
            key_padding: self.key_padding.clone().map(Tensor::inner),
            batch: self.batch,
            past: self.past,
            q_len: self.q_len,
            device: self.device.clone(),
        }
    }
}

/// The additive bias for `q_len` queries at absolute positions `past_len..past_len + q_len` over
/// `past_len + q_len` keys, `[b, 1, q, k]` (see [`AttentionMask::bias`]). `key_mask` is
/// `[b, past_len + q_len]` with 1 for real tokens and 0 for padding; `None` means no padding.
pub fn attention_bias<B: Backend>(
    key_mask: Option<&Tensor<B, 2, Int>>,
    batch: usize,
    past_len: usize,
    q_len: usize,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 4> {
    AttentionMask::new(key_mask, batch, past_len, q_len, device).bias(dtype)
}

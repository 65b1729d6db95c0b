//! Which keys each query may attend to: causal (query `i` of a pass sees the cached keys and the
//! new ones up to its own) and key padding. [`AttentionMask`] keeps only the padding of the keys,
//! `[b, k]`; the eager formula and the CPU kernels take it as one additive bias `[b, 1, q, k]` of
//! 0 (attend) and a large finite negative (masked), and the memory-efficient attention builds it a
//! block at a time (its causal triangles once per pass: every layer of a pass shares its mask
//! and the triangles it built).
//! A row with every key masked (a pad query of a left-padded batch) stays finite, so no NaN can
//! leak through `0 * NaN` in `probs @ V`.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor};

/// The value added to masked scores: large and finite (HF uses the dtype's minimum).
pub const MASK_VALUE: f32 = -1.0e9;

/// The mask of one forward pass: `q_len` queries at indices `past..past + q_len` over
/// `past + q_len` keys, causal, with optional key padding. Clones share the blocks built so far.
#[derive(Debug, Clone)]
pub struct AttentionMask<B: Backend> {
    /// `[b, past + q_len]`, 1 for a real key and 0 for padding, f32; `None` when nothing is padded.
    key_padding: Option<Tensor<B, 2>>,
    batch: usize,
    past: usize,
    q_len: usize,
    device: B::Device,
    /// The causal blocks built so far, by `(kv_heads, groups, rows, columns, offset)`.
    blocks: Arc<Mutex<HashMap<BlockKey, Tensor<B, 4>>>>,
    /// The key padding's bias `[b, 1, 1, k1 − k0]` of the key spans seen so far, by `(k0, k1)`.
    padding: Arc<Mutex<HashMap<(usize, usize), Tensor<B, 4>>>>,
    /// The same mask on an autodiff backend's inner backend, made once ([`Self::inner`]).
    inner: Arc<OnceLock<Box<dyn Any + Send + Sync>>>,
    /// [`Self::valid_keys`] where nothing is padded, made once for every layer.
    all_valid: Arc<OnceLock<Tensor<B, 2>>>,
}

/// A causal block of [`AttentionMask::block_bias`]: `(kv_heads, groups, rows, columns, offset)`,
/// where query `i` of the block sees key `j` when `j <= i + offset`.
type BlockKey = (usize, usize, usize, usize, i64);

impl<B: Backend> AttentionMask<B> {
    /// `key_mask` is `[b, past + q_len]` with 1 for real tokens and 0 for padding (`None`: no
    /// padding).
    pub fn new(key_mask: Option<&Tensor<B, 2, Int>>, batch: usize, past: usize, q_len: usize, device: &B::Device) -> Self {
        let key_padding = key_mask.map(|m| m.clone().float().cast(DType::F32));
        Self::from_parts(key_padding, batch, past, q_len, device.clone())
    }

    fn from_parts(key_padding: Option<Tensor<B, 2>>, batch: usize, past: usize, q_len: usize, device: B::Device) -> Self {
        let (blocks, padding, inner, all_valid) = (Arc::default(), Arc::default(), Arc::default(), Arc::default());
        Self { key_padding, batch, past, q_len, device, blocks, padding, inner, all_valid }
    }

    /// Keys cached before this pass's queries.
    pub fn past(&self) -> usize {
        self.past
    }

    /// `[b, past + q_len]`, f32: 1 for a real key, 0 for padding (all ones, made once per
    /// mask, where nothing is padded).
    pub fn valid_keys(&self) -> Tensor<B, 2> {
        match &self.key_padding {
            Some(valid) => valid.clone(),
            None => self
                .all_valid
                .get_or_init(|| Tensor::ones([self.batch, self.past + self.q_len], (&self.device, DType::F32)))
                .clone(),
        }
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

    /// The additive f32 bias of keys `k0..k1` for queries `q0..q1` of `kv_heads · groups` heads,
    /// each key/value head's `groups` query heads stacked along the rows (row `r` is query
    /// `q0 + r % (q1 − q0)`), for scores of shape `[b, kv_heads, groups · (q1 − q0), k1 − k0]`;
    /// `None` when no key of the block is masked for any of them. The causal part depends on the
    /// block's shape and on where its keys start relative to its queries, not on where it lies:
    /// the memory-efficient attention asks for the same triangle at every query block, so a pass
    /// builds it once, and without padding that triangle is the whole bias. The padding part is
    /// built once per pass too, as one row per sequence `[b, 1, 1, k1 − k0]` that the scores'
    /// addition broadcasts, except on burn-flex, which adds tensors of equal shape more than ten
    /// times faster than it broadcasts (0.65 against 8.7 ms for one 256-token block of
    /// Qwen3-0.6B's heads) and gets the bias at the scores' shape. Without this, every layer of a
    /// padded decoding step rebuilt the same padding with several kernels on a GPU.
    pub(crate) fn block_bias(
        &self,
        kv_heads: usize,
        groups: usize,
        (q0, q1): (usize, usize),
        (k0, k1): (usize, usize),
    ) -> Option<Tensor<B, 4>> {
        let causal = (k1 - 1 > self.past + q0).then(|| self.causal_block(kv_heads, groups, (q0, q1), (k0, k1)));
        let padding = self.padding_rows(k0, k1).map(|rows| {
            if crate::kernels::broadcasts_slowly::<B>() {
                rows.repeat_dim(1, kv_heads).repeat_dim(2, groups * (q1 - q0))
            } else {
                rows
            }
        });
        match (causal, padding) {
            (Some(c), Some(p)) => Some(c + p),
            (c, p) => c.or(p),
        }
    }

    /// The padding's bias of keys `k0..k1`, `[b, 1, 1, k1 − k0]`, built once per pass; `None`
    /// without padding.
    fn padding_rows(&self, k0: usize, k1: usize) -> Option<Tensor<B, 4>> {
        let valid = self.key_padding.as_ref()?;
        let mut built = self.padding.lock().expect("mask padding lock");
        let rows = built.entry((k0, k1)).or_insert_with(|| {
            (valid.clone().narrow(1, k0, k1 - k0).neg().add_scalar(1.0))
                .mul_scalar(MASK_VALUE)
                .reshape([self.batch, 1, 1, k1 - k0])
        });
        Some(rows.clone())
    }

    /// The causal part of [`Self::block_bias`] at its full shape, built once per pass for each
    /// shape and offset.
    fn causal_block(&self, kv_heads: usize, groups: usize, (q0, q1): (usize, usize), (k0, k1): (usize, usize)) -> Tensor<B, 4> {
        let (rows, cols) = (q1 - q0, k1 - k0);
        // Query i sees key j of the block when k0 + j <= past + q0 + i.
        let offset = (self.past + q0) as i64 - k0 as i64;
        let key = (kv_heads, groups, rows, cols, offset);
        if let Some(built) = self.blocks.lock().expect("mask blocks lock").get(&key) {
            return built.clone();
        }
        let future = Tensor::<B, 2, Bool>::tril_mask([rows, cols], offset, &self.device);
        let built = Tensor::<B, 2>::zeros([rows, cols], (&self.device, DType::F32))
            .mask_fill(future, MASK_VALUE)
            .reshape([1, 1, rows, cols])
            .repeat_dim(0, self.batch)
            .repeat_dim(1, kv_heads * groups)
            .reshape([self.batch, kv_heads, groups * rows, cols]);
        self.blocks.lock().expect("mask blocks lock").insert(key, built.clone());
        built
    }
}

impl<I: Backend, C: CheckpointStrategy> AttentionMask<Autodiff<I, C>> {
    /// The same mask on the inner backend, made once and shared by every call on this mask (so
    /// the blocks that one layer builds serve the next).
    pub(crate) fn inner(&self) -> AttentionMask<I> {
        let made = self.inner.get_or_init(|| {
            let padding = self.key_padding.clone().map(Tensor::inner);
            Box::new(AttentionMask::<I>::from_parts(padding, self.batch, self.past, self.q_len, self.device.clone()))
        });
        made.downcast_ref::<AttentionMask<I>>().expect("the inner mask of this backend").clone()
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

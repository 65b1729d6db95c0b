//! What attention holds on a pass, as `attn_implementation` and the compute path make it: the
//! eager formula's scores, the memory-efficient attention's block pairs and causal blocks, the
//! CPU kernel's bias.

use model::qwen3::attention::memory_efficient::block_sizes;
use model::AttnImplementation;

use super::{ComputePath, PlanDevice, PlanSettings, F32};

/// Where attention runs (see [`PlanSettings::attention_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AttentionPath {
    CpuKernel,
    Eager,
    MemoryEfficient,
}

impl PlanSettings {
    /// Where attention runs on a pass taking `path`: the CPU kernel, or one of the
    /// implementations as burn's tensor ops. Inference passes take the device's path
    /// ([`PlanDevice::path`]: the CPU kernel serves bf16 activations there), the update
    /// [`Self::path`].
    pub(super) fn attention_path(&self, path: ComputePath) -> AttentionPath {
        match (path, self.attention) {
            (ComputePath::CpuKernels, _) => AttentionPath::CpuKernel,
            (_, AttnImplementation::Eager) => AttentionPath::Eager,
            (_, AttnImplementation::MemoryEfficient) => AttentionPath::MemoryEfficient,
        }
    }

    /// Queries and keys per block of the memory-efficient attention for `rows` sequences of
    /// `queries` new tokens over `keys` keys (the model's choice, [`block_sizes`]).
    pub(super) fn attention_blocks(&self, rows: f64, queries: f64, keys: f64) -> (f64, f64) {
        let (q, k) = block_sizes(
            rows as usize,
            self.model.num_attention_heads,
            queries as usize,
            keys as usize,
            self.attention_block,
        );
        (q as f64, k as f64)
    }

    /// f32 values of attention's transients at once for `rows` sequences of `queries` new tokens
    /// over `keys` keys (the cached ones and their own; `queries = keys` without a cache) in one
    /// layer on a pass taking `path`: the eager formula's `[b, heads, q, k]` scores and their
    /// successors (3 forward, their gradients backward), or `blocks` block-pair-sized tensors of
    /// the memory-efficient attention (a query block against its widest span of keys: scores
    /// and exponentials forward, probabilities and their gradient backward, most of burn's
    /// element-wise ops working in place) and the causal triangle repeated to a diagonal block's
    /// scores. The CPU kernel works a block of rows at a time.
    pub(super) fn attention_transient(&self, path: ComputePath, rows: f64, queries: f64, keys: f64, blocks: f64) -> f64 {
        let heads = self.model.num_attention_heads as f64;
        match self.attention_path(path) {
            AttentionPath::CpuKernel => 0.0,
            AttentionPath::Eager => rows * queries * keys * 3.0 * heads,
            AttentionPath::MemoryEfficient => {
                let (q, k) = self.attention_blocks(rows, queries, keys);
                // The last query block sees every key before its diagonal.
                let widest_span = k.min(q.max(keys - q));
                let diagonal_bias = if q > 1.0 { rows * heads * q * q } else { 0.0 };
                blocks * rows * heads * q * widest_span + diagonal_bias
            }
        }
    }

    /// Bytes of the masks one pass builds for `rows` sequences of `queries` new tokens over
    /// `keys` keys with activations of `act` bytes: where the CPU kernels may run, the bias
    /// `[b, 1, q, k]` they take; for the eager formula the bias and its per-head copy; for the
    /// memory-efficient attention on a pass it runs (`path`), its causal blocks.
    pub(super) fn masks(&self, path: ComputePath, rows: f64, queries: f64, keys: f64, act: f64) -> f64 {
        let heads = self.model.num_attention_heads as f64;
        let kernels = self.device == PlanDevice::CpuKernels;
        let bias = rows * queries * keys * act;
        match self.attention_path(path) {
            _ if self.attention == AttnImplementation::Eager => bias * (1.0 + heads),
            AttentionPath::CpuKernel => bias,
            _ => f64::from(u8::from(kernels)) * bias + self.causal_blocks(rows, queries, keys),
        }
    }

    /// What of [`Self::masks`] the update keeps for its backward pass: the CPU kernel's node
    /// keeps its bias, the memory-efficient node its causal blocks; the eager formula's addition
    /// keeps nothing.
    pub(super) fn masks_kept(&self, rows: f64, len: f64, act: f64) -> f64 {
        match self.attention_path(self.path()) {
            AttentionPath::CpuKernel => rows * len * len * act,
            AttentionPath::Eager => 0.0,
            AttentionPath::MemoryEfficient => self.causal_blocks(rows, len, len),
        }
    }

    /// The memory-efficient attention's causal masks of one pass of `queries` new tokens over
    /// `keys` keys: the triangle of a query block's own keys at its scores' shape,
    /// `rows · heads · block²` f32, shared by every query block, and the last block's smaller one
    /// when the new tokens are not a multiple of the block.
    fn causal_blocks(&self, rows: f64, queries: f64, keys: f64) -> f64 {
        let (q, _) = self.attention_blocks(rows, queries, keys);
        let heads = self.model.num_attention_heads as f64;
        let last = queries % q;
        let triangles = if q > 1.0 { q * q } else { 0.0 } + if queries > q && last > 1.0 { last * last } else { 0.0 };
        rows * heads * triangles * F32
    }
}

//! How much a [`Decoder`](super::Decoder) runs at once ([`DecoderLimits`]), and the KV budget
//! one sequence needs alone ([`positions_to_hold`]).

use crate::qwen3::BLOCK_SIZE;

/// The KV budget (in positions) that holds one sequence of `len` positions alone: its blocks and
/// the scratch block. A smaller budget makes [`Decoder::step`](super::Decoder::step) fail on
/// such a sequence.
pub fn positions_to_hold(len: usize) -> usize {
    (len.div_ceil(BLOCK_SIZE) + 1) * BLOCK_SIZE
}

/// How much a [`Decoder`](super::Decoder) runs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderLimits {
    /// Most sequences decoding at once (vLLM's `max_num_seqs`); the others wait, in order.
    /// A decoding pass runs a token a row, so no more than `max_batched_tokens` rows run
    /// ([`DecoderLimits::rows`]).
    pub max_rows: usize,
    /// Most tokens one step runs (vLLM's `max_num_batched_tokens`): the running rows' one each,
    /// then the joining sequences' (a prefill pass's rows × new positions with padding, where
    /// it is a pass of its own). Longer prefills run in chunks over the next steps, beside the
    /// decoding rows, bounding activation memory and each step's time.
    pub max_batched_tokens: usize,
    /// Most KV positions the pool holds per layer, in blocks of [`BLOCK_SIZE`]: every running and
    /// parked sequence's blocks and one block of scratch; `None`: no limit. A position of Qwen3
    /// costs `2 · layers · kv_heads · head_dim` values. A pass also gathers its rows' keys and
    /// values for one layer at a time (rows × the longest row's positions), outside the pool.
    pub kv_budget: Option<usize>,
    /// Sequences share the blocks of equal prefixes (see the module docs): only for a decoder
    /// whose steps all run the same model (weights and adapters).
    pub share_prefixes: bool,
    /// A step with sequences joining runs their prefill beside the running rows' decoding in
    /// ragged passes (see the module docs), where the model takes such passes
    /// ([`crate::Qwen3ForCausalLM::takes_ragged_passes`]: a GPU backend's paged-attention kernel
    /// that takes prefills); otherwise, or when `false`, in passes of their own.
    pub ragged_passes: bool,
}

impl DecoderLimits {
    /// Most sequences running at once: `max_rows`, and no more than `max_batched_tokens` (a
    /// pass runs at least a token a row), at least one.
    pub fn rows(&self) -> usize {
        self.max_rows.min(self.max_batched_tokens).max(1)
    }
}

impl Default for DecoderLimits {
    /// No limit on rows, prefill size or KV memory; no prefix shared; ragged passes where the
    /// model takes them.
    fn default() -> Self {
        Self {
            max_rows: usize::MAX,
            max_batched_tokens: usize::MAX,
            kv_budget: None,
            share_prefixes: false,
            ragged_passes: true,
        }
    }
}

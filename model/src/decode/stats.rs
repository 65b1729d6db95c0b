//! What a [`Decoder`](super::Decoder) has done so far ([`DecoderStats`]).

/// What a [`Decoder`](super::Decoder) has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecoderStats {
    /// Tokens of sequences joining, run through prefill passes or beside decoding rows in
    /// ragged passes (padding not counted).
    pub prefill_tokens: u64,
    /// Running sequences' one token a step (a decoding pass's rows, or a ragged pass's).
    pub decode_tokens: u64,
    /// Positions sequences took from other sequences' blocks instead of prefilling them
    /// ([`DecoderLimits::share_prefixes`](super::DecoderLimits::share_prefixes)).
    pub shared_prefix_tokens: u64,
    /// Sequences of the batch (running, or part-way through their prefill) whose cache was
    /// dropped to stay within the KV budget.
    pub preemptions: u64,
    /// Parked caches dropped to make room.
    pub evictions: u64,
    /// Most KV positions the pool held at once (see
    /// [`DecoderLimits::kv_budget`](super::DecoderLimits::kv_budget)).
    pub peak_kv_positions: usize,
    /// Most KV positions in use at once: the blocks sequences held (and the scratch block).
    pub peak_kv_positions_in_use: usize,
    /// Key columns the passes' rows spanned, summed over passes: rows × the longest row's
    /// positions, padding included. burn's ops gather that many keys and values per layer in a
    /// pass the model's kernel choice hands no paged-attention kernel (the CPU kernels and a GPU's kernel read
    /// only each row's own positions where they lie).
    pub attention_columns: u64,
    /// Forward passes run: a step's decoding pass and prefill pass, or its ragged pass (more
    /// where a step with no row running goes on until a prefill is done).
    pub passes: u64,
    /// Most positions one pass ran (rows × new positions with padding, or a ragged pass's
    /// tokens): at most
    /// [`DecoderLimits::max_batched_tokens`](super::DecoderLimits::max_batched_tokens).
    pub largest_pass: usize,
}

//! The one decode loop: a batch of sequences, each with its KV cache kept for as long as the
//! caller keeps the sequence, that sequences join and leave between steps, as an inference
//! engine runs them (vLLM's scheduler, in small).
//!
//! A caller adds sequences ([`Decoder::add`]), then calls [`Decoder::step`]: it prefills the
//! sequences waiting to join (only their tokens not cached yet), decodes one token's forward for
//! every running sequence, and returns each one's next-token logits. The caller chooses the
//! tokens and, for each sequence, [`accept`](Decoder::accept)s its token to go on,
//! [`park`](Decoder::park)s it (it leaves the batch and keeps its cache, e.g. while an
//! environment call runs; [`extend`](Decoder::extend) later adds the reply's tokens and it
//! rejoins) or [`finish`](Decoder::finish)es it (its cache is freed). `generate`, `serve` and the
//! trainer's rollouts all run on it.
//!
//! The cache is paged ([`KvCache`]): a sequence's positions live in blocks of
//! [`BLOCK_SIZE`] of one pool, taken as it grows and given back when it ends or its cache is
//! dropped, so memory follows the positions in use (rounded up to a block per sequence), not
//! the batch's longest row. Sequences leave and join by their block tables alone: nothing is
//! copied, and a parked sequence's blocks wait in the pool. The pool grows by an eighth when
//! full (each layer's pools copied into larger ones; on a GPU the step then gives the old pools'
//! pages back to the device, [`crate::device_memory::release_unused_pages`]), shrinks to the parked sequences' blocks once nothing runs or waits and at most half of
//! it is in use, and is freed when the decoder holds no sequence. Within [`DecoderLimits::kv_budget`]
//! (the pool's positions) a sequence waits to join until its blocks fit; parked caches are
//! dropped first (oldest first) and running sequences preempted (newest first) when growth
//! would pass it, as vLLM preempts: their tokens stay, and they are prefilled again when they
//! rejoin.
//!
//! With [`DecoderLimits::share_prefixes`], sequences whose tokens begin alike share the blocks
//! of their common prefix (vLLM's automatic prefix caching): every full block a sequence has
//! computed is indexed by its tokens and the block before it, and a sequence that joins with no
//! cache takes the indexed blocks its tokens begin with (counted, not copied) and prefills only
//! the rest. A shared block is full, so no sequence writes to it; it is freed when its last
//! holder lets it go. Among sequences joining together whose common prefix is not cached yet,
//! the first joins alone and the others (and those queued behind them) join at the next step,
//! over its blocks. A decoder that
//! shares prefixes must run one model: the blocks hold that model's keys and values.
//!
//! Where the model takes ragged passes ([`crate::Qwen3ForCausalLM::takes_ragged_passes`]: a GPU
//! backend's paged-attention kernel that takes prefills), a step with sequences joining runs
//! their uncached tokens beside the running rows' one token each in one pass, the rows' tokens
//! one after another with no padding (vLLM's mixed batches): a step costs one pass where it
//! cost a decoding pass and a prefill pass, which on a GPU whose steps are bound by launching
//! kernels is most of a prefill's cost. Elsewhere (the CPU, burn's ops) the prefill runs in a
//! pass of its own, its rows left-padded to the longest.
//!
//! A step runs at most [`DecoderLimits::max_batched_tokens`] tokens (vLLM's chunked prefill):
//! the running rows' one each first, then the joining sequences' in order while there is room.
//! A prefill that does not fit goes on at the next steps, ahead of the sequences waiting, while
//! the running rows go on decoding, so a long prompt or reply never holds them up for more than
//! a step of that size. With no row running a step goes on until a prefill is done.
//!
//! Each pass's rows attend to their own slots: the CPU kernels read them in place, burn's ops
//! (the GPU path; burn has no paged attention op) get them gathered one layer at a time as
//! `[rows, kv_heads, width, head_dim]`. Rows line up their newest positions, a shorter row's
//! columns in front point at a scratch slot and are masked out, and positions are per sequence (`0..len`), so which blocks a sequence holds and beside
//! which rows it runs never change what it computes, to float rounding: a pass's products and
//! sums may split differently with its rows, chunks and shared blocks (a sequence's logits
//! moved by 2–5e-6 on the CPU), which once in tens of thousands of sampled tokens turns a draw
//! that falls within that rounding of a boundary into the neighbouring token.

use std::collections::{BTreeMap, HashMap, VecDeque};

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::error::ModelError;
use crate::lora::CausalLm;
use crate::qwen3::{grown_capacity, KvCache, BLOCK_SIZE, SCRATCH_SLOT as SCRATCH};

/// While rows run, waiting sequences join once they are this fraction (1 / N) of the running
/// rows (see `Decoder::admit`): each group that joins costs a prefill pass of its own.
const JOIN_FRACTION: usize = 8;

/// The most steps a waiting sequence is held back to join with others.
const MAX_JOIN_WAIT: u64 = 8;

/// The KV budget (in positions) that holds one sequence of `len` positions alone: its blocks and
/// the scratch block. A smaller budget makes [`Decoder::step`] fail on such a sequence.
pub fn positions_to_hold(len: usize) -> usize {
    (len.div_ceil(BLOCK_SIZE) + 1) * BLOCK_SIZE
}

/// Names a sequence of a [`Decoder`]; chosen by the caller (a batch row, an episode, a request).
pub type SequenceId = u64;

/// How much a [`Decoder`] runs at once.
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

/// What a [`Decoder`] has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecoderStats {
    /// Tokens of sequences joining, run through prefill passes or beside decoding rows in
    /// ragged passes (padding not counted).
    pub prefill_tokens: u64,
    /// Running sequences' one token a step (a decoding pass's rows, or a ragged pass's).
    pub decode_tokens: u64,
    /// Positions sequences took from other sequences' blocks instead of prefilling them
    /// ([`DecoderLimits::share_prefixes`]).
    pub shared_prefix_tokens: u64,
    /// Sequences of the batch (running, or part-way through their prefill) whose cache was
    /// dropped to stay within the KV budget.
    pub preemptions: u64,
    /// Parked caches dropped to make room.
    pub evictions: u64,
    /// Most KV positions the pool held at once (see [`DecoderLimits::kv_budget`]).
    pub peak_kv_positions: usize,
    /// Most KV positions in use at once: the blocks sequences held (and the scratch block).
    pub peak_kv_positions_in_use: usize,
    /// Key columns the passes' rows spanned, summed over passes: rows × the longest row's
    /// positions, padding included. burn's ops gather that many keys and values per layer in a
    /// pass no paged-attention kernel is registered for (the CPU kernels and a GPU's kernel read
    /// only each row's own positions where they lie).
    pub attention_columns: u64,
    /// Forward passes run: a step's decoding pass and prefill pass, or its ragged pass (more
    /// where a step with no row running goes on until a prefill is done).
    pub passes: u64,
    /// Most positions one pass ran (rows × new positions with padding, or a ragged pass's
    /// tokens): at most [`DecoderLimits::max_batched_tokens`].
    pub largest_pass: usize,
}

/// The next-token logits of the sequences one step ran: row `i` of `logits` (`[rows, vocab]`)
/// belongs to `ids[i]`.
#[derive(Debug, Clone)]
pub struct StepLogits<B: Backend> {
    pub ids: Vec<SequenceId>,
    pub logits: Tensor<B, 2>,
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A row of the running batch.
    Running,
    /// Waiting to join.
    Queued,
    /// Joined with more tokens to prefill than its steps had room for (see
    /// [`DecoderLimits::max_batched_tokens`]): the next steps go on with the rest, ahead of the
    /// sequences waiting to join.
    Prefilling,
    /// Out of the batch (its caller is busy with it).
    Parked,
}

#[derive(Debug)]
struct Sequence {
    /// Every token of the sequence, cached or not.
    tokens: Vec<u32>,
    /// How many of `tokens` the cache holds (positions `0..cached`).
    cached: usize,
    /// Its block table: position `p` is in block `blocks[p / BLOCK_SIZE]`.
    blocks: Vec<usize>,
    /// Its leading blocks already indexed as prefixes (or found indexed for another holder).
    indexed: usize,
    place: Place,
    /// When it was parked (for dropping the oldest parked cache first).
    parked_at: u64,
    /// The step it started waiting to join at.
    queued_at: u64,
}

impl Sequence {
    /// The pool slot of its position `p`.
    fn slot(&self, p: usize) -> usize {
        self.blocks[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    }

    /// Blocks it lacks to hold `len` positions.
    fn blocks_short_of(&self, len: usize) -> usize {
        len.div_ceil(BLOCK_SIZE).saturating_sub(self.blocks.len())
    }
}

/// Which blocks of the pool are free, and how many sequences hold each of the others. Block 0
/// holds the scratch slot; it is never handed out.
#[derive(Debug, Default)]
struct BlockPool {
    /// Blocks the pool has (0 before the first sequence, else at least the scratch block).
    total: usize,
    free: Vec<usize>,
    /// Holders of each block (0 for free blocks and the scratch block).
    holders: Vec<u32>,
}

impl BlockPool {
    /// Blocks in use, the scratch block included.
    fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// `n` blocks, the pool grown (by [`grown_capacity`], within `cap` blocks) when too few are
    /// free; `None` when even `cap` blocks would not hold them.
    fn take(&mut self, n: usize, cap: Option<usize>) -> Option<Vec<usize>> {
        if self.free.len() < n {
            let needed = self.total.max(1) + n - self.free.len();
            let grown = grown_capacity(needed * BLOCK_SIZE) / BLOCK_SIZE;
            let total = cap.map_or(grown, |cap| grown.min(cap));
            if total < needed {
                return None;
            }
            // Taken from the end: the lowest new blocks first.
            self.free.extend((self.total.max(1)..total).rev());
            self.total = total;
            self.holders.resize(total, 0);
        }
        let blocks: Vec<usize> = (0..n).map(|_| self.free.pop().expect("checked above")).collect();
        for &b in &blocks {
            self.holders[b] = 1;
        }
        Some(blocks)
    }

    /// One more holder of `block`.
    fn share(&mut self, block: usize) {
        self.holders[block] += 1;
    }

    /// Lets go of `blocks`; those with no holder left are freed and returned. The next `take`
    /// hands freed blocks out again in their order (consecutive blocks stay consecutive, one
    /// run for the attention).
    fn give_back(&mut self, blocks: Vec<usize>) -> Vec<usize> {
        let freed: Vec<usize> = blocks
            .into_iter()
            .filter(|&b| {
                self.holders[b] -= 1;
                self.holders[b] == 0
            })
            .collect();
        self.free.extend(freed.iter().rev());
        freed
    }
}

/// A full block as the prefix index knows it: the block before it ([`NO_PARENT`] for a
/// sequence's first) and its tokens. The block before stands for the whole prefix: an indexed
/// block is only ever held with the blocks before it, so it is freed (and leaves the index)
/// no later than they are.
type BlockKey = (usize, [u32; BLOCK_SIZE]);

/// The parent of a sequence's first block in a [`BlockKey`].
const NO_PARENT: usize = usize::MAX;

/// The full blocks sequences computed, by what they hold (see [`DecoderLimits::share_prefixes`]).
#[derive(Debug, Default)]
struct PrefixIndex {
    blocks: HashMap<BlockKey, usize>,
    keys: HashMap<usize, BlockKey>,
}

impl PrefixIndex {
    /// The key of block `k` of a sequence of `tokens` held in `blocks`.
    fn key(tokens: &[u32], blocks: &[usize], k: usize) -> BlockKey {
        let parent = if k == 0 { NO_PARENT } else { blocks[k - 1] };
        let held: [u32; BLOCK_SIZE] = tokens[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE].try_into().expect("a full block");
        (parent, held)
    }

    /// Indexes `block` as `key`, unless another block already holds that prefix; whether it is
    /// indexed now.
    fn insert(&mut self, key: BlockKey, block: usize) -> bool {
        if self.keys.contains_key(&block) {
            return true;
        }
        if self.blocks.contains_key(&key) {
            return false;
        }
        self.blocks.insert(key, block);
        self.keys.insert(block, key);
        true
    }

    /// Forgets freed `blocks`.
    fn remove(&mut self, blocks: &[usize]) {
        for b in blocks {
            if let Some(key) = self.keys.remove(b) {
                self.blocks.remove(&key);
            }
        }
    }

    /// The indexed blocks `tokens` begin with, leaving at least one token after them (a
    /// sequence must prefill a token to get its next-token logits).
    fn lookup(&self, tokens: &[u32]) -> Vec<usize> {
        let mut found: Vec<usize> = Vec::new();
        while (found.len() + 1) * BLOCK_SIZE < tokens.len() {
            match self.blocks.get(&Self::key(tokens, &found, found.len())) {
                Some(&b) => found.push(b),
                None => break,
            }
        }
        found
    }
}

/// Sequences decoding together, joining and leaving between steps (see the module docs).
#[derive(Debug)]
pub struct Decoder<B: Backend> {
    limits: DecoderLimits,
    sequences: BTreeMap<SequenceId, Sequence>,
    queue: VecDeque<SequenceId>,
    /// The running sequences, in the order they joined.
    running: Vec<SequenceId>,
    /// The sequences whose prefill goes on at the next step, in the order they joined.
    prefilling: Vec<SequenceId>,
    /// The pools of keys and values (`None` while no sequence has been run).
    cache: Option<KvCache<B>>,
    pool: BlockPool,
    /// The full blocks sequences may share (empty unless `limits.share_prefixes`).
    prefixes: PrefixIndex,
    clock: u64,
    /// Steps run so far.
    steps: u64,
    stats: DecoderStats,
}

impl<B: Backend> Decoder<B> {
    /// An empty decoder.
    pub fn new(limits: DecoderLimits) -> Self {
        Self {
            limits,
            sequences: BTreeMap::new(),
            queue: VecDeque::new(),
            running: Vec::new(),
            prefilling: Vec::new(),
            cache: None,
            pool: BlockPool::default(),
            prefixes: PrefixIndex::default(),
            clock: 0,
            steps: 0,
            stats: DecoderStats::default(),
        }
    }

    /// Its limits.
    pub fn limits(&self) -> DecoderLimits {
        self.limits
    }

    /// What it has done so far.
    pub fn stats(&self) -> DecoderStats {
        self.stats
    }

    /// Whether `id` is one of its sequences (running, waiting or parked).
    pub fn contains(&self, id: SequenceId) -> bool {
        self.sequences.contains_key(&id)
    }

    /// Every token of sequence `id`, cached or not.
    pub fn tokens(&self, id: SequenceId) -> Option<&[u32]> {
        self.sequences.get(&id).map(|s| s.tokens.as_slice())
    }

    /// How many tokens of sequence `id` its cache holds.
    pub fn cached_len(&self, id: SequenceId) -> Option<usize> {
        self.sequences.get(&id).map(|s| s.cached)
    }

    /// Whether a step would have nothing to run (no sequence running, prefilling or waiting).
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty() && self.prefilling.is_empty()
    }

    /// Sequences waiting to join, and those joined whose prefill is not done.
    pub fn waiting(&self) -> usize {
        self.queue.len() + self.prefilling.len()
    }

    /// KV positions the pool holds now (per layer): the blocks of every sequence, free blocks
    /// and the scratch block.
    pub fn kv_positions(&self) -> usize {
        self.pool.total * BLOCK_SIZE
    }

    /// KV positions in use now: the blocks sequences hold, and the scratch block.
    pub fn kv_positions_in_use(&self) -> usize {
        self.pool.used() * BLOCK_SIZE
    }

    /// KV positions in blocks that only sequences out of the batch hold (parked, or waiting to
    /// join with a cache): what dropping their caches, as the KV budget does first, would free.
    pub fn kv_positions_evictable(&self) -> usize {
        self.evictable_blocks(&[], &[]) * BLOCK_SIZE
    }

    /// The longest running sequence's cached positions (0 when none runs): the next decode
    /// step's rows span one more than that.
    fn longest_running(&self) -> usize {
        self.running.iter().map(|id| self.sequences[id].cached).max().unwrap_or(0)
    }

    /// Adds a sequence of `tokens` (at least one), to join at the next step.
    pub fn add(&mut self, model: &impl CausalLm<B>, id: SequenceId, tokens: Vec<u32>) -> Result<(), ModelError> {
        if self.sequences.contains_key(&id) {
            return Err(ModelError::Input(format!("sequence {id} is already in the decoder")));
        }
        if tokens.is_empty() {
            return Err(ModelError::Input(format!("sequence {id} is empty")));
        }
        model.base().check_token_ids(&tokens)?;
        let sequence = Sequence {
            tokens,
            cached: 0,
            blocks: Vec::new(),
            indexed: 0,
            place: Place::Queued,
            parked_at: 0,
            queued_at: self.steps,
        };
        self.sequences.insert(id, sequence);
        self.queue.push_back(id);
        Ok(())
    }

    /// Appends `tokens` to parked sequence `id` (e.g. an environment's reply), which rejoins at
    /// the next step: only its tokens not cached yet are prefilled.
    pub fn extend(&mut self, model: &impl CausalLm<B>, id: SequenceId, tokens: &[u32]) -> Result<(), ModelError> {
        model.base().check_token_ids(tokens)?;
        let steps = self.steps;
        let sequence = self.sequences.get_mut(&id).ok_or_else(|| unknown(id))?;
        if sequence.place != Place::Parked {
            return Err(ModelError::Input(format!("sequence {id} is not parked: only a parked sequence can be extended")));
        }
        if sequence.tokens.len() + tokens.len() == sequence.cached {
            return Err(ModelError::Input(format!("sequence {id} has no new token to decode from")));
        }
        sequence.tokens.extend_from_slice(tokens);
        sequence.place = Place::Queued;
        sequence.queued_at = steps;
        self.queue.push_back(id);
        Ok(())
    }

    /// Appends the token chosen for running sequence `id`, which the next step feeds.
    pub fn accept(&mut self, id: SequenceId, token: u32) -> Result<(), ModelError> {
        let sequence = self.sequences.get_mut(&id).ok_or_else(|| unknown(id))?;
        if sequence.place != Place::Running || sequence.tokens.len() != sequence.cached {
            return Err(ModelError::Input(format!("sequence {id} is not waiting for a token")));
        }
        sequence.tokens.push(token);
        Ok(())
    }

    /// Takes sequence `id` out of the batch (or the queue), keeping its cache: its blocks stay
    /// in the pool, nothing is copied.
    pub fn park(&mut self, id: SequenceId) -> Result<(), ModelError> {
        let clock = self.clock;
        self.clock += 1;
        let sequence = self.sequences.get_mut(&id).ok_or_else(|| unknown(id))?;
        sequence.parked_at = clock;
        match std::mem::replace(&mut sequence.place, Place::Parked) {
            Place::Queued => self.queue.retain(|&q| q != id),
            Place::Running => self.running.retain(|&r| r != id),
            Place::Prefilling => self.prefilling.retain(|&r| r != id),
            Place::Parked => {}
        }
        self.shrink_pool();
        Ok(())
    }

    /// Removes sequence `id` and frees its cache; returns its tokens. The pool itself is freed
    /// once no sequence is left.
    pub fn finish(&mut self, id: SequenceId) -> Option<Vec<u32>> {
        let sequence = self.sequences.remove(&id)?;
        match sequence.place {
            Place::Running => self.running.retain(|&r| r != id),
            Place::Prefilling => self.prefilling.retain(|&r| r != id),
            Place::Queued => self.queue.retain(|&q| q != id),
            Place::Parked => {}
        }
        self.release(sequence.blocks);
        if self.sequences.is_empty() {
            self.cache = None;
            self.pool = BlockPool::default();
            self.prefixes = PrefixIndex::default();
        } else {
            self.shrink_pool();
        }
        Some(sequence.tokens)
    }

    /// Once no sequence runs or waits and at most half the pool is in use, moves the blocks the
    /// parked sequences hold to a pool of just those (a copy of the positions in use): a
    /// server's cached prefixes keep their caches, not the pool a burst of requests grew.
    fn shrink_pool(&mut self) {
        if !self.is_idle() || self.pool.used() * 2 > self.pool.total {
            return;
        }
        let Some(cache) = self.cache.as_mut() else { return };
        // New block `i` is old block `order[i]` (a shared block once); the scratch block stays
        // first.
        let mut order = vec![0];
        let mut moved: HashMap<usize, usize> = HashMap::new();
        let mut holders = vec![0];
        for sequence in self.sequences.values_mut() {
            for block in &mut sequence.blocks {
                let new = *moved.entry(*block).or_insert_with(|| {
                    order.push(*block);
                    holders.push(0);
                    order.len() - 1
                });
                holders[new] += 1;
                *block = new;
            }
        }
        let slots: Vec<usize> = order.iter().flat_map(|&b| b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE).collect();
        cache.keep_slots(&slots);
        self.pool = BlockPool { total: order.len(), free: Vec::new(), holders };
        // An indexed block and the one before it are held (by the same sequences), so both
        // moved.
        let renumber = |b: usize| if b == NO_PARENT { Some(b) } else { moved.get(&b).copied() };
        let mut prefixes = PrefixIndex::default();
        for (&block, &(parent, tokens)) in &self.prefixes.keys {
            if let (Some(parent), Some(block)) = (renumber(parent), renumber(block)) {
                prefixes.insert((parent, tokens), block);
            }
        }
        self.prefixes = prefixes;
    }

    /// Lets go of a sequence's `blocks`: the freed ones leave the prefix index.
    fn release(&mut self, blocks: Vec<usize>) {
        let freed = self.pool.give_back(blocks);
        self.prefixes.remove(&freed);
    }

    /// Indexes the full blocks sequence `id` has computed (when prefixes are shared), up to the
    /// first whose prefix another block holds already.
    fn index_blocks(&mut self, id: SequenceId) {
        if !self.limits.share_prefixes {
            return;
        }
        let s = self.sequences.get_mut(&id).expect("a sequence of the decoder");
        while s.indexed < s.cached / BLOCK_SIZE {
            let key = PrefixIndex::key(&s.tokens, &s.blocks, s.indexed);
            if !self.prefixes.insert(key, s.blocks[s.indexed]) {
                break;
            }
            s.indexed += 1;
        }
    }

    /// The indexed blocks a sequence with no cache would take ([`DecoderLimits::share_prefixes`]).
    fn shared_prefix(&self, s: &Sequence) -> Vec<usize> {
        if !self.limits.share_prefixes || s.cached > 0 || !s.blocks.is_empty() {
            return Vec::new();
        }
        self.prefixes.lookup(&s.tokens)
    }

    /// One step: makes room within the budget, decodes every running sequence one position,
    /// prefills the sequences that join, at most `max_batched_tokens` tokens in all (the
    /// running rows' first), and returns the next-token logits of the running sequences and of
    /// those whose prefill is done. A prefill that does not fit goes on at the next steps, while
    /// the running rows decode (vLLM's chunked prefill); when no row is running the step goes on
    /// until one sequence's prefill is done ([`Decoder::step_once`] returns after each). `None`
    /// when nothing is running or waiting.
    ///
    /// After a step, every sequence it returned must be accepted, parked or finished before
    /// the next. A sequence preempted for room is not returned until it has rejoined.
    pub fn step(&mut self, model: &impl CausalLm<B>) -> Result<Option<StepLogits<B>>, ModelError> {
        loop {
            let out = self.step_once(model)?;
            if out.is_some() || self.prefilling.is_empty() {
                return Ok(out);
            }
        }
    }

    /// [`Decoder::step`], but one step only: `None` also when no row was running and the
    /// prefills it ran are not done yet ([`Decoder::is_idle`] tells the two apart). For a caller
    /// that adds sequences between steps as they come (a server), so that a long prefill does
    /// not keep them waiting.
    pub fn step_once(&mut self, model: &impl CausalLm<B>) -> Result<Option<StepLogits<B>>, ModelError> {
        self.steps += 1;
        for id in &self.running {
            let s = &self.sequences[id];
            if s.tokens.len() != s.cached + 1 {
                return Err(ModelError::Input(format!(
                    "sequence {id} has no next token: accept, park or finish each sequence after a step"
                )));
            }
        }
        self.make_room_to_decode()?;
        let blocks_before = self.pool.total;
        let ragged = self.limits.ragged_passes && model.base().takes_ragged_passes();
        let admitted = self.admit(ragged)?;
        let out = if !admitted.is_empty() && ragged {
            self.ragged_step(model, admitted)
        } else {
            let decoded = self.decode_running(model);
            let prefilled = if admitted.is_empty() { None } else { self.prefill(model, admitted) };
            match (decoded, prefilled) {
                (None, None) => None,
                (Some(a), None) | (None, Some(a)) => Some(a),
                (Some(mut a), Some(b)) => {
                    a.ids.extend(b.ids);
                    Some(StepLogits {
                        ids: a.ids,
                        logits: Tensor::cat(vec![a.logits, b.logits], 0),
                    })
                }
            }
        };
        self.stats.peak_kv_positions = self.stats.peak_kv_positions.max(self.kv_positions());
        self.stats.peak_kv_positions_in_use = self.stats.peak_kv_positions_in_use.max(self.kv_positions_in_use());
        if blocks_before > 0 && self.pool.total > blocks_before {
            // A GPU backend's pool (CubeCL's) keeps a freed slice for later tensors of its page's
            // size class, and a grown pool is larger than any slice its predecessors freed, often
            // of another class: without giving the old pools' pages back, every size the pools
            // passed through would stay reserved until the decoder's caller cleans up (modelled
            // on CUDA's classes: 99 GiB reserved for a 45 GiB budget on an 80 GiB GPU, 50 GiB
            // with this).
            crate::device_memory::release_unused_pages::<B, _>(&model.base().device(), || ())?;
        }
        Ok(out)
    }

    /// The budget in blocks, if any.
    fn cap(&self) -> Option<usize> {
        self.limits.kv_budget.map(|budget| budget / BLOCK_SIZE)
    }

    /// Blocks the pool may still hand out within the budget (unbounded without one).
    fn blocks_left(&self) -> usize {
        // The scratch block is taken with the first.
        let used = self.pool.used().max(1);
        self.cap().map_or(usize::MAX, |cap| cap.saturating_sub(used))
    }

    /// Blocks the running rows take to decode one more position.
    fn blocks_to_decode(&self) -> usize {
        self.running.iter().map(|id| self.sequences[id].blocks_short_of(self.sequences[id].cached + 1)).sum()
    }

    /// Frees sequence `id`'s blocks; it keeps its tokens and is prefilled again on joining.
    fn drop_cache(&mut self, id: SequenceId) {
        let sequence = self.sequences.get_mut(&id).expect("a sequence of the decoder");
        sequence.cached = 0;
        sequence.indexed = 0;
        let blocks = std::mem::take(&mut sequence.blocks);
        self.release(blocks);
    }

    /// The sequences out of the batch (parked or waiting) not among `except`.
    fn out_of_batch<'a>(&'a self, except: &'a [SequenceId]) -> impl Iterator<Item = (&'a SequenceId, &'a Sequence)> {
        self.sequences.iter().filter(move |(id, s)| !except.contains(id) && matches!(s.place, Place::Queued | Place::Parked))
    }

    /// Blocks that dropping the caches of the sequences out of the batch (not among `except`)
    /// would free: those no other sequence holds, `keep` (blocks about to be shared) left out.
    fn evictable_blocks(&self, except: &[SequenceId], keep: &[usize]) -> usize {
        let mut held: HashMap<usize, u32> = HashMap::new();
        for (_, s) in self.out_of_batch(except) {
            for &b in &s.blocks {
                *held.entry(b).or_default() += 1;
            }
        }
        held.iter().filter(|&(b, &n)| self.pool.holders[*b] == n && !keep.contains(b)).count()
    }

    /// Drops the oldest cache of a sequence out of the batch (parked or waiting) not among
    /// `except`; whether there was one.
    fn evict_parked(&mut self, except: &[SequenceId]) -> bool {
        let oldest = self.out_of_batch(except).filter(|(_, s)| !s.blocks.is_empty()).min_by_key(|(_, s)| s.parked_at).map(|(&id, _)| id);
        let Some(id) = oldest else { return false };
        self.drop_cache(id);
        self.stats.evictions += 1;
        true
    }

    /// Keeps the next decode within the budget: drops parked caches, then preempts the newest
    /// sequences of the batch, those still prefilling first (their tokens kept; they wait to
    /// join again, first in line).
    fn make_room_to_decode(&mut self) -> Result<(), ModelError> {
        let Some(budget) = self.limits.kv_budget else { return Ok(()) };
        while self.blocks_to_decode() > self.blocks_left() {
            if self.evict_parked(&[]) {
                continue;
            }
            if self.running.len() == 1 && self.prefilling.is_empty() {
                let id = self.running[0];
                return Err(too_small(budget, id, self.sequences[&id].tokens.len()));
            }
            let id = match self.prefilling.pop() {
                Some(id) => id,
                None => self.running.pop().expect("rows are running"),
            };
            self.drop_cache(id);
            let steps = self.steps;
            let sequence = self.sequences.get_mut(&id).expect("a row's sequence");
            sequence.place = Place::Queued;
            sequence.queued_at = steps;
            self.queue.push_front(id);
            self.stats.preemptions += 1;
        }
        Ok(())
    }

    /// Takes waiting sequences into this step while rows and the budget allow. Outside ragged
    /// passes each group that joins costs a prefill pass of its own, so while rows are running
    /// the waiting ones join in groups: once they are [`JOIN_FRACTION`] of the running rows (or
    /// fill the room left), or the first has waited [`MAX_JOIN_WAIT`] steps; and not while a
    /// padded prefill is still going on. In a ragged step (`ragged`) they join the decoding
    /// rows' pass at once, while it has room for some of their tokens.
    fn admit(&mut self, ragged: bool) -> Result<Vec<SequenceId>, ModelError> {
        // Those prefilling go on first: they hold their blocks already. Outside ragged passes
        // no other joins them: a padded prefill's rows end together, so a short prompt would
        // wait for the long one's last chunk, and its padding would cost every chunk a row.
        let mut admitted = std::mem::take(&mut self.prefilling);
        if !ragged && !admitted.is_empty() {
            return Ok(admitted);
        }
        let running = self.running.len();
        if running > 0 && !ragged {
            let room = self.limits.rows().saturating_sub(running).max(1);
            let enough = self.queue.len() >= (running / JOIN_FRACTION).clamp(1, room);
            let waited = self.queue.front().map_or(0, |id| self.steps - self.sequences[id].queued_at);
            if !enough && waited < MAX_JOIN_WAIT {
                return Ok(admitted);
            }
        }
        // Blocks this step takes already: the running rows' next positions.
        let mut taken = self.blocks_to_decode();
        // Tokens this step runs already (a ragged pass's): the running rows' one each, then the
        // prefills going on. A sequence joins only where some of its tokens run now: it takes
        // its blocks on joining.
        let uncached = |s: &Sequence| s.tokens.len() - s.cached;
        let mut tokens = running + admitted.iter().map(|id| uncached(&self.sequences[id])).sum::<usize>();
        while let Some(&id) = self.queue.front() {
            if running + admitted.len() >= self.limits.rows() || (ragged && tokens >= self.limits.max_batched_tokens) {
                break;
            }
            let s = &self.sequences[&id];
            let shared = self.shared_prefix(s);
            if self.limits.share_prefixes && s.cached == 0 && self.joins_after(&admitted, &s.tokens, shared.len()) {
                // It shares more than the indexed blocks with a sequence joining now: it takes
                // them once they are computed, at the next step (the sequences behind it wait
                // with it, in order).
                break;
            }
            let needed = s.blocks_short_of(s.tokens.len()) - shared.len();
            if let Some(budget) = self.limits.kv_budget {
                if taken + needed > self.blocks_left() {
                    let mut except = admitted.clone();
                    except.push(id);
                    // Parked caches are dropped only when dropping them all would make room.
                    if taken + needed <= self.blocks_left() + self.evictable_blocks(&except, &shared) && self.evict_parked(&except) {
                        continue;
                    }
                    if running + admitted.len() == 0 {
                        return Err(too_small(budget, id, self.sequences[&id].tokens.len()));
                    }
                    break;
                }
            }
            taken += needed;
            self.queue.pop_front();
            if !shared.is_empty() {
                for &b in &shared {
                    self.pool.share(b);
                }
                let s = self.sequences.get_mut(&id).expect("a waiting sequence");
                s.cached = shared.len() * BLOCK_SIZE;
                s.indexed = shared.len();
                s.blocks = shared;
                self.stats.shared_prefix_tokens += s.cached as u64;
            }
            tokens += uncached(&self.sequences[&id]);
            admitted.push(id);
        }
        Ok(admitted)
    }

    /// Whether a sequence of `tokens` with no cache, finding `indexed` blocks of its prefix in
    /// the index, would find more once one of `admitted` has been prefilled: it begins with
    /// more full blocks of one of them (a token still after them).
    fn joins_after(&self, admitted: &[SequenceId], tokens: &[u32], indexed: usize) -> bool {
        let blocks = (tokens.len() - 1) / BLOCK_SIZE;
        if blocks <= indexed {
            return false;
        }
        let end = (indexed + 1) * BLOCK_SIZE;
        admitted.iter().any(|id| {
            let other = &self.sequences[id].tokens;
            other.len() >= end && other[..end] == tokens[..end]
        })
    }

    /// Gives sequence `id` the blocks it lacks to hold `len` positions (within the budget: the
    /// step made room first).
    fn grow_sequence(&mut self, id: SequenceId, len: usize) {
        let cap = self.cap();
        let needed = self.sequences[&id].blocks_short_of(len);
        if needed > 0 {
            let blocks = self.pool.take(needed, cap).expect("the step made room for its blocks");
            self.sequences.get_mut(&id).expect("a sequence of the decoder").blocks.extend(blocks);
        }
    }

    /// Runs one pass of the model over `ids` and `positions` (`[rows, new]`), writing the new
    /// positions to `write` and attending to `read` (`rows × width` slots; the scratch slot's
    /// columns are padding, masked out): the last hidden states. A ragged pass (`ragged`: its
    /// rows' lengths) has `ids` `[1, tokens]`, the rows one after another
    /// ([`KvCache::set_ragged_slots`]).
    fn pass(
        &mut self,
        model: &impl CausalLm<B>,
        ids: Tensor<B, 2, Int>,
        positions: Tensor<B, 2, Int>,
        (write, read): (Vec<usize>, Vec<usize>),
        ragged: Option<&[usize]>,
    ) -> Tensor<B, 3> {
        let device = model.base().device();
        self.stats.attention_columns += read.len() as u64;
        self.stats.passes += 1;
        self.stats.largest_pass = self.stats.largest_pass.max(ids.dims().iter().product());
        let total = self.pool.total * BLOCK_SIZE;
        let cache = self.cache.get_or_insert_with(|| model.base().new_cache());
        cache.reserve(total);
        // A ragged pass's padding is in its slots; a padded pass's in the mask too.
        let mask = match ragged {
            Some(lens) => {
                cache.set_ragged_slots(write, read, lens, &device);
                None
            }
            None => {
                let rows = ids.dims()[0];
                let mask = device_mask::<B>(&read, rows, &device);
                cache.set_slots(write, read, rows, &device);
                mask
            }
        };
        model
            .base()
            .model
            .forward_with_adapters(ids, positions, mask.as_ref(), Some(cache), false, model.adapters())
            .last_hidden_state
    }

    /// Feeds every running row its one new token.
    fn decode_running(&mut self, model: &impl CausalLm<B>) -> Option<StepLogits<B>> {
        if self.running.is_empty() {
            return None;
        }
        let device = model.base().device();
        let ids = self.running.clone();
        for &id in &ids {
            let len = self.sequences[&id].cached + 1;
            self.grow_sequence(id, len);
        }
        let n = ids.len();
        let width = self.longest_running() + 1;
        let (mut tokens, mut positions) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut write, mut read) = (Vec::with_capacity(n), Vec::with_capacity(n * width));
        for id in &ids {
            let s = &self.sequences[id];
            let pad = width - 1 - s.cached;
            tokens.push(i64::from(s.tokens[s.cached]));
            positions.push(s.cached as i64);
            write.push(s.slot(s.cached));
            read.extend(std::iter::repeat_n(SCRATCH, pad));
            read.extend((0..=s.cached).map(|p| s.slot(p)));
        }
        let hidden = self.pass(
            model,
            Tensor::from_data(TensorData::new(tokens, [n, 1]), &device),
            Tensor::from_data(TensorData::new(positions, [n, 1]), &device),
            (write, read),
            None,
        );
        for &id in &ids {
            self.sequences.get_mut(&id).expect("a row's sequence").cached += 1;
            self.index_blocks(id);
        }
        self.stats.decode_tokens += n as u64;
        let logits = model.base().logits(hidden);
        let vocab = logits.dims()[2];
        Some(StepLogits { ids, logits: logits.reshape([n, vocab]) })
    }

    /// Runs the uncached tokens of `group` through the model, their newest positions lined up,
    /// in one pass of at most the step's room (`max_batched_tokens` less the rows decoded before
    /// it, rows × new positions with padding): when that holds every row's tokens, adds them to
    /// the running rows and returns their next-token logits; otherwise the rows go on prefilling
    /// at the next step (lined up so, they all end together).
    fn prefill(&mut self, model: &impl CausalLm<B>, group: Vec<SequenceId>) -> Option<StepLogits<B>> {
        let device = model.base().device();
        let n = group.len();
        for &id in &group {
            let len = self.sequences[&id].tokens.len();
            self.grow_sequence(id, len);
        }
        let lens: Vec<(usize, usize)> = group
            .iter()
            .map(|id| {
                let s = &self.sequences[id];
                (s.cached, s.tokens.len() - s.cached)
            })
            .collect();
        let past = lens.iter().map(|l| l.0).max().unwrap_or(0);
        let new = lens.iter().map(|l| l.1).max().unwrap_or(0);
        // The rows running hold at most `rows()` ≤ `max_batched_tokens` with the group
        // (`admit`), so the room holds a position a row.
        let room = self.limits.max_batched_tokens.saturating_sub(self.running.len());
        let chunk = (room / n).clamp(1, new);
        // Row `r`'s columns: `past - cached` padding, its cached positions, `new - fresh`
        // padding, its new positions; this pass runs the first `chunk` of the new ones.
        let (mut write, mut read) = (Vec::with_capacity(n * chunk), Vec::with_capacity(n * (past + chunk)));
        let (mut ids, mut positions) = (Vec::with_capacity(n * chunk), Vec::with_capacity(n * chunk));
        let mut ran = Vec::with_capacity(n);
        for (id, &(cached, fresh)) in group.iter().zip(&lens) {
            let s = &self.sequences[id];
            let pad = (new - fresh).min(chunk);
            let real = chunk - pad;
            read.extend(std::iter::repeat_n(SCRATCH, past - cached));
            read.extend((0..cached).map(|p| s.slot(p)));
            read.extend(std::iter::repeat_n(SCRATCH, pad));
            read.extend((cached..cached + real).map(|p| s.slot(p)));
            write.extend(std::iter::repeat_n(SCRATCH, pad));
            write.extend((cached..cached + real).map(|p| s.slot(p)));
            ids.extend(std::iter::repeat_n(0, pad));
            ids.extend(s.tokens[cached..cached + real].iter().map(|&t| i64::from(t)));
            positions.extend(std::iter::repeat_n(0, pad));
            positions.extend((cached..cached + real).map(|p| p as i64));
            ran.push(real);
        }
        let hidden = self.pass(
            model,
            Tensor::from_data(TensorData::new(ids, [n, chunk]), &device),
            Tensor::from_data(TensorData::new(positions, [n, chunk]), &device),
            (write, read),
            None,
        );
        let done = chunk == new;
        for (&id, &real) in group.iter().zip(&ran) {
            let s = self.sequences.get_mut(&id).expect("a joining sequence");
            s.cached += real;
            s.place = if done { Place::Running } else { Place::Prefilling };
            self.stats.prefill_tokens += real as u64;
            self.index_blocks(id);
        }
        if !done {
            self.prefilling = group;
            return None;
        }
        self.running.extend(&group);
        // Only the last position's logits are needed: the others would cost a vocabulary-sized
        // product each.
        let last = model.base().logits(hidden.narrow(1, chunk - 1, 1));
        let vocab = last.dims()[2];
        Some(StepLogits {
            ids: group,
            logits: last.reshape([n, vocab]),
        })
    }

    /// One step as one ragged pass (vLLM's mixed batches): the running rows' one token each,
    /// then the joining sequences' uncached tokens in order while the pass has room
    /// (`max_batched_tokens`), one row after another with no padding. A sequence whose tokens
    /// did not all fit goes on prefilling at the next step. Returns the next-token logits of the
    /// running rows, then of the sequences whose prefill is done; `None` when none is.
    fn ragged_step(&mut self, model: &impl CausalLm<B>, group: Vec<SequenceId>) -> Option<StepLogits<B>> {
        let device = model.base().device();
        let running = self.running.clone();
        for &id in &running {
            let len = self.sequences[&id].cached + 1;
            self.grow_sequence(id, len);
        }
        for &id in &group {
            let len = self.sequences[&id].tokens.len();
            self.grow_sequence(id, len);
        }
        // (sequence, its first position to run, the end of its positions, positions run): the
        // running rows hold at most `rows()` ≤ `max_batched_tokens` (`admit`), so all fit.
        let mut room = self.limits.max_batched_tokens.max(1);
        let mut rows: Vec<(SequenceId, usize, usize, usize)> = Vec::with_capacity(running.len() + group.len());
        for (&id, decoding) in running.iter().map(|id| (id, true)).chain(group.iter().map(|id| (id, false))) {
            let s = &self.sequences[&id];
            let end = if decoding { s.cached + 1 } else { s.tokens.len() };
            let n = (end - s.cached).min(room);
            room -= n;
            rows.push((id, s.cached, end, n));
        }
        let width = rows.iter().filter(|row| row.3 > 0).map(|&(_, next, _, n)| next + n).max().expect("a pass runs a row");
        let (mut tokens, mut positions, mut write, mut read, mut lens) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &(id, next, _, n) in rows.iter().filter(|row| row.3 > 0) {
            let s = &self.sequences[&id];
            tokens.extend(s.tokens[next..next + n].iter().map(|&t| i64::from(t)));
            positions.extend((next..next + n).map(|p| p as i64));
            write.extend((next..next + n).map(|p| s.slot(p)));
            read.extend(std::iter::repeat_n(SCRATCH, width - next - n));
            read.extend((0..next + n).map(|p| s.slot(p)));
            lens.push(n);
        }
        let count = tokens.len();
        let hidden = self.pass(
            model,
            Tensor::from_data(TensorData::new(tokens, [1, count]), &device),
            Tensor::from_data(TensorData::new(positions, [1, count]), &device),
            (write, read),
            Some(&lens),
        );
        // The rows whose last position ran: the next-token logits of that position only.
        let (mut ids, mut ends) = (Vec::new(), Vec::new());
        let mut at = 0;
        for (r, &(id, next, end, n)) in rows.iter().enumerate() {
            at += n;
            let s = self.sequences.get_mut(&id).expect("a sequence of the step");
            s.cached += n;
            if r < running.len() {
                self.stats.decode_tokens += 1;
            } else {
                self.stats.prefill_tokens += n as u64;
            }
            if next + n == end {
                ends.push(at as i64 - 1);
                ids.push(id);
                if s.place == Place::Prefilling || s.place == Place::Queued {
                    s.place = Place::Running;
                    self.running.push(id);
                }
            } else {
                s.place = Place::Prefilling;
                self.prefilling.push(id);
            }
            self.index_blocks(id);
        }
        if ends.is_empty() {
            return None;
        }
        let k = ends.len();
        let hidden = match k == count {
            true => hidden,
            false => hidden.select(1, Tensor::from_data(TensorData::new(ends, [k]), &device)),
        };
        let last = model.base().logits(hidden);
        let vocab = last.dims()[2];
        Some(StepLogits { ids, logits: last.reshape([k, vocab]) })
    }
}

/// The attention mask of a pass's `rows` reading `read` (`[rows, width]` slots): a column is
/// valid unless it reads the scratch slot (padding); `None` when no column does.
fn device_mask<B: Backend>(read: &[usize], rows: usize, device: &B::Device) -> Option<Tensor<B, 2, Int>> {
    if !read.contains(&SCRATCH) {
        return None;
    }
    let values: Vec<i64> = read.iter().map(|&slot| i64::from(slot != SCRATCH)).collect();
    Some(Tensor::from_data(TensorData::new(values, [rows, read.len() / rows]), device))
}

fn unknown(id: SequenceId) -> ModelError {
    ModelError::Input(format!("no sequence {id} in the decoder"))
}

fn too_small(budget: usize, id: SequenceId, len: usize) -> ModelError {
    ModelError::Input(format!(
        "a KV budget of {budget} positions cannot hold sequence {id} even alone: its {len} tokens take {} \
         (blocks of {BLOCK_SIZE}, with the cache's scratch block); raise the budget or shorten the sequences",
        positions_to_hold(len)
    ))
}

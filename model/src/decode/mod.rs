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

mod blocks;
mod limits;
mod passes;
mod schedule;
mod stats;

pub use limits::{positions_to_hold, DecoderLimits};
pub use stats::DecoderStats;

use std::collections::{BTreeMap, HashMap, VecDeque};

use burn::tensor::{backend::Backend, Tensor};

use crate::error::ModelError;
use crate::lora::CausalLm;
use crate::qwen3::{KvCache, BLOCK_SIZE};

use blocks::{BlockPool, PrefixIndex, NO_PARENT};

/// Names a sequence of a [`Decoder`]; chosen by the caller (a batch row, an episode, a request).
pub type SequenceId = u64;

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
        check_fits_the_context(model, id, tokens.len())?;
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
        check_fits_the_context(model, id, sequence.tokens.len() + tokens.len())?;
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
            check_fits_the_context(model, *id, s.tokens.len())?;
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
}

/// Refuses a sequence of `len` tokens longer than `model`'s context (`max_position_embeddings`):
/// its positions past the context would have no meaning to the model.
fn check_fits_the_context<B: Backend>(model: &impl CausalLm<B>, id: SequenceId, len: usize) -> Result<(), ModelError> {
    let context = model.base().config.max_position_embeddings;
    if len > context {
        return Err(ModelError::Input(format!(
            "sequence {id} would hold {len} tokens, past the model's context of {context} tokens (max_position_embeddings)"
        )));
    }
    Ok(())
}

fn unknown(id: SequenceId) -> ModelError {
    ModelError::Input(format!("no sequence {id} in the decoder"))
}

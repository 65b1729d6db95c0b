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
//! Memory follows the tokens in use: a leaving sequence takes only its own positions with it,
//! padding that no running row uses any more is cut from the front of the batch, and the cache
//! buffers grow by an eighth. Within [`DecoderLimits::kv_budget`] (KV positions held, running
//! and parked together) a sequence waits to join until it fits; parked caches are dropped first
//! (oldest first) and running sequences preempted (newest first) when growth would pass it, as
//! vLLM preempts: their tokens stay, and they are prefilled again when they rejoin.
//!
//! Rows of one batch line up their newest positions: a row that joins beside longer ones has
//! empty positions in front (masked out), a longer one widens the batch (the other rows' new
//! columns masked), and positions are per sequence (`0..len`), so where a row sits in the
//! batch, and which of its columns hold its positions, never changes what it computes. The rows
//! share one buffer per layer (burn has no paged attention). The place a row leaves stays in
//! the batch (decoded past and ignored, a [`DecoderStats::vacant_rows`]), and sequences that
//! join (in groups while rows run) take such places: only their own positions are copied in
//! ([`KvCache::place`](crate::qwen3::KvCache::place), a [`DecoderStats::joins_in_place`]).
//! The batch's cache is rebuilt, each kept position copied once
//! ([`KvCache::assemble`](crate::qwen3::KvCache::assemble)), only when a join finds too few
//! places, when the places that no parked sequence may take again reach an eighth of the rows
//! with nobody waiting, or when the budget needs their memory. A parked sequence's cache stays
//! in the row it left until it rejoins, another sequence needs the place or the batch is
//! rebuilt, and is copied out then: no cache is ever held twice.

use std::collections::{BTreeMap, VecDeque};

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::error::ModelError;
use crate::lora::CausalLm;
use crate::qwen3::{grown_capacity, KvCache, RowBlock, GROWTH_STEP};

/// While rows run, waiting sequences join once they are this fraction (1 / N) of the running
/// rows (see `Decoder::admit`), and the places rows left are dropped without a join once they
/// are this fraction of the batch's rows (see `Decoder::compact`).
const JOIN_FRACTION: usize = 8;

/// The most steps a waiting sequence is held back to join with others.
const MAX_JOIN_WAIT: u64 = 8;

/// Names a sequence of a [`Decoder`]; chosen by the caller (a batch row, an episode, a request).
pub type SequenceId = u64;

/// How much a [`Decoder`] runs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderLimits {
    /// Most sequences decoding at once (vLLM's `max_num_seqs`); the others wait, in order.
    pub max_rows: usize,
    /// Most positions one prefill pass runs, rows × new positions with padding (vLLM's
    /// `max_num_batched_tokens`); longer prefills run in chunks, bounding activation memory.
    pub max_batched_tokens: usize,
    /// Most KV positions held at once per layer, over every row (spare capacity and padding
    /// included) and every parked cache; `None`: no limit. A position of Qwen3 costs
    /// `2 · layers · kv_heads · head_dim` values.
    pub kv_budget: Option<usize>,
}

impl Default for DecoderLimits {
    /// No limit on rows, prefill size or KV memory.
    fn default() -> Self {
        Self {
            max_rows: usize::MAX,
            max_batched_tokens: usize::MAX,
            kv_budget: None,
        }
    }
}

/// What a [`Decoder`] has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecoderStats {
    /// Tokens run through prefill passes (padding not counted).
    pub prefill_tokens: u64,
    /// Tokens run through one-token decode passes.
    pub decode_tokens: u64,
    /// Running sequences whose cache was dropped to stay within the KV budget.
    pub preemptions: u64,
    /// Parked caches dropped to make room.
    pub evictions: u64,
    /// Most KV positions held at once (see [`DecoderLimits::kv_budget`]).
    pub peak_kv_positions: usize,
    /// KV positions copied to rebuild the batch as rows left and joined (every kept row's
    /// positions once per rebuild, and each rejoining sequence's cache).
    pub rebuilt_positions: u64,
    /// Rows of one-token passes run for places that sequences had left (computed and ignored
    /// until the batch is rebuilt, instead of a copy of the batch at every leave).
    pub vacant_rows: u64,
    /// Joins whose sequences took places rows had left, the batch not rebuilt.
    pub joins_in_place: u64,
}

/// The next-token logits of the sequences one step ran: row `i` of `logits` (`[rows, vocab]`)
/// belongs to `ids[i]`.
#[derive(Debug, Clone)]
pub struct StepLogits<B: Backend> {
    pub ids: Vec<SequenceId>,
    pub logits: Tensor<B, 2>,
}

/// Where a sequence is.
#[derive(Debug)]
enum Place<B: Backend> {
    /// A row of the running batch.
    Running,
    /// Waiting to join, with its cache (`None`: nothing cached, or dropped for room).
    Queued(Option<KvCache<B>>),
    /// Out of the batch (its caller is busy with it), with its cache if kept.
    Parked(Option<KvCache<B>>),
    /// Out of the batch, its cache still in the row it left (`Batch::parked`): taken out when
    /// it rejoins or the batch is rebuilt, so that no cache is held twice meanwhile.
    ParkedInRow,
}

#[derive(Debug)]
struct Sequence<B: Backend> {
    /// Every token of the sequence, cached or not.
    tokens: Vec<u32>,
    /// How many of `tokens` the cache holds (positions `0..cached`).
    cached: usize,
    place: Place<B>,
    /// When it was parked (for dropping the oldest parked cache first).
    parked_at: u64,
    /// The step it started waiting to join at.
    queued_at: u64,
}

impl<B: Backend> Sequence<B> {
    /// The cache held outside the batch, if any.
    fn own_cache(&self) -> Option<&KvCache<B>> {
        match &self.place {
            Place::Queued(c) | Place::Parked(c) => c.as_ref(),
            Place::Running | Place::ParkedInRow => None,
        }
    }
}

/// The running batch: one cache for every row, the rows' running sequences (`None`: a place a
/// sequence left, decoded past until the batch is rebuilt), the parked sequences whose caches
/// are still in the rows they left, and which cached positions of each row are its own.
#[derive(Debug)]
struct Batch<B: Backend> {
    cache: KvCache<B>,
    ids: Vec<Option<SequenceId>>,
    parked: BTreeMap<usize, SequenceId>,
    valid: Vec<Vec<bool>>,
    mask: DeviceMask<B>,
}

impl<B: Backend> Batch<B> {
    /// Row `row`'s own positions as a cache of their own (the batch's padding dropped).
    fn take_row(&self, row: usize) -> KvCache<B> {
        let slots: Vec<usize> = (0..self.valid[row].len()).filter(|&j| self.valid[row][j]).collect();
        self.cache.take_row(row, &slots)
    }
}

/// The device copy of `Batch::valid` that the attention takes.
#[derive(Debug)]
enum DeviceMask<B: Backend> {
    /// Rebuild from `valid` before the next pass.
    Stale,
    /// Every cached position of every row is valid: no mask.
    AllValid,
    Ready(Tensor<B, 2, Int>),
}

/// Sequences decoding together, joining and leaving between steps (see the module docs).
#[derive(Debug)]
pub struct Decoder<B: Backend> {
    limits: DecoderLimits,
    sequences: BTreeMap<SequenceId, Sequence<B>>,
    queue: VecDeque<SequenceId>,
    batch: Option<Batch<B>>,
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
            batch: None,
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

    /// Whether a step would have nothing to run (no sequence running or waiting).
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running_rows() == 0
    }

    /// Sequences waiting to join.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// KV positions held now: every row of the batch at its allocated capacity, and every
    /// cache held outside it.
    pub fn kv_positions(&self) -> usize {
        let batch = self.batch.as_ref().map_or(0, |b| b.ids.len() * b.cache.capacity());
        batch + self.sequences.values().filter_map(Sequence::own_cache).map(KvCache::capacity).sum::<usize>()
    }

    /// Columns of the running batch's cache (0 without a batch): at least as many as its longest
    /// row holds. Shorter rows mask the columns in front of theirs; a row may also have masked
    /// columns inside it (sequences prefilled together line up their new tokens, so one with a
    /// short reply keeps a gap between its cache and its reply), and columns no row uses any
    /// more stay until they are worth trimming.
    pub fn batch_width(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| b.cache.len())
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
            place: Place::Queued(None),
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
        let sequence = self.sequences.get(&id).ok_or_else(|| unknown(id))?;
        if !matches!(sequence.place, Place::Parked(_) | Place::ParkedInRow) {
            return Err(ModelError::Input(format!("sequence {id} is not parked: only a parked sequence can be extended")));
        }
        if sequence.tokens.len() + tokens.len() == sequence.cached {
            return Err(ModelError::Input(format!("sequence {id} has no new token to decode from")));
        }
        self.take_out_of_row(id);
        let sequence = self.sequences.get_mut(&id).expect("checked above");
        sequence.tokens.extend_from_slice(tokens);
        let Place::Parked(cache) = &mut sequence.place else { unreachable!("taken out of its row") };
        sequence.place = Place::Queued(cache.take());
        sequence.queued_at = self.steps;
        self.queue.push_back(id);
        Ok(())
    }

    /// Appends the token chosen for running sequence `id`, which the next step feeds.
    pub fn accept(&mut self, id: SequenceId, token: u32) -> Result<(), ModelError> {
        let sequence = self.sequences.get_mut(&id).ok_or_else(|| unknown(id))?;
        if !matches!(sequence.place, Place::Running) || sequence.tokens.len() != sequence.cached {
            return Err(ModelError::Input(format!("sequence {id} is not waiting for a token")));
        }
        sequence.tokens.push(token);
        Ok(())
    }

    /// Takes sequence `id` out of the batch (or the queue), keeping its cache (its own positions
    /// only, the batch's padding dropped; until it rejoins or the batch is rebuilt, in the row it
    /// left).
    pub fn park(&mut self, id: SequenceId) -> Result<(), ModelError> {
        let clock = self.clock;
        self.clock += 1;
        let sequence = self.sequences.get_mut(&id).ok_or_else(|| unknown(id))?;
        sequence.parked_at = clock;
        sequence.place = match std::mem::replace(&mut sequence.place, Place::Running) {
            Place::Queued(cache) => {
                self.queue.retain(|&q| q != id);
                Place::Parked(cache)
            }
            Place::Running => {
                let batch = self.batch.as_mut().expect("a running sequence has a batch");
                let row = batch.ids.iter().position(|&r| r == Some(id)).expect("a running sequence has a row");
                debug_assert_eq!(batch.valid[row].iter().filter(|&&v| v).count(), sequence.cached);
                batch.ids[row] = None;
                batch.parked.insert(row, id);
                Place::ParkedInRow
            }
            parked => parked,
        };
        Ok(())
    }

    /// Copies parked sequence `id`'s cache out of the row it left, if it is still there.
    fn take_out_of_row(&mut self, id: SequenceId) {
        let sequence = self.sequences.get_mut(&id).expect("a sequence of the decoder");
        if !matches!(sequence.place, Place::ParkedInRow) {
            return;
        }
        let mut batch = self.batch.take().expect("a sequence parked in a row has a batch");
        let row = batch.parked.iter().find(|&(_, &p)| p == id).map(|(&r, _)| r).expect("its row");
        self.release_parked_row(&mut batch, row);
        self.batch = Some(batch);
    }

    /// Copies the cache of the sequence parked in `row` of `batch` out of the row, for the
    /// sequence to hold itself (counted in `rebuilt_positions`); the row becomes a place left.
    fn release_parked_row(&mut self, batch: &mut Batch<B>, row: usize) {
        let id = batch.parked.remove(&row).expect("a row holding a parked sequence");
        let sequence = self.sequences.get_mut(&id).expect("a parked sequence");
        sequence.place = Place::Parked(Some(batch.take_row(row)));
        self.stats.rebuilt_positions += sequence.cached as u64;
    }

    /// Removes sequence `id` and frees its cache; returns its tokens.
    pub fn finish(&mut self, id: SequenceId) -> Option<Vec<u32>> {
        let sequence = self.sequences.remove(&id)?;
        match sequence.place {
            Place::Running => {
                if let Some(batch) = self.batch.as_mut() {
                    batch.ids.iter_mut().filter(|r| **r == Some(id)).for_each(|r| *r = None);
                }
            }
            Place::Queued(_) => self.queue.retain(|&q| q != id),
            Place::ParkedInRow => {
                if let Some(batch) = self.batch.as_mut() {
                    batch.parked.retain(|_, p| *p != id);
                }
            }
            Place::Parked(_) => {}
        }
        Some(sequence.tokens)
    }

    /// One step: makes room within the budget, decodes every running sequence one position,
    /// prefills the sequences that join (in chunks of at most `max_batched_tokens`), and
    /// returns the next-token logits of all of them. `None` when nothing is running or waiting.
    ///
    /// After a step, every sequence it returned must be accepted, parked or finished before
    /// the next. A sequence preempted for room is not returned until it has rejoined.
    pub fn step(&mut self, model: &impl CausalLm<B>) -> Result<Option<StepLogits<B>>, ModelError> {
        self.steps += 1;
        self.compact(false);
        if let Some(batch) = &self.batch {
            for id in batch.ids.iter().flatten() {
                let s = &self.sequences[id];
                if s.tokens.len() != s.cached + 1 {
                    return Err(ModelError::Input(format!(
                        "sequence {id} has no next token: accept, park or finish each sequence after a step"
                    )));
                }
            }
        }
        self.make_room_to_decode()?;
        let admitted = self.admit()?;
        let decoded = self.decode_running(model);
        let prefilled = (!admitted.is_empty()).then(|| self.prefill(model, admitted));
        self.stats.peak_kv_positions = self.stats.peak_kv_positions.max(self.kv_positions());
        Ok(match (decoded, prefilled) {
            (None, None) => None,
            (Some(a), None) | (None, Some(a)) => Some(a),
            (Some(mut a), Some(b)) => {
                a.ids.extend(b.ids);
                Some(StepLogits {
                    ids: a.ids,
                    logits: Tensor::cat(vec![a.logits, b.logits], 0),
                })
            }
        })
    }

    fn running_rows(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| b.ids.iter().flatten().count())
    }

    /// Rebuilds the batch without the rows that left (once those that no parked sequence may
    /// take again are an eighth of its rows and no sequence waits to join; always when
    /// `force`d) or without the leading positions no row uses any more (once they are worth a
    /// copy).
    fn compact(&mut self, force: bool) {
        let Some(batch) = self.batch.as_ref() else { return };
        let rows = batch.ids.len();
        let running: Vec<usize> = (0..rows).filter(|&r| batch.ids[r].is_some()).collect();
        if running.is_empty() {
            // Takes the parked caches out of their rows.
            let batch = self.batch.take().expect("checked above");
            self.batch = self.rebuild(batch, None);
            return;
        }
        let holes = rows - running.len();
        // Parked sequences are expected back (an environment's reply): they rejoin in places
        // rows left, so the places they may take are not counted against the batch.
        let returning = self.sequences.values().filter(|s| matches!(s.place, Place::Parked(_) | Place::ParkedInRow)).count();
        let spare = holes.saturating_sub(returning);
        let drop_holes = holes > 0 && (force || spare * JOIN_FRACTION >= rows && self.queue.is_empty());
        let width = batch.cache.len();
        let lead = running.iter().chain(batch.parked.keys()).map(|&r| leading_invalid(&batch.valid[r])).min().unwrap_or(0);
        let trim = lead > 0 && lead >= (width / 8).max(GROWTH_STEP);
        if drop_holes || trim {
            let batch = self.batch.take().expect("checked above");
            self.batch = self.rebuild(batch, None);
        }
    }

    /// The rows of `batch` still running, then every row of `joined`, in one batch whose cache
    /// lines up their newest positions and drops the leading positions no row uses: each kept
    /// position is copied once. `None` when no row is left.
    fn rebuild(&mut self, mut batch: Batch<B>, joined: Option<Batch<B>>) -> Option<Batch<B>> {
        let parked: Vec<usize> = batch.parked.keys().copied().collect();
        for row in parked {
            self.release_parked_row(&mut batch, row);
        }
        let parts: Vec<Batch<B>> = std::iter::once(batch).chain(joined).collect();
        let kept: Vec<(Vec<usize>, usize, usize)> = parts
            .iter()
            .map(|part| {
                let rows: Vec<usize> = (0..part.ids.len()).filter(|&r| part.ids[r].is_some()).collect();
                let width = part.cache.len();
                let lead = rows.iter().map(|&r| leading_invalid(&part.valid[r])).min().unwrap_or(width);
                (rows, lead, width)
            })
            .collect();
        let width = kept.iter().map(|(_, lead, w)| w - lead).max().unwrap_or(0);
        let total: usize = kept.iter().map(|(rows, ..)| rows.len()).sum();
        if total == 0 {
            return None;
        }
        let (mut sources, mut blocks, mut ids, mut valid) = (Vec::new(), Vec::new(), Vec::with_capacity(total), Vec::with_capacity(total));
        for (i, (part, (rows, lead, part_width))) in parts.into_iter().zip(&kept).enumerate() {
            let pad = width - (part_width - lead);
            let mut r = 0;
            while r < rows.len() {
                let run = rows[r..].iter().enumerate().take_while(|&(k, &row)| row == rows[r] + k).count();
                blocks.push(RowBlock {
                    source: i,
                    rows: rows[r]..rows[r] + run,
                    positions: *lead..*part_width,
                    at: [ids.len() + r, pad],
                });
                r += run;
            }
            for &row in rows {
                ids.push(part.ids[row]);
                let mut v = vec![false; pad];
                v.extend_from_slice(&part.valid[row][*lead..]);
                valid.push(v);
            }
            self.stats.rebuilt_positions += (rows.len() * (part_width - lead)) as u64;
            sources.push(part.cache);
        }
        Some(Batch {
            cache: KvCache::assemble(sources, &blocks, total, width, grown_capacity(width)),
            ids,
            parked: BTreeMap::new(),
            valid,
            mask: DeviceMask::Stale,
        })
    }

    /// Puts the rows of `joined` in places of `batch` that no running row holds: places rows
    /// left, then rows of parked sequences (whose caches are copied out first, as a rebuild
    /// would). Each joined row's positions end at the batch's newest column; a joining row
    /// longer than the batch widens it in front, the other rows moved on (a copy of the batch,
    /// as a rebuild would make; widening at the end instead would leave every other row a gap
    /// that no trim removes, and the batch would grow wider than its longest row while episodes
    /// of all ages join it). Otherwise only the joining rows' positions are copied, where a
    /// rebuild copies every row's. Gives both back when there are too few such places or the KV
    /// budget would not hold the batch at its number of rows.
    fn join_in_place(&mut self, mut batch: Batch<B>, joined: Batch<B>) -> Result<Batch<B>, (Batch<B>, Batch<B>)> {
        let n = joined.ids.len();
        let vacant: Vec<usize> = (0..batch.ids.len()).filter(|r| batch.ids[*r].is_none() && !batch.parked.contains_key(r)).collect();
        let parked: Vec<usize> = batch.parked.keys().copied().take(n.saturating_sub(vacant.len())).collect();
        if vacant.len() + parked.len() < n {
            return Err((batch, joined));
        }
        let (width, joined_width) = (batch.cache.len(), joined.cache.len());
        let new_width = width.max(joined_width);
        // Room for the next decode step's position too, so that it does not grow the buffers again.
        let capacity = if new_width + 1 > batch.cache.capacity() { grown_capacity(new_width + 1) } else { batch.cache.capacity() };
        if let Some(budget) = self.limits.kv_budget {
            let taken_out: usize = parked.iter().map(|r| self.sequences[&batch.parked[r]].cached).sum();
            if batch.ids.len() * capacity + self.held_outside(&[]) + taken_out > budget {
                return Err((batch, joined));
            }
        }
        for &row in &parked {
            self.release_parked_row(&mut batch, row);
        }
        let places: Vec<usize> = vacant.into_iter().chain(parked).take(n).collect();
        let (offset, shift) = (new_width - joined_width, new_width - width);
        // One block per run of joined rows going to consecutive places.
        let mut blocks: Vec<RowBlock> = Vec::new();
        for (i, &row) in places.iter().enumerate() {
            match blocks.last_mut() {
                Some(b) if b.rows.end == i && b.at[0] + b.rows.len() == row => b.rows.end += 1,
                _ => blocks.push(RowBlock { source: 0, rows: i..i + 1, positions: 0..joined_width, at: [row, offset] }),
            }
        }
        batch.cache.place(joined.cache, &blocks, shift, new_width, new_width + 1);
        if shift > 0 {
            for v in &mut batch.valid {
                v.splice(0..0, std::iter::repeat_n(false, shift));
            }
            self.stats.rebuilt_positions += (batch.ids.len() * width) as u64;
        }
        for ((&row, id), valid) in places.iter().zip(joined.ids).zip(joined.valid) {
            batch.ids[row] = id;
            batch.valid[row] = std::iter::repeat_n(false, offset).chain(valid).collect();
        }
        batch.mask = DeviceMask::Stale;
        self.stats.rebuilt_positions += (n * joined_width) as u64;
        self.stats.joins_in_place += 1;
        Ok(batch)
    }

    /// Positions held by caches outside the batch, except those of `except`.
    fn held_outside(&self, except: &[SequenceId]) -> usize {
        self.sequences
            .iter()
            .filter(|(id, _)| !except.contains(id))
            .filter_map(|(_, s)| s.own_cache())
            .map(KvCache::capacity)
            .sum()
    }

    /// Drops the oldest cache held outside the batch (parked or waiting) not among `except`;
    /// whether there was one. Its sequence keeps its tokens and is prefilled again on joining.
    fn evict_parked(&mut self, except: &[SequenceId]) -> bool {
        let oldest = self
            .sequences
            .iter()
            .filter(|(id, s)| !except.contains(id) && s.own_cache().is_some())
            .min_by_key(|(_, s)| s.parked_at)
            .map(|(&id, _)| id);
        let Some(id) = oldest else { return false };
        let sequence = self.sequences.get_mut(&id).expect("just found");
        match &mut sequence.place {
            Place::Parked(cache) | Place::Queued(cache) => *cache = None,
            Place::Running | Place::ParkedInRow => unreachable!("holds no cache of its own"),
        }
        sequence.cached = 0;
        self.stats.evictions += 1;
        true
    }

    /// Positions the batch holds after decoding one more position.
    fn batch_after_decode(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| {
            let needed = b.cache.len() + 1;
            let capacity = if needed > b.cache.capacity() { grown_capacity(needed) } else { b.cache.capacity() };
            b.ids.len() * capacity
        })
    }

    /// Keeps the next decode within the budget: drops parked caches, then preempts the newest
    /// running rows (their tokens kept; they wait to join again, first in line).
    fn make_room_to_decode(&mut self) -> Result<(), ModelError> {
        let Some(budget) = self.limits.kv_budget else { return Ok(()) };
        while self.batch_after_decode() + self.held_outside(&[]) > budget {
            if self.evict_parked(&[]) {
                continue;
            }
            if self.has_holes() {
                self.compact(true);
                continue;
            }
            let Some(batch) = self.batch.as_mut() else { return Ok(()) };
            if batch.ids.len() == 1 {
                let id = batch.ids[0].expect("compacted");
                return Err(too_small(budget, id, self.sequences[&id].tokens.len()));
            }
            let row = batch.ids.len() - 1;
            let id = batch.ids[row].take().expect("compacted");
            let sequence = self.sequences.get_mut(&id).expect("a row's sequence");
            sequence.cached = 0;
            sequence.place = Place::Queued(None);
            sequence.queued_at = self.steps;
            self.queue.push_front(id);
            self.stats.preemptions += 1;
            self.compact(true);
        }
        Ok(())
    }

    /// Whether rows that left still hold their place in the batch.
    fn has_holes(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| b.ids.iter().any(Option::is_none))
    }

    /// Takes waiting sequences into this step while rows and the budget allow. Joining copies
    /// the batch's cache (its rows share one buffer), so while rows are running the waiting ones
    /// join in groups: once they are [`JOIN_FRACTION`] of the running rows (or fill the room
    /// left), or the first has waited [`MAX_JOIN_WAIT`] steps.
    fn admit(&mut self) -> Result<Vec<SequenceId>, ModelError> {
        let mut admitted = Vec::new();
        let running = self.running_rows();
        if running > 0 {
            let room = self.limits.max_rows.saturating_sub(running).max(1);
            let enough = self.queue.len() >= (running / JOIN_FRACTION).clamp(1, room);
            let waited = self.queue.front().map_or(0, |id| self.steps - self.sequences[id].queued_at);
            if !enough && waited < MAX_JOIN_WAIT {
                return Ok(admitted);
            }
        }
        while let Some(&id) = self.queue.front() {
            if running + admitted.len() >= self.limits.max_rows {
                break;
            }
            if let Some(budget) = self.limits.kv_budget {
                admitted.push(id);
                let needed = self.positions_with(&admitted);
                admitted.pop();
                if needed > budget {
                    let mut except = admitted.clone();
                    except.push(id);
                    if self.evict_parked(&except) {
                        continue;
                    }
                    if self.has_holes() {
                        self.compact(true);
                        continue;
                    }
                    if running + admitted.len() == 0 {
                        return Err(too_small(budget, id, self.sequences[&id].tokens.len()));
                    }
                    break;
                }
            }
            self.queue.pop_front();
            admitted.push(id);
        }
        Ok(admitted)
    }

    /// Positions held once `group` has joined the batch and decoded one position.
    fn positions_with(&self, group: &[SequenceId]) -> usize {
        let (mut past, mut new) = (0, 0);
        for id in group {
            let s = &self.sequences[id];
            past = past.max(s.cached);
            new = new.max(s.tokens.len() - s.cached);
        }
        // Joining rebuilds the batch without the rows that left, in buffers grown for `width`,
        // and the parked caches still in their rows come out at their own size.
        let width = self.batch.as_ref().map_or(0, |b| b.cache.len()).max(past + new) + 1;
        let parked_in_rows: usize = self.batch.as_ref().map_or(0, |b| b.parked.values().map(|id| self.sequences[id].cached).sum());
        (self.running_rows() + group.len()) * grown_capacity(width) + parked_in_rows + self.held_outside(group)
    }

    /// Feeds every running row its one new token (and each place a row left, one it ignores).
    fn decode_running(&mut self, model: &impl CausalLm<B>) -> Option<StepLogits<B>> {
        let batch = self.batch.as_mut()?;
        let device = model.base().device();
        let n = batch.ids.len();
        let mut ids = Vec::with_capacity(n);
        let mut running = Vec::with_capacity(n);
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for (row, id) in batch.ids.iter().enumerate() {
            let Some(id) = *id else {
                tokens.push(0);
                positions.push(0);
                continue;
            };
            let s = self.sequences.get_mut(&id).expect("a row's sequence");
            tokens.push(i64::from(s.tokens[s.cached]));
            positions.push(s.cached as i64);
            s.cached += 1;
            ids.push(id);
            running.push(row);
        }
        batch.mask = match std::mem::replace(&mut batch.mask, DeviceMask::Stale) {
            DeviceMask::Stale => device_mask(&batch.valid, true, &device),
            DeviceMask::AllValid => DeviceMask::AllValid,
            DeviceMask::Ready(m) => DeviceMask::Ready(Tensor::cat(vec![m, Tensor::ones([n, 1], &device)], 1)),
        };
        // The rows that left compute on (ignored); their new positions are nobody's.
        for (v, id) in batch.valid.iter_mut().zip(&batch.ids) {
            v.push(id.is_some());
        }
        let mask = match &batch.mask {
            DeviceMask::Ready(m) => Some(m),
            _ => None,
        };
        let logits = model.base().forward_with_adapters(
            Tensor::from_data(TensorData::new(tokens, [n, 1]), &device),
            Tensor::from_data(TensorData::new(positions, [n, 1]), &device),
            mask,
            Some(&mut batch.cache),
            model.adapters(),
        );
        self.stats.decode_tokens += ids.len() as u64;
        self.stats.vacant_rows += (n - ids.len()) as u64;
        let vocab = logits.dims()[2];
        let logits = logits.reshape([n, vocab]);
        let logits = if running.len() == n { logits } else { logits.select(0, crate::batch::row_index(&running, &device)) };
        Some(StepLogits { ids, logits })
    }

    /// Runs the uncached tokens of `group` through the model, their newest positions lined up,
    /// and joins them to the batch; returns their next-token logits.
    fn prefill(&mut self, model: &impl CausalLm<B>, group: Vec<SequenceId>) -> StepLogits<B> {
        let device = model.base().device();
        let n = group.len();
        let mut caches = Vec::with_capacity(n);
        for id in &group {
            let s = self.sequences.get_mut(id).expect("a waiting sequence");
            let cache = match std::mem::replace(&mut s.place, Place::Running) {
                Place::Queued(cache) => cache,
                _ => None,
            };
            caches.push(cache);
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
        // The cached positions of the group, their newest lined up at `past`, in buffers with
        // room for the new ones.
        let mut cache = if caches.iter().all(Option::is_none) {
            model.base().new_cache()
        } else {
            let (mut sources, mut blocks) = (Vec::new(), Vec::new());
            for (row, (c, &(cached, _))) in caches.into_iter().zip(&lens).enumerate() {
                if let Some(c) = c {
                    blocks.push(RowBlock { source: sources.len(), rows: 0..1, positions: 0..cached, at: [row, past - cached] });
                    sources.push(c);
                    self.stats.rebuilt_positions += cached as u64;
                }
            }
            KvCache::assemble(sources, &blocks, n, past, grown_capacity(past + new))
        };
        let mut valid = Vec::with_capacity(n);
        let mut ids = Vec::with_capacity(n * new);
        let mut positions = Vec::with_capacity(n * new);
        for (id, &(cached, fresh)) in group.iter().zip(&lens) {
            let s = &self.sequences[id];
            let mut row = vec![false; past - cached];
            row.extend(std::iter::repeat_n(true, cached));
            row.extend(std::iter::repeat_n(false, new - fresh));
            row.extend(std::iter::repeat_n(true, fresh));
            valid.push(row);
            ids.extend(std::iter::repeat_n(0, new - fresh));
            ids.extend(s.tokens[cached..].iter().map(|&t| i64::from(t)));
            positions.extend(std::iter::repeat_n(0, new - fresh));
            positions.extend((cached..cached + fresh).map(|p| p as i64));
        }
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, new]), &device);
        let positions = Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [n, new]), &device);
        let chunk = (self.limits.max_batched_tokens / n).clamp(1, new);
        let mut last = None;
        let mut start = 0;
        while start < new {
            let end = (start + chunk).min(new);
            let columns: Vec<Vec<bool>> = valid.iter().map(|v| v[..past + end].to_vec()).collect();
            let mask = match device_mask(&columns, false, &device) {
                DeviceMask::Ready(m) => Some(m),
                _ => None,
            };
            let hidden = model
                .base()
                .model
                .forward_with_adapters(
                    ids.clone().narrow(1, start, end - start),
                    positions.clone().narrow(1, start, end - start),
                    mask.as_ref(),
                    Some(&mut cache),
                    false,
                    model.adapters(),
                )
                .last_hidden_state;
            if end == new {
                // Only the last position's logits are needed: the others would cost a
                // vocabulary-sized product each.
                last = Some(model.base().logits(hidden.narrow(1, end - start - 1, 1)));
            }
            start = end;
        }
        for (id, &(_, fresh)) in group.iter().zip(&lens) {
            self.sequences.get_mut(id).expect("a joining sequence").cached += fresh;
            self.stats.prefill_tokens += fresh as u64;
        }
        let joined = Batch {
            cache,
            parked: BTreeMap::new(),
            ids: group.iter().map(|&id| Some(id)).collect(),
            valid,
            mask: DeviceMask::Stale,
        };
        self.batch = match self.batch.take() {
            None => Some(joined),
            Some(batch) => match self.join_in_place(batch, joined) {
                Ok(batch) => Some(batch),
                Err((batch, joined)) => self.rebuild(batch, Some(joined)),
            },
        };
        let last = last.expect("a prefill has at least one position");
        let vocab = last.dims()[2];
        StepLogits {
            ids: group,
            logits: last.reshape([n, vocab]),
        }
    }
}

/// How many positions at the front of a row are not its own.
fn leading_invalid(valid: &[bool]) -> usize {
    valid.iter().take_while(|&&x| !x).count()
}

/// The attention mask of `valid` (one more valid column when `plus_one`), or `AllValid`.
fn device_mask<B: Backend>(valid: &[Vec<bool>], plus_one: bool, device: &B::Device) -> DeviceMask<B> {
    if valid.iter().all(|v| v.iter().all(|&x| x)) {
        return DeviceMask::AllValid;
    }
    let width = valid.first().map_or(0, Vec::len) + usize::from(plus_one);
    let mut values = Vec::with_capacity(valid.len() * width);
    for v in valid {
        values.extend(v.iter().map(|&x| i64::from(x)));
        if plus_one {
            values.push(1);
        }
    }
    DeviceMask::Ready(Tensor::from_data(TensorData::new(values, [valid.len(), width]), device))
}

fn unknown(id: SequenceId) -> ModelError {
    ModelError::Input(format!("no sequence {id} in the decoder"))
}

fn too_small(budget: usize, id: SequenceId, len: usize) -> ModelError {
    ModelError::Input(format!(
        "a KV budget of {budget} positions cannot hold sequence {id} ({len} tokens) even alone: raise the budget or shorten the sequences"
    ))
}

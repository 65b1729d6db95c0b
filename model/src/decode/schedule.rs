//! Room within the KV budget and who joins a step: blocks left, parked caches dropped and rows
//! preempted to make room, waiting sequences admitted, and the blocks a sequence grows by.

use std::collections::HashMap;

use burn::tensor::backend::Backend;

use super::{positions_to_hold, Decoder, Place, Sequence, SequenceId};
use crate::error::ModelError;
use crate::qwen3::BLOCK_SIZE;

/// While rows run, waiting sequences join once they are this fraction (1 / N) of the running
/// rows (see `Decoder::admit`): each group that joins costs a prefill pass of its own.
const JOIN_FRACTION: usize = 8;

/// The most steps a waiting sequence is held back to join with others.
const MAX_JOIN_WAIT: u64 = 8;

impl<B: Backend> Decoder<B> {
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
    pub(super) fn evictable_blocks(&self, except: &[SequenceId], keep: &[usize]) -> usize {
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
    pub(super) fn make_room_to_decode(&mut self) -> Result<(), ModelError> {
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
    pub(super) fn admit(&mut self, ragged: bool) -> Result<Vec<SequenceId>, ModelError> {
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
    pub(super) fn grow_sequence(&mut self, id: SequenceId, len: usize) {
        let cap = self.cap();
        let needed = self.sequences[&id].blocks_short_of(len);
        if needed > 0 {
            let blocks = self.pool.take(needed, cap).expect("the step made room for its blocks");
            self.sequences.get_mut(&id).expect("a sequence of the decoder").blocks.extend(blocks);
        }
    }
}

fn too_small(budget: usize, id: SequenceId, len: usize) -> ModelError {
    ModelError::Input(format!(
        "a KV budget of {budget} positions cannot hold sequence {id} even alone: its {len} tokens take {} \
         (blocks of {BLOCK_SIZE}, with the cache's scratch block); raise the budget or shorten the sequences",
        positions_to_hold(len)
    ))
}

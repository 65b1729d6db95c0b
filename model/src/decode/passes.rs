//! The model's passes over a step's rows: the running rows' decoding pass, a prefill pass
//! (left-padded), or one ragged pass of both, their slots and mask, and their logits.

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use super::{Decoder, Place, SequenceId, StepLogits};
use crate::lora::CausalLm;
use crate::qwen3::{BLOCK_SIZE, SCRATCH_SLOT as SCRATCH};

impl<B: Backend> Decoder<B> {
    /// Runs one pass of the model over `ids` and `positions` (`[rows, new]`), writing the new
    /// positions to `write` and attending to `read` (`rows × width` slots; the scratch slot's
    /// columns are padding, masked out): the last hidden states. A ragged pass (`ragged`: its
    /// rows' lengths) has `ids` `[1, tokens]`, the rows one after another
    /// ([`KvCache::set_ragged_slots`](crate::qwen3::KvCache::set_ragged_slots)).
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
    pub(super) fn decode_running(&mut self, model: &impl CausalLm<B>) -> Option<StepLogits<B>> {
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
    pub(super) fn prefill(&mut self, model: &impl CausalLm<B>, group: Vec<SequenceId>) -> Option<StepLogits<B>> {
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
    pub(super) fn ragged_step(&mut self, model: &impl CausalLm<B>, group: Vec<SequenceId>) -> Option<StepLogits<B>> {
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

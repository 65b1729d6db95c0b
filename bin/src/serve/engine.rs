//! The generation worker: the one thread that owns the model (the [`Policy`]: base weights and
//! named LoRA adapters). It runs every request as a sequence of one [`Decoder`], continuously
//! batched: between steps it adds the requests that have arrived (up to `max_batch` decode at
//! once, the others wait in order), each step decodes one token for every running row and
//! prefills the rows that join, and a row leaves as soon as it ends, its place taken at the next
//! step. Each row has its own sampling settings and seeded generator ([`choose_row_tokens`]: on
//! the device off the CPU kernels, unless a row asks for top-k or top-p), so a request's tokens
//! depend only on its prompt, settings and policy, not on the rows beside it. Every row's text
//! is sent out as it grows, decoded a token at a time ([`Detokenizer`]); its token ids and
//! their log-probs come with its end. A row ends at an EOS or stop token, a stop string, its
//! token limit, or when its client has gone (its event channel is closed). A failed step (an error or a panic) fails the rows in the decoder, and
//! the worker goes on with the requests that come after. Each time the work runs out the worker
//! calls [`Engine::on_idle`] before it waits for more. After each step it writes what it has
//! done into [`Engine::metrics`] (`GET /metrics`), and what it holds (the KV pool's blocks, the
//! device's memory pool) at most once a second and as it goes idle.
//!
//! Work is taken in arrival order. Rows of different adapters cannot share a forward, so the
//! decoder runs one variant (an adapter, or the base alone) at a time: a request for another
//! waits until the running rows have ended. A change of the policy (an adapter loaded or
//! unloaded, new base weights) waits the same way: every request that came before it ends with
//! the policy it started with, every request after it runs with the new one.
//!
//! A row that ends is parked in the decoder, its KV cache kept, in the [`PrefixCache`] (within
//! `prefix_cache` positions, the least recently cached finished first): a later request of the
//! same variant whose prompt extends its tokens (prompt and accepted tokens, the ending one not
//! included) takes it over and prefills only the rest of its prompt. A change of the policy
//! drops every cached sequence, so that none is reused under weights it was not computed with.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use model::generation::row_seed;
use model::tokenizer::{Qwen3Tokenizer, TokenizerError};
use model::{choose_row_tokens, Decoder, DecoderLimits, LoraModel, RowSampling, Sampling, SequenceId};
use rand::{rngs::StdRng, SeedableRng};
use trainer::run::DeviceMemoryProbe;

use super::detokenize::Detokenizer;
use super::error::ApiError;
use super::metrics::ServerMetrics;
use super::policy::{Change, Models, Policy};
use super::prefix_cache::PrefixCache;
use super::stop::StopStrings;

/// How long an idle worker waits for more requests once one has come, so that requests sent
/// together start together.
const BATCH_WINDOW: Duration = Duration::from_millis(5);

/// How often a working worker reads what it holds for `GET /metrics`: its KV pool's blocks (which
/// walks every parked sequence's block table) and the device's memory pool.
const READING_EVERY: Duration = Duration::from_secs(1);

/// How one request is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// At least 1.
    pub max_tokens: usize,
    /// The row's generator is seeded with `sampling.seed` as `prompt-r1 generate --seed` seeds
    /// batch row 0.
    pub sampling: Sampling,
    pub stop: StopStrings,
    /// Token ids that end this row besides the server's own EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Whether special tokens are left out of the text (vLLM's default: true).
    pub skip_special_tokens: bool,
    /// Whether the server's EOS ids are sampled as any other token instead of ending the row
    /// (vLLM's `ignore_eos`); `stop_token_ids` and the stop strings still end it.
    pub ignore_eos: bool,
}

/// A request waiting for the worker.
pub struct Job {
    pub prompt: Vec<u32>,
    /// The LoRA adapter it runs with; `None`: the base model alone.
    pub adapter: Option<String>,
    pub params: GenParams,
    pub events: Sender<Event>,
    /// Set by the request's handler when its client goes away.
    pub cancel: Cancel,
}

/// A request's cancellation, shared by its handler and the worker: once its client has gone the
/// worker drops it, whether it waits or decodes, at its next step (as vLLM aborts a request whose
/// client disconnected), so that an abandoned request holds no row.
#[derive(Debug, Clone, Default)]
pub struct Cancel(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Cancel {
    /// Marks the request as abandoned.
    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the request was abandoned.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A change of the policy and where its outcome goes.
pub struct Control {
    pub change: Change,
    pub reply: Sender<Result<String, ApiError>>,
}

/// What the handlers send the worker.
pub enum Work {
    Job(Job),
    Control(Control),
}

/// What the worker tells a request's handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// More text (never part of a stop string, never half a character).
    Text(String),
    /// The row is over.
    Done(Finished),
    /// Generation failed.
    Failed(String),
    /// The request cannot run as asked (its adapter was unloaded before it started).
    Refused(ApiError),
}

/// How a row ended, with every token it sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub finish: Finish,
    /// vLLM's `stop_reason`: the stop token id or stop string that ended the row; `None` at
    /// the token limit or at one of the server's own EOS ids.
    pub stop_reason: Option<StopReason>,
    /// The sampled ids, the one that ended the row included.
    pub token_ids: Vec<u32>,
    /// The sampler's log-prob of each of `token_ids`.
    pub logprobs: Vec<f32>,
    /// Prompt tokens whose KV cache came from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

impl Finished {
    pub fn completion_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// The ids whose text the reply's text is (before a stop string cuts it): all of
    /// `token_ids` but an ending EOS or stop token.
    pub fn text_ids(&self) -> &[u32] {
        let on_token = self.finish == Finish::Stop && !matches!(self.stop_reason, Some(StopReason::Text(_)));
        &self.token_ids[..self.token_ids.len() - usize::from(on_token && !self.token_ids.is_empty())]
    }
}

/// What ended a row early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// Why a row ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An EOS or stop token, or a stop string.
    Stop,
    /// The token limit.
    Length,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The policy and what decoding needs besides it.
pub struct Engine<'m, B: Backend> {
    pub policy: Policy<B>,
    pub tokenizer: &'m Qwen3Tokenizer,
    /// Token ids that end every row (not part of its text).
    pub stop_ids: Vec<u32>,
    /// Most rows decoding at once; later requests wait for a row to end.
    pub max_batch: usize,
    /// Most tokens a decoder step runs (a long prompt is prefilled over several steps while
    /// the other rows decode).
    pub max_batched_tokens: usize,
    /// Where the handlers see the policy's parts; updated after every change.
    pub models: &'m Mutex<Models>,
    /// Most KV positions the prefix cache holds (0: no prefix cache).
    pub prefix_cache: usize,
    /// Most KV positions the decoder's pool holds (`--kv-cache-memory`): requests wait to join,
    /// and the newest are preempted, rather than go past it; `None`: no limit. Every request must
    /// fit in it alone (the handlers refuse longer ones).
    pub kv_budget: Option<usize>,
    /// Called each time the worker has run work and has none left, before it waits for more:
    /// `serve` gives the device back the memory pages the burst left unused there, so that a
    /// process beside it on the same GPU (a trainer, another worker) can take them.
    pub on_idle: Box<dyn FnMut() + Send + 'm>,
    /// Where the handlers see what the worker holds and has done (`GET /metrics`).
    pub metrics: Arc<ServerMetrics>,
    /// Reads the device's memory pool from the worker's thread (`None` on the CPU).
    pub memory_probe: Option<DeviceMemoryProbe>,
}

/// The worker's requests: the decoder's sequences and each one's row, and the adapter they run
/// with.
struct Running<B: Backend> {
    decoder: Decoder<B>,
    rows: BTreeMap<SequenceId, Row>,
    next_id: SequenceId,
    variant: Option<String>,
    /// Ended rows' sequences, parked in `decoder`.
    cache: PrefixCache,
    /// Preemptions of the decoders that failed steps replaced.
    earlier_preemptions: u64,
}

impl<B: Backend> Engine<'_, B> {
    /// Serves work until every sender is gone and the last row has ended.
    pub fn run(&mut self, work: &Receiver<Work>) {
        let limits = DecoderLimits {
            max_rows: self.max_batch.max(1),
            max_batched_tokens: self.max_batched_tokens.max(1),
            kv_budget: self.kv_budget,
            ..DecoderLimits::default()
        };
        let mut running = Running {
            decoder: Decoder::new(limits),
            rows: BTreeMap::new(),
            next_id: 0,
            variant: None,
            cache: PrefixCache::new(self.prefix_cache, model::qwen3::BLOCK_SIZE),
            earlier_preemptions: 0,
        };
        let mut pending: VecDeque<Work> = VecDeque::new();
        self.publish();
        let mut worked = false;
        let mut last_reading = Instant::now();
        loop {
            self.record_state(&running, &pending, &mut last_reading);
            if running.decoder.is_idle() && pending.is_empty() {
                if std::mem::take(&mut worked) {
                    (self.on_idle)();
                }
                let Ok(first) = work.recv() else { return };
                pending.push_back(first);
                let deadline = Instant::now() + BATCH_WINDOW;
                while pending.len() < limits.rows() {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    match work.recv_timeout(wait) {
                        Ok(next) => pending.push_back(next),
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    }
                }
            } else {
                while let Ok(next) = work.try_recv() {
                    pending.push_back(next);
                }
            }
            worked = true;
            self.admit(&mut running, &mut pending);
            self.drop_abandoned(&mut running);
            if running.decoder.is_idle() {
                continue;
            }
            let failure = match catch_unwind(AssertUnwindSafe(|| self.step(&mut running))) {
                Ok(Ok(())) => continue,
                Ok(Err(message)) => message,
                Err(panic) => format!("generation failed: {}", crate::panic_text::panic_text(&*panic)),
            };
            // The decoder's state is unknown after a failed step: its rows fail, and the next
            // requests start on a fresh one.
            let failed = std::mem::take(&mut running.rows);
            self.metrics.update(|m| m.failed += failed.len() as u64);
            for row in failed.into_values() {
                let _ = row.events.send(Event::Failed(failure.clone()));
            }
            running.earlier_preemptions += running.decoder.stats().preemptions;
            running.decoder = Decoder::new(limits);
            running.cache.clear();
        }
    }

    /// Takes the pending work in order while it can start now: requests for the variant the
    /// decoder runs (any variant once it is idle), and changes of the policy once it is idle.
    fn admit(&mut self, running: &mut Running<B>, pending: &mut VecDeque<Work>) {
        while let Some(next) = pending.front() {
            if matches!(next, Work::Job(job) if job.cancel.is_cancelled()) {
                pending.pop_front();
                self.metrics.update(|m| m.aborted += 1);
                continue;
            }
            let idle = running.decoder.is_idle();
            match next {
                Work::Job(job) if job.adapter != running.variant && !idle => break,
                Work::Control(_) if !idle => break,
                _ => {}
            }
            match pending.pop_front().expect("a front") {
                Work::Job(job) => {
                    running.variant = job.adapter.clone();
                    self.add(running, job);
                }
                Work::Control(Control { change, reply }) => {
                    // Cached sequences were computed with the policy as it is: dropped
                    // whatever the outcome (a failed change leaves the policy unchanged, but
                    // dropping is always safe).
                    for id in running.cache.clear() {
                        running.decoder.finish(id);
                    }
                    let outcome = self.policy.apply(change);
                    if outcome.is_ok() {
                        self.publish();
                    }
                    let _ = reply.send(outcome);
                }
            }
        }
    }

    /// Drops the requests whose clients have gone, waiting in the decoder or decoding.
    fn drop_abandoned(&self, running: &mut Running<B>) {
        let gone: Vec<SequenceId> = running.rows.iter().filter(|(_, row)| row.cancel.is_cancelled()).map(|(&id, _)| id).collect();
        for id in gone {
            running.rows.remove(&id);
            running.decoder.finish(id);
            self.metrics.update(|m| m.aborted += 1);
        }
    }

    /// Writes the requests running and waiting, the peak KV pool and the preemptions into the
    /// metrics; and the KV pool's blocks, with a reading of the device's pool, where the last are
    /// older than [`READING_EVERY`] (the blocks also when the decoder is idle, so that the state a
    /// burst leaves is there at once).
    fn record_state(&self, running: &Running<B>, pending: &VecDeque<Work>, last_reading: &mut Instant) {
        let decoder = &running.decoder;
        let waiting = decoder.waiting();
        let queued = pending.iter().filter(|work| matches!(work, Work::Job(_))).count();
        let due = last_reading.elapsed() >= READING_EVERY;
        if due {
            *last_reading = Instant::now();
        }
        let blocks = (due || decoder.is_idle()).then(|| {
            let evictable = decoder.kv_positions_evictable();
            (decoder.kv_positions_in_use().saturating_sub(evictable), evictable, decoder.kv_positions())
        });
        let reading = self.memory_probe.as_ref().filter(|_| due).and_then(|probe| probe());
        let stats = decoder.stats();
        self.metrics.update(|m| {
            m.running = running.rows.len().saturating_sub(waiting);
            m.waiting = waiting + queued;
            if let Some((used, cached, pool)) = blocks {
                (m.kv_used_tokens, m.kv_cached_tokens, m.kv_pool_tokens) = (used, cached, pool);
            }
            m.kv_pool_peak_tokens = m.kv_pool_peak_tokens.max(stats.peak_kv_positions);
            m.preemptions = running.earlier_preemptions + stats.preemptions;
            if let Some(reading) = reading {
                m.read_device_memory(reading);
            }
        });
    }

    /// Shows the handlers the policy as it is now.
    fn publish(&self) {
        let view = self.policy.view();
        *self.models.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = view;
    }

    /// Adds `job` to the decoder to join at the next step, or tells it why it cannot run.
    fn add(&self, running: &mut Running<B>, job: Job) {
        let id = running.next_id;
        running.next_id += 1;
        let Job {
            prompt,
            adapter,
            params,
            events,
            cancel,
        } = job;
        if self.policy.model(adapter.as_deref()).is_none() {
            let name = adapter.unwrap_or_default();
            let _ = events.send(Event::Refused(ApiError::unknown_model(&name)));
            return;
        }
        // A cached sequence whose tokens start the prompt is extended by the rest.
        if let Some((cached_id, _)) = running.cache.take(adapter.as_deref(), &prompt) {
            let held = running.decoder.tokens(cached_id).map_or(0, <[u32]>::len);
            let cached = running.decoder.cached_len(cached_id).unwrap_or(0);
            if held < prompt.len() && prompt.starts_with(running.decoder.tokens(cached_id).unwrap_or_default()) {
                match running.decoder.extend(self.policy.base(), cached_id, &prompt[held..]) {
                    Ok(()) => {
                        self.count_prompt(prompt.len(), cached, true);
                        running.rows.insert(cached_id, Row::new(params, events, cached, cancel.clone()));
                    }
                    Err(err) => {
                        running.decoder.finish(cached_id);
                        self.metrics.update(|m| m.failed += 1);
                        let _ = events.send(Event::Failed(err.to_string()));
                    }
                }
                return;
            }
            // Not what the cache said it held (cannot happen): not used.
            running.decoder.finish(cached_id);
        }
        let prompt_len = prompt.len();
        match running.decoder.add(self.policy.base(), id, prompt) {
            Ok(()) => {
                self.count_prompt(prompt_len, 0, running.cache.enabled());
                running.rows.insert(id, Row::new(params, events, 0, cancel));
            }
            Err(err) => {
                self.metrics.update(|m| m.failed += 1);
                let _ = events.send(Event::Failed(err.to_string()));
            }
        }
    }

    /// Counts a joining request's `prompt` tokens, `cached` of them from the prefix cache
    /// (`looked_up`: the cache is on).
    fn count_prompt(&self, prompt: usize, cached: usize, looked_up: bool) {
        self.metrics.update(|m| {
            m.prompt_tokens += prompt as u64;
            if looked_up {
                m.prefix_cache_queries += prompt as u64;
                m.prefix_cache_hits += cached as u64;
            }
        });
    }

    /// Ends sequence `id`'s row: parks it in the prefix cache (finishing what the cache's bound
    /// no longer holds), or finishes it when caching is off.
    fn retire(decoder: &mut Decoder<B>, cache: &mut PrefixCache, variant: &Option<String>, id: SequenceId) -> Result<(), String> {
        if !cache.enabled() {
            decoder.finish(id);
            return Ok(());
        }
        decoder.park(id).map_err(|err| err.to_string())?;
        let tokens = decoder.tokens(id).map(<[u32]>::to_vec).unwrap_or_default();
        for evicted in cache.insert(id, variant.clone(), tokens) {
            decoder.finish(evicted);
        }
        Ok(())
    }

    /// One step of the decoder: every row it ran takes its next token and goes on or leaves.
    fn step(&self, running: &mut Running<B>) -> Result<(), String> {
        let Running {
            decoder,
            rows,
            variant,
            cache,
            ..
        } = running;
        let model: LoraModel<'_, B> = self
            .policy
            .model(variant.as_deref())
            .ok_or_else(|| format!("the LoRA adapter {variant:?} is no longer loaded"))?;
        // One step at a time, so that requests arriving during a long prefill join at the next.
        let Some(step) = decoder.step_once(&model).map_err(|err| err.to_string())? else {
            return Ok(());
        };
        let tokens = {
            let mut by_id: HashMap<SequenceId, &mut Row> = rows.iter_mut().map(|(&id, row)| (id, row)).collect();
            let mut samplers = step
                .ids
                .iter()
                .map(|id| {
                    let Row { sampling, rng, .. } =
                        by_id.remove(id).ok_or_else(|| format!("the decoder ran sequence {id}, which has no request"))?;
                    Ok(RowSampling { sampling, rng })
                })
                .collect::<Result<Vec<_>, String>>()?;
            choose_row_tokens(model.base.compute(), step.logits, &mut samplers).map_err(|err| err.to_string())?
        };
        self.metrics.update(|m| m.generation_tokens += step.ids.len() as u64);
        for (&id, (token, logprob)) in step.ids.iter().zip(tokens) {
            let row = rows.get_mut(&id).expect("every stepped sequence has a row");
            match row.push(token, logprob, &self.stop_ids, self.tokenizer) {
                None => decoder.accept(id, token).map_err(|err| err.to_string())?,
                Some(ending) => {
                    self.metrics.update(|m| match ending {
                        Ending::Finished(Finish::Stop) => m.finished_stop += 1,
                        Ending::Finished(Finish::Length) => m.finished_length += 1,
                        Ending::ClientGone => m.aborted += 1,
                        Ending::Failed => m.failed += 1,
                    });
                    rows.remove(&id);
                    Self::retire(decoder, cache, variant, id)?;
                }
            }
        }
        Ok(())
    }
}

/// How a row left the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// It ended, its reply sent.
    Finished(Finish),
    /// Its client went away.
    ClientGone,
    /// Its text could not be decoded.
    Failed,
}

/// One request being decoded.
struct Row {
    events: Sender<Event>,
    cancel: Cancel,
    sampling: Sampling,
    rng: StdRng,
    max_tokens: usize,
    stop: StopStrings,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    /// Every sampled token, with its log-prob.
    sampled: Vec<u32>,
    logprobs: Vec<f32>,
    /// The text of the tokens (the sampled ones but an ending stop token), a token at a time.
    detokenizer: Detokenizer,
    /// Text decoded and not sent yet: held back while it could still start a stop string.
    unsent: String,
    /// Prompt tokens taken from the prefix cache.
    cached_tokens: usize,
}

impl Row {
    fn new(p: GenParams, events: Sender<Event>, cached_tokens: usize, cancel: Cancel) -> Self {
        Self {
            events,
            cancel,
            rng: StdRng::seed_from_u64(row_seed(p.sampling.seed, 0)),
            sampling: p.sampling,
            max_tokens: p.max_tokens.max(1),
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            sampled: Vec::new(),
            logprobs: Vec::new(),
            detokenizer: Detokenizer::new(p.skip_special_tokens),
            unsent: String::new(),
            cached_tokens,
        }
    }

    /// Takes the next token and its log-prob; returns how the row ended, `None` while it goes on.
    /// Only the new text is decoded and searched for stop strings (with the held-back text
    /// before it, where a stop string could start), so a token costs the same however long the
    /// reply already is.
    fn push(&mut self, token: u32, logprob: f32, stop_ids: &[u32], tokenizer: &Qwen3Tokenizer) -> Option<Ending> {
        self.sampled.push(token);
        self.logprobs.push(logprob);
        let ending = self.ending(token, stop_ids);
        let last = ending.is_some() || self.sampled.len() >= self.max_tokens;
        match self.decode_next(token, ending.is_none(), last, tokenizer) {
            Ok(text) => self.unsent.push_str(&text),
            Err(err) => {
                let _ = self.events.send(Event::Failed(format!("decoding: {err}")));
                return Some(Ending::Failed);
            }
        }
        if let Some(reason) = ending {
            return Some(self.end(self.unsent.len(), Finish::Stop, reason));
        }
        if let Some((at, stop)) = self.stop.earliest(&self.unsent) {
            let reason = StopReason::Text(stop.to_string());
            return Some(self.end(at, Finish::Stop, Some(reason)));
        }
        if last {
            return Some(self.end(self.unsent.len(), Finish::Length, None));
        }
        let safe = self.stop.safe_len(&self.unsent);
        (!self.send_text(safe)).then_some(Ending::ClientGone)
    }

    /// Whether `token` ends the row, and its stop reason: the model's EOS (none; not under
    /// `ignore_eos`), or one of the request's `stop_token_ids`. An ending token's text is not
    /// part of the reply, as in vLLM, which leaves it out (EOS or stop token, special or not)
    /// unless `include_stop_str_in_output`.
    fn ending(&self, token: u32, stop_ids: &[u32]) -> Option<Option<StopReason>> {
        if !self.ignore_eos && stop_ids.contains(&token) {
            Some(None)
        } else if self.stop_token_ids.contains(&token) {
            Some(Some(StopReason::Token(token)))
        } else {
            None
        }
    }

    /// The text `token` adds (`in_text`: it is part of the text), with, when the row ends here,
    /// what the detokenizer held back (an unfinished character).
    fn decode_next(&mut self, token: u32, in_text: bool, last: bool, tokenizer: &Qwen3Tokenizer) -> Result<String, TokenizerError> {
        let mut text = if in_text { self.detokenizer.push(tokenizer, token)? } else { String::new() };
        if last {
            text.push_str(&self.detokenizer.flush(tokenizer)?);
        }
        Ok(text)
    }

    /// Sends the rest of the text up to `upto` bytes of the unsent part, then the row's end.
    fn end(&mut self, upto: usize, finish: Finish, stop_reason: Option<StopReason>) -> Ending {
        if !self.send_text(upto) {
            return Ending::ClientGone;
        }
        self.finish(finish, stop_reason);
        Ending::Finished(finish)
    }

    /// Sends the first `upto` bytes of the unsent text; false when the client is gone.
    fn send_text(&mut self, upto: usize) -> bool {
        if upto == 0 {
            return true;
        }
        let new: String = self.unsent.drain(..upto).collect();
        self.events.send(Event::Text(new)).is_ok()
    }

    /// Reports the end of the row.
    fn finish(&mut self, finish: Finish, stop_reason: Option<StopReason>) {
        let _ = self.events.send(Event::Done(Finished {
            finish,
            stop_reason,
            token_ids: std::mem::take(&mut self.sampled),
            logprobs: std::mem::take(&mut self.logprobs),
            cached_tokens: self.cached_tokens,
        }));
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc;

    use model::checkpoint::StorageDtype;
    use model::init::write_random_checkpoint;
    use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};
    use model::{load_pretrained, LoadOptions, Preset, Qwen3Config};

    use super::*;

    type B = burn::backend::Flex;

    fn job(prompt: Vec<u32>, max_tokens: usize) -> (Job, Receiver<Event>) {
        let (events, received) = mpsc::channel();
        let params = GenParams {
            max_tokens,
            sampling: Sampling::greedy(),
            stop: StopStrings::new(Vec::new()),
            stop_token_ids: Vec::new(),
            skip_special_tokens: true,
            ignore_eos: false,
        };
        let job = Job {
            prompt,
            adapter: None,
            params,
            events,
            cancel: Cancel::default(),
        };
        (job, received)
    }

    fn tiny(dir: &Path, seed: u64) -> (Qwen3Config, Qwen3Tokenizer) {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![tokenizer.special().im_end]);
        write_random_checkpoint(&config, dir, seed, StorageDtype::F32).unwrap();
        (config, tokenizer)
    }

    fn engine<'m>(dir: &Path, tokenizer: &'m Qwen3Tokenizer, models: &'m Mutex<Models>) -> Engine<'m, B> {
        let options = LoadOptions::default();
        let model = load_pretrained::<B>(dir, &Default::default(), options).unwrap();
        let root = dir.display().to_string();
        Engine {
            policy: Policy::new("tiny".into(), model, root, Default::default(), options, 2, false),
            tokenizer,
            stop_ids: Vec::new(),
            max_batch: 2,
            max_batched_tokens: usize::MAX,
            models,
            prefix_cache: 0,
            kv_budget: None,
            on_idle: Box::new(|| {}),
            metrics: Arc::default(),
            memory_probe: None,
        }
    }

    fn last(events: &Receiver<Event>) -> Event {
        events.iter().last().expect("an event")
    }

    /// A prompt the decoder refuses (a token out of the vocabulary, an empty one) fails alone:
    /// the requests queued beside it are answered, and the worker returns once the queue is
    /// closed and the last row has ended.
    #[test]
    fn a_rejected_prompt_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (config, tokenizer) = tiny(dir.path(), 0);
        let models = Mutex::default();
        let mut engine = engine(dir.path(), &tokenizer, &models);
        let vocab = config.vocab_size as u32;
        let (work, queue) = mpsc::channel();
        let mut replies = Vec::new();
        for (prompt, max_tokens) in [(vec![1, 2, 3], 4), (vec![1, vocab + 5], 4), (vec![], 4), (vec![7], 6), (vec![2, 9, 4, 4], 3)] {
            let (job, events) = job(prompt, max_tokens);
            work.send(Work::Job(job)).unwrap();
            replies.push(events);
        }
        drop(work);
        engine.run(&queue);
        let ends: Vec<Event> = replies.iter().map(last).collect();
        for (i, max_tokens) in [(0, 4), (3, 6), (4, 3)] {
            let Event::Done(done) = &ends[i] else { panic!("request {i}: {:?}", ends[i]) };
            assert_eq!((done.finish, done.completion_tokens(), done.logprobs.len()), (Finish::Length, max_tokens, max_tokens));
            assert!(done.logprobs.iter().all(|&l| l <= 0.0 && l.is_finite()), "{done:?}");
        }
        for i in [1, 2] {
            assert!(matches!(&ends[i], Event::Failed(message) if !message.is_empty()), "request {i}: {:?}", ends[i]);
        }
        assert_eq!(models.lock().unwrap().base_root, dir.path().display().to_string());
        // `GET /metrics` counts the three answered and the two refused, and shows nothing left.
        let counted = engine.metrics.snapshot();
        assert_eq!(
            (counted.prompt_tokens, counted.generation_tokens, counted.finished_length, counted.finished_stop, counted.failed),
            (3 + 1 + 4, 4 + 6 + 3, 3, 0, 2)
        );
        assert_eq!((counted.running, counted.waiting, counted.kv_used_tokens, counted.kv_pool_tokens), (0, 0, 0, 0));
        assert_eq!((counted.prefix_cache_queries, counted.prefix_cache_hits), (0, 0), "no prefix cache, no lookups");
    }

    /// The prefix cache: a request whose prompt extends an ended request's prompt and ids
    /// takes over its cache (`cached_tokens`: the first request's prompt and ids but the last)
    /// and answers as without the cache; a policy change drops it; a bound too small for one
    /// sequence caches nothing.
    #[test]
    fn a_prompt_that_extends_an_ended_request_reuses_its_cache() {
        let dir = tempfile::tempdir().unwrap();
        let (_, tokenizer) = tiny(dir.path(), 0);
        let models = Mutex::default();
        let first: Vec<u32> = vec![5, 9, 12, 30, 7];
        let turns = |engine: &mut Engine<'_, B>, change: bool| {
            let (work, queue) = mpsc::channel();
            std::thread::scope(|scope| {
                scope.spawn(move || engine.run(&queue));
                let ask = |prompt: Vec<u32>| {
                    let (job, events) = job(prompt, 6);
                    work.send(Work::Job(job)).unwrap();
                    match last(&events) {
                        Event::Done(done) => done,
                        other => panic!("{other:?}"),
                    }
                };
                let one = ask(first.clone());
                let mut second = first.clone();
                second.extend(&one.token_ids);
                second.extend([3, 4, 8]);
                if change {
                    let (reply, outcome) = mpsc::channel();
                    let path = dir.path().display().to_string();
                    work.send(Work::Control(Control { change: Change::UpdateWeights { path }, reply })).unwrap();
                    assert!(outcome.recv().unwrap().is_ok());
                }
                let two = ask(second);
                drop(work);
                (one, two)
            })
        };
        let mut plain = engine(dir.path(), &tokenizer, &models);
        let (one, two) = turns(&mut plain, false);
        assert_eq!((one.cached_tokens, two.cached_tokens), (0, 0));
        let mut cached = engine(dir.path(), &tokenizer, &models);
        cached.prefix_cache = 1000;
        let (hit_one, hit_two) = turns(&mut cached, false);
        assert_eq!((hit_one.cached_tokens, hit_two.cached_tokens), (0, first.len() + one.token_ids.len() - 1));
        let counted = cached.metrics.snapshot();
        let prompts = (first.len() + first.len() + one.token_ids.len() + 3) as u64;
        assert_eq!(
            (counted.prompt_tokens, counted.prefix_cache_queries, counted.prefix_cache_hits),
            (prompts, prompts, hit_two.cached_tokens as u64)
        );
        assert_eq!((&hit_one.token_ids, &hit_two.token_ids), (&one.token_ids, &two.token_ids));
        for (a, b) in hit_two.logprobs.iter().zip(&two.logprobs) {
            assert!((a - b).abs() < 1e-4, "{:?} vs {:?}", hit_two.logprobs, two.logprobs);
        }
        let (_, changed) = turns(&mut cached, true);
        assert_eq!((changed.cached_tokens, &changed.token_ids), (0, &two.token_ids));
        cached.prefix_cache = 4;
        let (_, small) = turns(&mut cached, false);
        assert_eq!((small.cached_tokens, &small.token_ids), (0, &two.token_ids));
    }

    /// A row ends at a stop token of its own with that token as its last id and its stop
    /// reason, and at one of the server's EOS ids with no stop reason, unless `ignore_eos`.
    #[test]
    fn stop_tokens_are_the_last_ids() {
        let dir = tempfile::tempdir().unwrap();
        let (_, tokenizer) = tiny(dir.path(), 0);
        let models = Mutex::default();
        let greedy = |engine: &mut Engine<'_, B>, stop_token_ids: Vec<u32>, ignore_eos: bool| {
            let (work, queue) = mpsc::channel();
            let (mut job, events) = job(vec![5, 9, 12, 30], 12);
            job.params.stop_token_ids = stop_token_ids;
            job.params.ignore_eos = ignore_eos;
            work.send(Work::Job(job)).unwrap();
            drop(work);
            engine.run(&queue);
            match last(&events) {
                Event::Done(done) => done,
                other => panic!("{other:?}"),
            }
        };
        let mut plain = engine(dir.path(), &tokenizer, &models);
        let full = greedy(&mut plain, Vec::new(), false);
        assert_eq!(full.token_ids.len(), 12);
        let stop = full.token_ids[3];
        let at = full.token_ids.iter().position(|&t| t == stop).unwrap();
        let cut = greedy(&mut plain, vec![stop], false);
        assert_eq!(cut.token_ids, full.token_ids[..=at]);
        assert_eq!(cut.logprobs, full.logprobs[..=at]);
        assert_eq!((cut.finish, cut.stop_reason), (Finish::Stop, Some(StopReason::Token(stop))));
        plain.stop_ids = vec![stop];
        let eos = greedy(&mut plain, vec![stop], false);
        assert_eq!((&eos.token_ids, eos.finish, eos.stop_reason), (&cut.token_ids, Finish::Stop, None));
        // `ignore_eos`: the EOS id is sampled as any other token, to `max_tokens`; a stop token
        // of the request's own still ends the row.
        let ignored = greedy(&mut plain, Vec::new(), true);
        assert_eq!((&ignored.token_ids, &ignored.logprobs, ignored.finish), (&full.token_ids, &full.logprobs, Finish::Length));
        let own = greedy(&mut plain, vec![stop], true);
        assert_eq!((own.token_ids, own.finish, own.stop_reason), (cut.token_ids, Finish::Stop, Some(StopReason::Token(stop))));
    }

    /// A row that ends at a stop token sends the text it held back for a stop string that
    /// never completed: the same text as without that stop string.
    #[test]
    fn an_ending_token_sends_the_held_back_text() {
        let dir = tempfile::tempdir().unwrap();
        let (_, tokenizer) = tiny(dir.path(), 0);
        let models = Mutex::default();
        let mut plain = engine(dir.path(), &tokenizer, &models);
        let text = |engine: &mut Engine<'_, B>, stop_token_ids: Vec<u32>, stop: Vec<String>| {
            let (mut job, events) = job(vec![5, 9, 12, 30], 12);
            // Sampled (seeded): the random tiny model's greedy tokens repeat at once.
            job.params.sampling = Sampling { temperature: 1.0, seed: 11, ..Sampling::default() };
            job.params.stop_token_ids = stop_token_ids;
            job.params.stop = StopStrings::new(stop);
            reply_of(engine, job, &events)
        };
        let (_, full) = text(&mut plain, Vec::new(), Vec::new());
        // A token whose first place is past the third, so that some text comes before it.
        let first_at = |t: &u32| full.token_ids.iter().position(|x| x == t).unwrap();
        let stop = *full.token_ids.iter().find(|t| first_at(t) >= 3).expect("a token first seen past the third");
        let (whole, ended) = text(&mut plain, vec![stop], Vec::new());
        assert_eq!(ended.stop_reason, Some(StopReason::Token(stop)));
        let last = whole.chars().last().expect("the row's text before its stop token is not empty");
        let (held, held_ended) = text(&mut plain, vec![stop], vec![format!("{last}\u{1}never")]);
        assert_eq!((held, held_ended.token_ids), (whole.clone(), ended.token_ids.clone()));
        plain.stop_ids = vec![stop];
        let (at_eos, _) = text(&mut plain, Vec::new(), vec![format!("{last}\u{1}never")]);
        assert_eq!(at_eos, whole);
    }

    /// Runs `job` alone on `engine`: the text it sent and how it ended.
    fn reply_of(engine: &mut Engine<'_, B>, job: Job, events: &Receiver<Event>) -> (String, Finished) {
        let (work, queue) = mpsc::channel();
        work.send(Work::Job(job)).unwrap();
        drop(work);
        engine.run(&queue);
        let mut text = String::new();
        for event in events.iter() {
            match event {
                Event::Text(part) => text.push_str(&part),
                Event::Done(done) => return (text, done),
                other => panic!("{other:?}"),
            }
        }
        panic!("no end")
    }

    /// A row's text, sent a piece at a time as it is decoded a token at a time, is what
    /// decoding its tokens all at once gives (the ending stop token left out), special tokens
    /// skipped or kept, up to where a stop string cuts it.
    #[test]
    fn the_text_sent_is_the_decoding_of_the_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let (_, tokenizer) = tiny(dir.path(), 0);
        let models = Mutex::default();
        let mut plain = engine(dir.path(), &tokenizer, &models);
        let mut run = |skip: bool, stop_token_ids: Vec<u32>, stop: Vec<String>| {
            let (mut job, events) = job(vec![5, 9, 12, 30], 300);
            // Sampled (seeded): the random tiny model's greedy tokens repeat at once.
            job.params.sampling = Sampling { temperature: 1.0, seed: 5, ..Sampling::default() };
            job.params.skip_special_tokens = skip;
            job.params.stop_token_ids = stop_token_ids;
            job.params.stop = StopStrings::new(stop);
            reply_of(&mut plain, job, &events)
        };
        let special = *tokenizer.special();
        for skip in [true, false] {
            let (text, full) = run(skip, Vec::new(), Vec::new());
            assert_eq!(text, tokenizer.decode(&full.token_ids, skip).unwrap(), "skip_special_tokens {skip}");
            let marks = [special.im_start, special.im_end, special.endoftext];
            assert!(full.token_ids.iter().any(|t| marks.contains(t)), "no special token sampled: {:?}", full.token_ids);
            let stop = full.token_ids[200];
            let (cut, ended) = run(skip, vec![stop], Vec::new());
            assert_eq!(ended.stop_reason, Some(StopReason::Token(stop)));
            assert_eq!((cut.clone(), ended.text_ids()), (tokenizer.decode(ended.text_ids(), skip).unwrap(), &ended.token_ids[..ended.token_ids.len() - 1]));
            let chars: Vec<char> = text.chars().collect();
            let stop_string: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
            let (before, ended) = run(skip, Vec::new(), vec![stop_string.clone()]);
            assert_eq!(ended.stop_reason, Some(StopReason::Text(stop_string.clone())));
            assert_eq!(Some(before.len()), text.find(&stop_string), "{stop_string:?}");
        }
    }

    /// New base weights are applied once the rows before them have ended: a request queued
    /// before the change decodes with the old weights, one queued after with the new, and a
    /// request for an adapter that is not loaded is refused with a 404.
    #[test]
    fn a_policy_change_waits_for_the_rows_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let (old_dir, new_dir) = (dir.path().join("old"), dir.path().join("new"));
        let (_, tokenizer) = tiny(&old_dir, 0);
        tiny(&new_dir, 1);
        let models = Mutex::default();
        let answer = |engine: &mut Engine<'_, B>, change: Option<Change>| {
            let (work, queue) = mpsc::channel();
            let (before, before_events) = job(vec![3, 1, 4, 1, 5], 8);
            let (after, after_events) = job(vec![3, 1, 4, 1, 5], 8);
            let (mut missing, missing_events) = job(vec![3], 2);
            missing.adapter = Some("nope".into());
            let (reply, outcome) = mpsc::channel();
            work.send(Work::Job(before)).unwrap();
            if let Some(change) = change {
                work.send(Work::Control(Control { change, reply })).unwrap();
            }
            work.send(Work::Job(after)).unwrap();
            work.send(Work::Job(missing)).unwrap();
            drop(work);
            engine.run(&queue);
            assert!(matches!(last(&missing_events), Event::Refused(err) if err.status == 404));
            (last(&before_events), last(&after_events), outcome.try_recv().ok())
        };
        // Without a change both requests decode together; with one, each alone. The ids are
        // equal either way, the log-probs within 1e-4: a batch of two rounds its products
        // differently from one row (the CPU kernels' one-row products sum in another order),
        // while the two weights' log-probs differ by far more.
        let same = |a: &Event, b: &Event| match (a, b) {
            (Event::Done(a), Event::Done(b)) => {
                a.token_ids == b.token_ids
                    && a.finish == b.finish
                    && a.logprobs.iter().zip(&b.logprobs).all(|(x, y)| (x - y).abs() < 1e-4)
            }
            _ => false,
        };
        let (old, _, _) = answer(&mut engine(&old_dir, &tokenizer, &models), None);
        let (new, _, _) = answer(&mut engine(&new_dir, &tokenizer, &models), None);
        assert!(!same(&old, &new), "{old:?} {new:?}");
        let mut served = engine(&old_dir, &tokenizer, &models);
        let path = new_dir.display().to_string();
        let (before, after, outcome) = answer(&mut served, Some(Change::UpdateWeights { path: path.clone() }));
        assert!(outcome.is_some_and(|o| o.is_ok()));
        assert!(same(&before, &old) && same(&after, &new), "{before:?} {old:?} {after:?} {new:?}");
        assert_eq!(models.lock().unwrap().base_root, path);
        // A bad directory is refused, naming it, and the weights stay.
        let bad = dir.path().join("none").display().to_string();
        let mut served = engine(&old_dir, &tokenizer, &models);
        let (_, after, outcome) = answer(&mut served, Some(Change::UpdateWeights { path: bad.clone() }));
        let err = outcome.unwrap().unwrap_err();
        assert!(err.status == 400 && err.message.contains(&bad), "{err:?}");
        assert!(same(&after, &old), "{after:?} {old:?}");
    }

    /// The worker calls `on_idle` once each time its work runs out, after the burst's last row
    /// has ended and before it waits: not before any work, not while requests wait for a row
    /// (three requests for two rows are one burst), and once more after a later burst.
    #[test]
    fn the_worker_goes_idle_once_after_each_burst() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;

        let dir = tempfile::tempdir().unwrap();
        let (_, tokenizer) = tiny(dir.path(), 0);
        let models = Mutex::default();
        let mut engine = engine(dir.path(), &tokenizer, &models);
        let idle = Arc::new(AtomicUsize::new(0));
        let calls = Arc::clone(&idle);
        engine.on_idle = Box::new(move || {
            calls.fetch_add(1, Ordering::SeqCst);
        });
        let (work, queue) = mpsc::channel();
        // The first burst is queued before the worker starts, so that it finds all three.
        let first: Vec<Receiver<Event>> = (0..3u32)
            .map(|i| {
                let (job, events) = job(vec![5, 9 + i, 12], 6);
                work.send(Work::Job(job)).unwrap();
                events
            })
            .collect();
        std::thread::scope(|scope| {
            let worker = scope.spawn(move || engine.run(&queue));
            for events in &first {
                assert!(matches!(last(events), Event::Done(_)));
            }
            let (job, events) = job(vec![7, 3], 4);
            work.send(Work::Job(job)).unwrap();
            assert!(matches!(last(&events), Event::Done(_)));
            drop(work);
            worker.join().unwrap();
        });
        assert_eq!(idle.load(Ordering::SeqCst), 2);
    }
}

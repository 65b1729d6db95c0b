//! The generation worker: the one thread that owns the model. It runs every request as a
//! sequence of one [`Decoder`], continuously batched: between steps it adds the requests that
//! have arrived (up to `max_batch` decode at once, the others wait in order), each step decodes
//! one token for every running row and prefills the rows that join, and a row leaves as soon as
//! it ends, its place taken at the next step. Each row has its own sampling settings and seeded
//! generator ([`choose_row_tokens`]: on the device off the CPU kernels, unless a row asks for
//! top-k or top-p), so a request's text depends only on its prompt and settings, not on the rows
//! beside it. Every row's text is sent out as it grows. A row ends at an EOS token, a stop
//! string, its token limit, or when its client has gone (its event channel is closed). A failed
//! step (an error or a panic) fails the rows in the decoder, and the worker goes on with the
//! requests that come after.

use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use model::generation::row_seed;
use model::tokenizer::Qwen3Tokenizer;
use model::{choose_row_tokens, Decoder, DecoderLimits, Qwen3ForCausalLM, RowSampling, Sampling, SequenceId};
use rand::{rngs::StdRng, SeedableRng};

use super::stop::{SentText, StopStrings};

/// How long an idle worker waits for more requests once one has come, so that requests sent
/// together start together.
const BATCH_WINDOW: Duration = Duration::from_millis(5);

/// How one request is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// At least 1.
    pub max_tokens: usize,
    /// The row's generator is seeded with `sampling.seed` as `prompt-r1 generate --seed` seeds
    /// batch row 0.
    pub sampling: Sampling,
    pub stop: StopStrings,
}

/// A request waiting for the worker.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    pub events: Sender<Event>,
}

/// What the worker tells a request's handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// More text (never part of a stop string, never half a character).
    Text(String),
    /// The row is over.
    Done {
        finish: Finish,
        completion_tokens: usize,
    },
    /// Generation failed.
    Failed(String),
}

/// Why a row ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An EOS token or a stop string.
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

/// The model and what decoding needs besides it.
pub struct Engine<'m, B: Backend> {
    pub model: &'m Qwen3ForCausalLM<B>,
    pub tokenizer: &'m Qwen3Tokenizer,
    /// Token ids that end a row (not part of its text).
    pub stop_ids: Vec<u32>,
    /// Most rows decoding at once; later requests wait for a row to end.
    pub max_batch: usize,
}

/// The worker's requests: the decoder's sequences and each one's row.
struct Running<B: Backend> {
    decoder: Decoder<B>,
    rows: BTreeMap<SequenceId, Row>,
    next_id: SequenceId,
}

impl<B: Backend> Engine<'_, B> {
    /// Serves jobs until every sender is gone and the last row has ended.
    pub fn run(&self, jobs: &Receiver<Job>) {
        let limits = DecoderLimits {
            max_rows: self.max_batch.max(1),
            ..DecoderLimits::default()
        };
        let mut running = Running {
            decoder: Decoder::new(limits),
            rows: BTreeMap::new(),
            next_id: 0,
        };
        loop {
            if running.decoder.is_idle() {
                let Ok(first) = jobs.recv() else { return };
                self.add(&mut running, first);
                let deadline = Instant::now() + BATCH_WINDOW;
                while running.decoder.waiting() < limits.max_rows {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    match jobs.recv_timeout(wait) {
                        Ok(job) => self.add(&mut running, job),
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    }
                }
            } else {
                while let Ok(job) = jobs.try_recv() {
                    self.add(&mut running, job);
                }
            }
            let failure = match catch_unwind(AssertUnwindSafe(|| self.step(&mut running))) {
                Ok(Ok(())) => continue,
                Ok(Err(message)) => message,
                Err(panic) => format!("generation failed: {}", crate::panic_text::panic_text(&*panic)),
            };
            // The decoder's state is unknown after a failed step: its rows fail, and the next
            // requests start on a fresh one.
            for row in std::mem::take(&mut running.rows).into_values() {
                let _ = row.events.send(Event::Failed(failure.clone()));
            }
            running.decoder = Decoder::new(limits);
        }
    }

    /// Adds `job` to the decoder to join at the next step, or tells it why its prompt cannot be
    /// decoded.
    fn add(&self, running: &mut Running<B>, job: Job) {
        let id = running.next_id;
        running.next_id += 1;
        let Job { prompt, params, events } = job;
        match running.decoder.add(self.model, id, prompt) {
            Ok(()) => {
                running.rows.insert(id, Row::new(params, events));
            }
            Err(err) => {
                let _ = events.send(Event::Failed(err.to_string()));
            }
        }
    }

    /// One step of the decoder: every row it ran takes its next token and goes on or leaves.
    fn step(&self, running: &mut Running<B>) -> Result<(), String> {
        let Running { decoder, rows, .. } = running;
        let Some(step) = decoder.step(self.model).map_err(|err| err.to_string())? else {
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
            choose_row_tokens(step.logits, &mut samplers).map_err(|err| err.to_string())?
        };
        for (&id, (token, _)) in step.ids.iter().zip(tokens) {
            let row = rows.get_mut(&id).expect("every stepped sequence has a row");
            if row.push(token, &self.stop_ids, self.tokenizer) {
                decoder.accept(id, token).map_err(|err| err.to_string())?;
            } else {
                decoder.finish(id);
                rows.remove(&id);
            }
        }
        Ok(())
    }
}

/// One request being decoded.
struct Row {
    events: Sender<Event>,
    sampling: Sampling,
    rng: StdRng,
    max_tokens: usize,
    stop: StopStrings,
    tokens: Vec<u32>,
    generated: usize,
    sent: SentText,
}

impl Row {
    fn new(p: GenParams, events: Sender<Event>) -> Self {
        Self {
            events,
            rng: StdRng::seed_from_u64(row_seed(p.sampling.seed, 0)),
            sampling: p.sampling,
            max_tokens: p.max_tokens.max(1),
            stop: p.stop,
            tokens: Vec::new(),
            generated: 0,
            sent: SentText::default(),
        }
    }

    /// Takes the next token; returns whether the row goes on.
    fn push(&mut self, token: u32, stop_ids: &[u32], tokenizer: &Qwen3Tokenizer) -> bool {
        self.generated += 1;
        if stop_ids.contains(&token) {
            return self.finish(Finish::Stop);
        }
        self.tokens.push(token);
        let text = match tokenizer.decode(&self.tokens, true) {
            Ok(text) => text,
            Err(err) => {
                let _ = self.events.send(Event::Failed(format!("decoding: {err}")));
                return false;
            }
        };
        if let Some(at) = self.stop.first_match(&text) {
            return self.send_text(&text, at) && self.finish(Finish::Stop);
        }
        if self.generated >= self.max_tokens {
            return self.send_text(&text, text.len()) && self.finish(Finish::Length);
        }
        let safe = self.stop.safe_len(&text);
        self.send_text(&text, safe)
    }

    /// Sends the unsent part of `text[..upto]`; false when the client is gone.
    fn send_text(&mut self, text: &str, upto: usize) -> bool {
        let new = self.sent.take(text, upto);
        new.is_empty() || self.events.send(Event::Text(new.to_string())).is_ok()
    }

    /// Reports the end of the row; always false (the row does not go on).
    fn finish(&mut self, finish: Finish) -> bool {
        let _ = self.events.send(Event::Done {
            finish,
            completion_tokens: self.generated,
        });
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use model::checkpoint::StorageDtype;
    use model::init::write_random_checkpoint;
    use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};
    use model::{load_pretrained, LoadOptions, Preset};

    use super::*;

    type B = burn::backend::Flex;

    fn job(prompt: Vec<u32>, max_tokens: usize) -> (Job, Receiver<Event>) {
        let (events, received) = mpsc::channel();
        let params = GenParams {
            max_tokens,
            sampling: Sampling::greedy(),
            stop: StopStrings::new(Vec::new()),
        };
        (Job { prompt, params, events }, received)
    }

    /// A prompt the decoder refuses (a token out of the vocabulary, an empty one) fails alone:
    /// the requests queued beside it are answered, and the worker returns once the queue is
    /// closed and the last row has ended.
    #[test]
    fn a_rejected_prompt_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![tokenizer.special().im_end]);
        write_random_checkpoint(&config, dir.path(), 0, StorageDtype::F32).unwrap();
        let model = load_pretrained::<B>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();
        let engine = Engine {
            model: &model,
            tokenizer: &tokenizer,
            stop_ids: Vec::new(),
            max_batch: 2,
        };
        let vocab = config.vocab_size as u32;
        let (jobs, queue) = mpsc::channel();
        let mut replies = Vec::new();
        for (prompt, max_tokens) in [(vec![1, 2, 3], 4), (vec![1, vocab + 5], 4), (vec![], 4), (vec![7], 6), (vec![2, 9, 4, 4], 3)] {
            let (job, events) = job(prompt, max_tokens);
            jobs.send(job).unwrap();
            replies.push(events);
        }
        drop(jobs);
        engine.run(&queue);
        let ends: Vec<Event> = replies.iter().map(|r| r.iter().last().expect("an event")).collect();
        for (i, max_tokens) in [(0, 4), (3, 6), (4, 3)] {
            let want = Event::Done {
                finish: Finish::Length,
                completion_tokens: max_tokens,
            };
            assert_eq!(ends[i], want, "request {i}");
        }
        for i in [1, 2] {
            assert!(matches!(&ends[i], Event::Failed(message) if !message.is_empty()), "request {i}: {:?}", ends[i]);
        }
    }
}

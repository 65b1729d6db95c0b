//! The generation worker: the one thread that owns the model. It takes queued requests in
//! batches (those waiting when it becomes free, up to `max_batch`), decodes them together in
//! one left-padded batch with a KV cache, each row with its own sampling settings and seeded
//! generator, and sends every row's text out as it grows. A row ends at an EOS token, a stop
//! string, its token limit, or when its client has gone (its event channel is closed). Off the
//! CPU kernels (a GPU) tokens are chosen on the device from the rows' own draws, so a step reads
//! back a token and a log-prob per row, unless a row asks for top-k or top-p (the host sorts).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use model::device_sampling;
use model::generation::{choose_token, row_seed};
use model::tokenizer::Qwen3Tokenizer;
use model::{Padding, Qwen3ForCausalLM, Sampling, TokenBatch};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::stop::{SentText, StopStrings};

/// How long the worker waits for more requests to join a batch once it has one.
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
    pub pad_id: u32,
    pub max_batch: usize,
}

impl<B: Backend> Engine<'_, B> {
    /// Serves jobs until every sender is gone.
    pub fn run(&self, jobs: &Receiver<Job>) {
        while let Ok(first) = jobs.recv() {
            let mut batch = vec![first];
            let deadline = Instant::now() + BATCH_WINDOW;
            while batch.len() < self.max_batch.max(1) {
                let wait = deadline.saturating_duration_since(Instant::now());
                match jobs.recv_timeout(wait) {
                    Ok(job) => batch.push(job),
                    Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                }
            }
            let senders: Vec<Sender<Event>> = batch.iter().map(|j| j.events.clone()).collect();
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.run_batch(batch))) {
                let text = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown error");
                for sender in senders {
                    let _ = sender.send(Event::Failed(format!("generation failed: {text}")));
                }
            }
        }
    }

    /// Decodes one batch to the end of its last row.
    fn run_batch(&self, jobs: Vec<Job>) {
        let prompts: Vec<Vec<u32>> = jobs.iter().map(|j| j.prompt.clone()).collect();
        let mut rows: Vec<Row> = jobs.into_iter().map(Row::new).collect();
        // `active[j]` is the row of `rows` at batch position j.
        let mut active: Vec<usize> = (0..rows.len()).collect();
        let device = self.model.device();
        let batch = match TokenBatch::<B>::new(&prompts, Padding::Left, self.pad_id, &device) {
            Ok(batch) => batch,
            Err(err) => return fail(&rows, &active, &err.to_string()),
        };
        let mut cache = self.model.new_cache();
        let mut key_mask: Vec<Vec<i64>> = batch
            .lengths
            .iter()
            .map(|&l| {
                (0..batch.len)
                    .map(|j| i64::from(j >= batch.len - l))
                    .collect()
            })
            .collect();
        let mut next_position: Vec<i64> = batch.lengths.iter().map(|&l| l as i64).collect();
        let hidden = self
            .model
            .model
            .forward(
                batch.input_ids.clone(),
                batch.position_ids.clone(),
                batch.mask(),
                Some(&mut cache),
                false,
            )
            .last_hidden_state;
        let mut last = self.model.logits(hidden.narrow(1, batch.len - 1, 1));
        let on_device = !model::cpu_kernels::active::<B>();
        loop {
            let tokens = match self.choose(last, &mut rows, &active, on_device) {
                Ok(tokens) => tokens,
                Err(message) => return fail(&rows, &active, &message),
            };
            let mut keep = Vec::with_capacity(active.len());
            let mut next_tokens = Vec::with_capacity(active.len());
            for (j, (&r, token)) in active.iter().zip(tokens).enumerate() {
                if rows[r].push(token, &self.stop_ids, self.tokenizer) {
                    keep.push(j);
                    next_tokens.push(token);
                }
            }
            if keep.is_empty() {
                return;
            }
            if keep.len() < active.len() {
                cache.select_rows(&keep);
                key_mask = keep.iter().map(|&j| key_mask[j].clone()).collect();
                next_position = keep.iter().map(|&j| next_position[j]).collect();
                active = keep.iter().map(|&j| active[j]).collect();
            }
            let n = active.len();
            for mask in &mut key_mask {
                mask.push(1);
            }
            let ids: Vec<i64> = next_tokens.iter().map(|&t| i64::from(t)).collect();
            let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, 1]), &device);
            let positions = Tensor::<B, 2, Int>::from_data(
                TensorData::new(next_position.clone(), [n, 1]),
                &device,
            );
            let mask = key_mask.iter().any(|m| m.contains(&0)).then(|| {
                let width = key_mask[0].len();
                Tensor::<B, 2, Int>::from_data(
                    TensorData::new(key_mask.concat(), [n, width]),
                    &device,
                )
            });
            for p in &mut next_position {
                *p += 1;
            }
            last = self
                .model
                .forward(ids, positions, mask.as_ref(), Some(&mut cache));
        }
    }

    /// The next token of each active row from its logits (`[rows, 1, vocab]`): on the device
    /// when `on_device` and no row needs top-k or top-p, else on the host from the whole rows.
    fn choose(&self, logits: Tensor<B, 3>, rows: &mut [Row], active: &[usize], on_device: bool) -> Result<Vec<u32>, String> {
        let vocab = self.model.config.vocab_size;
        if on_device && active.iter().all(|&r| device_sampling::supported(&rows[r].sampling)) {
            let temperatures: Vec<f32> = active.iter().map(|&r| rows[r].sampling.temperature).collect();
            // One draw per sampled token, as `choose_token` makes: the same seed, the same text.
            let uniforms: Vec<f64> = active
                .iter()
                .map(|&r| if rows[r].sampling.temperature > 0.0 { rows[r].rng.random::<f64>() } else { 0.0 })
                .collect();
            let choices = device_sampling::choose_tokens(logits.reshape([active.len(), vocab]), &temperatures, &uniforms)
                .map_err(|err| err.to_string())?;
            return Ok(choices.into_iter().map(|(token, _)| token).collect());
        }
        let values: Vec<f32> = logits.into_data().convert::<f32>().to_vec().map_err(|err| format!("reading logits: {err:?}"))?;
        Ok(active
            .iter()
            .enumerate()
            .map(|(j, &r)| {
                let row = &mut rows[r];
                choose_token(&values[j * vocab..(j + 1) * vocab], &row.sampling, &mut row.rng).0
            })
            .collect())
    }
}

/// Tells the rows `which` of `rows` that generation failed.
fn fail(rows: &[Row], which: &[usize], message: &str) {
    for &r in which {
        let _ = rows[r].events.send(Event::Failed(message.to_string()));
    }
}

/// One request inside a batch.
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
    fn new(job: Job) -> Self {
        let p = job.params;
        Self {
            events: job.events,
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

//! The agent as a local Qwen3 checkpoint run by our burn model on a [`Decoder`]: each episode is
//! one sequence of the decoder from its first prompt to its end, so its KV cache is kept across
//! turns and after an environment reply only the reply's tokens are prefilled. Within a turn
//! each episode leaves the batch as its own turn ends (its own token budget). The context is
//! built token by token (the first prompt and each environment text are tokenised once, on their
//! own; the agent's sampled tokens are recorded as sampled, with their log-probs). By default it
//! decodes continuously: the episode loop hands it turns as episodes become ready and steps it,
//! so an episode whose environment call is out leaves the batch while the others go on (see
//! [`LocalAgent::with_continuous_batching`] for turn by turn).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use env::{Agent, AgentContext, AgentError, EnvironmentTokens, TurnEnd, TurnText};
use model::generation::row_seed;
use model::tokenizer::Qwen3Tokenizer;
use model::{choose_row_tokens, CausalLm, Decoder, DecoderLimits, DecoderStats, LoraAdapters, LoraModel, ModelError, Qwen3ForCausalLM, RowSampling, Sampling, SequenceId};
use rand::{rngs::StdRng, SeedableRng};

/// A local checkpoint acting as the Prompt-R1 agent (with LoRA adapters, if given).
pub struct LocalAgent<'m, B: Backend> {
    model: LoraModel<'m, B>,
    tokenizer: &'m Qwen3Tokenizer,
    /// How turns are sampled; `sampling.seed` is the base seed: each episode and turn derives
    /// its own stream from it.
    sampling: Sampling,
    /// Distinguishes batches of episodes run with the same agent (e.g. training steps), so that
    /// episode `i` of two batches does not repeat its samples.
    batch_stream: u64,
    stop_ids: Vec<u32>,
    turns_generated: Vec<u64>,
    /// Every running episode's sequence (keyed by its index), its cache kept between turns.
    decoder: Decoder<B>,
    /// The episodes generating a turn, by index.
    rows: HashMap<SequenceId, TurnRow>,
    /// Turns that ended without decoding (a zero budget), reported by the next `advance`.
    ended: Vec<(usize, Result<TurnText, AgentError>)>,
    step_times: StepTimes,
    /// Whether turns join and leave the batch as their episodes are ready (see
    /// [`Self::with_continuous_batching`]).
    continuous: bool,
}

/// Where a [`LocalAgent`]'s decoder steps spent their wall-clock time, each step with its
/// sampling (which waits for a GPU to finish the step): steps that only decoded, and steps that
/// also prefilled sequences joining the batch (and joined them to it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// Steps that only decoded one token for each running row.
    pub decode_steps: u64,
    pub decode_time: Duration,
    /// Steps that also prefilled joining sequences.
    pub prefill_steps: u64,
    pub prefill_time: Duration,
}

impl StepTimes {
    /// Mean milliseconds of a step that only decoded (0 without one).
    pub fn decode_step_ms(&self) -> f64 {
        1e3 * self.decode_time.as_secs_f64() / self.decode_steps.max(1) as f64
    }

    /// Mean milliseconds of a step that also prefilled (0 without one).
    pub fn prefill_step_ms(&self) -> f64 {
        1e3 * self.prefill_time.as_secs_f64() / self.prefill_steps.max(1) as f64
    }

    /// Rows decoded per step on average, for `decode_tokens` decoded over these steps.
    pub fn rows_per_step(&self, decode_tokens: u64) -> f64 {
        decode_tokens as f64 / (self.decode_steps + self.prefill_steps).max(1) as f64
    }

    /// The steps and time since `earlier` (a copy taken before).
    pub fn since(&self, earlier: &StepTimes) -> StepTimes {
        StepTimes {
            decode_steps: self.decode_steps - earlier.decode_steps,
            decode_time: self.decode_time.saturating_sub(earlier.decode_time),
            prefill_steps: self.prefill_steps - earlier.prefill_steps,
            prefill_time: self.prefill_time.saturating_sub(earlier.prefill_time),
        }
    }
}

/// One episode's turn while it generates.
struct TurnRow {
    rng: StdRng,
    budget: usize,
    generated: usize,
    /// Where the turn's tokens start in the episode's trace.
    start: usize,
}

impl<'m, B: Backend> LocalAgent<'m, B> {
    /// An agent over a loaded model and its tokenizer, decoding without limits (see
    /// [`Self::with_limits`]).
    pub fn new(
        model: &'m Qwen3ForCausalLM<B>,
        tokenizer: &'m Qwen3Tokenizer,
        sampling: Sampling,
    ) -> Self {
        let special = *tokenizer.special();
        Self {
            model: LoraModel::new(model, None),
            tokenizer,
            sampling,
            batch_stream: 0,
            stop_ids: vec![special.im_end, special.endoftext],
            turns_generated: Vec::new(),
            decoder: Decoder::new(DecoderLimits::default()),
            rows: HashMap::new(),
            ended: Vec::new(),
            step_times: StepTimes::default(),
            continuous: true,
        }
    }

    /// The agent with LoRA `adapters` applied to its model's forward.
    pub fn with_adapters(mut self, adapters: Option<&'m LoraAdapters<B>>) -> Self {
        self.model.adapters = adapters;
        self
    }

    /// The agent decoding within `limits` (rows at once, prefill chunk, KV budget).
    pub fn with_limits(mut self, limits: DecoderLimits) -> Self {
        self.decoder = Decoder::new(limits);
        self
    }

    /// Continuous batching (`true`, the default) or turn by turn (`false`): with it, an
    /// episode's environment call goes out as soon as its turn ends and the episode rejoins the
    /// batch with the reply while the others decode, so which rows decode side by side follows
    /// the environment's timing (moving the last bits of their logits); turn by turn, every
    /// running episode of the batch generates its turn, then all their calls run, so the same
    /// seed gives the same episodes bit for bit whatever the timing. Kept caches either way.
    pub fn with_continuous_batching(mut self, continuous: bool) -> Self {
        self.continuous = continuous;
        self
    }

    /// Sets the stream of the next batch of episodes (e.g. the training step), which together
    /// with the episode index and turn number seeds every turn's sampling.
    pub fn set_batch_stream(&mut self, stream: u64) {
        self.batch_stream = stream;
    }

    /// Tokens this agent has run through prefill: each episode's first prompt and environment
    /// replies, and anything prefilled again after its cache was dropped for room (padding
    /// not counted). The agent's own tokens go through one-token decode steps.
    pub fn prefill_tokens(&self) -> u64 {
        self.decoder.stats().prefill_tokens
    }

    /// What the decoder has done (prefill and decode tokens, preemptions, peak KV positions).
    pub fn decoder_stats(&self) -> DecoderStats {
        self.decoder.stats()
    }

    /// The time this agent's decoder steps took so far, by kind of step.
    pub fn step_times(&self) -> StepTimes {
        self.step_times
    }

    fn turn_seed(&self, episode: usize, turn: u64) -> u64 {
        super::turn_seed(self.sampling.seed, self.batch_stream, episode, turn)
    }

    /// How many tokens episode `ctx` may still sample before its context fills the model's
    /// (`max_position_embeddings`), so that no position past the context is ever decoded: 0 once
    /// an environment reply filled it; a first prompt that fills it alone is refused (the episode
    /// fails, naming the lengths).
    fn room_in_context(&self, ctx: &AgentContext) -> Result<usize, AgentError> {
        let context = self.model.base().config.max_position_embeddings;
        let held = ctx.trace().len();
        if held >= context && ctx.exchanges().is_empty() {
            return Err(AgentError::Model(format!(
                "the episode leaves the agent no room to answer: its first prompt holds {held} tokens, the model's context is {context} (max_position_embeddings)"
            )));
        }
        Ok(context.saturating_sub(held))
    }

    /// Puts episode `ctx`'s sequence in line for its next turn: a new sequence of its whole
    /// context, or its kept sequence extended by the tokens recorded since.
    fn queue_turn(&mut self, ctx: &AgentContext) -> Result<(), ModelError> {
        let id = ctx.index() as SequenceId;
        let trace = ctx.trace().ids();
        match self.decoder.tokens(id) {
            None => self.decoder.add(&self.model, id, trace.to_vec()),
            Some(known) if trace.starts_with(known) => {
                let known = known.len();
                self.decoder.extend(&self.model, id, &trace[known..])
            }
            Some(_) => Err(ModelError::Input(format!(
                "episode {id}'s context no longer starts with the tokens its cache holds"
            ))),
        }
    }

    /// One decoder step for every episode generating a turn (`episodes` holds them, found by
    /// index): records each sampled token in its context, and returns the turns that ended
    /// (their sequences parked, caches kept for the next turn).
    fn step_once(&mut self, episodes: &mut [&mut AgentContext]) -> Result<Vec<(usize, Result<TurnText, AgentError>)>, ModelError> {
        let start = Instant::now();
        let prefilled = self.decoder.stats().prefill_tokens;
        let Some(step) = self.decoder.step(&self.model)? else {
            return Err(ModelError::Input("the decoder has no sequence for the turns in progress".into()));
        };
        let slots: HashMap<SequenceId, usize> = episodes.iter().enumerate().map(|(slot, c)| (c.index() as SequenceId, slot)).collect();
        let mut rows = Vec::with_capacity(step.ids.len());
        for id in &step.ids {
            let row = self.rows.remove(id).ok_or_else(|| ModelError::Input(format!("sequence {id} is not an episode generating a turn")))?;
            let slot = *slots.get(id).ok_or_else(|| ModelError::Input(format!("episode {id} was not handed to the step")))?;
            rows.push((*id, slot, row));
        }
        let choices = {
            let mut samplers: Vec<RowSampling<'_>> = rows.iter_mut().map(|(_, _, row)| RowSampling { sampling: &self.sampling, rng: &mut row.rng }).collect();
            choose_row_tokens(self.model.base().compute(), step.logits, &mut samplers)?
        };
        let t = &mut self.step_times;
        if self.decoder.stats().prefill_tokens > prefilled {
            t.prefill_steps += 1;
            t.prefill_time += start.elapsed();
        } else {
            t.decode_steps += 1;
            t.decode_time += start.elapsed();
        }
        let im_end = self.tokenizer.special().im_end;
        let mut ended = Vec::new();
        for ((id, slot, mut row), (token, logprob)) in rows.into_iter().zip(choices) {
            let ctx = &mut episodes[slot];
            ctx.record_agent_token(token, logprob);
            row.generated += 1;
            self.decoder.accept(id, token)?;
            let end = if token == im_end {
                Some(TurnEnd::ImEnd)
            } else if self.stop_ids.contains(&token) || row.generated >= row.budget {
                Some(TurnEnd::Length)
            } else {
                None
            };
            match end {
                None => {
                    self.rows.insert(id, row);
                }
                Some(end) => {
                    self.decoder.park(id)?;
                    let tokens = &ctx.trace().ids()[row.start..];
                    let body = if end == TurnEnd::ImEnd { &tokens[..tokens.len() - 1] } else { tokens };
                    let text = self.tokenizer.decode(body, false).map_err(|e| AgentError::Model(e.to_string()));
                    ended.push((ctx.index(), text.map(|text| TurnText { text, tokens: tokens.len(), end })));
                }
            }
        }
        Ok(ended)
    }
}

impl<B: Backend> Agent for LocalAgent<'_, B> {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        let ids = self
            .tokenizer
            .encode(&ctx.prompt().chatml())
            .map_err(|e| AgentError::Model(e.to_string()))?;
        ctx.record_context_tokens(&ids);
        if self.turns_generated.len() <= ctx.index() {
            self.turns_generated.resize(ctx.index() + 1, 0);
        }
        self.turns_generated[ctx.index()] = 0;
        self.rows.remove(&(ctx.index() as SequenceId));
        self.decoder.finish(ctx.index() as SequenceId);
        Ok(())
    }

    /// The turn of every given episode, decoded together; each leaves the batch as its turn
    /// ends.
    fn generate_turns(
        &mut self,
        episodes: &mut [&mut AgentContext],
    ) -> Vec<Result<TurnText, AgentError>> {
        env::turns_by_advancing(self, episodes, |agent| agent.rows.is_empty())
    }

    fn continuous(&self) -> bool {
        self.continuous
    }

    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), AgentError>> {
        episodes
            .iter()
            .map(|ctx| {
                let turn = self.turns_generated.get(ctx.index()).copied().unwrap_or(0);
                if let Some(n) = self.turns_generated.get_mut(ctx.index()) {
                    *n += 1;
                }
                if ctx.turn_budget() == 0 {
                    let empty = TurnText { text: String::new(), tokens: 0, end: TurnEnd::Length };
                    self.ended.push((ctx.index(), Ok(empty)));
                    return Ok(());
                }
                let room = self.room_in_context(ctx)?;
                if room == 0 {
                    // The context filled (an environment reply took its last room): the episode
                    // ends at its token limit, as when its response budget runs out.
                    let empty = TurnText { text: String::new(), tokens: 0, end: TurnEnd::Length };
                    self.ended.push((ctx.index(), Ok(empty)));
                    return Ok(());
                }
                self.queue_turn(ctx).map_err(|e| AgentError::Model(e.to_string()))?;
                let row = TurnRow {
                    // As `prompt-r1 serve` seeds a request's row from its `seed`, so that a
                    // server given the turn's seed samples what this agent samples.
                    rng: StdRng::seed_from_u64(row_seed(self.turn_seed(ctx.index(), turn), 0)),
                    budget: ctx.turn_budget().min(room),
                    generated: 0,
                    start: ctx.trace().len(),
                };
                self.rows.insert(ctx.index() as SequenceId, row);
                Ok(())
            })
            .collect()
    }

    fn advance(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<TurnText, AgentError>)> {
        let mut ended = std::mem::take(&mut self.ended);
        if self.rows.is_empty() {
            return ended;
        }
        match self.step_once(episodes) {
            Ok(more) => ended.extend(more),
            Err(e) => {
                // The step failed as a whole: every turn in progress fails with it.
                let message = e.to_string();
                for (id, _) in self.rows.drain() {
                    self.decoder.finish(id);
                    ended.push((id as usize, Err(AgentError::Model(message.clone()))));
                }
            }
        }
        ended
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.rows.remove(&(ctx.index() as SequenceId));
        self.decoder.finish(ctx.index() as SequenceId);
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        let ids = self.tokenizer.encode(text).map_err(|e| AgentError::Model(e.to_string()))?;
        Ok(EnvironmentTokens::Ids(ids))
    }
}

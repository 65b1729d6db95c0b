//! `bench --rollout`: multi-turn episodes through the real rollout path (`LocalAgent` driven
//! by `env::run_episodes`, as `train` runs them) against a local scripted environment that
//! sleeps a fixed latency and replies with about N tokens, beside pure decode at the same batch.
//!
//! A random model does not write well-formed calls, so [`ForcedCalls`] wraps the agent: the
//! tokens are the agent's own (sampled, recorded and appended to the context exactly as in
//! training), only the turn's text as the episode loop parses it is replaced, with a call on
//! every turn but the last and an answer on the last. Each turn generates `--rollout-turn-tokens`
//! tokens unless the model samples a stop token (`<|im_end|>` or `<|endoftext|>`, which
//! `LocalAgent` stops on); such turns are counted and reported.
//!
//! Each batch runs twice: first with every turn re-prefilling its episode's whole history (the
//! agent's state dropped after each turn: the rollout loop before kept KV caches), then as the
//! trainer runs it, each episode's KV cache kept across its turns. Both sample the same tokens.

use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use burn::tensor::backend::Backend;
use env::{
    run_episodes_admitted, Admission, Agent, AgentContext, AgentError, ChatMessage, EnvError, Environment,
    EpisodeConfig, NoObserver, Role, StopReason, Trajectory, TurnEnd, TurnText, ANSWER_CLOSE, ANSWER_OPEN,
    CALL_CLOSE, CALL_OPEN,
};
use model::tokenizer::Qwen3Tokenizer;
use model::{generate, DecoderLimits, DecoderStats, Qwen3ForCausalLM, Sampling, SamplingConfig};
use serde::Serialize;
use trainer::rollout::{LocalAgent, ServerAgent, ServerPool, ServerSettings, StepTimes};
use crate::device::MemoryProbe;

/// The shape of the rollout workload.
#[derive(Clone, Debug)]
pub struct RolloutSettings {
    /// Agent turns per episode: every turn but the last is an environment call.
    pub turns: usize,
    /// Tokens the agent generates per turn (`max_turn_tokens`).
    pub turn_tokens: usize,
    /// How long each environment call sleeps before it replies.
    pub latency: Duration,
    /// Tokens (of the agent's tokenizer) in each environment reply.
    pub reply_tokens: usize,
    /// Most environment calls in flight at once (`episode.env_concurrency`).
    pub env_concurrency: usize,
    /// The agent's sampling seed.
    pub seed: u64,
    /// Timed runs of each measurement (the median is reported).
    pub runs: usize,
    /// Rollout workers serving the same model, to run each batch on as well (none: local only).
    pub workers: Vec<String>,
    /// The model name the workers serve.
    pub worker_model: String,
    /// Also time the rollout turn by turn (`[rollout] continuous_batching = false`).
    pub turn_by_turn: bool,
    /// Most positions of one prefill pass (`[rollout] max_num_batched_tokens`).
    pub max_batched_tokens: usize,
    /// Episodes per rollout (`None`: the batch), run `batch` at a time (and with continuous
    /// admission too, when more).
    pub episodes: Option<usize>,
    /// Each episode takes its own number of turns ([`episode_turns`]), else `turns`.
    pub varied_turns: bool,
    /// The rollouts' KV budget in bytes (`[rollout] kv_budget`); `None`: no limit.
    pub kv_budget: Option<u64>,
    /// Most episodes decoding at once (`[rollout] max_num_seqs`); the others in flight wait for a
    /// row. `None`: every episode in flight decodes.
    pub max_num_seqs: Option<usize>,
    /// Episodes share the KV blocks of equal prefixes (`[rollout] share_prefixes`).
    pub share_prefixes: bool,
    /// Also time the rollout without shared prefixes (when they are shared).
    pub unshared: bool,
    /// Consecutive episodes asking the same question (a GRPO group, `rollout.n`).
    pub group_size: usize,
    /// Steps with sequences joining run them beside the decoding rows in ragged passes, where
    /// the model takes them (`DecoderLimits::ragged_passes`).
    pub ragged_passes: bool,
}

/// The turns episode `index` takes: `turns`, or with `varied` one of 1 to `turns` drawn from
/// the index (the same every run).
pub fn episode_turns(turns: usize, varied: bool, index: usize) -> usize {
    use rand::{Rng, SeedableRng};
    if !varied || turns <= 1 {
        return turns;
    }
    rand::rngs::StdRng::seed_from_u64(index as u64).random_range(1..=turns)
}

/// What one rollout batch did: the counts are exact (the same seed gives the same episodes on
/// every run), the seconds the median of the timed runs.
#[derive(Clone, Debug, Serialize)]
pub struct RolloutStats {
    /// Most episodes in flight (`rollout.generation_batch`).
    pub batch: usize,
    /// Episodes of the rollout.
    pub episodes: usize,
    /// Consecutive episodes asking the same question.
    pub group_size: usize,
    /// Whether each episode took its own number of turns (1 to `turns`).
    pub varied_turns: bool,
    pub turns: usize,
    pub turn_tokens: usize,
    pub reply_tokens: usize,
    pub latency_ms: u64,
    /// Most positions of one prefill pass.
    pub max_num_batched_tokens: usize,
    /// Most episodes decoding at once (`max_num_seqs`), if fewer than `batch`.
    pub max_num_seqs: Option<usize>,
    /// Rows of the pure decode measurements: `batch`, or `max_num_seqs` when fewer, the most the
    /// rollout's decoder runs at once.
    pub decode_rows: usize,
    /// The KV budget in positions, if one was given.
    pub kv_budget_positions: Option<usize>,
    /// Episodes whose cache was dropped to stay within the budget (preempted or evicted).
    pub preemptions: u64,
    /// Wall-clock seconds of the whole rollout.
    pub seconds: f64,
    /// Seconds inside the agent (generation, tokenising); the rest is spent waiting on the
    /// environment.
    pub agent_seconds: f64,
    pub env_wait_seconds: f64,
    pub agent_tokens: usize,
    /// Agent tokens per wall-clock second of the rollout.
    pub agent_tokens_per_second: f64,
    /// Agent tokens per second spent inside the agent.
    pub agent_tokens_per_agent_second: f64,
    /// Tokens the agent prefilled per episode (its KV cache kept across turns).
    pub prefill_tokens_per_episode: f64,
    /// Whether episodes shared the KV blocks of equal prefixes (`[rollout] share_prefixes`).
    pub share_prefixes: bool,
    /// Positions per episode taken from blocks other episodes computed, not prefilled.
    pub shared_prefix_tokens_per_episode: f64,
    /// Tokens prefilled per episode when every turn re-prefills the whole history.
    pub reprefill_prefill_tokens_per_episode: f64,
    /// The same with the padding of each turn's batch (rows × the longest history).
    pub padded_prefill_tokens_per_episode: f64,
    /// Most KV positions the decoder's pool held at once (the blocks of running and parked
    /// sequences, free blocks, the scratch block).
    pub peak_kv_positions: usize,
    /// Their size in MiB (keys and values of every layer, in the dtype of the weights).
    pub peak_kv_mib: f64,
    /// Most KV positions in the blocks sequences held at once.
    pub peak_kv_positions_in_use: usize,
    /// Whether steps with a prefill ran it beside the decoding rows in ragged passes (asked for
    /// and taken by the model: a GPU's paged-attention kernel that takes prefills).
    pub ragged_passes: bool,
    /// Forward passes per decoder step: 1 where every step is one pass.
    pub passes_per_step: f64,
    /// Key columns the attention spanned (rows × each pass's longest row, padding included),
    /// per token run through the decoder: what burn's ops (the GPU path) gather per layer where
    /// no kernel reads the cache in place (a GPU's prefill passes unless `--device-kernels all`;
    /// every pass with `off` or `--portable-ops`).
    pub attention_columns_per_token: f64,
    /// Sequences decoding per decoder step, on average (at most `batch`): on a GPU whose step
    /// costs the same at any number of rows, the rollout's speed follows it.
    pub rows_per_step: f64,
    /// Tokens in an episode's context at its end (prompt, agent turns, replies).
    pub context_tokens_per_episode: f64,
    /// Of those, the ones not sampled by the agent: what a kept KV cache must prefill, once.
    pub non_agent_context_tokens_per_episode: f64,
    /// Turns that ended on a sampled stop token before `turn_tokens`.
    pub turns_stopped_early: usize,
    pub env_calls: usize,
    /// Episodes that did not end with their forced answer (should be 0).
    pub unexpected_endings: usize,
    /// Pure decode at the same batch (`decode_rows`): as many tokens per row as an episode's
    /// turns from 16-token prompts in one `generate` call, timed after the prefill's step
    /// (contexts shorter than the rollout's: an upper bound on what a rollout can reach).
    pub decode_tokens_per_second: f64,
    /// `agent_tokens_per_second / decode_tokens_per_second`.
    pub rollout_over_decode: f64,
    /// Positions before the rollout's agent tokens, on average: the context each was decoded at.
    pub mean_agent_token_context: f64,
    /// Prompt tokens per row of the pure decode at the rollout's contexts: its tokens sit at
    /// `mean_agent_token_context` on average (16 at least).
    pub context_decode_prompt_tokens: usize,
    /// Pure decode of as many tokens, at the same rows, from `context_decode_prompt_tokens`-token
    /// prompts (windows of the episodes' own tokens): what decoding the rollout's tokens costs
    /// where they were decoded, with nothing else to do.
    pub context_decode_tokens_per_second: f64,
    /// `agent_tokens_per_second / context_decode_tokens_per_second`.
    pub rollout_over_context_decode: f64,
    /// Shares of the rollout's wall time: decoder steps that only decoded, steps with a prefill,
    /// the agent outside steps, and the rest (no step running: every episode in flight waiting
    /// on the environment, and the episode loop). They add up to 1.
    pub time_shares: TimeShares,
    /// Milliseconds per step of the pure decode (all rows, sampling included).
    pub pure_decode_step_ms: f64,
    /// The rollout's decoder steps that only decoded, and their mean milliseconds (sampling
    /// included).
    pub decode_steps: u64,
    pub decode_step_ms: f64,
    /// The rollout's steps that also prefilled joining sequences (and joined them to the
    /// batch), and their mean milliseconds.
    pub prefill_steps: u64,
    pub prefill_step_ms: f64,
    /// Seconds in the agent outside decoder steps (tokenising, queueing turns, the episode loop).
    pub agent_seconds_outside_steps: f64,
    /// Agent tokens per wall-clock second when every turn re-prefills the whole history.
    pub reprefill_agent_tokens_per_second: f64,
    /// `agent_tokens_per_second / reprefill_agent_tokens_per_second`.
    pub speedup_over_reprefill: f64,
    /// On a GPU, the largest memory of CubeCL's pool during each measurement (sampled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<RolloutMemory>,
    /// Agent tokens per wall-clock second turn by turn (kept caches, not continuous), when
    /// asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn_by_turn_agent_tokens_per_second: Option<f64>,
    /// The same batch on rollout workers, when some were given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<WorkerRollout>,
    /// With more episodes than the batch: the rollout with each episode beginning as one ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuous_admission: Option<ContinuousAdmission>,
    /// The same rollout without shared prefixes, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unshared: Option<Unshared>,
}

/// The rollout with each episode prefilling its whole context itself (`share_prefixes = false`),
/// beside the rollout that shares prefixes.
#[derive(Clone, Debug, Serialize)]
pub struct Unshared {
    pub seconds: f64,
    pub agent_tokens_per_second: f64,
    pub prefill_tokens_per_episode: f64,
    /// Most KV positions the decoder's pool held at once.
    pub peak_kv_positions: usize,
    /// The sharing rollout's agent tokens/s over these.
    pub shared_over_unshared: f64,
    /// Whether every episode's tokens equal the sharing rollout's.
    pub same_tokens: bool,
}

/// Where a rollout's wall time went, as fractions of it (see [`RolloutStats::time_shares`]).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TimeShares {
    pub decode_steps: f64,
    pub prefill_steps: f64,
    pub agent_outside_steps: f64,
    pub waiting: f64,
}

impl TimeShares {
    /// The shares of `seconds` of wall time with `agent_seconds` in the agent and `steps` in it.
    fn of(seconds: f64, agent_seconds: f64, steps: &StepTimes) -> Self {
        let wall = seconds.max(1e-9);
        let decode = steps.decode_time.as_secs_f64() / wall;
        let prefill = steps.prefill_time.as_secs_f64() / wall;
        let agent = (agent_seconds / wall).min(1.0);
        let outside = (agent - decode - prefill).max(0.0);
        Self { decode_steps: decode, prefill_steps: prefill, agent_outside_steps: outside, waiting: (1.0 - decode - prefill - outside).max(0.0) }
    }
}

/// The episodes run with at most `batch` in flight, the next beginning as soon as one ends
/// (`[rollout] admission = "continuous"`), where the rollout above runs them `batch` at a time
/// (the default, each batch waiting for its longest episode): the same episodes, sampled from
/// the same streams.
#[derive(Clone, Debug, Serialize)]
pub struct ContinuousAdmission {
    pub seconds: f64,
    pub agent_tokens: usize,
    pub agent_tokens_per_second: f64,
    /// Sequences decoding per decoder step, on average.
    pub rows_per_step: f64,
    /// The decoder's steps that only decoded and those with a prefill, and their mean
    /// milliseconds.
    pub decode_steps: u64,
    pub decode_step_ms: f64,
    pub prefill_steps: u64,
    pub prefill_step_ms: f64,
    /// Most KV positions the decoder's pool held at once.
    pub peak_kv_positions: usize,
    /// Episodes whose cache was dropped to stay within the budget.
    pub preemptions: u64,
    /// These agent tokens/s over the rollout's in batches.
    pub over_batches: f64,
}

/// A GPU's memory during the three measurements of a rollout batch, in MiB: the most held by
/// live tensors, and the most CubeCL's pool had reserved from the device. The pool gives its
/// unused pages back before each measurement, so each counts its own.
#[derive(Clone, Debug, Serialize)]
pub struct RolloutMemory {
    pub decode_in_use_mib: f64,
    pub decode_reserved_mib: f64,
    pub reprefill_in_use_mib: f64,
    pub reprefill_reserved_mib: f64,
    pub kept_in_use_mib: f64,
    pub kept_reserved_mib: f64,
}

/// One rollout batch on rollout workers (`engine = "servers"`): the median of the timed runs.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerRollout {
    pub workers: usize,
    pub seconds: f64,
    pub agent_tokens: usize,
    pub agent_tokens_per_second: f64,
    /// `agent_tokens_per_second` over the local rollout's.
    pub over_local: f64,
    /// Whether every episode's tokens equal the local rollout's (same seeds, same model).
    pub same_tokens_as_local: bool,
    /// Turns sent again to another worker after one failed.
    pub retries: u64,
}

/// A local environment: each call sleeps `latency`, then returns the reply for its turn
/// (the number of user messages it was sent, less one, picks one of `replies`).
pub struct ScriptedEnvironment {
    latency: Duration,
    replies: Vec<String>,
    calls: AtomicUsize,
}

impl ScriptedEnvironment {
    /// An environment answering call `k` of an episode with `replies[k % replies.len()]`.
    pub fn new(latency: Duration, replies: Vec<String>) -> Self {
        assert!(!replies.is_empty(), "a scripted environment needs a reply");
        Self {
            latency,
            replies,
            calls: AtomicUsize::new(0),
        }
    }

    /// An environment with `turns` replies of about `tokens` tokens each, as `count` counts them.
    pub fn with_reply_tokens(
        latency: Duration,
        tokens: usize,
        turns: usize,
        count: impl Fn(&str) -> usize,
    ) -> Self {
        Self::new(
            latency,
            (0..turns.max(1))
                .map(|k| reply_text(tokens, k, &count))
                .collect(),
        )
    }

    /// Calls answered so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }
}

impl Environment for ScriptedEnvironment {
    fn complete(&self, messages: &[ChatMessage]) -> Result<String, EnvError> {
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let turn = messages
            .iter()
            .filter(|m| m.role == Role::User)
            .count()
            .saturating_sub(1);
        Ok(self.replies[turn % self.replies.len()].clone())
    }
}

/// Deterministic English-like text of at least `tokens` tokens as `count` counts them (the
/// first length reached, growing by one word at the end, so a word or two over at most),
/// distinct for each `variant`.
pub fn reply_text(tokens: usize, variant: usize, count: impl Fn(&str) -> usize) -> String {
    const WORDS: [&str; 24] = [
        "the", "answer", "depends", "on", "which", "record", "you", "read", "first", "and", "how",
        "its", "figures", "were", "measured", "by", "those", "who", "kept", "them", "over", "many",
        "years", "so",
    ];
    let mut text = format!("Reply {variant}:");
    let mut i = variant * 7;
    // Words are added in steps of an eighth of the tokens still missing (a word is at least
    // one token and rarely more than a few), one at a time at the end, so the text is counted
    // O(log n) times and overshoots by a word at most.
    loop {
        let have = count(&text);
        if have >= tokens {
            return text;
        }
        let step = ((tokens - have) / 8).max(1);
        for _ in 0..step {
            text.push(' ');
            text.push_str(WORDS[i % WORDS.len()]);
            i += 1;
            if i % 13 == 0 {
                text.push_str(&format!(" {}.", i / 13));
            }
        }
    }
}

/// Counts of what the agent did during a rollout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolloutCounts {
    /// Turns generated (rows of every `generate_turns` call).
    pub turns: usize,
    /// Agent tokens sampled.
    pub agent_tokens: usize,
    /// Tokens a loop without kept caches prefills: each row's whole history at each turn.
    pub prefill_tokens: usize,
    /// Prefill with the batch's left padding: rows × the longest history, per turn.
    pub padded_prefill_tokens: usize,
    /// Tokens appended from the environment's replies.
    pub appended_tokens: usize,
    /// Turns that ended on a stop token.
    pub stopped_early: usize,
}

/// An agent whose turns are forced into a fixed shape: `inner` generates (and records) the
/// tokens, but the text the episode loop parses is a call on every turn before the last
/// (`turns`) and an answer on the last. Counts the prefill of today's loop and the time spent
/// inside the agent.
pub struct ForcedCalls<A> {
    inner: A,
    turns: usize,
    /// Each episode takes its own number of turns ([`episode_turns`]).
    varied: bool,
    /// Ends the inner agent's episode state after every turn, so that each turn prefills the
    /// whole history again (the loop before kept KV caches, for comparison).
    forget_between_turns: bool,
    counts: RolloutCounts,
    agent_time: Duration,
    /// Samples the GPU's memory after every call into the inner agent (outside `agent_time`,
    /// inside the rollout's wall time: a call into the GPU's server per step).
    probe: Option<Rc<MemoryProbe>>,
}

impl<A: Agent> ForcedCalls<A> {
    pub fn new(inner: A, turns: usize) -> Self {
        Self {
            inner,
            turns,
            varied: false,
            forget_between_turns: false,
            counts: RolloutCounts::default(),
            agent_time: Duration::ZERO,
            probe: None,
        }
    }

    /// The agent giving each episode its own number of turns, from 1 to `turns`
    /// ([`episode_turns`]), if `varied`.
    pub fn with_varied_turns(mut self, varied: bool) -> Self {
        self.varied = varied;
        self
    }

    /// The agent with its GPU memory sampled after every call into it.
    pub fn with_probe(mut self, probe: Option<Rc<MemoryProbe>>) -> Self {
        self.probe = probe;
        self
    }

    /// The agent re-prefilling each episode's whole history at every turn (see
    /// `forget_between_turns`).
    pub fn forgetting(mut self) -> Self {
        self.forget_between_turns = true;
        self
    }

    /// The wrapped agent.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    pub fn counts(&self) -> &RolloutCounts {
        &self.counts
    }

    /// Time spent in the inner agent's methods.
    pub fn agent_time(&self) -> Duration {
        self.agent_time
    }

    /// Clears the counts and the time (between timed runs).
    pub fn reset(&mut self) {
        self.counts = RolloutCounts::default();
        self.agent_time = Duration::ZERO;
    }

    /// Counts a generated turn and replaces its text with the forced call or answer.
    fn force(&mut self, ctx: &AgentContext, result: Result<TurnText, AgentError>) -> Result<TurnText, AgentError> {
        let turn = result?;
        self.counts.turns += 1;
        self.counts.agent_tokens += turn.tokens;
        if turn.end == TurnEnd::ImEnd {
            self.counts.stopped_early += 1;
        }
        let t = ctx.exchanges().len();
        let text = if t + 1 < episode_turns(self.turns, self.varied, ctx.index()) {
            format!("{CALL_OPEN}Call {t} of episode {}{CALL_CLOSE}", ctx.index())
        } else {
            format!("{ANSWER_OPEN}forced{ANSWER_CLOSE}")
        };
        Ok(TurnText { text, ..turn })
    }

    fn timed<T>(&mut self, f: impl FnOnce(&mut A) -> T) -> T {
        let start = Instant::now();
        let out = f(&mut self.inner);
        self.agent_time += start.elapsed();
        if let Some(probe) = &self.probe {
            probe.sample();
        }
        out
    }
}

impl<A: Agent> Agent for ForcedCalls<A> {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        self.timed(|a| a.begin_episode(ctx))
    }

    fn generate_turns(
        &mut self,
        episodes: &mut [&mut AgentContext],
    ) -> Vec<Result<TurnText, AgentError>> {
        let lengths: Vec<usize> = episodes.iter().map(|c| c.trace().len()).collect();
        self.counts.prefill_tokens += lengths.iter().sum::<usize>();
        self.counts.padded_prefill_tokens +=
            lengths.len() * lengths.iter().copied().max().unwrap_or(0);
        let forget = self.forget_between_turns;
        let results = self.timed(|a| {
            let results = a.generate_turns(episodes);
            if forget {
                episodes.iter_mut().for_each(|ctx| a.end_episode(ctx));
            }
            results
        });
        episodes
            .iter()
            .zip(results)
            .map(|(ctx, result)| self.force(ctx, result))
            .collect()
    }

    /// Continuous when the inner agent is, except when re-prefilling every turn (which goes
    /// turn by turn, as the loop before kept caches did).
    fn continuous(&self) -> bool {
        !self.forget_between_turns && self.inner.continuous()
    }

    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), AgentError>> {
        for ctx in episodes.iter() {
            self.counts.prefill_tokens += ctx.trace().len();
            self.counts.padded_prefill_tokens += ctx.trace().len();
        }
        self.timed(|a| a.start_turns(episodes))
    }

    fn advance(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<TurnText, AgentError>)> {
        let ended = self.timed(|a| a.advance(episodes));
        ended
            .into_iter()
            .map(|(index, result)| {
                let forced = match episodes.iter().find(|c| c.index() == index) {
                    Some(ctx) => self.force(ctx, result),
                    None => result,
                };
                (index, forced)
            })
            .collect()
    }

    fn append_environment(
        &mut self,
        ctx: &mut AgentContext,
        text: &str,
    ) -> Result<usize, AgentError> {
        let tokens = self.timed(|a| a.append_environment(ctx, text))?;
        self.counts.appended_tokens += tokens;
        Ok(tokens)
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.timed(|a| a.end_episode(ctx))
    }
}

/// Tokens today's loop prefills for one episode: at each turn the whole history, i.e. the
/// prompt plus every earlier turn's agent tokens and appended reply. `turns[t]` is turn `t`'s
/// (agent tokens, tokens appended after it); the last turn's appended count is not used.
pub fn today_prefill_tokens(prompt: usize, turns: &[(usize, usize)]) -> usize {
    let mut history = prompt;
    let mut total = 0;
    for &(agent, appended) in turns {
        total += history;
        history += agent + appended;
    }
    total
}

/// An episode's prompt length and turn shape, read from its loss mask: after the prompt,
/// runs of agent tokens (mask 1), each followed by the tokens appended after it (mask 0).
pub fn turn_shape(trajectory: &Trajectory) -> (usize, Vec<(usize, usize)>) {
    let mut shape: Vec<(usize, usize)> = Vec::new();
    let mut previous = 0;
    for &m in trajectory.loss_mask.iter().skip(trajectory.prompt_len) {
        match (m, previous) {
            (1, 1) => shape.last_mut().expect("a run is open").0 += 1,
            (1, _) => shape.push((1, 0)),
            (_, 0) if shape.is_empty() => {}
            _ => shape.last_mut().expect("a run is open").1 += 1,
        }
        previous = m;
    }
    (trajectory.prompt_len, shape)
}

/// The episode settings of the workload: `turns` rounds of exactly `turn_tokens` tokens, calls
/// always sent, replies never cut and no response limit.
pub fn episode_config(settings: &RolloutSettings) -> EpisodeConfig {
    let mut config = EpisodeConfig::training();
    config.max_turns = settings.turns;
    config.max_turn_tokens = settings.turn_tokens;
    config.max_response_tokens = usize::MAX;
    config.reply.max_chars = usize::MAX;
    config.env_concurrency = settings.env_concurrency.max(1);
    config
}

/// The questions of `episodes` episodes, each asked by `group` consecutive episodes (as a GRPO
/// group of `rollout.n` samples a question).
fn questions(episodes: usize, group: usize) -> Vec<String> {
    (0..episodes)
        .map(|i| format!("What is the capital of country number {}?", i / group.max(1)))
        .collect()
}

/// Runs and times the workload at `batch` episodes: `settings.runs` rollouts and as many pure
/// decode measurements (the medians are reported).
pub fn measure<B: Backend>(
    model: &Qwen3ForCausalLM<B>,
    tokenizer: &Qwen3Tokenizer,
    settings: &RolloutSettings,
    batch: usize,
    probe: Option<Rc<MemoryProbe>>,
) -> Result<RolloutStats> {
    if batch == 0 || settings.turns == 0 || settings.turn_tokens < 2 || settings.runs == 0 {
        bail!("--rollout-batch and --rollout-turns must be at least 1, --rollout-turn-tokens at least 2");
    }
    let count = |text: &str| tokenizer.encode(text).map(|ids| ids.len()).unwrap_or(0);
    let environment = ScriptedEnvironment::with_reply_tokens(
        settings.latency,
        settings.reply_tokens,
        settings.turns,
        count,
    );
    let config = episode_config(settings);
    let episodes = settings.episodes.unwrap_or(batch).max(1);
    let questions = questions(episodes, settings.group_size);
    let sampling = Sampling {
        temperature: 1.0,
        seed: settings.seed,
        ..Sampling::default()
    };

    // Pure decode, as the `decode batch` workload: 16-token prompts (windows of the first
    // episode's prompt), as many new tokens per row as an episode's turns, timed after the
    // prefill's step (with the first token); the pure decode at the rollout's contexts is
    // below, after the rollout.
    let ids = tokenizer.encode(&config.prompts.first_prompt(&questions[0]).chatml())?;
    if ids.len() < DECODE_PROMPT + 8 {
        bail!("the episode prompt is too short ({} tokens)", ids.len());
    }
    let decode_rows = batch.min(settings.max_num_seqs.unwrap_or(usize::MAX)).max(1);
    let prompts: Vec<Vec<u32>> = (0..decode_rows)
        .map(|b| ids[b % 8..b % 8 + DECODE_PROMPT].to_vec())
        .collect();
    let new_tokens = settings.turns * settings.turn_tokens;
    let mib = |m: crate::device::DeviceMemory| (m.in_use as f64 / 1048576.0, m.reserved as f64 / 1048576.0);
    // Each measurement's memory its own: the pages the one before it freed go back to the
    // device (as `train` gives them back between a step's phases), and the peak starts anew.
    let device = model.device();
    let memory = || -> Result<Option<(f64, f64)>> {
        let Some(probe) = &probe else { return Ok(None) };
        let peak = mib(probe.take());
        trainer::run::release_unused_device_memory::<B>(&device)?;
        probe.take();
        Ok(Some(peak))
    };
    memory()?;
    let decode_seconds = pure_decode_seconds(model, &prompts, new_tokens, &sampling, settings.runs)?;
    let decode_rate = (decode_rows * (new_tokens - 1)) as f64 / decode_seconds;

    // The rollout, through LocalAgent and the episode loop: first with each turn re-prefilling
    // its episode's history (the loop before kept caches), then as the trainer runs it (`batch`
    // episodes at a time), or beginning each as one ends (`admission`).
    let per_position = trainer::plan::kv_position_bytes(&model.config, model.model.embed_tokens.weight.val().dtype());
    let kv_budget = settings.kv_budget.map(|bytes| usize::try_from(bytes / per_position.max(1)).unwrap_or(usize::MAX));
    let timed_sharing = |forget: bool, continuous: bool, admission: Admission, share_prefixes: bool| -> TimedRollout {
        let limits = DecoderLimits {
            max_rows: settings.max_num_seqs.unwrap_or(usize::MAX).max(1),
            max_batched_tokens: settings.max_batched_tokens,
            kv_budget,
            share_prefixes,
            ragged_passes: settings.ragged_passes,
        };
        let local = LocalAgent::new(model, tokenizer, sampling.clone()).with_limits(limits).with_continuous_batching(continuous);
        let mut agent = ForcedCalls::new(local, settings.turns).with_varied_turns(settings.varied_turns).with_probe(probe.clone());
        if forget {
            agent = agent.forgetting();
        }
        let mut runs = Vec::new();
        for _ in 0..settings.runs {
            agent.reset();
            let prefilled = agent.inner().prefill_tokens();
            let stats_before = agent.inner().decoder_stats();
            let steps_before = agent.inner().step_times();
            let start = Instant::now();
            let trajectories = run_episodes_admitted(&mut agent, &environment, &questions, &config, admission, &mut NoObserver);
            runs.push(TimedRollout {
                seconds: start.elapsed().as_secs_f64(),
                agent_seconds: agent.agent_time().as_secs_f64(),
                counts: agent.counts().clone(),
                prefill_tokens: (agent.inner().prefill_tokens() - prefilled) as usize,
                decoder: DecoderRun::between(&stats_before, &agent.inner().decoder_stats()),
                steps: agent.inner().step_times().since(&steps_before),
                trajectories,
            });
        }
        runs.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        runs.swap_remove(runs.len() / 2)
    };
    // Re-prefilling every turn is the loop before kept caches: no prefix shared either.
    let timed = |forget: bool, continuous: bool, admission: Admission| timed_sharing(forget, continuous, admission, settings.share_prefixes && !forget);
    let decode_memory = memory()?;
    let batches = Admission::Batches(batch);
    let before = timed(true, true, batches);
    let reprefill_memory = memory()?;
    let TimedRollout { seconds, agent_seconds, counts, prefill_tokens, decoder, steps, trajectories } = timed(false, true, batches);
    let device_memory = decode_memory.zip(reprefill_memory).zip(memory()?).map(|((d, r), k)| RolloutMemory {
        decode_in_use_mib: d.0,
        decode_reserved_mib: d.1,
        reprefill_in_use_mib: r.0,
        reprefill_reserved_mib: r.1,
        kept_in_use_mib: k.0,
        kept_reserved_mib: k.1,
    });
    let turn_by_turn = settings.turn_by_turn.then(|| timed(false, false, batches));
    let unshared = (settings.unshared && settings.share_prefixes).then(|| timed_sharing(false, true, batches, false));
    let rate = counts.agent_tokens as f64 / seconds;
    let continuous_admission = (episodes > batch).then(|| {
        let run = timed(false, true, Admission::Continuous(batch));
        let run_rate = run.counts.agent_tokens as f64 / run.seconds;
        ContinuousAdmission {
            seconds: run.seconds,
            agent_tokens: run.counts.agent_tokens,
            agent_tokens_per_second: run_rate,
            rows_per_step: run.steps.rows_per_step(run.decoder.decoded),
            decode_steps: run.steps.decode_steps,
            decode_step_ms: run.steps.decode_step_ms(),
            prefill_steps: run.steps.prefill_steps,
            prefill_step_ms: run.steps.prefill_step_ms(),
            peak_kv_positions: run.decoder.peak_kv_positions,
            preemptions: run.decoder.preemptions,
            over_batches: run_rate / rate,
        }
    });
    if turn_by_turn.as_ref().is_some_and(|t| !same_tokens(&t.trajectories, &trajectories)) {
        eprintln!("the episodes differ between continuous batching and turn by turn");
    }
    if !same_tokens(&before.trajectories, &trajectories) {
        eprintln!("the episodes differ between re-prefilling and kept caches");
    }
    let unexpected = trajectories
        .iter()
        .enumerate()
        .filter(|(i, t)| t.stop_reason != StopReason::Answer || t.env_calls + 1 != episode_turns(settings.turns, settings.varied_turns, *i))
        .count();
    if let Some(t) = trajectories.iter().find(|t| t.error.is_some()) {
        eprintln!(
            "an episode failed: {}",
            t.error.as_deref().unwrap_or_default()
        );
    }
    let expected: usize = trajectories
        .iter()
        .map(|t| {
            let (prompt, shape) = turn_shape(t);
            today_prefill_tokens(prompt, &shape)
        })
        .sum();
    if expected != before.prefill_tokens {
        eprintln!(
            "prefill of the re-prefilling run ({}) differs from the episodes' turn shapes ({expected})",
            before.prefill_tokens
        );
    }
    let workers = if settings.workers.is_empty() {
        None
    } else {
        let rate = counts.agent_tokens as f64 / seconds;
        Some(on_workers(tokenizer, &environment, &questions, batch, &config, &sampling, settings, model.config.vocab_size, &trajectories, rate)?)
    };
    let env_calls: usize = trajectories.iter().map(|t| t.env_calls).sum();
    let modes = 2 + usize::from(turn_by_turn.is_some()) + usize::from(unshared.is_some()) + usize::from(continuous_admission.is_some()) + settings.workers.len().min(1);
    if modes * env_calls * settings.runs != environment.calls() {
        eprintln!(
            "the environment answered {} calls; the episodes count {env_calls} per run",
            environment.calls()
        );
    }
    // Pure decode where the rollout decoded: from prompts of the episodes' own tokens, long
    // enough that the decoded tokens sit at the rollout's mean context.
    let (positions, agent_tokens_in_context) = trajectories
        .iter()
        .flat_map(|t| t.loss_mask.iter().enumerate().filter(|&(_, &m)| m == 1).map(|(p, _)| p))
        .fold((0usize, 0usize), |(sum, n), p| (sum + p, n + 1));
    let mean_context = positions as f64 / agent_tokens_in_context.max(1) as f64;
    let context_prompt = ((mean_context - (new_tokens / 2) as f64).round().max(0.0) as usize).max(DECODE_PROMPT);
    let sources: Vec<&[u32]> = trajectories.iter().map(|t| t.token_ids.as_slice()).filter(|ids| !ids.is_empty()).collect();
    if sources.is_empty() {
        bail!("no episode of the rollout recorded a token");
    }
    let context_prompts: Vec<Vec<u32>> = (0..decode_rows)
        .map(|r| {
            let source = sources[r % sources.len()];
            (0..context_prompt).map(|i| source[(i + r % 8) % source.len()]).collect()
        })
        .collect();
    let context_decode_seconds = pure_decode_seconds(model, &context_prompts, new_tokens, &sampling, settings.runs)?;
    let context_decode_rate = (decode_rows * (new_tokens - 1)) as f64 / context_decode_seconds;
    let context: usize = trajectories.iter().map(|t| t.token_ids.len()).sum();
    let per_episode = |n: usize| n as f64 / episodes as f64;
    Ok(RolloutStats {
        batch,
        episodes,
        group_size: settings.group_size.max(1),
        varied_turns: settings.varied_turns,
        turns: settings.turns,
        turn_tokens: settings.turn_tokens,
        reply_tokens: settings.reply_tokens,
        latency_ms: settings.latency.as_millis() as u64,
        max_num_batched_tokens: settings.max_batched_tokens,
        max_num_seqs: settings.max_num_seqs.filter(|&rows| rows < batch),
        decode_rows,
        kv_budget_positions: kv_budget,
        preemptions: decoder.preemptions,
        seconds,
        agent_seconds,
        env_wait_seconds: (seconds - agent_seconds).max(0.0),
        agent_tokens: counts.agent_tokens,
        agent_tokens_per_second: rate,
        agent_tokens_per_agent_second: counts.agent_tokens as f64 / agent_seconds.max(1e-9),
        prefill_tokens_per_episode: per_episode(prefill_tokens),
        share_prefixes: settings.share_prefixes,
        shared_prefix_tokens_per_episode: per_episode(decoder.shared_prefix_tokens as usize),
        reprefill_prefill_tokens_per_episode: per_episode(before.prefill_tokens),
        padded_prefill_tokens_per_episode: per_episode(counts.padded_prefill_tokens),
        peak_kv_positions: decoder.peak_kv_positions,
        peak_kv_mib: (decoder.peak_kv_positions as u64 * per_position) as f64 / 1048576.0,
        peak_kv_positions_in_use: decoder.peak_kv_positions_in_use,
        ragged_passes: settings.ragged_passes && model.takes_ragged_passes(),
        passes_per_step: decoder.passes as f64 / (steps.decode_steps + steps.prefill_steps).max(1) as f64,
        attention_columns_per_token: decoder.attention_columns as f64 / (decoder.decoded + prefill_tokens as u64).max(1) as f64,
        rows_per_step: steps.rows_per_step(decoder.decoded),
        context_tokens_per_episode: per_episode(context),
        non_agent_context_tokens_per_episode: per_episode(context - agent_tokens_in_context),
        turns_stopped_early: counts.stopped_early,
        env_calls,
        unexpected_endings: unexpected,
        decode_tokens_per_second: decode_rate,
        rollout_over_decode: rate / decode_rate,
        mean_agent_token_context: mean_context,
        context_decode_prompt_tokens: context_prompt,
        context_decode_tokens_per_second: context_decode_rate,
        rollout_over_context_decode: rate / context_decode_rate,
        time_shares: TimeShares::of(seconds, agent_seconds, &steps),
        pure_decode_step_ms: 1e3 * decode_seconds / (new_tokens - 1) as f64,
        decode_steps: steps.decode_steps,
        decode_step_ms: steps.decode_step_ms(),
        prefill_steps: steps.prefill_steps,
        prefill_step_ms: steps.prefill_step_ms(),
        agent_seconds_outside_steps: (agent_seconds - (steps.decode_time + steps.prefill_time).as_secs_f64()).max(0.0),
        reprefill_agent_tokens_per_second: before.counts.agent_tokens as f64 / before.seconds,
        speedup_over_reprefill: rate / (before.counts.agent_tokens as f64 / before.seconds),
        turn_by_turn_agent_tokens_per_second: turn_by_turn.map(|t| t.counts.agent_tokens as f64 / t.seconds),
        device_memory,
        workers,
        continuous_admission,
        unshared: unshared.map(|run| {
            let unshared_rate = run.counts.agent_tokens as f64 / run.seconds;
            Unshared {
                seconds: run.seconds,
                agent_tokens_per_second: unshared_rate,
                prefill_tokens_per_episode: per_episode(run.prefill_tokens),
                peak_kv_positions: run.decoder.peak_kv_positions,
                shared_over_unshared: rate / unshared_rate,
                same_tokens: same_tokens(&run.trajectories, &trajectories),
            }
        }),
    })
}

/// The batch on `settings.workers` through the trainer's server agent (the median of
/// `settings.runs` runs), compared with the local rollout's `local` trajectories and agent
/// tokens/s.
#[allow(clippy::too_many_arguments)]
fn on_workers(
    tokenizer: &Qwen3Tokenizer,
    environment: &ScriptedEnvironment,
    questions: &[String],
    batch: usize,
    config: &EpisodeConfig,
    sampling: &Sampling,
    settings: &RolloutSettings,
    vocab_size: usize,
    local: &[Trajectory],
    local_rate: f64,
) -> Result<WorkerRollout> {
    let servers = ServerSettings { urls: settings.workers.clone(), model_name: Some(settings.worker_model.clone()), ..ServerSettings::default() };
    let mut pool = ServerPool::new(&servers, false).map_err(|e| anyhow!("--rollout-workers: {e}"))?;
    let mut runs = Vec::new();
    for _ in 0..settings.runs {
        let mut agent = ForcedCalls::new(ServerAgent::new(&mut pool, tokenizer, sampling.clone(), vocab_size), settings.turns).with_varied_turns(settings.varied_turns);
        let start = Instant::now();
        let trajectories = run_episodes_admitted(&mut agent, environment, questions, config, Admission::Batches(batch), &mut NoObserver);
        let seconds = start.elapsed().as_secs_f64();
        if let Some(t) = trajectories.iter().find(|t| t.error.is_some()) {
            bail!("an episode failed on the workers: {}", t.error.as_deref().unwrap_or_default());
        }
        runs.push((seconds, agent.counts().agent_tokens, trajectories));
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (seconds, agent_tokens, trajectories) = runs.swap_remove(runs.len() / 2);
    let rate = agent_tokens as f64 / seconds;
    Ok(WorkerRollout {
        workers: settings.workers.len(),
        seconds,
        agent_tokens,
        agent_tokens_per_second: rate,
        over_local: rate / local_rate,
        same_tokens_as_local: same_tokens(&trajectories, local),
        retries: pool.retries(),
    })
}

/// One timed rollout (the median of the runs).
struct TimedRollout {
    seconds: f64,
    agent_seconds: f64,
    counts: RolloutCounts,
    /// Tokens the agent's decoder prefilled.
    prefill_tokens: usize,
    decoder: DecoderRun,
    /// The agent's decoder steps during the run.
    steps: StepTimes,
    trajectories: Vec<Trajectory>,
}

/// What the agent's decoder did during one run.
struct DecoderRun {
    /// Tokens through one-token decode passes.
    decoded: u64,
    /// Positions taken from other sequences' blocks instead of prefilled.
    shared_prefix_tokens: u64,
    /// Caches dropped for room: running sequences preempted and parked caches evicted.
    preemptions: u64,
    /// Key columns the attention spanned.
    attention_columns: u64,
    /// Forward passes.
    passes: u64,
    /// The pool's peak, and the peak of the blocks in use (the decoder's, over every run so
    /// far: the pool is freed between runs, so each run reaches its own).
    peak_kv_positions: usize,
    peak_kv_positions_in_use: usize,
}

impl DecoderRun {
    /// The difference between the decoder's stats `before` and `after` a run.
    fn between(before: &DecoderStats, after: &DecoderStats) -> Self {
        Self {
            decoded: after.decode_tokens - before.decode_tokens,
            shared_prefix_tokens: after.shared_prefix_tokens - before.shared_prefix_tokens,
            preemptions: after.preemptions + after.evictions - before.preemptions - before.evictions,
            attention_columns: after.attention_columns - before.attention_columns,
            passes: after.passes - before.passes,
            peak_kv_positions: after.peak_kv_positions,
            peak_kv_positions_in_use: after.peak_kv_positions_in_use,
        }
    }
}

/// The tokenizer of the rollout: the checkpoint's own, or (random presets) the project's tiny
/// tokenizer, whose ids are valid in every preset's vocabulary (ids a larger model samples
/// outside it decode to nothing; the turn texts are forced anyway).
pub fn tokenizer(dir: &std::path::Path) -> Result<Qwen3Tokenizer> {
    if dir.join(model::tokenizer::TOKENIZER_FILE).exists() {
        return Ok(Qwen3Tokenizer::from_dir(dir)?);
    }
    Ok(model::tiny_tokenizer::train_tiny_tokenizer(
        model::tiny_tokenizer::TINY_VOCAB_SIZE,
    )?)
}

/// Prints one batch's figures in words.
pub fn print(stats: &RolloutStats) {
    let s = stats;
    let turns = if s.varied_turns { format!("1 to {} turns", s.turns) } else { format!("{} turns", s.turns) };
    let mut rows = s.max_num_seqs.map_or(String::new(), |rows| format!(", at most {rows} decoding at once (max_num_seqs)"));
    if s.group_size > 1 {
        rows.push_str(&format!(", each question asked by {} episodes", s.group_size));
    }
    println!(
        "rollout batch {}: {} episodes of {turns} of {} tokens, replies of {} tokens after {} ms; LocalAgent + the episode loop (turn texts forced), prefill passes of at most {} positions{rows}",
        s.batch, s.episodes, s.turn_tokens, s.reply_tokens, s.latency_ms, s.max_num_batched_tokens
    );
    println!(
        "  {:.2} s wall ({:.2} s in the agent, {:.2} s waiting on the environment, {} calls); {} agent tokens ({} turns stopped early)",
        s.seconds, s.agent_seconds, s.env_wait_seconds, s.env_calls, s.agent_tokens, s.turns_stopped_early
    );
    println!(
        "  agent tokens/s {:.1} (in the agent: {:.1}); pure decode at batch {}: {:.1} tok/s from {DECODE_PROMPT}-token prompts, {:.1} tok/s from {}-token prompts (the rollout decoded its tokens at {:.0} positions on average); rollout / decode = {:.3}, {:.3} at the rollout's contexts",
        s.agent_tokens_per_second,
        s.agent_tokens_per_agent_second,
        s.decode_rows,
        s.decode_tokens_per_second,
        s.context_decode_tokens_per_second,
        s.context_decode_prompt_tokens,
        s.mean_agent_token_context,
        s.rollout_over_decode,
        s.rollout_over_context_decode
    );
    let t = &s.time_shares;
    println!(
        "  wall time: {:.0}% in steps that only decoded, {:.0}% in steps with a prefill, {:.0}% in the agent outside steps, {:.0}% with no step running (every episode in flight on the environment, the episode loop)",
        100.0 * t.decode_steps,
        100.0 * t.prefill_steps,
        100.0 * t.agent_outside_steps,
        100.0 * t.waiting
    );
    let shared = if s.share_prefixes { format!(" ({:.0} more taken from prefixes other episodes computed)", s.shared_prefix_tokens_per_episode) } else { " (no prefix shared)".to_string() };
    println!(
        "  per episode: {:.0} prefill tokens{shared} for {:.0} context tokens, {:.0} of them not the agent's; peak KV {} positions ({:.0} MiB){}",
        s.prefill_tokens_per_episode,
        s.context_tokens_per_episode,
        s.non_agent_context_tokens_per_episode,
        s.peak_kv_positions,
        s.peak_kv_mib,
        s.kv_budget_positions.map_or(String::new(), |b| format!(" within a budget of {b} ({} preempted)", s.preemptions))
    );
    println!(
        "  decoder steps: {} decoding only at {:.1} ms (pure decode: {:.1} ms a step), {} with a prefill at {:.1} ms ({}); {:.2} forward passes a step; {:.2} s in the agent outside steps",
        s.decode_steps,
        s.decode_step_ms,
        s.pure_decode_step_ms,
        s.prefill_steps,
        s.prefill_step_ms,
        if s.ragged_passes { "ragged passes: the prefill beside the decoding rows" } else { "the prefill in passes of its own" },
        s.passes_per_step,
        s.agent_seconds_outside_steps
    );
    println!(
        "  paged KV: at most {} positions in sequences' blocks (the pool {}); the attention spanned {:.0} key columns per token (padding to each pass's longest row included; burn's ops gather them where no kernel reads the cache in place); {:.2} of {} rows decoded per step",
        s.peak_kv_positions_in_use, s.peak_kv_positions, s.attention_columns_per_token, s.rows_per_step, s.decode_rows
    );
    if let Some(c) = &s.continuous_admission {
        println!(
            "  beginning each episode as one ends (admission = \"continuous\", at most {} in flight): {:.2} s wall, {:.1} agent tokens/s ({:.2}x the batches'), {:.2} rows decoded per step; {} steps decoding only at {:.1} ms, {} with a prefill at {:.1} ms; peak KV {} positions ({} preempted)",
            s.batch, c.seconds, c.agent_tokens_per_second, c.over_batches, c.rows_per_step, c.decode_steps, c.decode_step_ms, c.prefill_steps, c.prefill_step_ms, c.peak_kv_positions, c.preemptions
        );
    }
    println!(
        "  re-prefilling every turn instead: {:.1} agent tokens/s, {:.0} prefill tokens per episode; kept caches are {:.2}x faster",
        s.reprefill_agent_tokens_per_second, s.reprefill_prefill_tokens_per_episode, s.speedup_over_reprefill
    );
    if let Some(m) = &s.device_memory {
        println!(
            "  GPU memory (CubeCL's pool, MiB in use / reserved): pure decode {:.0} / {:.0}, re-prefilling {:.0} / {:.0}, kept caches {:.0} / {:.0}",
            m.decode_in_use_mib, m.decode_reserved_mib, m.reprefill_in_use_mib, m.reprefill_reserved_mib, m.kept_in_use_mib, m.kept_reserved_mib
        );
    }
    if let Some(u) = &s.unshared {
        println!(
            "  without shared prefixes (share_prefixes = false): {:.1} agent tokens/s, {:.0} prefill tokens per episode, peak KV {} positions; sharing is {:.2}x faster; tokens {} the sharing rollout's",
            u.agent_tokens_per_second,
            u.prefill_tokens_per_episode,
            u.peak_kv_positions,
            u.shared_over_unshared,
            if u.same_tokens { "equal to" } else { "DIFFER from" }
        );
    }
    if let Some(rate) = s.turn_by_turn_agent_tokens_per_second {
        println!(
            "  turn by turn (continuous_batching = false): {:.1} agent tokens/s, {:.2}x the continuous rollout",
            rate,
            rate / s.agent_tokens_per_second
        );
    }
    if let Some(w) = &s.workers {
        println!(
            "  on {} rollout worker(s): {:.2} s wall, {:.1} agent tokens/s ({:.2}x the local rollout); tokens {} the local ones; {} turns resent",
            w.workers,
            w.seconds,
            w.agent_tokens_per_second,
            w.over_local,
            if w.same_tokens_as_local { "equal to" } else { "DIFFER from" },
            w.retries
        );
    }
    if s.unexpected_endings > 0 {
        println!(
            "  {} episodes did not end with their forced answer",
            s.unexpected_endings
        );
    }
}

/// Prompt tokens per row of the pure decode measurement (as the `decode batch` workload).
const DECODE_PROMPT: usize = 16;

/// Seconds `generate` takes to decode `new_tokens - 1` tokens for each row of `prompts` after
/// its first, timed from when the first step's tokens (the prefill's) reached the host: the
/// median of `runs`, after a few untimed steps (on a GPU they compile the kernels of these
/// shapes).
fn pure_decode_seconds<B: Backend>(
    model: &Qwen3ForCausalLM<B>,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    sampling: &Sampling,
    runs: usize,
) -> Result<f64> {
    let decode = SamplingConfig {
        max_new_tokens: new_tokens,
        sampling: sampling.clone(),
        stop_token_ids: Vec::new(),
    };
    generate(model, prompts, &SamplingConfig { max_new_tokens: 4, ..decode.clone() })?;
    median(runs, || super::decoding_seconds(model, prompts, &decode))
}

/// Whether two runs of the same episodes sampled the same tokens, episode by episode.
fn same_tokens(a: &[Trajectory], b: &[Trajectory]) -> bool {
    a.iter().map(|t| &t.token_ids).eq(b.iter().map(|t| &t.token_ids))
}

/// The median of `runs` calls of `time`.
fn median(runs: usize, mut time: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut seconds = (0..runs).map(|_| time()).collect::<Result<Vec<_>>>()?;
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[runs / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent that records `prompt` tokens for the first prompt, `turn` tokens per turn (or
    /// the budget, if smaller) and one token per 4 characters of environment text.
    struct Fixed {
        prompt: usize,
        turn: usize,
    }

    impl Agent for Fixed {
        fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
            ctx.record_context_tokens(&vec![1; self.prompt]);
            Ok(())
        }

        fn generate_turns(
            &mut self,
            episodes: &mut [&mut AgentContext],
        ) -> Vec<Result<TurnText, AgentError>> {
            episodes
                .iter_mut()
                .map(|ctx| {
                    let n = self.turn.min(ctx.turn_budget());
                    for _ in 0..n {
                        ctx.record_agent_token(2, -1.0);
                    }
                    Ok(TurnText {
                        text: "no tags at all".into(),
                        tokens: n,
                        end: TurnEnd::Length,
                    })
                })
                .collect()
        }

        fn append_environment(
            &mut self,
            ctx: &mut AgentContext,
            text: &str,
        ) -> Result<usize, AgentError> {
            let n = env::estimate_tokens(text);
            ctx.record_context_tokens(&vec![3; n]);
            Ok(n)
        }
    }

    fn settings(turns: usize, turn_tokens: usize) -> RolloutSettings {
        RolloutSettings {
            turns,
            turn_tokens,
            latency: Duration::ZERO,
            reply_tokens: 40,
            env_concurrency: 4,
            seed: 0,
            runs: 1,
            workers: Vec::new(),
            worker_model: String::new(),
            turn_by_turn: false,
            max_batched_tokens: 8192,
            episodes: None,
            varied_turns: false,
            kv_budget: None,
            max_num_seqs: None,
            share_prefixes: true,
            unshared: false,
            group_size: 1,
            ragged_passes: true,
        }
    }

    #[test]
    fn rollout_replies_have_about_the_asked_tokens() {
        let tokenizer =
            model::tiny_tokenizer::train_tiny_tokenizer(model::tiny_tokenizer::TINY_VOCAB_SIZE)
                .unwrap();
        let count = |t: &str| tokenizer.encode(t).unwrap().len();
        for tokens in [1, 100, 300] {
            let env = ScriptedEnvironment::with_reply_tokens(Duration::ZERO, tokens, 3, count);
            for turn in 0..3 {
                let mut messages = vec![ChatMessage::system("s")];
                for _ in 0..=turn {
                    messages.push(ChatMessage::user("p"));
                }
                let reply = env.complete(&messages).unwrap();
                let n = count(&reply);
                assert!(
                    n >= tokens && n <= tokens + 6,
                    "{n} tokens for {tokens} asked"
                );
                assert_eq!(
                    reply,
                    env.complete(&messages).unwrap(),
                    "replies are deterministic"
                );
            }
        }
        let env = ScriptedEnvironment::with_reply_tokens(Duration::ZERO, 50, 2, count);
        let first = env.complete(&[ChatMessage::user("a")]).unwrap();
        let second = env
            .complete(&[ChatMessage::user("a"), ChatMessage::user("b")])
            .unwrap();
        assert_ne!(first, second, "each turn has its own reply");
        assert_eq!(env.calls(), 2);
    }

    /// With varied turns each episode answers after its own number of turns, from 1 to the
    /// most, found by its place in the whole list whichever way the episodes begin.
    #[test]
    fn rollout_varied_turns_end_each_episode_at_its_own_turn() {
        let (turns, episodes) = (4, 12);
        let settings = settings(turns, 3);
        let env = ScriptedEnvironment::new(Duration::ZERO, vec![reply_text(5, 0, env::estimate_tokens)]);
        let drawn: Vec<usize> = (0..episodes).map(|i| episode_turns(turns, true, i)).collect();
        assert!(drawn.iter().all(|&t| (1..=turns).contains(&t)), "{drawn:?}");
        assert!(drawn.contains(&1) && drawn.contains(&turns), "from 1 to {turns}: {drawn:?}");
        assert_eq!(drawn, (0..episodes).map(|i| episode_turns(turns, true, i)).collect::<Vec<_>>(), "the same every run");
        assert!((0..episodes).all(|i| episode_turns(turns, false, i) == turns));
        let mut agent = ForcedCalls::new(Fixed { prompt: 10, turn: 3 }, turns).with_varied_turns(true);
        for admission in [Admission::Batches(5), Admission::Continuous(4)] {
            let trajectories = run_episodes_admitted(&mut agent, &env, &questions(episodes, 1), &episode_config(&settings), admission, &mut NoObserver);
            for (i, t) in trajectories.iter().enumerate() {
                assert_eq!(t.stop_reason, StopReason::Answer, "episode {i}: {:?}", t.error);
                assert_eq!((t.turns.len(), t.env_calls), (drawn[i], drawn[i] - 1), "episode {i}, {admission:?}");
            }
        }
    }

    #[test]
    fn rollout_prefill_accounting_of_a_turn_shape() {
        // 100-token prompt, 10-token turns, 50 tokens appended after each: 100 + 160 + 220.
        assert_eq!(
            today_prefill_tokens(100, &[(10, 50), (10, 50), (10, 0)]),
            480
        );
        assert_eq!(today_prefill_tokens(7, &[(3, 0)]), 7);
        assert_eq!(today_prefill_tokens(7, &[]), 0);
    }

    #[test]
    fn rollout_forced_episodes_call_every_turn_but_the_last() {
        let (prompt, turn, turns, batch) = (30, 6, 4, 3);
        let settings = settings(turns, turn);
        // One reply for every turn, so that every turn appends the same number of tokens.
        let env = ScriptedEnvironment::new(
            Duration::ZERO,
            vec![reply_text(40, 0, env::estimate_tokens)],
        );
        let mut agent = ForcedCalls::new(Fixed { prompt, turn }, turns);
        let trajectories = env::run_episodes(
            &mut agent,
            &env,
            &questions(batch, 1),
            &episode_config(&settings),
        );
        assert_eq!(trajectories.len(), batch);
        for t in &trajectories {
            assert_eq!(t.stop_reason, StopReason::Answer, "{:?}", t.error);
            assert_eq!(t.env_calls, turns - 1);
            assert_eq!(t.turns.len(), turns);
        }
        assert_eq!(env.calls(), batch * (turns - 1));
        let counts = agent.counts();
        assert_eq!(counts.turns, batch * turns);
        assert_eq!(counts.agent_tokens, batch * turns * turn);
        assert_eq!(counts.stopped_early, 0);
        let appended = counts.appended_tokens / (batch * (turns - 1));
        assert_eq!(counts.appended_tokens, appended * batch * (turns - 1));
        let mut shape = vec![(turn, appended); turns];
        shape[turns - 1].1 = 0;
        assert_eq!(
            counts.prefill_tokens,
            batch * today_prefill_tokens(prompt, &shape)
        );
        assert_eq!(counts.padded_prefill_tokens, counts.prefill_tokens);
        let context = prompt + turns * turn + (turns - 1) * appended;
        for t in &trajectories {
            assert_eq!(t.token_ids.len(), context);
            assert_eq!(turn_shape(t), (prompt, shape.clone()));
        }
    }
}

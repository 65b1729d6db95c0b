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
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use burn::tensor::backend::Backend;
use env::{run_episodes_admitted, Admission, EpisodeConfig, NoObserver, StopReason, Trajectory};
use model::tokenizer::Qwen3Tokenizer;
use model::{generate, DecoderLimits, DecoderStats, Qwen3ForCausalLM, Sampling, SamplingConfig};
use trainer::rollout::{LocalAgent, ServerAgent, ServerPool, ServerSettings, StepTimes};
use crate::device::MemoryProbe;

mod environment;
mod forced_calls;
mod report;

use environment::ScriptedEnvironment;
use forced_calls::{ForcedCalls, RolloutCounts};
pub use report::{print, RolloutStats};
use report::{environment_bound, ContinuousAdmission, RatioFactors, RolloutMemory, TimeShares, Unshared, WorkerRollout};

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
    // Within the model's context: the prompt and the new tokens but the last are fed.
    let room = (model.config.max_position_embeddings + 1).saturating_sub(new_tokens);
    let context_prompt = ((mean_context - (new_tokens / 2) as f64).round().max(0.0) as usize).min(room).max(DECODE_PROMPT);
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
    let max_num_seqs = settings.max_num_seqs.filter(|&rows| rows < batch);
    let pure_step_seconds = decode_seconds / (new_tokens - 1) as f64;
    let rows_per_step = steps.rows_per_step(decoder.decoded);
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
        max_num_seqs,
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
        rows_per_step,
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
        environment_bound: max_num_seqs.is_none().then(|| {
            environment_bound(counts.agent_tokens, env_calls, episodes, batch.min(episodes), settings.env_concurrency, pure_step_seconds, settings.latency.as_secs_f64())
        }),
        ratio_factors: RatioFactors::of(rows_per_step, decode_rows, 1e3 * pure_step_seconds, &steps, seconds),
        pure_decode_step_ms: 1e3 * pure_step_seconds,
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

/// Prompt tokens per row of the pure decode measurement (as the `decode batch` workload).
pub(super) const DECODE_PROMPT: usize = 16;

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
    use super::environment::reply_text;
    use env::{Agent, AgentContext, AgentError, TurnEnd, TurnText};

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

        fn environment_tokens(&mut self, text: &str) -> Result<env::EnvironmentTokens, AgentError> {
            Ok(env::EnvironmentTokens::Ids(vec![3; env::estimate_tokens(text)]))
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

//! The figures of one rollout batch ([`RolloutStats`] and the parts it holds) and [`print()`],
//! which prints them in words.

use serde::Serialize;
use trainer::rollout::StepTimes;

use super::DECODE_PROMPT;

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
    /// `rollout_over_decode` as the product of three factors: where the gap to pure decode lies.
    pub ratio_factors: RatioFactors,
    /// An estimate of the most `rollout_over_decode` can reach at this batch whatever the
    /// engine, set by the environment alone (see [`environment_bound`]); `None` with
    /// `max_num_seqs` below the batch, where waiting episodes do not hold rows.
    pub environment_bound: Option<f64>,
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
    pub(super) fn of(seconds: f64, agent_seconds: f64, steps: &StepTimes) -> Self {
        let wall = seconds.max(1e-9);
        let decode = steps.decode_time.as_secs_f64() / wall;
        let prefill = steps.prefill_time.as_secs_f64() / wall;
        let agent = (agent_seconds / wall).min(1.0);
        let outside = (agent - decode - prefill).max(0.0);
        Self { decode_steps: decode, prefill_steps: prefill, agent_outside_steps: outside, waiting: (1.0 - decode - prefill - outside).max(0.0) }
    }
}

/// The rollout's speed over pure decode's at the same rows, as the product of three factors
/// (exactly, where every decoded token is an agent token):
/// `rows × step_speed × stepping = decoded tokens × pure step / (rows of pure decode × wall)`.
/// On a GPU, whose step costs about the same at any number of rows, `rows` is what the
/// workload's environment waits leave to decode, and `step_speed × stepping` is the engine's.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct RatioFactors {
    /// Rows decoded per step over the rows of pure decode: the others wait on the environment,
    /// for a row (`max_num_seqs`), or are prefilled in a pass of their own.
    pub rows: f64,
    /// Pure decode's step time over the rollout's mean step (decoding-only and prefill steps
    /// together): what prefills, longer contexts and the cache's bookkeeping cost a step.
    pub step_speed: f64,
    /// The share of the wall time with a decoder step running (the rest: every episode in
    /// flight on the environment, the episode loop, the agent outside steps).
    pub stepping: f64,
}

impl RatioFactors {
    /// The factors of a rollout of `seconds` whose `steps` decoded `rows_per_step` rows each on
    /// average, against a pure decode of `decode_rows` rows at `pure_step_ms` a step.
    pub(super) fn of(rows_per_step: f64, decode_rows: usize, pure_step_ms: f64, steps: &StepTimes, seconds: f64) -> Self {
        let step_seconds = (steps.decode_time + steps.prefill_time).as_secs_f64();
        let mean_step_ms = 1e3 * step_seconds / (steps.decode_steps + steps.prefill_steps).max(1) as f64;
        Self {
            rows: rows_per_step / decode_rows.max(1) as f64,
            step_speed: if mean_step_ms > 0.0 { pure_step_ms / mean_step_ms } else { 0.0 },
            stepping: (step_seconds / seconds.max(1e-9)).min(1.0),
        }
    }

    /// Their product: the rollout's speed over pure decode's, counted in decoded tokens.
    pub fn product(&self) -> f64 {
        self.rows * self.step_speed * self.stepping
    }
}

/// The most a rollout's speed over pure decode's can be when every episode holds a row while
/// its environment call runs, estimated from its episodes: each one's `agent_tokens /
/// episodes` decoded at pure decode's `pure_step_seconds` a token (prefills free), against its
/// `env_calls / episodes` waits of `latency_seconds`, calls queued in waves of
/// `env_concurrency` when `in_flight` episodes call at once (a call waits half the waves
/// before it on average). Episodes alike in length and in step make it exact; others, a guide.
pub fn environment_bound(agent_tokens: usize, env_calls: usize, episodes: usize, in_flight: usize, env_concurrency: usize, pure_step_seconds: f64, latency_seconds: f64) -> f64 {
    let episodes = episodes.max(1) as f64;
    let decoding = agent_tokens as f64 / episodes * pure_step_seconds;
    let waves = in_flight.max(1).div_ceil(env_concurrency.max(1)) as f64;
    let waiting = env_calls as f64 / episodes * latency_seconds * (waves + 1.0) / 2.0;
    if decoding + waiting > 0.0 { decoding / (decoding + waiting) } else { 1.0 }
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
    let f = &s.ratio_factors;
    println!(
        "  rollout / decode = {:.3} = {:.2} (rows decoded a step over {}: the others on the environment or waiting for a row) x {:.2} (pure decode's step over the rollout's mean step: prefills, longer contexts) x {:.2} (share of the wall time with a step running){}",
        f.product(),
        f.rows,
        s.decode_rows,
        f.step_speed,
        f.stepping,
        s.environment_bound.map_or(String::new(), |b| format!("; the environment's {} ms calls alone cap it at about {b:.2} at this batch (every step at pure decode's, prefills free)", s.latency_ms))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_ratio_factors_multiply_to_decoded_tokens_over_pure_decode() {
        // 300 decoding-only steps of 2 ms and 20 prefill steps of 10 ms in a 1.6 s rollout that
        // decoded 1,920 tokens, against pure decode of 8 rows at 1.5 ms a step.
        let steps = StepTimes { decode_steps: 300, decode_time: Duration::from_millis(600), prefill_steps: 20, prefill_time: Duration::from_millis(200) };
        let (decoded, seconds, rows, pure_step_ms) = (1920.0, 1.6, 8, 1.5);
        let f = RatioFactors::of(decoded / 320.0, rows, pure_step_ms, &steps, seconds);
        assert!((f.rows - 0.75).abs() < 1e-12, "{f:?}");
        assert!((f.step_speed - 1.5 / 2.5).abs() < 1e-12, "{f:?}");
        assert!((f.stepping - 0.5).abs() < 1e-12, "{f:?}");
        let ratio = (decoded / seconds) / (rows as f64 / (pure_step_ms / 1e3));
        assert!((f.product() - ratio).abs() < 1e-12, "{} against {ratio}", f.product());
    }

    #[test]
    fn the_environment_bound_weighs_decoding_against_waits() {
        // 8 episodes of 640 tokens at 2 ms a step (1.28 s each) and 4 calls of 200 ms (0.8 s).
        let bound = environment_bound(8 * 640, 8 * 4, 8, 8, 32, 2e-3, 0.2);
        assert!((bound - 1.28 / 2.08).abs() < 1e-12, "{bound}");
        // 64 in flight with 32 calls at once: two waves, a call waits 1.5 latencies on average.
        let waves = environment_bound(64 * 640, 64 * 4, 64, 64, 32, 2e-3, 0.2);
        assert!((waves - 1.28 / (1.28 + 1.2)).abs() < 1e-12, "{waves}");
        // Faster steps leave the same waits a larger share: the bound falls.
        assert!(environment_bound(8 * 640, 8 * 4, 8, 8, 32, 1e-3, 0.2) < bound);
        assert_eq!(environment_bound(640, 0, 1, 1, 32, 2e-3, 0.2), 1.0, "no call, no wait");
        assert_eq!(environment_bound(0, 0, 0, 0, 0, 0.0, 0.0), 1.0, "nothing to weigh");
    }

    #[test]
    fn a_rollout_without_steps_has_factors_of_zero_not_nan() {
        let f = RatioFactors::of(0.0, 8, 1.5, &StepTimes::default(), 0.0);
        assert_eq!((f.rows, f.step_speed, f.stepping), (0.0, 0.0, 0.0));
    }
}

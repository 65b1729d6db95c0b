//! The agent wrapper of the rollout workload: [`ForcedCalls`] forces each turn's text into a
//! call or an answer and keeps [`RolloutCounts`] of what the agent did.

use std::rc::Rc;
use std::time::{Duration, Instant};

use env::{Agent, AgentContext, AgentError, EnvironmentTokens, TurnEnd, TurnText, ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE, CALL_OPEN};
use crate::device::MemoryProbe;

use super::episode_turns;

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

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        let tokens = self.timed(|a| a.environment_tokens(text))?;
        self.counts.appended_tokens += tokens.len();
        Ok(tokens)
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.timed(|a| a.end_episode(ctx))
    }
}

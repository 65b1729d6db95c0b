//! The episode agent whose turns are sampled by rollout workers.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use env::{Agent, AgentContext, AgentError, EnvironmentTokens, TurnEnd, TurnText};
use model::tokenizer::Qwen3Tokenizer;
use model::Sampling;
use serde_json::{json, Value};

use super::http::{parse_completion, Completion, Failure};
use super::pool::ServerPool;
use crate::rollout::turn_seed;

/// How long [`ServerAgent::advance`] waits for a turn before returning none, so that the
/// episode loop can take the environment's replies meanwhile.
const POLL: Duration = Duration::from_millis(20);

/// The Prompt-R1 agent as the rollout workers of a [`ServerPool`]: its token context is built
/// here exactly as the local agent builds it (the first prompt and each environment text
/// tokenised on their own), and each turn is one `/v1/completions` request with the whole
/// context as a token-id prompt and the turn's seed ([`turn_seed`]); the ids and log-probs
/// that come back are recorded as sampled. It decodes continuously: every episode's request
/// runs on its own thread, and [`Agent::advance`] hands back the turns that came back.
///
/// An episode goes to the worker with the fewest episodes at its first turn and stays there.
/// A request that fails on a worker (no connection, a timeout, a 5xx, 408 or 429, a malformed
/// reply) leaves that worker out and is sent again, unchanged, to another: the same seed
/// samples the same tokens, and the context is only extended from a reply that was taken, so
/// no turn is lost or repeated. Any other 4xx fails the episode (the request would fail
/// everywhere), as does a turn with no worker left.
pub struct ServerAgent<'a> {
    pool: &'a mut ServerPool,
    tokenizer: &'a Qwen3Tokenizer,
    sampling: Sampling,
    vocab_size: usize,
    stop_ids: Vec<u32>,
    batch_stream: u64,
    turns_generated: HashMap<usize, u64>,
    /// The worker each running episode is on.
    affinity: HashMap<usize, usize>,
    /// The request of each episode generating a turn.
    in_flight: HashMap<usize, Request>,
    /// Turns that ended without a request (a zero budget, a failure), for the next `advance`.
    ended: Vec<(usize, Result<TurnText, AgentError>)>,
    next_attempt: u64,
    replies: Receiver<Reply>,
    reply_to: Sender<Reply>,
    /// Prompt tokens the workers prefilled for the turns taken, as their replies' usage says.
    prefill_tokens: u64,
}

/// A turn's request while it is out.
struct Request {
    /// The body, without `model` (set per worker).
    body: Value,
    budget: usize,
    worker: usize,
    /// Tells this sending's reply from a stale one.
    attempt: u64,
}

struct Reply {
    episode: usize,
    attempt: u64,
    result: Result<String, Failure>,
}

impl<'a> ServerAgent<'a> {
    /// An agent on `pool`'s usable workers, sampling as `sampling` says (its seed is the base of
    /// every turn's), checking replies against a vocabulary of `vocab_size` ids (the model's).
    pub fn new(pool: &'a mut ServerPool, tokenizer: &'a Qwen3Tokenizer, sampling: Sampling, vocab_size: usize) -> Self {
        let special = *tokenizer.special();
        let (reply_to, replies) = channel();
        Self {
            pool,
            tokenizer,
            sampling,
            vocab_size,
            stop_ids: vec![special.im_end, special.endoftext],
            batch_stream: 0,
            turns_generated: HashMap::new(),
            affinity: HashMap::new(),
            in_flight: HashMap::new(),
            ended: Vec::new(),
            next_attempt: 0,
            replies,
            reply_to,
            prefill_tokens: 0,
        }
    }

    /// Prompt tokens the workers ran through prefill for the turns taken so far (each reply's
    /// `usage.prompt_tokens` less its `cached_tokens`; see `perf/prefill_tokens`).
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    /// Sets the stream of the next batch of episodes (see [`crate::rollout::LocalAgent::set_batch_stream`]).
    pub fn set_batch_stream(&mut self, stream: u64) {
        self.batch_stream = stream;
    }

    /// The episode's worker: the one it is on, or (at its first turn, or when its worker was
    /// left out) the usable one with the fewest episodes.
    fn assign(&mut self, episode: usize) -> Result<usize, AgentError> {
        if let Some(&worker) = self.affinity.get(&episode) {
            if self.pool.slots[worker].down.is_none() {
                return Ok(worker);
            }
            self.release(episode);
        }
        let worker = self.pool.pick().ok_or_else(|| {
            AgentError::Model(format!("no rollout worker is left: {}", self.pool.describe_failures()))
        })?;
        self.pool.slots[worker].episodes += 1;
        self.affinity.insert(episode, worker);
        Ok(worker)
    }

    fn release(&mut self, episode: usize) {
        if let Some(worker) = self.affinity.remove(&episode) {
            let slot = &mut self.pool.slots[worker];
            slot.episodes = slot.episodes.saturating_sub(1);
        }
    }

    /// The body of episode `ctx`'s next turn (`model` left out).
    fn request_body(&self, ctx: &AgentContext, seed: u64) -> Value {
        let mut body = json!({
            "prompt": ctx.trace().ids(),
            "max_tokens": ctx.turn_budget(),
            "temperature": shortest(self.sampling.temperature),
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": true,
            "skip_special_tokens": false,
            "stop_token_ids": self.stop_ids,
            "stream": false,
        });
        if let Some(p) = self.sampling.top_p {
            body["top_p"] = json!(shortest(p));
        }
        if let Some(k) = self.sampling.top_k.filter(|&k| k > 0) {
            body["top_k"] = json!(k);
        }
        body
    }

    /// Sends episode `episode`'s request to its worker on a thread of its own.
    fn send(&mut self, episode: usize, mut request: Request) -> Result<(), AgentError> {
        let slot = &self.pool.slots[request.worker];
        let mut body = request.body.clone();
        body["model"] = json!(slot.model);
        let bytes = serde_json::to_vec(&body).expect("a JSON value serialises");
        let (worker, reply_to, timeout) = (slot.worker.clone(), self.reply_to.clone(), self.pool.request_timeout);
        request.attempt = self.next_attempt;
        self.next_attempt += 1;
        let attempt = request.attempt;
        std::thread::Builder::new()
            .name("rollout-request".into())
            .spawn(move || {
                let result = worker.post("/v1/completions", &bytes, timeout);
                // The agent may be gone (its rollout failed): nobody waits for the reply then.
                let _ = reply_to.send(Reply { episode, attempt, result });
            })
            .map_err(|e| AgentError::Model(format!("could not start a request thread: {e}")))?;
        self.in_flight.insert(episode, request);
        Ok(())
    }

    /// Takes one reply: records the turn, or sends it again elsewhere, or fails it.
    fn take(&mut self, reply: Reply, episodes: &mut [&mut AgentContext], ended: &mut Vec<(usize, Result<TurnText, AgentError>)>) {
        match self.in_flight.get(&reply.episode) {
            Some(request) if request.attempt == reply.attempt => {}
            _ => return, // a reply to a request since sent again, or of an episode that ended
        }
        let request = self.in_flight.remove(&reply.episode).expect("looked up above");
        let episode = reply.episode;
        let url = format!("{}/v1/completions", self.pool.slots[request.worker].worker.base());
        let outcome = reply.result.and_then(|body| {
            parse_completion(&body, request.budget, self.vocab_size, &self.stop_ids)
                .map_err(|detail| Failure::Retry(format!("{url}: malformed reply: {detail}")))
        });
        match outcome {
            Ok(completion) => {
                self.prefill_tokens += completion.prefilled;
                let result = match episodes.iter_mut().find(|c| c.index() == episode) {
                    Some(ctx) => self.record(ctx, completion),
                    None => Err(AgentError::Model(format!("episode {episode} was not handed to the step"))),
                };
                ended.push((episode, result));
            }
            Err(Failure::Fatal(message)) => ended.push((episode, Err(AgentError::Model(message)))),
            Err(Failure::Retry(message)) => {
                self.pool.mark_down(request.worker, message);
                let resent = self.assign(episode).and_then(|worker| {
                    self.pool.retries += 1;
                    self.send(episode, Request { worker, ..request })
                });
                if let Err(e) = resent {
                    ended.push((episode, Err(e)));
                }
            }
        }
    }

    /// Records a turn's tokens in its context and ends it as the local agent does.
    fn record(&self, ctx: &mut AgentContext, completion: Completion) -> Result<TurnText, AgentError> {
        let start = ctx.trace().len();
        for (&id, &logprob) in completion.ids.iter().zip(&completion.logprobs) {
            ctx.record_agent_token(id, logprob);
        }
        let tokens = &ctx.trace().ids()[start..];
        let im_end = self.tokenizer.special().im_end;
        let end = if tokens.last() == Some(&im_end) { TurnEnd::ImEnd } else { TurnEnd::Length };
        let body = if end == TurnEnd::ImEnd { &tokens[..tokens.len() - 1] } else { tokens };
        let text = self.tokenizer.decode(body, false).map_err(|e| AgentError::Model(e.to_string()))?;
        Ok(TurnText { text, tokens: tokens.len(), end })
    }
}

/// `x` as the f64 of its shortest decimal form (0.7, not 0.699999988), as a config wrote it.
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

impl Agent for ServerAgent<'_> {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        let ids = self.tokenizer.encode(&ctx.prompt().chatml()).map_err(|e| AgentError::Model(e.to_string()))?;
        ctx.record_context_tokens(&ids);
        self.turns_generated.insert(ctx.index(), 0);
        self.in_flight.remove(&ctx.index());
        self.release(ctx.index());
        Ok(())
    }

    /// Every given episode's turn, the requests out together.
    fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<TurnText, AgentError>> {
        env::turns_by_advancing(self, episodes, |agent| agent.in_flight.is_empty() && agent.ended.is_empty())
    }

    fn continuous(&self) -> bool {
        true
    }

    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), AgentError>> {
        episodes
            .iter()
            .map(|ctx| {
                let index = ctx.index();
                let counter = self.turns_generated.entry(index).or_insert(0);
                let turn = *counter;
                *counter += 1;
                if ctx.turn_budget() == 0 {
                    let empty = TurnText { text: String::new(), tokens: 0, end: TurnEnd::Length };
                    self.ended.push((index, Ok(empty)));
                    return Ok(());
                }
                let worker = self.assign(index)?;
                let seed = turn_seed(self.sampling.seed, self.batch_stream, index, turn);
                let body = self.request_body(ctx, seed);
                self.send(index, Request { body, budget: ctx.turn_budget(), worker, attempt: 0 })
            })
            .collect()
    }

    /// The turns that came back, waiting a moment for one when none has.
    fn advance(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<TurnText, AgentError>)> {
        let mut ended = std::mem::take(&mut self.ended);
        if self.in_flight.is_empty() {
            return ended;
        }
        let mut replies = Vec::new();
        if ended.is_empty() {
            match self.replies.recv_timeout(POLL) {
                Ok(reply) => replies.push(reply),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => unreachable!("the agent holds a sender"),
            }
        }
        replies.extend(self.replies.try_iter());
        for reply in replies {
            self.take(reply, episodes, &mut ended);
        }
        ended
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.in_flight.remove(&ctx.index());
        self.turns_generated.remove(&ctx.index());
        self.release(ctx.index());
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        let ids = self.tokenizer.encode(text).map_err(|e| AgentError::Model(e.to_string()))?;
        Ok(EnvironmentTokens::Ids(ids))
    }
}

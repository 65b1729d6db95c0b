//! The episode loop shared by inference and training. For an agent that decodes continuously
//! (the local model) an episode's call is sent on a worker thread as soon as its turn ends and
//! the others keep decoding; any other agent goes turn by turn over the batch, the calls of a
//! turn sent in parallel. Both share the per-episode steps (a turn taken, a reply appended).

use std::time::{Duration, Instant};

use crate::agent::{Agent, AgentContext, EnvironmentTokens, Exchange, TurnEnd};
use crate::environment::{environment_messages, Environment, ENV_SYSTEM_MESSAGE};
use crate::parallel::ParallelRunner;
use crate::prompts::PromptTexts;
use crate::reply::{environment_text, ReplyFormat, IM_END, NEXT_TURN_PREFIX};
use crate::trajectory::{StopReason, Timings, Trajectory, TurnRecord};
use crate::turn::{parse_turn, TurnAction};

/// Limits and texts of an episode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpisodeConfig {
    /// Most agent generation rounds per episode, as the reference's `max_turns`: every round
    /// is one agent turn (a call, an answer, or neither), with no extra answer round after the
    /// last. A call in the last round is still sent and its reply appended to the context; the
    /// episode then ends with [`StopReason::TurnLimit`], without an answer. So 5 rounds fit 4
    /// calls and an answer.
    pub max_turns: usize,
    /// Whether calls are sent at all. When false a call ends the episode with
    /// [`StopReason::TurnLimit`] without reaching the environment (the agent answering alone).
    pub allow_calls: bool,
    /// Most tokens the agent may generate in one turn.
    pub max_turn_tokens: usize,
    /// Most tokens after the prompt (agent and environment together).
    pub max_response_tokens: usize,
    /// How replies are shown to the agent (length limit, escaping).
    pub reply: ReplyFormat,
    /// Most environment calls in flight at once.
    pub env_concurrency: usize,
    /// The agent's system message and instruction.
    pub prompts: PromptTexts,
    /// The environment's system message.
    pub env_system: String,
}

impl Default for EpisodeConfig {
    /// The training settings: 5 rounds, 1024 tokens per turn, 8192 response tokens, replies
    /// cut to 2048 characters.
    fn default() -> Self {
        Self {
            max_turns: 5,
            allow_calls: true,
            max_turn_tokens: 1024,
            max_response_tokens: 8192,
            reply: ReplyFormat::default(),
            env_concurrency: 32,
            prompts: PromptTexts::default(),
            env_system: ENV_SYSTEM_MESSAGE.to_string(),
        }
    }
}

impl EpisodeConfig {
    /// The training settings (the default).
    pub fn training() -> Self {
        Self::default()
    }

    /// The inference settings: as training, but replies cut to 8192 characters.
    pub fn inference() -> Self {
        Self {
            reply: ReplyFormat {
                max_chars: 8192,
                ..ReplyFormat::default()
            },
            ..Self::default()
        }
    }
}

/// Hears about progress while episodes run (e.g. to print each turn as it happens).
pub trait EpisodeObserver {
    /// A turn is complete: answered, ended the episode, or got its environment reply.
    fn turn_finished(&mut self, _episode: usize, _turn: &TurnRecord) {}
    /// An episode is over.
    fn episode_finished(&mut self, _episode: usize, _trajectory: &Trajectory) {}
    /// Whether episodes not begun yet may begin; `false` (e.g. their results could not be
    /// kept): the run ends once the episodes in flight have, and the others come back
    /// unfinished.
    fn admits_more(&self) -> bool {
        true
    }
}

/// An observer that ignores everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoObserver;

impl EpisodeObserver for NoObserver {}

/// Runs one episode per question, all begun at once, and returns the trajectories in question
/// order.
pub fn run_episodes<A, E, Q>(
    agent: &mut A,
    env: &E,
    questions: &[Q],
    config: &EpisodeConfig,
) -> Vec<Trajectory>
where
    A: Agent + ?Sized,
    E: Environment + ?Sized,
    Q: AsRef<str>,
{
    run_episodes_observed(agent, env, questions, config, &mut NoObserver)
}

/// [`run_episodes`], reporting progress to `observer`.
pub fn run_episodes_observed<A, E, Q>(
    agent: &mut A,
    env: &E,
    questions: &[Q],
    config: &EpisodeConfig,
    observer: &mut dyn EpisodeObserver,
) -> Vec<Trajectory>
where
    A: Agent + ?Sized,
    E: Environment + ?Sized,
    Q: AsRef<str>,
{
    run_episodes_admitted(agent, env, questions, config, Admission::Batches(questions.len()), observer)
}

/// When the episodes of a run begin, with at most `n` begun and not yet ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// `n` at a time: the next `n` begin once all of the previous have ended.
    Batches(usize),
    /// The next episode begins as soon as one ends, as an inference engine admits a request
    /// when another finishes: a long episode does not keep the places of finished ones empty.
    Continuous(usize),
}

impl Admission {
    /// The most episodes in flight.
    pub fn max_in_flight(self) -> usize {
        match self {
            Admission::Batches(n) | Admission::Continuous(n) => n.max(1),
        }
    }
}

/// Runs one episode per question, beginning them in question order as `admission` says; the
/// trajectories come back in question order. `observer` hears of each turn and episode as it
/// ends.
pub fn run_episodes_admitted<A, E, Q>(
    agent: &mut A,
    env: &E,
    questions: &[Q],
    config: &EpisodeConfig,
    admission: Admission,
    observer: &mut dyn EpisodeObserver,
) -> Vec<Trajectory>
where
    A: Agent + ?Sized,
    E: Environment + ?Sized,
    Q: AsRef<str>,
{
    let mut run = Run {
        agent,
        observer,
        admission,
        begun: 0,
    };
    let mut episodes: Vec<Episode> = questions
        .iter()
        .enumerate()
        .map(|(index, question)| {
            let question = question.as_ref();
            Episode::new(AgentContext::new(
                index,
                question,
                config.prompts.first_prompt(question),
            ))
        })
        .collect();
    if run.agent.continuous() {
        run.continuous(&mut episodes, env, config);
    } else {
        loop {
            // Episodes that end before their turn (out of turns or tokens) free their places for
            // this round already (`prepare_turn` only ends episodes or sets the same budget).
            let active = loop {
                run.admit(&mut episodes);
                let active: Vec<usize> = (0..episodes.len())
                    .filter(|&i| episodes[i].is_running() && run.prepare_turn(&mut episodes[i], config))
                    .collect();
                if !run.can_admit(&episodes) {
                    break active;
                }
            };
            if active.is_empty() {
                if run.begun == episodes.len() || !run.observer.admits_more() {
                    break;
                }
                continue;
            }
            let calls = run.generate(&mut episodes, &active, config);
            run.call_environment(&mut episodes, calls, env, config);
        }
    }
    episodes
        .into_iter()
        .map(|episode| episode.done.unwrap_or_else(|| unfinished(&episode.ctx)))
        .collect()
}

/// One episode's state while it runs.
struct Episode {
    ctx: AgentContext,
    turns: Vec<TurnRecord>,
    prompt_len: usize,
    calls: usize,
    response_tokens: usize,
    response_text: String,
    agent_time: Duration,
    env_time: Duration,
    /// When the episode began (`None`: not yet, waiting for a place among those in flight).
    begun: Option<Instant>,
    done: Option<Trajectory>,
}

impl Episode {
    fn new(ctx: AgentContext) -> Self {
        Self {
            ctx,
            turns: Vec::new(),
            prompt_len: 0,
            calls: 0,
            response_tokens: 0,
            response_text: String::new(),
            agent_time: Duration::ZERO,
            env_time: Duration::ZERO,
            begun: None,
            done: None,
        }
    }

    /// Begun and not ended.
    fn is_running(&self) -> bool {
        self.begun.is_some() && self.done.is_none()
    }
}

/// A call waiting for the environment.
struct PendingCall {
    episode: usize,
    messages: Vec<crate::chat::ChatMessage>,
    prompt: String,
    agent_emitted_im_end: bool,
}

struct Run<'a, A: ?Sized> {
    agent: &'a mut A,
    observer: &'a mut dyn EpisodeObserver,
    /// When episodes begin.
    admission: Admission,
    /// Episodes begun so far: the first `begun` of the list.
    begun: usize,
}

impl<A: Agent + ?Sized> Run<'_, A> {
    /// Whether the admission lets an episode begin now.
    fn can_admit(&self, episodes: &[Episode]) -> bool {
        let running = episodes[..self.begun].iter().filter(|e| e.is_running()).count();
        self.begun < episodes.len()
            && self.observer.admits_more()
            && match self.admission {
                Admission::Batches(_) => running == 0,
                Admission::Continuous(n) => running < n.max(1),
            }
    }

    /// Begins the next episodes as the admission allows; returns those that began (an episode
    /// the agent cannot begin ends at once, as an agent failure).
    fn admit(&mut self, episodes: &mut [Episode]) -> Vec<usize> {
        let mut admitted = Vec::new();
        if !self.can_admit(episodes) {
            return admitted;
        }
        let mut running = episodes[..self.begun].iter().filter(|e| e.is_running()).count();
        while running < self.admission.max_in_flight() && self.begun < episodes.len() {
            let i = self.begun;
            self.begun += 1;
            let episode = &mut episodes[i];
            episode.begun = Some(Instant::now());
            match self.agent.begin_episode(&mut episode.ctx) {
                Ok(()) => {
                    episode.prompt_len = episode.ctx.trace().len();
                    admitted.push(i);
                    running += 1;
                }
                Err(err) => self.finish(episode, StopReason::AgentFailure, None, Some(err.to_string())),
            }
        }
        admitted
    }

    /// Generates one turn for every active episode and returns the calls to make.
    fn generate(
        &mut self,
        episodes: &mut [Episode],
        active: &[usize],
        config: &EpisodeConfig,
    ) -> Vec<PendingCall> {
        let started = Instant::now();
        let results = {
            let mut contexts: Vec<&mut AgentContext> = episodes
                .iter_mut()
                .filter(|e| e.is_running())
                .map(|e| &mut e.ctx)
                .collect();
            self.agent.generate_turns(&mut contexts)
        };
        let elapsed = started.elapsed();
        if results.len() != active.len() {
            let error = format!(
                "the agent returned {} turns for {} episodes",
                results.len(),
                active.len()
            );
            for &i in active {
                self.finish(
                    &mut episodes[i],
                    StopReason::AgentFailure,
                    None,
                    Some(error.clone()),
                );
            }
            return Vec::new();
        }
        let mut calls = Vec::new();
        for (&i, result) in active.iter().zip(results) {
            episodes[i].agent_time += elapsed;
            calls.extend(self.take_turn(&mut episodes[i], i, result, config));
        }
        calls
    }

    /// Ends an episode that is out of turns or tokens; else sets the budget of its next turn.
    /// Whether it goes on.
    fn prepare_turn(&mut self, episode: &mut Episode, config: &EpisodeConfig) -> bool {
        if episode.turns.len() >= config.max_turns {
            self.finish(episode, StopReason::TurnLimit, None, None);
            return false;
        }
        let left = config.max_response_tokens.saturating_sub(episode.response_tokens);
        if left == 0 || config.max_turn_tokens == 0 {
            self.finish(episode, StopReason::TokenLimit, None, None);
            return false;
        }
        episode.ctx.set_turn_budget(left.min(config.max_turn_tokens));
        true
    }

    /// Takes episode `i`'s generated turn: ends the episode (an answer, no call, a limit, a
    /// failure) or returns the call to send.
    fn take_turn(
        &mut self,
        episode: &mut Episode,
        i: usize,
        result: Result<crate::agent::TurnText, crate::agent::AgentError>,
        config: &EpisodeConfig,
    ) -> Option<PendingCall> {
        let turn = match result {
            Ok(turn) => turn,
            Err(err) => {
                self.finish(episode, StopReason::AgentFailure, None, Some(err.to_string()));
                return None;
            }
        };
        let text = format!("{}{}", episode.ctx.turn_prefix(), turn.text);
        episode.response_text.push_str(&turn.text);
        if turn.end == TurnEnd::ImEnd {
            episode.response_text.push_str(IM_END);
        }
        episode.response_tokens += turn.tokens;
        let parsed = parse_turn(&text);
        let mut record = TurnRecord {
            think: parsed.think,
            prompt: None,
            response: None,
            response_truncated: false,
            answer: None,
            text,
            tokens: turn.tokens,
            end: turn.end,
            env_ms: None,
        };
        let stop = match parsed.action {
            TurnAction::Answer(answer) => {
                record.answer = Some(answer);
                StopReason::Answer
            }
            TurnAction::Call(call) => {
                record.prompt = Some(call.prompt.clone());
                if !config.allow_calls {
                    StopReason::TurnLimit
                } else if episode.response_tokens >= config.max_response_tokens {
                    StopReason::TokenLimit
                } else {
                    let pending = PendingCall {
                        episode: i,
                        messages: environment_messages(&config.env_system, episode.ctx.exchanges(), &call.prompt),
                        prompt: call.prompt,
                        agent_emitted_im_end: turn.end == TurnEnd::ImEnd,
                    };
                    episode.turns.push(record);
                    return Some(pending);
                }
            }
            TurnAction::Nothing if turn.end == TurnEnd::Length => StopReason::TokenLimit,
            TurnAction::Nothing => StopReason::NoCall,
        };
        let answer = record.answer.clone();
        self.observer.turn_finished(i, &record);
        episode.turns.push(record);
        self.finish(episode, stop, answer, None);
        None
    }

    /// Sends the calls in parallel and appends each reply to its episode.
    fn call_environment<E: Environment + ?Sized>(
        &mut self,
        episodes: &mut [Episode],
        calls: Vec<PendingCall>,
        env: &E,
        config: &EpisodeConfig,
    ) {
        let replies = ParallelRunner::new(config.env_concurrency).map(&calls, |_, call| {
            let started = Instant::now();
            let reply = env.complete(&call.messages);
            (reply, started.elapsed())
        });
        for (call, (reply, elapsed)) in calls.into_iter().zip(replies) {
            let i = call.episode;
            self.take_reply(&mut episodes[i], call, reply, elapsed, config);
        }
    }

    /// Appends the environment's reply to its episode, or ends the episode: on a failed call, or
    /// at the token limit when the reply would take its response past `max_response_tokens`
    /// (the reply is then not appended: a response never exceeds the limit).
    fn take_reply(
        &mut self,
        episode: &mut Episode,
        call: PendingCall,
        reply: Result<String, crate::error::EnvError>,
        elapsed: Duration,
        config: &EpisodeConfig,
    ) {
        episode.env_time += elapsed;
        episode.calls += 1;
        let Some(mut record) = episode.turns.pop() else {
            return;
        };
        record.env_ms = Some(millis(elapsed));
        let reply = match reply {
            Ok(reply) => reply.trim().to_string(),
            Err(err) => {
                self.observer.turn_finished(call.episode, &record);
                episode.turns.push(record);
                self.finish(episode, StopReason::EnvFailure, None, Some(err.to_string()));
                return;
            }
        };
        let shown = config.reply.show(&reply);
        let text = environment_text(&shown.text, call.agent_emitted_im_end);
        let room = config.max_response_tokens.saturating_sub(episode.response_tokens);
        match self.agent.environment_tokens(&text) {
            Ok(tokens) if tokens.len() > room => {
                self.observer.turn_finished(call.episode, &record);
                episode.turns.push(record);
                self.finish(episode, StopReason::TokenLimit, None, None);
            }
            Ok(tokens) => {
                if let EnvironmentTokens::Ids(ids) = &tokens {
                    episode.ctx.record_context_tokens(ids);
                }
                record.response = Some(reply.clone());
                record.response_truncated = shown.truncated;
                episode.response_tokens += tokens.len();
                episode.response_text.push_str(&text);
                let exchange = Exchange {
                    turn_text: record.text.clone(),
                    prompt: call.prompt,
                    reply,
                    shown_reply: shown.text,
                };
                episode.ctx.push_exchange(exchange, NEXT_TURN_PREFIX);
                self.observer.turn_finished(call.episode, &record);
                episode.turns.push(record);
            }
            Err(err) => {
                self.observer.turn_finished(call.episode, &record);
                episode.turns.push(record);
                self.finish(episode, StopReason::AgentFailure, None, Some(err.to_string()));
            }
        }
    }

    /// The loop for an agent that decodes continuously: an episode whose turn ends leaves the
    /// batch, its call goes to one of `env_concurrency` worker threads (the environment stays
    /// synchronous), and the other episodes keep decoding; it rejoins with its reply at the next
    /// step.
    fn continuous<E: Environment + ?Sized>(&mut self, episodes: &mut [Episode], env: &E, config: &EpisodeConfig) {
        type Answered = (PendingCall, Result<String, crate::error::EnvError>, Duration);
        let (jobs, job_queue) = std::sync::mpsc::channel::<PendingCall>();
        let job_queue = std::sync::Mutex::new(job_queue);
        let (answers, answered) = std::sync::mpsc::channel::<Answered>();
        std::thread::scope(|scope| {
            for _ in 0..config.env_concurrency.max(1).min(episodes.len().max(1)) {
                let (job_queue, answers) = (&job_queue, answers.clone());
                scope.spawn(move || loop {
                    let next = job_queue.lock().map(|queue| queue.recv());
                    let Ok(Ok(call)) = next else { return };
                    let started = Instant::now();
                    let reply = env.complete(&call.messages);
                    if answers.send((call, reply, started.elapsed())).is_err() {
                        return;
                    }
                });
            }
            drop(answers);
            let mut ready: Vec<usize> = Vec::new();
            let (mut in_turn, mut waiting) = (Vec::<usize>::new(), 0usize);
            loop {
                // Episodes begin as places among those in flight come free.
                ready.extend(self.admit(episodes));
                // In index order, the order their contexts are handed over in.
                ready.sort_unstable();
                let starting: Vec<usize> = std::mem::take(&mut ready)
                    .into_iter()
                    .filter(|&i| episodes[i].is_running() && self.prepare_turn(&mut episodes[i], config))
                    .collect();
                if !starting.is_empty() {
                    let results = {
                        let mut contexts: Vec<&mut AgentContext> = episodes.iter_mut().enumerate().filter(|(i, _)| starting.contains(i)).map(|(_, e)| &mut e.ctx).collect();
                        self.agent.start_turns(&mut contexts)
                    };
                    for (&i, result) in starting.iter().zip(results) {
                        match result {
                            Ok(()) => in_turn.push(i),
                            Err(err) => self.finish(&mut episodes[i], StopReason::AgentFailure, None, Some(err.to_string())),
                        }
                    }
                }
                if !in_turn.is_empty() {
                    let started = Instant::now();
                    let ended = {
                        let mut contexts: Vec<&mut AgentContext> = episodes.iter_mut().enumerate().filter(|(i, _)| in_turn.contains(i)).map(|(_, e)| &mut e.ctx).collect();
                        self.agent.advance(&mut contexts)
                    };
                    let elapsed = started.elapsed();
                    for &i in &in_turn {
                        episodes[i].agent_time += elapsed;
                    }
                    for (i, result) in ended {
                        in_turn.retain(|&j| j != i);
                        if let Some(call) = self.take_turn(&mut episodes[i], i, result, config) {
                            waiting += 1;
                            if let Err(unsent) = jobs.send(call) {
                                let call = unsent.0;
                                waiting -= 1;
                                let lost = crate::error::EnvError::Config("the environment workers stopped".into());
                                self.take_reply(&mut episodes[call.episode], call, Err(lost), Duration::ZERO, config);
                            }
                        }
                    }
                }
                // Places that episodes ended in just now are taken before anything blocks.
                ready.extend(self.admit(episodes));
                if in_turn.is_empty() && waiting == 0 && ready.is_empty() {
                    // An episode still running here is in no turn and has no call out: the agent
                    // dropped its turn (fewer results than episodes). It ends as a failure.
                    for episode in episodes[..self.begun].iter_mut().filter(|e| e.is_running()) {
                        self.finish(episode, StopReason::AgentFailure, None, Some("the agent returned no result for this episode's turn".into()));
                    }
                    if self.begun == episodes.len() || !self.observer.admits_more() {
                        break;
                    }
                    continue;
                }
                // Block for a reply only when nothing can decode meanwhile.
                let mut replies: Vec<Answered> = answered.try_iter().collect();
                if replies.is_empty() && in_turn.is_empty() && ready.is_empty() {
                    match answered.recv() {
                        Ok(reply) => replies.push(reply),
                        Err(_) => break,
                    }
                }
                for (call, reply, elapsed) in replies {
                    waiting -= 1;
                    let i = call.episode;
                    self.take_reply(&mut episodes[i], call, reply, elapsed, config);
                    if episodes[i].is_running() {
                        ready.push(i);
                    }
                }
            }
            drop(jobs);
        });
    }

    /// Ends an episode: frees the agent's state, builds the trajectory and reports it.
    fn finish(
        &mut self,
        episode: &mut Episode,
        stop_reason: StopReason,
        answer: Option<String>,
        error: Option<String>,
    ) {
        self.agent.end_episode(&mut episode.ctx);
        let trace = episode.ctx.take_trace();
        let trajectory = Trajectory {
            question: episode.ctx.question().to_string(),
            answer,
            stop_reason,
            error,
            turns: std::mem::take(&mut episode.turns),
            prompt_text: episode.ctx.prompt().chatml(),
            response_text: std::mem::take(&mut episode.response_text),
            token_ids: trace.ids().to_vec(),
            loss_mask: trace.loss_mask().to_vec(),
            logprobs: trace.logprobs().to_vec(),
            prompt_len: episode.prompt_len,
            response_tokens: episode.response_tokens,
            env_calls: episode.calls,
            timings: Timings {
                total_ms: millis(episode.begun.map_or(Duration::ZERO, |begun| begun.elapsed())),
                agent_ms: millis(episode.agent_time),
                env_ms: millis(episode.env_time),
            },
        };
        self.observer
            .episode_finished(episode.ctx.index(), &trajectory);
        episode.done = Some(trajectory);
    }
}

/// The trajectory of an episode the loop left without a stop reason (does not happen; kept so
/// that no path can panic).
fn unfinished(ctx: &AgentContext) -> Trajectory {
    Trajectory {
        question: ctx.question().to_string(),
        answer: None,
        stop_reason: StopReason::AgentFailure,
        error: Some("the episode ended without a stop reason".to_string()),
        turns: Vec::new(),
        prompt_text: ctx.prompt().chatml(),
        response_text: String::new(),
        token_ids: Vec::new(),
        loss_mask: Vec::new(),
        logprobs: Vec::new(),
        prompt_len: 0,
        response_tokens: 0,
        env_calls: 0,
        timings: Timings::default(),
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

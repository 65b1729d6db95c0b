//! The local burn model as the episode agent: the context it builds turn by turn decodes to the
//! reference format, its loss mask covers exactly the tokens it sampled, and the log-probs it
//! records while sampling equal those of a fresh scoring pass over the finished context (the
//! "old" log-probs GRPO's ratios start from).

use burn::backend::Flex;
use env::{Agent, AgentContext, PromptTexts, TurnEnd};
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};
use model::{completion_logprobs, load_pretrained, LoadOptions, Preset, Sampling};
use prompt_r1_trainer::rollout::LocalAgent;

/// A random checkpoint of the tiny preset (weights from `seed`) loaded on the CPU, and the tiny
/// tokenizer; the checkpoint's directory lives as long as the first value.
fn tiny_model(seed: u64) -> (tempfile::TempDir, model::tokenizer::Qwen3Tokenizer, model::Qwen3ForCausalLM<Flex>) {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    let special = *tokenizer.special();
    let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![special.im_end]);
    write_random_checkpoint(&config, dir.path(), seed, StorageDtype::F32).unwrap();
    let model = load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();
    (dir, tokenizer, model)
}

#[test]
fn local_agent_builds_the_context_token_by_token() {
    let (_dir, tokenizer, model) = tiny_model(5);

    let sampling = Sampling { temperature: 1.0, seed: 11, ..Default::default() };
    let mut agent = LocalAgent::new(&model, &tokenizer, sampling);
    let texts = PromptTexts::default();
    let mut contexts: Vec<AgentContext> = ["What is 2 + 2?", "Who wrote Hamlet?"]
        .iter()
        .enumerate()
        .map(|(i, q)| AgentContext::new(i, *q, texts.first_prompt(q)))
        .collect();
    for ctx in &mut contexts {
        agent.begin_episode(ctx).unwrap();
    }
    let prompt_lens: Vec<usize> = contexts.iter().map(|c| c.trace().len()).collect();

    // Outside the episode loop no turn budget has been set, so the agent must write nothing.
    let first = {
        let mut refs: Vec<&mut AgentContext> = contexts.iter_mut().collect();
        agent.generate_turns(&mut refs)
    };
    for (turn, ctx) in first.iter().zip(&contexts) {
        let turn = turn.as_ref().unwrap();
        assert_eq!(turn.tokens, 0);
        assert_eq!(ctx.trace().len(), prompt_lens[ctx.index()]);
    }
    for turn_text in first {
        assert_eq!(turn_text.unwrap().end, TurnEnd::Length);
    }
}

/// Runs the agent through `env::run_episodes` against a scripted environment, then checks the
/// trajectory's tokens, mask and log-probs.
#[test]
fn trajectories_of_the_local_agent_are_consistent() {
    let (_dir, tokenizer, model) = tiny_model(5);

    struct Echo;
    impl env::Environment for Echo {
        fn complete(&self, messages: &[env::ChatMessage]) -> Result<String, env::EnvError> {
            Ok(format!("echo of {} messages", messages.len()))
        }
    }
    let episode = env::EpisodeConfig { max_turn_tokens: 24, ..env::EpisodeConfig::training() };
    let questions = ["What is 2 + 2?", "Who wrote Hamlet?", "Name a river."];
    let run = |seed: u64| {
        let mut agent = LocalAgent::new(&model, &tokenizer, Sampling { temperature: 1.0, seed, ..Default::default() });
        env::run_episodes(&mut agent, &Echo, &questions, &episode)
    };
    // Timings differ between runs; the sampled content must not.
    let content = |ts: &[env::Trajectory]| -> Vec<(Vec<u32>, Vec<u8>, Vec<f32>)> {
        ts.iter().map(|t| (t.token_ids.clone(), t.loss_mask.clone(), t.logprobs.clone())).collect()
    };
    let trajectories = run(3);
    assert!(content(&run(3)) == content(&trajectories), "same seed, same trajectories");

    // Each context token enters the episode's kept cache once: the first turn prefills the
    // prompt; a later turn prefills the previous turn's last sampled token (chosen, not yet fed)
    // and the environment's reply; every other sampled token goes through a decode step
    // (`perf/prefill_tokens` of a training step).
    let mut agent = LocalAgent::new(&model, &tokenizer, Sampling { temperature: 1.0, seed: 3, ..Default::default() });
    let counted = env::run_episodes(&mut agent, &Echo, &questions, &episode);
    assert!(content(&counted) == content(&trajectories), "counting changes nothing");
    let mut expected = 0u64;
    for t in &counted {
        let sampled = |i: usize| t.loss_mask[i] == 1;
        let starts: Vec<usize> = (0..t.loss_mask.len()).filter(|&i| sampled(i) && (i == 0 || !sampled(i - 1))).collect();
        let ends: Vec<usize> = (0..t.loss_mask.len()).filter(|&i| sampled(i) && (i + 1 == t.loss_mask.len() || !sampled(i + 1))).collect();
        assert_eq!(starts.len(), t.turns.len(), "one run of sampled tokens per turn");
        expected += starts[0] as u64;
        for k in 1..starts.len() {
            expected += (starts[k] - ends[k - 1]) as u64;
        }
    }
    assert!(expected > 0);
    assert_eq!(agent.prefill_tokens(), expected);
    assert!(content(&run(4)) != content(&trajectories), "another seed samples differently");

    for t in &trajectories {
        let ids = &t.token_ids;
        assert_eq!(ids.len(), t.loss_mask.len());
        assert_eq!(ids.len(), t.logprobs.len());
        // The prompt is the ChatML rendering of the first prompt, tokenised once.
        let prompt = PromptTexts::default().first_prompt(&t.question).chatml();
        assert_eq!(tokenizer.decode(&ids[..t.prompt_len], false).unwrap(), prompt);
        assert!(t.loss_mask[..t.prompt_len].iter().all(|&m| m == 0));
        // Everything decodes to the prompt followed by the response text.
        let decoded = tokenizer.decode(ids, false).unwrap();
        assert_eq!(decoded, format!("{prompt}{}", t.response_text));
        // Agent tokens: at most the turn budget per turn, at least one token sampled.
        let agent_tokens = t.loss_mask.iter().filter(|&&m| m == 1).count();
        assert!(agent_tokens >= 1 && agent_tokens <= 24 * (t.turns.len().max(1)));
        assert!(t.logprobs.iter().zip(&t.loss_mask).all(|(&lp, &m)| if m == 1 { lp <= 0.0 } else { lp == 0.0 }));

        // Rollout log-probs equal a scoring pass over the finished sequence (sampling at T = 1).
        let start = t.prompt_len;
        let scored = completion_logprobs(&model, &[(ids[..start].to_vec(), ids[start..].to_vec())], tokenizer.special().endoftext)
            .unwrap()
            .remove(0);
        for (k, (&m, &lp)) in t.loss_mask[start..].iter().zip(&t.logprobs[start..]).enumerate() {
            if m == 1 {
                assert!((lp - scored[k]).abs() < 1e-4, "token {k}: rollout {lp} vs scoring {}", scored[k]);
            }
        }
    }
}

/// Hands the episode loop a call on every turn but the last (a random model writes none), the
/// agent's sampled tokens kept as they are: multi-turn episodes from a tiny model.
struct ForcedCalls<'m>(LocalAgent<'m, Flex>, usize);

impl ForcedCalls<'_> {
    fn force(&self, ctx: &AgentContext, turn: Result<env::TurnText, env::AgentError>) -> Result<env::TurnText, env::AgentError> {
        let turn = turn?;
        let t = ctx.exchanges().len();
        let text = if t + 1 < self.1 {
            format!("{}call {t} of {}{}", env::CALL_OPEN, ctx.question(), env::CALL_CLOSE)
        } else {
            format!("{}done{}", env::ANSWER_OPEN, env::ANSWER_CLOSE)
        };
        Ok(env::TurnText { text, ..turn })
    }
}

impl Agent for ForcedCalls<'_> {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), env::AgentError> {
        self.0.begin_episode(ctx)
    }

    fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<env::TurnText, env::AgentError>> {
        let results = self.0.generate_turns(episodes);
        episodes.iter().zip(results).map(|(ctx, turn)| self.force(ctx, turn)).collect()
    }

    fn continuous(&self) -> bool {
        self.0.continuous()
    }

    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), env::AgentError>> {
        self.0.start_turns(episodes)
    }

    fn advance(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<env::TurnText, env::AgentError>)> {
        let ended = self.0.advance(episodes);
        ended
            .into_iter()
            .map(|(index, turn)| {
                let ctx = episodes.iter().find(|c| c.index() == index).expect("an episode of the step");
                (index, self.force(ctx, turn))
            })
            .collect()
    }

    fn environment_tokens(&mut self, text: &str) -> Result<env::EnvironmentTokens, env::AgentError> {
        self.0.environment_tokens(text)
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.0.end_episode(ctx)
    }
}

/// Replies after a random delay (its own generator: the delays differ from run to run of the
/// test, by design), and fails every call of the question "Fail?".
struct Delayed(std::sync::Mutex<rand::rngs::StdRng>);

impl env::Environment for Delayed {
    fn complete(&self, messages: &[env::ChatMessage]) -> Result<String, env::EnvError> {
        use rand::Rng;
        let delay = self.0.lock().unwrap().random_range(0..25);
        std::thread::sleep(std::time::Duration::from_millis(delay));
        if messages.iter().any(|m| m.content.contains("of Fail?")) {
            return Err(env::EnvError::Config("scripted failure".into()));
        }
        Ok(format!("reply to {} messages", messages.len()))
    }
}

/// Episodes run as the trainer runs them (at most `generation_batch` in flight, in batches turn
/// by turn and beginning as others end continuously, each episode's stream numbered by its
/// place in the list): the same seed gives the same episodes whatever
/// the batch size, whatever the environment's delays (which reorder who decodes beside whom
/// when the loop runs continuously) and turn by turn or continuously, each episode keeping its
/// KV cache across its turns; an environment failure in the middle of a batch ends only its
/// episode. Turn by turn, the same batch size gives the same log-probs bit for bit whatever
/// the delays (continuously, the rows decoded side by side follow the delays: within 1e-4).
/// With shared prefixes (the trainer's default) the tokens are the same and the log-probs
/// within 1e-4, and the prompts' common blocks are prefilled once.
#[test]
fn episodes_do_not_depend_on_batching_or_environment_delays() {
    use rand::SeedableRng;
    let (_dir, tokenizer, model) = tiny_model(9);
    let questions = ["Paris?", "Rome?", "Fail?", "Oslo?", "Lima?", "Bern?", "Kyiv?", "Nome?"];
    let episode = env::EpisodeConfig { max_turns: 3, max_turn_tokens: 12, env_concurrency: 8, ..env::EpisodeConfig::training() };
    let run_sharing = |generation_batch: usize, delays: u64, continuous: bool, share_prefixes: bool| {
        let env = Delayed(std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(delays)));
        let sampling = Sampling { temperature: 1.0, seed: 5, ..Default::default() };
        let limits = model::DecoderLimits { share_prefixes, ..Default::default() };
        let mut agent = ForcedCalls(LocalAgent::new(&model, &tokenizer, sampling).with_limits(limits).with_continuous_batching(continuous), 3);
        agent.0.set_batch_stream(2);
        let admission = if continuous { env::Admission::Continuous(generation_batch) } else { env::Admission::Batches(generation_batch) };
        let out = env::run_episodes_admitted(&mut agent, &env, &questions, &episode, admission, &mut env::NoObserver);
        (out, agent.0.decoder_stats())
    };
    let run = |generation_batch: usize, delays: u64, continuous: bool| run_sharing(generation_batch, delays, continuous, false);
    let (reference, stats) = run(8, 1, true);
    for (i, t) in reference.iter().enumerate() {
        if questions[i] == "Fail?" {
            assert_eq!(t.stop_reason, env::StopReason::EnvFailure, "{:?}", t.error);
        } else {
            assert_eq!(t.stop_reason, env::StopReason::Answer, "episode {i}: {:?}", t.error);
            assert_eq!(t.turns.len(), 3, "episode {i}");
        }
    }
    // Each context token entered its episode's cache once, and no turn re-ran its history.
    let fed = stats.prefill_tokens + stats.decode_tokens;
    let context: u64 = reference.iter().map(|t| t.token_ids.len() as u64).sum();
    assert!(fed <= context, "{fed} tokens fed for {context} context tokens");
    let cases = [(1, 2, true, false), (3, 3, true, false), (8, 4, true, false), (8, 5, false, false), (3, 6, false, false), (8, 8, true, true), (3, 9, false, true)];
    for (generation_batch, delays, continuous, share_prefixes) in cases {
        let (other, other_stats) = run_sharing(generation_batch, delays, continuous, share_prefixes);
        if share_prefixes {
            // The prompts share their system prompt's full blocks: the episodes after the first
            // of each batch take them; every other context token is fed once, as without.
            assert!(other_stats.shared_prefix_tokens > 0, "{other_stats:?}");
            assert_eq!(other_stats.prefill_tokens + other_stats.shared_prefix_tokens, stats.prefill_tokens, "{other_stats:?}");
        }
        for (i, (a, b)) in reference.iter().zip(&other).enumerate() {
            let case = format!("episode {i}, generation_batch {generation_batch}, continuous {continuous}, share_prefixes {share_prefixes}");
            assert_eq!(a.token_ids, b.token_ids, "{case}");
            assert_eq!(a.loss_mask, b.loss_mask, "{case}");
            assert_eq!(a.stop_reason, b.stop_reason, "{case}");
            let worst = a.logprobs.iter().zip(&b.logprobs).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "{case}: log-probs differ by {worst}");
        }
    }
    let (turn_by_turn, _) = run(8, 5, false);
    let (other_delays, _) = run(8, 7, false);
    for (i, (a, b)) in turn_by_turn.iter().zip(&other_delays).enumerate() {
        assert_eq!(a.token_ids, b.token_ids, "episode {i}, turn by turn");
        assert_eq!(a.logprobs, b.logprobs, "episode {i}, turn by turn: log-probs not bit for bit equal");
    }
}

/// Holds every call until `n` calls have come in (at most two seconds), then replies: at least
/// `n` episodes are out on a call at once, however fast the agent decodes.
struct Gathering {
    n: usize,
    calls: std::sync::Mutex<usize>,
    arrived: std::sync::Condvar,
}

impl env::Environment for Gathering {
    fn complete(&self, messages: &[env::ChatMessage]) -> Result<String, env::EnvError> {
        let mut calls = self.calls.lock().unwrap();
        *calls += 1;
        self.arrived.notify_all();
        let timeout = std::time::Duration::from_secs(2);
        let _ = self.arrived.wait_timeout_while(calls, timeout, |calls| *calls < self.n).unwrap();
        Ok(format!("reply to {} messages", messages.len()))
    }
}

/// With fewer rows than episodes in flight (`max_num_seqs` below `generation_batch`), an
/// episode waiting on the environment keeps its cache while others take its row: the blocks in
/// use go past the rows' share, and the pool stays within what the memory plan counts (every
/// episode in flight at the longest context in blocks, the pool grown by an eighth).
#[test]
fn episodes_waiting_on_the_environment_keep_their_caches_beyond_the_rows() {
    let (_dir, tokenizer, model) = tiny_model(9);
    let questions = ["Paris?", "Rome?", "Oslo?", "Lima?", "Bern?", "Kyiv?"];
    let episode = env::EpisodeConfig { max_turns: 3, max_turn_tokens: 8, ..env::EpisodeConfig::training() };
    let sampling = Sampling { temperature: 1.0, seed: 5, ..Default::default() };
    let (rows, in_flight) = (2, questions.len());
    let limits = model::DecoderLimits { max_rows: rows, ..Default::default() };
    let mut agent = ForcedCalls(LocalAgent::new(&model, &tokenizer, sampling).with_limits(limits), 3);
    let env = Gathering { n: 4, calls: Default::default(), arrived: Default::default() };
    let trajectories = env::run_episodes_admitted(&mut agent, &env, &questions, &episode, env::Admission::Batches(in_flight), &mut env::NoObserver);
    assert!(trajectories.iter().all(|t| t.stop_reason == env::StopReason::Answer), "{:?}", trajectories.iter().map(|t| &t.error).collect::<Vec<_>>());
    let shortest = trajectories.iter().map(|t| t.prompt_len).min().unwrap();
    let longest = trajectories.iter().map(|t| t.token_ids.len()).max().unwrap();
    let stats = agent.0.decoder_stats();
    let (peak, in_use) = (stats.peak_kv_positions, stats.peak_kv_positions_in_use);
    println!("peak {peak} KV positions ({in_use} in use); prompts of {shortest}+ tokens, the longest episode {longest}");
    let blocks = |n: usize| n.div_ceil(model::qwen3::BLOCK_SIZE) * model::qwen3::BLOCK_SIZE;
    assert!(in_use > rows * blocks(longest) + model::qwen3::BLOCK_SIZE, "{in_use} positions in use: parked caches are kept");
    assert!(in_use >= (rows + 2) * blocks(shortest), "{in_use} positions in use");
    let plan = model::qwen3::grown_capacity(in_flight * blocks(longest) + model::qwen3::BLOCK_SIZE);
    assert!(peak <= plan, "peak {peak} positions, past the plan's bound {plan}");
}

/// No episode decodes a position past the model's context (`max_position_embeddings`): a turn
/// ends when the context is full, and a first prompt that fills it alone fails its episode with
/// the reason, leaving the other episodes as they were.
#[test]
fn episodes_stay_within_the_models_context() {
    let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    let texts = PromptTexts::default();
    let short = "What is 2 + 2?";
    let long = "Which river runs through the capital of France, and how long is it, and who named it?";
    let prompt_len = |q: &str| tokenizer.encode(&texts.first_prompt(q).chatml()).unwrap().len();
    let context = prompt_len(short) + 10;
    assert!(prompt_len(long) >= context, "the long question fills the context alone");
    let dir = tempfile::tempdir().unwrap();
    let mut config = Preset::Tiny.config(tokenizer.vocab_size(), vec![tokenizer.special().im_end]);
    config.max_position_embeddings = context;
    write_random_checkpoint(&config, dir.path(), 5, StorageDtype::F32).unwrap();
    let model = load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();

    struct Echo;
    impl env::Environment for Echo {
        fn complete(&self, _: &[env::ChatMessage]) -> Result<String, env::EnvError> {
            Ok("echo".into())
        }
    }
    let episode = env::EpisodeConfig { max_turn_tokens: 24, max_response_tokens: 100, ..env::EpisodeConfig::training() };
    let mut agent = LocalAgent::new(&model, &tokenizer, Sampling { temperature: 1.0, seed: 3, ..Default::default() });
    let runs = env::run_episodes(&mut agent, &Echo, &[short, long], &episode);
    assert!(runs[0].error.is_none(), "{:?}", runs[0].error);
    assert!(runs[0].token_ids.len() <= context, "{} tokens past a context of {context}", runs[0].token_ids.len());
    assert_eq!(runs[0].loss_mask.iter().filter(|&&m| m == 1).count(), 10, "the turn filled the context");
    assert_eq!(runs[1].stop_reason, env::StopReason::AgentFailure);
    let why = runs[1].error.as_deref().unwrap_or_default();
    assert!(why.contains("no room") && why.contains(&format!("context is {context}")), "{why}");

    // A call whose reply fills the context ends the episode at its token limit, as a spent
    // response budget does: no failure. (A random model writes no call: its turns that sampled
    // a token are made calls here.)
    struct Calls<A>(A);
    impl<A: Agent> Agent for Calls<A> {
        fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), env::AgentError> {
            self.0.begin_episode(ctx)
        }
        fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<env::TurnText, env::AgentError>> {
            let turns = self.0.generate_turns(episodes);
            let call = format!("<think>t</think>{}Paris?{}", env::CALL_OPEN, env::CALL_CLOSE);
            let forced = |turn: env::TurnText| if turn.tokens > 0 { env::TurnText { text: call.clone(), ..turn } } else { turn };
            turns.into_iter().map(|turn| turn.map(forced)).collect()
        }
        fn environment_tokens(&mut self, text: &str) -> Result<env::EnvironmentTokens, env::AgentError> {
            self.0.environment_tokens(text)
        }
        fn end_episode(&mut self, ctx: &mut AgentContext) {
            self.0.end_episode(ctx)
        }
    }
    let mut agent = Calls(LocalAgent::new(&model, &tokenizer, Sampling { temperature: 1.0, seed: 3, ..Default::default() }));
    let runs = env::run_episodes(&mut agent, &Echo, &[short], &episode);
    assert_eq!((runs[0].stop_reason, runs[0].error.as_deref(), runs[0].env_calls), (env::StopReason::TokenLimit, None, 1));
    assert_eq!(runs[0].loss_mask.iter().filter(|&&m| m == 1).count(), 10, "one turn, cut at the context");
}

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
use trainer::rollout::LocalAgent;

#[test]
fn local_agent_builds_the_context_token_by_token() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    let special = *tokenizer.special();
    let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![special.im_end]);
    write_random_checkpoint(&config, dir.path(), 5, StorageDtype::F32).unwrap();
    let model = load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();

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
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    let special = *tokenizer.special();
    let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![special.im_end]);
    write_random_checkpoint(&config, dir.path(), 5, StorageDtype::F32).unwrap();
    let model = load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();

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

    // Each turn prefills its episode's whole history: the tokens before the turn's first
    // sampled token (`perf/prefill_tokens` of a training step).
    let mut agent = LocalAgent::new(&model, &tokenizer, Sampling { temperature: 1.0, seed: 3, ..Default::default() });
    let counted = env::run_episodes(&mut agent, &Echo, &questions, &episode);
    let mut expected = 0u64;
    for t in &counted {
        let starts: Vec<usize> = (0..t.loss_mask.len())
            .filter(|&i| t.loss_mask[i] == 1 && (i == 0 || t.loss_mask[i - 1] == 0))
            .collect();
        assert_eq!(starts.len(), t.turns.len(), "one run of sampled tokens per turn");
        expected += starts.iter().map(|&i| i as u64).sum::<u64>();
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
        let scored = completion_logprobs(&model, &[(ids[..start].to_vec(), ids[start..].to_vec())], special.endoftext)
            .unwrap()
            .remove(0);
        for (k, (&m, &lp)) in t.loss_mask[start..].iter().zip(&t.logprobs[start..]).enumerate() {
            if m == 1 {
                assert!((lp - scored[k]).abs() < 1e-4, "token {k}: rollout {lp} vs scoring {}", scored[k]);
            }
        }
    }
}

//! The episode loop with a scripted token-level agent (a toy char-level tokenizer) and a
//! scripted environment.

use std::collections::HashMap;
use std::sync::Mutex;

use prompt_r1_env::{
    run_episodes, run_episodes_admitted, run_episodes_observed, Admission, Agent, AgentContext, AgentError, ChatMessage, EnvError,
    Environment, EnvironmentTokens, EpisodeConfig, EpisodeObserver, ReplyFormat, StopReason, Trajectory, TurnEnd,
    TurnRecord, TurnText, ENV_SYSTEM_MESSAGE, REFERENCE_INSTRUCTION, REFERENCE_SYSTEM,
};

const IM_START_ID: u32 = 151_644;
const IM_END_ID: u32 = 151_645;

/// Char-level tokens, with `<|im_start|>` and `<|im_end|>` as single special tokens.
fn tokenize(text: &str) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if let Some(after) = rest.strip_prefix("<|im_start|>") {
            ids.push(IM_START_ID);
            rest = after;
        } else if let Some(after) = rest.strip_prefix("<|im_end|>") {
            ids.push(IM_END_ID);
            rest = after;
        } else {
            ids.push(c as u32);
            rest = &rest[c.len_utf8()..];
        }
    }
    ids
}

fn decode(ids: &[u32]) -> String {
    ids.iter()
        .map(|&id| match id {
            IM_START_ID => "<|im_start|>".to_string(),
            IM_END_ID => "<|im_end|>".to_string(),
            id => char::from_u32(id).unwrap().to_string(),
        })
        .collect()
}

/// A scripted turn: the text the agent "samples" and whether it then samples `<|im_end|>`.
#[derive(Clone)]
struct Scripted {
    text: String,
    im_end: bool,
}

fn turn(text: &str) -> Scripted {
    Scripted {
        text: text.to_string(),
        im_end: true,
    }
}

/// Plays scripted turns per question, recording tokens like the local model will.
#[derive(Default)]
struct ScriptedAgent {
    scripts: HashMap<String, Vec<Scripted>>,
    fail_on: Option<String>,
    played: HashMap<usize, usize>,
    batch_sizes: Vec<usize>,
    prefixes_seen: Vec<(usize, String)>,
    ended: Vec<usize>,
    /// Episodes begun (`true`) and ended (`false`), in order.
    log: Vec<(bool, usize)>,
}

impl ScriptedAgent {
    fn new(scripts: &[(&str, Vec<Scripted>)]) -> Self {
        Self {
            scripts: scripts
                .iter()
                .map(|(q, turns)| (q.to_string(), turns.clone()))
                .collect(),
            ..Self::default()
        }
    }
}

impl Agent for ScriptedAgent {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        self.log.push((true, ctx.index()));
        let ids = tokenize(&ctx.prompt().chatml());
        ctx.record_context_tokens(&ids);
        Ok(())
    }

    fn generate_turns(
        &mut self,
        episodes: &mut [&mut AgentContext],
    ) -> Vec<Result<TurnText, AgentError>> {
        self.batch_sizes.push(episodes.len());
        episodes
            .iter_mut()
            .map(|ctx| {
                if self.fail_on.as_deref() == Some(ctx.question()) {
                    return Err(AgentError::Model("out of memory".into()));
                }
                self.prefixes_seen
                    .push((ctx.index(), ctx.turn_prefix().to_string()));
                let n = self.played.entry(ctx.index()).or_insert(0);
                let script = &self.scripts[ctx.question()];
                let scripted = script[(*n).min(script.len() - 1)].clone();
                *n += 1;
                let mut ids = tokenize(&scripted.text);
                let budget = ctx.turn_budget();
                let mut end = if scripted.im_end {
                    TurnEnd::ImEnd
                } else {
                    TurnEnd::StopString
                };
                if ids.len() + usize::from(scripted.im_end) > budget {
                    ids.truncate(budget);
                    end = TurnEnd::Length;
                }
                for (k, &id) in ids.iter().enumerate() {
                    ctx.record_agent_token(id, -0.01 * (k as f32 + 1.0));
                }
                let mut tokens = ids.len();
                if end == TurnEnd::ImEnd {
                    ctx.record_agent_token(IM_END_ID, -0.001);
                    tokens += 1;
                }
                Ok(TurnText {
                    text: decode(&ids),
                    tokens,
                    end,
                })
            })
            .collect()
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        Ok(EnvironmentTokens::Ids(tokenize(text)))
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.ended.push(ctx.index());
        self.log.push((false, ctx.index()));
    }
}

/// Answers by a function of the messages and logs every call.
struct ScriptedEnv<F> {
    reply: F,
    calls: Mutex<Vec<Vec<ChatMessage>>>,
}

impl<F: Fn(&[ChatMessage]) -> Result<String, EnvError> + Sync> ScriptedEnv<F> {
    fn new(reply: F) -> Self {
        Self {
            reply,
            calls: Mutex::new(Vec::new()),
        }
    }

    fn calls(&self) -> Vec<Vec<ChatMessage>> {
        self.calls.lock().unwrap().clone()
    }
}

impl<F: Fn(&[ChatMessage]) -> Result<String, EnvError> + Sync> Environment for ScriptedEnv<F> {
    fn complete(&self, messages: &[ChatMessage]) -> Result<String, EnvError> {
        self.calls.lock().unwrap().push(messages.to_vec());
        (self.reply)(messages)
    }
}

fn last_user(messages: &[ChatMessage]) -> &str {
    &messages.last().unwrap().content
}

fn env_text(reply_json: &str) -> String {
    format!(
        "\n<|im_start|>user\n<interaction_response>\n{reply_json}\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
}

/// The loss mask expected for agent segments (`true`) and context segments (`false`).
fn expected_mask(segments: &[(&str, bool)]) -> Vec<u8> {
    segments
        .iter()
        .flat_map(|(text, agent)| vec![u8::from(*agent); tokenize(text).len()])
        .collect()
}

const T1: &str = "<think>\nThe question asks about X.\n</think>\n<interaction_prompt>\n{\"name\": \"prompt\", \"arguments\": {\"prompt\": \"What is X?\"}}\n</interaction_prompt>";
const T2: &str =
    "X is x, let me check.\n</think>\n<interaction_prompt>Check that X is x.</interaction_prompt>";
const T3: &str = "Confirmed.\n</think>\n<answer>x</answer>";

#[test]
fn a_full_episode_builds_the_reference_context_token_by_token() {
    let mut agent = ScriptedAgent::new(&[("What is X?", vec![turn(T1), turn(T2), turn(T3)])]);
    let env = ScriptedEnv::new(|messages: &[ChatMessage]| {
        Ok(match last_user(messages) {
            "What is X?" => " X is x. ".to_string(),
            _ => "Yes, \"x\".".to_string(),
        })
    });
    let trajectories = run_episodes(
        &mut agent,
        &env,
        &["What is X?"],
        &EpisodeConfig::training(),
    );
    let t = &trajectories[0];

    assert_eq!(t.stop_reason, StopReason::Answer);
    assert_eq!(t.answer.as_deref(), Some("x"));
    assert_eq!(t.error, None);
    assert_eq!(t.env_calls, 2);

    // The first prompt: reference system text, `Question: {q}\n{instruction}`.
    let prompt = format!(
        "<|im_start|>system\n{REFERENCE_SYSTEM}<|im_end|>\n<|im_start|>user\nQuestion: What is X?\n{REFERENCE_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.prompt_text, prompt);
    assert_eq!(t.prompt_len, tokenize(&prompt).len());

    // The context decodes to the reference format with one <|im_end|> per turn boundary.
    let reply1 = r#"{"results": ["X is x."]}"#;
    let reply2 = r#"{"results": ["Yes, \"x\"."]}"#;
    let reference = format!(
        "{prompt}{T1}<|im_end|>{}{T2}<|im_end|>{}{T3}<|im_end|>",
        env_text(reply1),
        env_text(reply2)
    );
    assert_eq!(decode(&t.token_ids), reference);
    assert_eq!(t.context_text(), reference);
    assert!(!reference.contains("<|im_end|><|im_end|>"));
    assert_eq!(t.response_tokens, t.token_ids.len() - t.prompt_len);

    // Loss mask: 1 on exactly the agent's tokens (its <|im_end|> included).
    let mask = expected_mask(&[
        (&prompt, false),
        (T1, true),
        ("<|im_end|>", true),
        (&env_text(reply1), false),
        (T2, true),
        ("<|im_end|>", true),
        (&env_text(reply2), false),
        (T3, true),
        ("<|im_end|>", true),
    ]);
    assert_eq!(t.loss_mask, mask);
    assert_eq!(t.logprobs.len(), t.token_ids.len());
    for (logprob, mask) in t.logprobs.iter().zip(&t.loss_mask) {
        assert_eq!(*logprob < 0.0, *mask == 1);
    }

    // What the environment saw: system message, earlier pairs, the new prompt; never <think>.
    assert_eq!(
        env.calls(),
        vec![
            vec![
                ChatMessage::system(ENV_SYSTEM_MESSAGE),
                ChatMessage::user("What is X?")
            ],
            vec![
                ChatMessage::system(ENV_SYSTEM_MESSAGE),
                ChatMessage::user("What is X?"),
                ChatMessage::assistant("X is x."),
                ChatMessage::user("Check that X is x."),
            ],
        ]
    );

    // Turns as users see them.
    let turns: Vec<_> = t
        .turns
        .iter()
        .map(|r| {
            (
                r.think.as_deref(),
                r.prompt.as_deref(),
                r.response.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        turns,
        vec![
            (
                Some("The question asks about X."),
                Some("What is X?"),
                Some("X is x.")
            ),
            (
                Some("X is x, let me check."),
                Some("Check that X is x."),
                Some("Yes, \"x\".")
            ),
            (Some("Confirmed."), None, None),
        ]
    );
    assert!(t.turns[1].text.starts_with("<think>\n"));
    assert_eq!(t.turns[2].answer.as_deref(), Some("x"));

    assert_eq!(
        agent.prefixes_seen,
        vec![
            (0, "".into()),
            (0, "<think>\n".into()),
            (0, "<think>\n".into())
        ]
    );
    assert_eq!(agent.ended, vec![0]);
}

#[test]
fn batches_are_turn_synchronous_and_masks_stay_per_episode() {
    let call = |p: &str| {
        turn(&format!(
            "<think>t</think><interaction_prompt>{p}</interaction_prompt>"
        ))
    };
    let mut agent = ScriptedAgent::new(&[
        ("one", vec![turn("<think>t</think><answer>1</answer>")]),
        ("two", vec![call("p"), turn("t</think><answer>2</answer>")]),
        (
            "three",
            vec![call("p"), call("q"), turn("t</think><answer>3</answer>")],
        ),
    ]);
    let env = ScriptedEnv::new(|m: &[ChatMessage]| Ok(format!("re {}", last_user(m))));
    let questions = ["one", "two", "three"];
    let trajectories = run_episodes(&mut agent, &env, &questions, &EpisodeConfig::default());
    assert_eq!(agent.batch_sizes, vec![3, 2, 1]);
    let answers: Vec<_> = trajectories.iter().map(|t| t.answer.as_deref()).collect();
    assert_eq!(answers, vec![Some("1"), Some("2"), Some("3")]);
    for t in &trajectories {
        assert!(decode(&t.token_ids).contains(&format!("Question: {}\n", t.question)));
        let agent_text: String = t
            .token_ids
            .iter()
            .zip(&t.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(id, _)| decode(&[*id]))
            .collect();
        let expected: String = t
            .turns
            .iter()
            .map(|r| agent_part(&r.text) + "<|im_end|>")
            .collect();
        assert_eq!(agent_text, expected, "{}", t.question);
    }
}

/// The agent-sampled part of a turn's text (without the `<think>\n` the environment added).
fn agent_part(text: &str) -> String {
    text.strip_prefix("<think>\n").unwrap_or(text).to_string()
}

#[test]
fn stop_reasons() {
    let call = turn("<think>again</think><interaction_prompt>more</interaction_prompt>");
    let mut agent = ScriptedAgent::new(&[
        (
            "answers",
            vec![turn("<think>easy</think><answer>42</answer>")],
        ),
        (
            "no call",
            vec![turn("<think>hmm</think> I will just stop here.")],
        ),
        ("keeps calling", vec![call.clone()]),
        ("rambles", vec![turn(&"a".repeat(500))]),
    ]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("reply".to_string()));
    let config = EpisodeConfig {
        max_turns: 2,
        max_turn_tokens: 100,
        ..EpisodeConfig::default()
    };
    let questions = ["answers", "no call", "keeps calling", "rambles"];
    let trajectories = run_episodes(&mut agent, &env, &questions, &config);
    let reasons: Vec<_> = trajectories.iter().map(|t| t.stop_reason).collect();
    assert_eq!(
        reasons,
        vec![
            StopReason::Answer,
            StopReason::NoCall,
            StopReason::TurnLimit,
            StopReason::TokenLimit
        ]
    );
    // Two rounds, both calls: the second call is still sent (as the reference does), then
    // the round limit ends the episode without a third turn.
    let limited = &trajectories[2];
    assert_eq!((limited.env_calls, limited.turns.len()), (2, 2));
    assert_eq!(limited.turns[1].prompt.as_deref(), Some("more"));
    assert_eq!(limited.turns[1].response.as_deref(), Some("reply"));
    assert_eq!(env.calls().len(), 2);
    let rambling = &trajectories[3];
    assert_eq!(rambling.turns[0].tokens, 100);
    assert_eq!(rambling.turns[0].end, TurnEnd::Length);
    assert!(trajectories.iter().all(|t| t.error.is_none()));
}

/// `max_turns` counts agent generation rounds, as the reference's `for turn in range(max_turns)`:
/// 5 rounds fit 4 calls and an answer; a 5th call is sent, its reply appended, and the
/// episode ends there (no 6th round to answer in).
#[test]
fn max_turns_counts_generation_rounds() {
    let call = turn("<think>t</think><interaction_prompt>p</interaction_prompt>");
    let answer = turn("t</think><answer>a</answer>");
    let mut four_then_answer = vec![call.clone(); 4];
    four_then_answer.push(answer.clone());
    let mut agent = ScriptedAgent::new(&[
        ("four calls", four_then_answer),
        ("five calls", vec![call.clone(); 5]),
    ]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".to_string()));
    let config = EpisodeConfig::training();
    assert_eq!(config.max_turns, 5);
    let t = run_episodes(&mut agent, &env, &["four calls", "five calls"], &config);
    assert_eq!(t[0].stop_reason, StopReason::Answer);
    assert_eq!((t[0].env_calls, t[0].turns.len()), (4, 5));
    assert_eq!(t[0].answer.as_deref(), Some("a"));
    assert_eq!(t[1].stop_reason, StopReason::TurnLimit);
    assert_eq!((t[1].env_calls, t[1].turns.len()), (5, 5));
    assert_eq!(t[1].answer, None);
    assert_eq!(t[1].turns[4].response.as_deref(), Some("r"));
    // The text stops after the 5th reply, at the `<think>\n` the context opens the next turn
    // with, exactly where the reference's decoded episode stops.
    assert!(t[1]
        .response_text
        .ends_with(&env_text("{\"results\": [\"r\"]}")));
    assert_eq!(env.calls().len(), 9);

    // No rounds: the episode ends before the agent speaks.
    let mut agent = ScriptedAgent::new(&[("q", vec![answer])]);
    let none = EpisodeConfig {
        max_turns: 0,
        ..EpisodeConfig::training()
    };
    let t = &run_episodes(&mut agent, &env, &["q"], &none)[0];
    assert_eq!((t.stop_reason, t.turns.len()), (StopReason::TurnLimit, 0));
}

/// With calls not allowed, a call ends the episode unsent; an answer still ends it normally.
#[test]
fn calls_can_be_disallowed() {
    let mut agent = ScriptedAgent::new(&[
        (
            "calls",
            vec![turn(
                "<think>t</think><interaction_prompt>p</interaction_prompt>",
            )],
        ),
        ("answers", vec![turn("<think>t</think><answer>a</answer>")]),
    ]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".to_string()));
    let config = EpisodeConfig {
        max_turns: 1,
        allow_calls: false,
        ..EpisodeConfig::inference()
    };
    let t = run_episodes(&mut agent, &env, &["calls", "answers"], &config);
    assert_eq!(
        (t[0].stop_reason, t[0].env_calls),
        (StopReason::TurnLimit, 0)
    );
    assert_eq!(t[0].turns[0].prompt.as_deref(), Some("p"));
    assert_eq!(t[1].stop_reason, StopReason::Answer);
    assert!(env.calls().is_empty());
}

#[test]
fn the_total_token_budget_ends_episodes() {
    let call = turn("<think>t</think><interaction_prompt>p</interaction_prompt>");
    let mut agent = ScriptedAgent::new(&[("q", vec![call])]);
    // 59 tokens per call turn, 142 per environment text: the second turn has 49 left.
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".repeat(50)));
    let config = EpisodeConfig {
        max_response_tokens: 250,
        max_turn_tokens: 1000,
        ..EpisodeConfig::default()
    };
    let t = &run_episodes(&mut agent, &env, &["q"], &config)[0];
    assert_eq!(t.stop_reason, StopReason::TokenLimit);
    assert_eq!(t.env_calls, 1);
    assert_eq!(t.response_tokens, 250);
    // The second turn got only what was left of the budget.
    assert_eq!(t.turns.len(), 2);
    assert_eq!((t.turns[1].tokens, t.turns[1].end), (49, TurnEnd::Length));
    assert_eq!(t.response_tokens, t.token_ids.len() - t.prompt_len);
}

#[test]
fn a_reply_past_the_response_budget_ends_the_episode_unappended() {
    let call = turn("<think>t</think><interaction_prompt>p</interaction_prompt>");
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".repeat(50)));
    // 59 tokens per call turn, 142 per environment text.
    let run = |max_response_tokens: usize| {
        let mut agent = ScriptedAgent::new(&[("q", vec![call.clone()])]);
        let config = EpisodeConfig { max_response_tokens, max_turn_tokens: 1000, ..EpisodeConfig::default() };
        run_episodes(&mut agent, &env, &["q"], &config).remove(0)
    };
    let cut = run(59 + 141);
    assert_eq!(cut.stop_reason, StopReason::TokenLimit);
    assert_eq!(cut.env_calls, 1);
    assert_eq!(cut.response_tokens, 59);
    assert_eq!(cut.token_ids.len() - cut.prompt_len, 59);
    assert_eq!(cut.turns.len(), 1);
    assert_eq!(cut.turns[0].prompt.as_deref(), Some("p"));
    assert_eq!(cut.turns[0].response, None);
    assert!(cut.response_text.ends_with("</interaction_prompt><|im_end|>"), "{}", cut.response_text);
    // A reply that just fits is appended, and leaves nothing for another turn.
    let fits = run(59 + 142);
    assert_eq!(fits.stop_reason, StopReason::TokenLimit);
    assert_eq!(fits.response_tokens, 59 + 142);
    assert_eq!(fits.token_ids.len() - fits.prompt_len, 59 + 142);
    assert_eq!(fits.turns.len(), 1);
    assert!(fits.turns[0].response.is_some());
}

#[test]
fn long_replies_are_cut_for_the_agent_but_kept_whole_in_the_record() {
    let script = vec![
        turn("<think>t</think><interaction_prompt>long please</interaction_prompt>"),
        turn("t</think><answer>done</answer>"),
    ];
    let long = "é".repeat(3000);
    let long_reply = long.clone();
    let env = ScriptedEnv::new(move |_: &[ChatMessage]| Ok(long_reply.clone()));

    let mut agent = ScriptedAgent::new(&[("q", script.clone())]);
    let training = EpisodeConfig {
        reply: ReplyFormat {
            max_chars: 100,
            ascii_escape: true,
        },
        ..EpisodeConfig::training()
    };
    let t = &run_episodes(&mut agent, &env, &["q"], &training)[0];
    let shown = format!("{{\"results\": [\"{}\\u...", "\\u00e9".repeat(14));
    assert_eq!(shown.chars().count(), 103);
    assert!(t.response_text.contains(&format!(
        "<interaction_response>\n{shown}\n</interaction_response>"
    )));
    assert_eq!(t.turns[0].response.as_deref(), Some(long.as_str()));
    assert!(t.turns[0].response_truncated);

    // Inference keeps 8192 characters: 1000 escaped characters (6000) fit.
    assert_eq!(EpisodeConfig::inference().reply.max_chars, 8192);
    assert_eq!(EpisodeConfig::training().reply.max_chars, 2048);
    let mut agent = ScriptedAgent::new(&[("q", script)]);
    let short_env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("é".repeat(1000)));
    let t = &run_episodes(&mut agent, &short_env, &["q"], &EpisodeConfig::inference())[0];
    assert!(!t.turns[0].response_truncated);
    assert!(t
        .response_text
        .contains(&format!("{}\"]}}", "\\u00e9".repeat(1000))));
}

#[test]
fn environment_failures_end_the_episode_and_never_reach_the_agent() {
    let mut agent = ScriptedAgent::new(&[
        (
            "fails",
            vec![turn(
                "<think>t</think><interaction_prompt>doomed</interaction_prompt>",
            )],
        ),
        (
            "works",
            vec![
                turn("<think>t</think><interaction_prompt>p</interaction_prompt>"),
                turn("t</think><answer>ok</answer>"),
            ],
        ),
    ]);
    let env = ScriptedEnv::new(|m: &[ChatMessage]| {
        if last_user(m) == "doomed" {
            Err(EnvError::Http {
                url: "http://llm/v1/chat/completions".into(),
                status: 503,
                message: "upstream overloaded".into(),
                attempts: 6,
            })
        } else {
            Ok("fine".to_string())
        }
    });
    let trajectories = run_episodes(
        &mut agent,
        &env,
        &["fails", "works"],
        &EpisodeConfig::default(),
    );
    let (failed, ok) = (&trajectories[0], &trajectories[1]);
    assert_eq!(failed.stop_reason, StopReason::EnvFailure);
    assert!(failed.stop_reason.is_failure());
    let error = failed.error.as_deref().unwrap();
    assert!(
        error.contains("HTTP 503") && error.contains("upstream overloaded"),
        "{error}"
    );
    let after_prompt = decode(&failed.token_ids[failed.prompt_len..]);
    assert_eq!(
        after_prompt,
        "<think>t</think><interaction_prompt>doomed</interaction_prompt><|im_end|>"
    );
    assert_eq!(failed.response_text, after_prompt);
    assert_eq!(failed.token_ids.last(), Some(&IM_END_ID));
    assert_eq!(failed.turns[0].prompt.as_deref(), Some("doomed"));
    assert_eq!(failed.turns[0].response, None);
    assert_eq!(failed.env_calls, 1);
    assert_eq!(ok.stop_reason, StopReason::Answer);
    assert_eq!(ok.error, None);
}

#[test]
fn agent_failures_are_recorded() {
    let mut agent = ScriptedAgent::new(&[
        ("bad", vec![turn("x")]),
        ("good", vec![turn("<answer>g</answer>")]),
    ]);
    agent.fail_on = Some("bad".into());
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok(String::new()));
    let trajectories = run_episodes(
        &mut agent,
        &env,
        &["bad", "good"],
        &EpisodeConfig::default(),
    );
    assert_eq!(trajectories[0].stop_reason, StopReason::AgentFailure);
    assert_eq!(
        trajectories[0].error.as_deref(),
        Some("agent model failed: out of memory")
    );
    assert_eq!(trajectories[1].answer.as_deref(), Some("g"));
    assert_eq!(agent.ended.len(), 2);
}

#[test]
fn only_the_first_call_of_a_turn_runs() {
    let mut agent = ScriptedAgent::new(&[(
        "q",
        vec![
            turn("<think>t</think><interaction_prompt>first</interaction_prompt><interaction_prompt>second</interaction_prompt>"),
            turn("t</think><answer>a</answer>"),
        ],
    )]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".to_string()));
    run_episodes(&mut agent, &env, &["q"], &EpisodeConfig::default());
    let prompts: Vec<_> = env
        .calls()
        .iter()
        .map(|m| last_user(m).to_string())
        .collect();
    assert_eq!(prompts, vec!["first"]);
}

#[test]
fn a_turn_ended_by_a_stop_string_gets_the_full_wrapper() {
    let mut agent = ScriptedAgent::new(&[(
        "q",
        vec![
            Scripted {
                text: "<think>t</think><interaction_prompt>p</interaction_prompt>".into(),
                im_end: false,
            },
            turn("t</think><answer>a</answer>"),
        ],
    )]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".to_string()));
    let t = &run_episodes(&mut agent, &env, &["q"], &EpisodeConfig::default())[0];
    let expected_env = format!("<|im_end|>{}", env_text(r#"{"results": ["r"]}"#));
    assert!(t
        .response_text
        .contains(&format!("</interaction_prompt>{expected_env}")));
    assert_eq!(decode(&t.token_ids), t.context_text());
    assert!(!t.context_text().contains("<|im_end|><|im_end|>"));
}

#[derive(Default)]
struct Recorder {
    turns: Vec<(usize, Option<String>)>,
    finished: Vec<(usize, StopReason)>,
}

impl EpisodeObserver for Recorder {
    fn turn_finished(&mut self, episode: usize, turn: &TurnRecord) {
        self.turns.push((episode, turn.response.clone()));
    }

    fn episode_finished(&mut self, episode: usize, trajectory: &Trajectory) {
        self.finished.push((episode, trajectory.stop_reason));
    }
}

#[test]
fn observers_hear_each_turn_as_it_completes() {
    let mut agent = ScriptedAgent::new(&[(
        "q",
        vec![
            turn("<think>t</think><interaction_prompt>p</interaction_prompt>"),
            turn("t</think><answer>a</answer>"),
        ],
    )]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".to_string()));
    let mut recorder = Recorder::default();
    run_episodes_observed(
        &mut agent,
        &env,
        &["q"],
        &EpisodeConfig::default(),
        &mut recorder,
    );
    assert_eq!(recorder.turns, vec![(0, Some("r".to_string())), (0, None)]);
    assert_eq!(recorder.finished, vec![(0, StopReason::Answer)]);
}

#[test]
fn trajectory_json_has_the_cli_shape() {
    let mut agent = ScriptedAgent::new(&[(
        "q",
        vec![
            turn("<think>t</think><interaction_prompt>p</interaction_prompt>"),
            turn("u</think><answer>a</answer>"),
        ],
    )]);
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("r".to_string()));
    let t = &run_episodes(&mut agent, &env, &["q"], &EpisodeConfig::default())[0];
    let json = serde_json::to_value(t).unwrap();
    assert_eq!(json["answer"], "a");
    assert_eq!(json["stop_reason"], "answer");
    assert_eq!(json["error"], serde_json::Value::Null);
    assert_eq!(json["turns"][0]["think"], "t");
    assert_eq!(json["turns"][0]["prompt"], "p");
    assert_eq!(json["turns"][0]["response"], "r");
    assert_eq!(json["turns"][1]["think"], "u");
    let back: Trajectory = serde_json::from_value(json).unwrap();
    assert_eq!(&back, t);
}

#[test]
fn no_questions_no_episodes() {
    let mut agent = ScriptedAgent::default();
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok(String::new()));
    let none: [&str; 0] = [];
    assert!(run_episodes(&mut agent, &env, &none, &EpisodeConfig::default()).is_empty());
}

/// A continuous agent over [`ScriptedAgent`]: each `advance` ends the turn of one episode (the
/// one whose turn started first), so turns end and calls go out one at a time while others are
/// "decoding"; `start_turns` fails for the second turn of the question `refuse`.
struct OneAtATime {
    inner: ScriptedAgent,
    refuse: &'static str,
    in_turn: Vec<usize>,
    /// The questions of the episodes begun so far, for the environment to see.
    began: std::sync::Arc<Mutex<Vec<String>>>,
}

impl Agent for OneAtATime {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        self.began.lock().unwrap().push(ctx.question().to_string());
        self.inner.begin_episode(ctx)
    }

    fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<TurnText, AgentError>> {
        self.inner.generate_turns(episodes)
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        self.inner.environment_tokens(text)
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.inner.end_episode(ctx)
    }

    fn continuous(&self) -> bool {
        true
    }

    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), AgentError>> {
        episodes
            .iter()
            .map(|ctx| {
                if ctx.question() == self.refuse && ctx.exchanges().len() == 1 {
                    return Err(AgentError::Model(format!("refused {}", ctx.question())));
                }
                self.in_turn.push(ctx.index());
                Ok(())
            })
            .collect()
    }

    fn advance(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<TurnText, AgentError>)> {
        let Some(index) = (!self.in_turn.is_empty()).then(|| self.in_turn.remove(0)) else { return Vec::new() };
        // A step takes a while, so replies pile up meanwhile and come back several at once.
        std::thread::sleep(std::time::Duration::from_millis(25));
        let ctx = episodes.iter_mut().find(|c| c.index() == index).expect("the loop hands every episode in turn");
        let mut one = [&mut **ctx];
        let result = self.inner.generate_turns(&mut one).pop().expect("one turn");
        vec![(index, result)]
    }
}

/// The continuous loop gives each episode what the turn-by-turn loop gives it (the same
/// context, calls and answers), and an agent failure at the start of a turn ends only its own
/// episode, whichever order the replies came back in (episodes then start their turns in
/// reply order, not index order).
#[test]
fn the_continuous_loop_matches_the_turn_by_turn_loop() {
    let scripts: Vec<(&str, Vec<Scripted>)> = [("What is X?", 'X'), ("What is Y?", 'Y'), ("What is Z?", 'Z'), ("What is W?", 'W')]
        .iter()
        .map(|&(q, l)| {
            let first = format!("<think>\nabout {l}\n</think>\n<interaction_prompt>ask {l}</interaction_prompt>");
            let second = format!("more\n</think>\n<interaction_prompt>check {l}</interaction_prompt>");
            (q, vec![turn(&first), turn(&second), turn(T3)])
        })
        .collect();
    let questions: Vec<&str> = scripts.iter().map(|s| s.0).collect();
    // X's replies take longer, so X's and Y's come back together, Y's first.
    let env = ScriptedEnv::new(|messages: &[ChatMessage]| {
        let delay = if messages.iter().any(|m| m.content.contains(" X")) { 50 } else { 5 };
        std::thread::sleep(std::time::Duration::from_millis(delay));
        Ok(format!("reply to {}", last_user(messages).len()))
    });
    let by_turn = run_episodes(&mut ScriptedAgent::new(&scripts), &env, &questions, &EpisodeConfig::default());
    let mut continuous = OneAtATime { inner: ScriptedAgent::new(&scripts), refuse: "What is Y?", in_turn: Vec::new(), began: Default::default() };
    let trajectories = run_episodes(&mut continuous, &env, &questions, &EpisodeConfig::default());
    for (i, (a, b)) in by_turn.iter().zip(&trajectories).enumerate() {
        if questions[i] == "What is Y?" {
            assert_eq!(b.stop_reason, StopReason::AgentFailure);
            assert_eq!(b.error.as_deref(), Some("agent model failed: refused What is Y?"));
            assert_eq!(b.env_calls, 1);
            continue;
        }
        assert_eq!(b.stop_reason, a.stop_reason, "episode {i}: {:?}", b.error);
        assert_eq!(b.stop_reason, StopReason::Answer);
        assert_eq!((&b.token_ids, &b.loss_mask, &b.response_text), (&a.token_ids, &a.loss_mask, &a.response_text), "episode {i}");
        assert_eq!(b.env_calls, 2);
    }
    assert_eq!(continuous.inner.ended.len(), questions.len(), "every episode ended once");
}

/// The most episodes begun and not ended at once in `log`, and where in `log` each episode
/// began and ended.
fn in_flight(log: &[(bool, usize)]) -> (usize, HashMap<usize, usize>, HashMap<usize, usize>) {
    let (mut now, mut most, mut began, mut ended) = (0usize, 0usize, HashMap::new(), HashMap::new());
    for (at, &(begin, i)) in log.iter().enumerate() {
        if begin {
            now += 1;
            most = most.max(now);
            began.insert(i, at);
        } else {
            now -= 1;
            ended.insert(i, at);
        }
    }
    assert_eq!(began.len(), ended.len(), "every episode begun ends");
    (most, began, ended)
}

/// With at most two episodes in flight, both loops begin the next question's episode as soon as
/// one ends under continuous admission (the third begins before the long second one ends), and
/// only once both have ended in batches; never more than two at once, and every episode gets
/// what it gets when all run at once, in question order.
#[test]
fn episodes_begin_as_the_admission_says() {
    let call = |l: char| turn(&format!("<think>\nabout {l}\n</think>\n<interaction_prompt>ask {l}</interaction_prompt>"));
    // Episode 1 calls twice before answering; the others answer at once or after one call.
    let scripts: Vec<(&str, Vec<Scripted>)> = vec![
        ("What is A?", vec![turn(T3)]),
        ("What is B?", vec![call('B'), call('B'), turn(T3)]),
        ("What is C?", vec![call('C'), turn(T3)]),
        ("What is D?", vec![turn(T3)]),
        ("What is E?", vec![call('E'), turn(T3)]),
    ];
    let questions: Vec<&str> = scripts.iter().map(|s| s.0).collect();
    let env = ScriptedEnv::new(|messages: &[ChatMessage]| Ok(format!("reply to {}", last_user(messages).len())));
    let config = EpisodeConfig::default();
    let all_at_once = run_episodes(&mut ScriptedAgent::new(&scripts), &env, &questions, &config);
    let check = |trajectories: &[Trajectory], log: &[(bool, usize)], admission: Admission, what: &str| {
        assert_eq!(trajectories.len(), questions.len(), "{what}");
        for (i, (a, b)) in all_at_once.iter().zip(trajectories).enumerate() {
            assert_eq!(b.question, questions[i], "{what}: episode {i} in question order");
            assert_eq!(b.stop_reason, StopReason::Answer, "{what}: episode {i}: {:?}", b.error);
            assert_eq!((&b.token_ids, &b.loss_mask, b.env_calls), (&a.token_ids, &a.loss_mask, a.env_calls), "{what}: episode {i}");
        }
        let (most, began, ended) = in_flight(log);
        assert_eq!(most, 2, "{what}: at most two episodes in flight, and two at a time: {log:?}");
        match admission {
            Admission::Continuous(_) => assert!(began[&2] < ended[&1], "{what}: episode 2 begins before episode 1 ends: {log:?}"),
            Admission::Batches(_) => {
                assert!(began[&2] > ended[&0].max(ended[&1]), "{what}: episode 2 begins after episodes 0 and 1: {log:?}");
                assert!(began[&4] > ended[&2].max(ended[&3]), "{what}: episode 4 begins after episodes 2 and 3: {log:?}");
            }
        }
        let begun: Vec<usize> = log.iter().filter(|e| e.0).map(|e| e.1).collect();
        assert_eq!(begun, vec![0, 1, 2, 3, 4], "{what}: episodes begin in question order");
    };
    for admission in [Admission::Continuous(2), Admission::Batches(2)] {
        let mut by_turn = ScriptedAgent::new(&scripts);
        let trajectories = run_episodes_admitted(&mut by_turn, &env, &questions, &config, admission, &mut prompt_r1_env::NoObserver);
        check(&trajectories, &by_turn.log, admission, &format!("turn by turn, {admission:?}"));
        assert!(by_turn.batch_sizes.iter().all(|&b| b <= 2), "{:?}", by_turn.batch_sizes);
        let mut continuous = OneAtATime { inner: ScriptedAgent::new(&scripts), refuse: "", in_turn: Vec::new(), began: Default::default() };
        let trajectories = run_episodes_admitted(&mut continuous, &env, &questions, &config, admission, &mut prompt_r1_env::NoObserver);
        check(&trajectories, &continuous.inner.log, admission, &format!("continuous, {admission:?}"));
    }
}

/// Continuous admission takes a place as soon as an episode ends, also when every other episode
/// is out on a call: the environment here answers B only once C has begun (else it fails B
/// after two seconds), and A's answer frees the place C takes.
#[test]
fn a_place_is_taken_while_the_others_wait_on_the_environment() {
    let call = turn("<think>\nabout B\n</think>\n<interaction_prompt>ask B</interaction_prompt>");
    let scripts: Vec<(&str, Vec<Scripted>)> =
        vec![("What is B?", vec![call, turn(T3)]), ("What is A?", vec![turn(T3)]), ("What is C?", vec![turn(T3)])];
    let questions: Vec<&str> = scripts.iter().map(|s| s.0).collect();
    let mut agent = OneAtATime { inner: ScriptedAgent::new(&scripts), refuse: "", in_turn: Vec::new(), began: Default::default() };
    let began = agent.began.clone();
    let env = ScriptedEnv::new(move |_: &[ChatMessage]| {
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(2) {
            if began.lock().unwrap().iter().any(|q| q == "What is C?") {
                return Ok("reply".to_string());
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Err(EnvError::Config("C had not begun while B waited on its call".into()))
    });
    let trajectories = run_episodes_admitted(&mut agent, &env, &questions, &EpisodeConfig::default(), Admission::Continuous(2), &mut prompt_r1_env::NoObserver);
    for t in &trajectories {
        assert_eq!(t.stop_reason, StopReason::Answer, "{}: {:?}", t.question, t.error);
    }
    assert_eq!(trajectories[0].env_calls, 1);
}

/// A continuous agent that drops the last episode of every `start_turns` call of more than one
/// (a broken agent: fewer results than episodes).
struct DropsATurn(OneAtATime);

impl Agent for DropsATurn {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        self.0.begin_episode(ctx)
    }

    fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<TurnText, AgentError>> {
        self.0.generate_turns(episodes)
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        self.0.environment_tokens(text)
    }

    fn end_episode(&mut self, ctx: &mut AgentContext) {
        self.0.end_episode(ctx)
    }

    fn continuous(&self) -> bool {
        true
    }

    fn start_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<(), AgentError>> {
        let n = episodes.len();
        let keep = if n > 1 { n - 1 } else { n };
        let mut results = self.0.start_turns(&mut episodes[..keep]);
        results.truncate(keep);
        results
    }

    fn advance(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<(usize, Result<TurnText, AgentError>)> {
        self.0.advance(episodes)
    }
}

/// An episode whose turn the agent drops ends as an agent failure, and the run goes on to the
/// next batch instead of waiting for it forever.
#[test]
fn an_episode_the_agent_drops_ends_as_a_failure() {
    let scripts: Vec<(&str, Vec<Scripted>)> = ["What is A?", "What is B?", "What is C?", "What is D?"].iter().map(|&q| (q, vec![turn(T3)])).collect();
    let questions: Vec<&str> = scripts.iter().map(|s| s.0).collect();
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("reply".to_string()));
    let inner = OneAtATime { inner: ScriptedAgent::new(&scripts), refuse: "", in_turn: Vec::new(), began: Default::default() };
    let mut agent = DropsATurn(inner);
    let trajectories = run_episodes_admitted(&mut agent, &env, &questions, &EpisodeConfig::default(), Admission::Batches(2), &mut prompt_r1_env::NoObserver);
    let reasons: Vec<StopReason> = trajectories.iter().map(|t| t.stop_reason).collect();
    assert_eq!(reasons, vec![StopReason::Answer, StopReason::AgentFailure, StopReason::Answer, StopReason::AgentFailure]);
    assert_eq!(trajectories[1].error.as_deref(), Some("the agent returned no result for this episode's turn"));
}

/// Stops admitting episodes after the first has finished (as `eval` does once a result cannot
/// be written).
struct StopsAfterOne(usize);

impl prompt_r1_env::EpisodeObserver for StopsAfterOne {
    fn episode_finished(&mut self, _episode: usize, _trajectory: &Trajectory) {
        self.0 += 1;
    }

    fn admits_more(&self) -> bool {
        self.0 == 0
    }
}

/// An observer that admits no more episodes ends the run once those in flight have ended,
/// in both loops and under both admissions; the episodes never begun come back unfinished.
#[test]
fn an_observer_can_stop_further_episodes() {
    let scripts: Vec<(&str, Vec<Scripted>)> = ["What is A?", "What is B?", "What is C?", "What is D?", "What is E?"].iter().map(|&q| (q, vec![turn(T3)])).collect();
    let questions: Vec<&str> = scripts.iter().map(|s| s.0).collect();
    let env = ScriptedEnv::new(|_: &[ChatMessage]| Ok("reply".to_string()));
    for admission in [Admission::Continuous(2), Admission::Batches(2)] {
        for continuous in [false, true] {
            let mut observer = StopsAfterOne(0);
            let trajectories = if continuous {
                let mut agent = OneAtATime { inner: ScriptedAgent::new(&scripts), refuse: "", in_turn: Vec::new(), began: Default::default() };
                run_episodes_admitted(&mut agent, &env, &questions, &EpisodeConfig::default(), admission, &mut observer)
            } else {
                run_episodes_admitted(&mut ScriptedAgent::new(&scripts), &env, &questions, &EpisodeConfig::default(), admission, &mut observer)
            };
            let answered = trajectories.iter().filter(|t| t.stop_reason == StopReason::Answer).count();
            let what = format!("{admission:?}, continuous {continuous}");
            assert_eq!(answered, observer.0, "{what}: every episode begun finished");
            assert!((1..=2).contains(&answered), "{what}: only the episodes in flight ran: {answered}");
            assert!(trajectories[answered..].iter().all(|t| t.token_ids.is_empty()), "{what}");
        }
    }
}

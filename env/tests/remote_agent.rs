//! A whole episode over HTTP: a remote agent endpoint and the environment client, both served
//! by a scripted server on loopback.

mod common;

use common::{completion, Action, ScriptedServer};
use prompt_r1_env::{
    run_episodes, ClientConfig, EpisodeConfig, OpenAiClient, RemoteAgent, RetryPolicy,
    SamplingParams, StopReason, TurnEnd, ENV_SYSTEM_MESSAGE, REFERENCE_SYSTEM,
};

const QUESTION: &str = "What is the capital of France?";

fn client(server: &ScriptedServer, model: &str) -> OpenAiClient {
    let config = ClientConfig {
        read_timeout_secs: 5.0,
        retry: RetryPolicy {
            max_attempts: 2,
            base_delay_secs: 0.01,
            max_delay_secs: 0.01,
            ..RetryPolicy::default()
        },
        ..ClientConfig::new(&server.base_url, model)
    };
    OpenAiClient::with_api_key(config, None).unwrap()
}

/// The agent asks once (its stop string cut by the server), then answers with its reasoning
/// returned apart; the environment answers the prompt.
fn serve(request: &common::Recorded, env_status: u16) -> Action {
    let body = request.json();
    let messages = body["messages"].as_array().unwrap();
    match body["model"].as_str() {
        Some("agent") if messages.len() == 2 => Action::json(
            200,
            completion("<think>\nI should ask.\n</think>\n<interaction_prompt>What is the capital of France?", None, "stop"),
        ),
        Some("agent") => Action::json(200, completion("<answer>Paris", Some("It says Paris."), "stop")),
        _ if env_status == 200 => Action::ok("Paris is the capital of France."),
        _ => Action::json(env_status, r#"{"error":{"message":"Incorrect API key provided"}}"#),
    }
}

#[test]
fn a_remote_agent_and_a_remote_environment_run_an_episode() {
    let server = ScriptedServer::start_with(|request| serve(request, 200));
    let sampling = SamplingParams {
        temperature: Some(0.0),
        ..SamplingParams::default()
    };
    let mut agent = RemoteAgent::new(client(&server, "agent"), sampling);
    let env = client(&server, "env");
    let t = &run_episodes(&mut agent, &env, &[QUESTION], &EpisodeConfig::inference())[0];

    assert_eq!(t.stop_reason, StopReason::Answer, "{t:?}");
    assert_eq!(t.answer.as_deref(), Some("Paris"));
    assert_eq!(t.turns.len(), 2);
    assert_eq!(t.turns[0].think.as_deref(), Some("I should ask."));
    assert_eq!(t.turns[0].prompt.as_deref(), Some(QUESTION));
    assert_eq!(
        t.turns[0].response.as_deref(),
        Some("Paris is the capital of France.")
    );
    assert_eq!(t.turns[0].end, TurnEnd::StopString);
    assert_eq!(t.turns[1].think.as_deref(), Some("It says Paris."));
    assert!(t.token_ids.is_empty() && t.loss_mask.is_empty());

    let first_turn = "<think>\nI should ask.\n</think>\n<interaction_prompt>What is the capital of France?</interaction_prompt>";
    let reply = r#"{"results": ["Paris is the capital of France."]}"#;
    let expected = format!(
        "{first_turn}<|im_end|>\n<|im_start|>user\n<interaction_response>\n{reply}\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\nIt says Paris.\n</think>\n\n<answer>Paris</answer>"
    );
    assert_eq!(t.response_text, expected);

    let requests = server.requests();
    let bodies: Vec<_> = requests.iter().map(|r| r.json()).collect();
    let agent_calls: Vec<_> = bodies.iter().filter(|b| b["model"] == "agent").collect();
    let env_calls: Vec<_> = bodies.iter().filter(|b| b["model"] == "env").collect();
    assert_eq!((agent_calls.len(), env_calls.len()), (2, 1));
    assert_eq!(
        agent_calls[0]["stop"],
        serde_json::json!(["</interaction_prompt>", "</answer>"])
    );
    assert_eq!(agent_calls[0]["max_tokens"], 1024);
    assert_eq!(agent_calls[0]["temperature"], 0.0);
    assert_eq!(agent_calls[0]["messages"][0]["content"], REFERENCE_SYSTEM);
    assert_eq!(
        agent_calls[1]["messages"][2],
        serde_json::json!({"role": "assistant", "content": first_turn})
    );
    assert_eq!(
        agent_calls[1]["messages"][3],
        serde_json::json!({"role": "user", "content": format!("<interaction_response>\n{reply}\n</interaction_response>")})
    );
    assert_eq!(
        env_calls[0]["messages"],
        serde_json::json!([{"role": "system", "content": ENV_SYSTEM_MESSAGE}, {"role": "user", "content": QUESTION}])
    );
}

#[test]
fn an_environment_that_rejects_the_key_fails_the_episode_cleanly() {
    let server = ScriptedServer::start_with(|request| serve(request, 401));
    let mut agent = RemoteAgent::new(client(&server, "agent"), SamplingParams::default());
    let env = client(&server, "env");
    let t = &run_episodes(&mut agent, &env, &[QUESTION], &EpisodeConfig::inference())[0];
    assert_eq!(t.stop_reason, StopReason::EnvFailure);
    assert!(
        t.error
            .as_deref()
            .unwrap()
            .contains("authentication failed"),
        "{:?}",
        t.error
    );
    assert!(!t.response_text.contains("Incorrect API key"));
    // One agent turn, one environment request (401 is not retried), no second agent turn.
    assert_eq!(server.count(), 2);
    assert_eq!(env.stats().failed(), 1);
}

#[test]
fn an_unreachable_agent_endpoint_is_an_agent_failure() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = ClientConfig {
        retry: RetryPolicy::none(),
        connect_timeout_secs: 0.5,
        ..ClientConfig::new(format!("http://127.0.0.1:{port}/v1"), "agent")
    };
    let mut agent = RemoteAgent::new(
        OpenAiClient::with_api_key(config, None).unwrap(),
        SamplingParams::default(),
    );
    let server = ScriptedServer::start(vec![]);
    let env = client(&server, "env");
    let t = &run_episodes(&mut agent, &env, &[QUESTION], &EpisodeConfig::default())[0];
    assert_eq!(t.stop_reason, StopReason::AgentFailure);
    assert!(
        t.error
            .as_deref()
            .unwrap()
            .starts_with("agent endpoint failed: connection"),
        "{:?}",
        t.error
    );
    assert_eq!(server.count(), 0);
}

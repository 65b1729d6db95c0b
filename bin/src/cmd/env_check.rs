//! `prompt-r1 env-check`: one short request to the environment LLM, reporting latency and the
//! reply, or exactly what is wrong.

use std::time::Instant;

use anyhow::anyhow;
use env::{
    ChatMessage, ClientConfig, FailureKind, OpenAiClient, RetryPolicy, SamplingParams, DEFAULT_API_KEY_ENV,
};
use serde_json::json;

/// The question sent (also `eval`'s probe); short so that the check costs next to nothing.
pub(crate) const PROBE: &str = "Reply with the single word: OK";
/// The most tokens the check's reply may take.
const PROBE_TOKENS: u32 = 16;

/// Send one short request to an OpenAI-compatible server and report the latency and reply, or
/// what is wrong (unreachable, bad key, unknown model, timeout, malformed reply).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Base URL of the API, e.g. `https://api.openai.com/v1` or `http://127.0.0.1:8000/v1`.
    #[arg(long, value_name = "URL")]
    pub env_url: String,
    /// Model name to ask.
    #[arg(long, value_name = "NAME")]
    pub env_model: String,
    /// Environment variable holding the API key (the key itself is never taken from a flag).
    #[arg(long, value_name = "VAR", default_value = DEFAULT_API_KEY_ENV)]
    pub api_key_env: String,
    /// Seconds to wait for the reply.
    #[arg(long, value_name = "S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub timeout: f64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A number of seconds above 0.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() => Ok(secs),
        _ => Err(format!("{text:?} is not a number of seconds above 0")),
    }
}

/// Runs the check; fails (exit status 1) when the server cannot answer.
pub fn run(args: Args) -> anyhow::Result<()> {
    let config = ClientConfig {
        api_key_env: args.api_key_env.clone(),
        connect_timeout_secs: args.timeout.min(10.0),
        read_timeout_secs: args.timeout,
        retry: RetryPolicy::none(),
        max_concurrency: 1,
        ..ClientConfig::new(&args.env_url, &args.env_model)
    };
    let client = OpenAiClient::new(config)
        .map_err(|err| report_failure(&args, None, &err.to_string(), "config"))?;
    let mut started = Instant::now();
    // A short reply, so that a slow server or a model that would think at length answers within
    // the timeout; a server that refuses `max_tokens` (some reasoning models want
    // `max_completion_tokens`) is asked again without it.
    let probe = [ChatMessage::user(PROBE)];
    let result = match client.chat(&probe, &SamplingParams { max_tokens: Some(PROBE_TOKENS), ..SamplingParams::default() }) {
        Err(err) if err.kind() == FailureKind::Rejected => {
            started = Instant::now();
            client.chat(&probe, &SamplingParams::default())
        }
        result => result,
    };
    let latency_ms = started.elapsed().as_millis();
    let reply = match result {
        Ok(reply) => reply,
        Err(err) => {
            let kind = serde_json::to_value(err.kind())?;
            let kind = kind.as_str().unwrap_or("unknown").to_string();
            return Err(report_failure(
                &args,
                Some((&client, latency_ms)),
                &err.to_string(),
                &kind,
            ));
        }
    };
    let model = reply
        .model
        .clone()
        .unwrap_or_else(|| args.env_model.clone());
    if args.json {
        let report = json!({
            "ok": true,
            "endpoint": client.endpoint(),
            "model": model,
            "latency_ms": latency_ms,
            "reply": reply.content,
            "finish_reason": reply.finish_reason,
            "usage": reply.usage,
            "api_key_env": args.api_key_env,
            "api_key_set": client.has_api_key(),
        });
        println!("{report}");
    } else {
        let key = if client.has_api_key() {
            "set"
        } else {
            "not set"
        };
        let text = reply.content.trim();
        println!("ok: {} answered in {latency_ms} ms", client.endpoint());
        println!("model: {model}");
        println!("api key: ${} {key}", args.api_key_env);
        if text.is_empty() {
            println!("reply: (empty)");
        } else {
            println!("reply: {text}");
        }
    }
    Ok(())
}

/// Prints the JSON failure report when asked for, and returns the error for the exit status.
fn report_failure(
    args: &Args,
    sent: Option<(&OpenAiClient, u128)>,
    message: &str,
    kind: &str,
) -> anyhow::Error {
    if args.json {
        let report = json!({
            "ok": false,
            "endpoint": sent.map(|(client, _)| client.endpoint()),
            "model": args.env_model,
            "latency_ms": sent.map(|(_, ms)| ms),
            "error": message,
            "kind": kind,
            "api_key_env": args.api_key_env,
            "api_key_set": sent.map(|(client, _)| client.has_api_key()),
        });
        println!("{report}");
    }
    anyhow!("environment check failed: {message}")
}

//! A blocking JSON client for one rollout worker, and the parsing of its replies.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use env::http::{error_message, is_loopback};
use env::ApiKey;
use serde::Deserialize;

/// How long connecting to a worker may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The workers' API key, in the environment variable `var`: an error when the variable is
/// unset, empty or not UTF-8 (a run that names a key variable means to send a key).
pub(crate) fn api_key_from_env(var: &str) -> Result<ApiKey, model::SettingError> {
    let unset = || format!("rollout.servers.api_key_env names ${var}, which is unset or empty");
    match std::env::var(var) {
        Ok(key) => ApiKey::new(key).ok_or_else(|| unset().into()),
        Err(std::env::VarError::NotPresent) => Err(unset().into()),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("${var} (rollout.servers.api_key_env) is not valid UTF-8").into()),
    }
}

/// Why a request to a worker failed, its message naming the URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The worker is unusable (no connection, a timeout, a 5xx, 408 or 429, a malformed reply):
    /// another worker may take the request.
    Retry(String),
    /// The request itself is at fault (any other 4xx): it would fail on every worker.
    Fatal(String),
}

impl Failure {
    pub fn message(&self) -> &str {
        match self {
            Failure::Retry(m) | Failure::Fatal(m) => m,
        }
    }
}

/// One worker's connection settings: its base URL (no final `/` or `/v1`) and key.
#[derive(Clone)]
pub(crate) struct Worker {
    base: String,
    http: ureq::Agent,
    key: Option<Arc<ApiKey>>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker").field("base", &self.base).field("key", &self.key).finish()
    }
}

impl Worker {
    pub fn new(base: String, key: Option<Arc<ApiKey>>) -> Self {
        let mut builder = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .max_redirects_will_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .user_agent(concat!("prompt-r1-trainer/", env!("CARGO_PKG_VERSION")));
        if is_loopback(&base) {
            builder = builder.proxy(None);
        }
        Self { http: ureq::Agent::new_with_config(builder.build()), base, key }
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// POSTs the JSON `body` to `route` (e.g. `/v1/completions`); the reply's body on a 2xx.
    pub fn post(&self, route: &str, body: &[u8], timeout: Duration) -> Result<String, Failure> {
        let url = format!("{}{route}", self.base);
        let mut request = self
            .http
            .post(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .header("content-type", "application/json")
            .header("accept", "application/json");
        if let Some(key) = &self.key {
            request = request.header("authorization", key.bearer());
        }
        read_reply(&url, request.send(body))
    }

    /// GETs `route`; the reply's body on a 2xx.
    pub fn get(&self, route: &str, timeout: Duration) -> Result<String, Failure> {
        let url = format!("{}{route}", self.base);
        let mut request = self
            .http
            .get(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .header("accept", "application/json");
        if let Some(key) = &self.key {
            request = request.header("authorization", key.bearer());
        }
        read_reply(&url, request.call())
    }
}

fn read_reply(url: &str, sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<String, Failure> {
    let mut response = sent.map_err(|e| Failure::Retry(format!("{url}: {}", describe(&e))))?;
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_string();
    if (200..300).contains(&status) {
        return body.map_err(|e| Failure::Retry(format!("{url}: the reply could not be read ({})", describe(&e))));
    }
    let message = error_message(&body.unwrap_or_default());
    let message = format!("{url}: HTTP {status}{}", if message.is_empty() { String::new() } else { format!(": {message}") });
    Err(if status == 408 || status == 429 || status >= 500 { Failure::Retry(message) } else { Failure::Fatal(message) })
}

fn describe(err: &ureq::Error) -> String {
    match err {
        ureq::Error::Timeout(which) => format!("timed out ({which:?})"),
        ureq::Error::ConnectionFailed => "could not connect".into(),
        ureq::Error::HostNotFound => "host not found".into(),
        other => other.to_string(),
    }
}

/// A completion's sampled ids with the log-prob of each, and the prompt tokens the worker ran
/// through prefill for it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Completion {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// `usage.prompt_tokens` less `usage.prompt_tokens_details.cached_tokens` (the prompt
    /// tokens the worker's prefix cache held): all of the prompt where the worker reports no
    /// cached tokens (vLLM without `--enable-prompt-tokens-details`), 0 where it reports no usage.
    pub prefilled: u64,
}

#[derive(Deserialize)]
struct CompletionReply {
    choices: Vec<CompletionChoice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl Usage {
    fn prefilled(&self) -> u64 {
        let cached = self.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens).unwrap_or(0);
        self.prompt_tokens.saturating_sub(cached)
    }
}

#[derive(Deserialize)]
struct CompletionChoice {
    #[serde(default)]
    token_ids: Option<Vec<i64>>,
    #[serde(default)]
    logprobs: Option<ChoiceLogprobs>,
}

#[derive(Deserialize)]
struct ChoiceLogprobs {
    token_logprobs: Vec<Option<f64>>,
}

/// Parses a `/v1/completions` reply to a token-id request and checks it against the request:
/// one log-prob per id, ids below `vocab_size`, between 1 and `max_tokens` of them, and a stop
/// id (of `stop_ids`) only last. The message says what is wrong.
pub(crate) fn parse_completion(body: &str, max_tokens: usize, vocab_size: usize, stop_ids: &[u32]) -> Result<Completion, String> {
    let reply: CompletionReply = serde_json::from_str(body).map_err(|e| format!("not a completion reply ({e})"))?;
    let prefilled = reply.usage.as_ref().map_or(0, Usage::prefilled);
    let choice = reply.choices.into_iter().next().ok_or("the reply has no choice")?;
    let ids = choice
        .token_ids
        .ok_or("the choice has no `token_ids` (the worker must support `return_token_ids`)")?;
    let logprobs = choice
        .logprobs
        .ok_or("the choice has no `logprobs` (the worker must support `logprobs`)")?
        .token_logprobs;
    if ids.len() != logprobs.len() {
        return Err(format!("{} token ids but {} log-probs", ids.len(), logprobs.len()));
    }
    if ids.is_empty() && max_tokens > 0 {
        return Err("no token was generated".into());
    }
    if ids.len() > max_tokens {
        return Err(format!("{} tokens generated, over max_tokens {max_tokens}", ids.len()));
    }
    let ids: Vec<u32> = ids
        .iter()
        .map(|&id| u32::try_from(id).ok().filter(|&id| (id as usize) < vocab_size).ok_or(id))
        .collect::<Result<_, _>>()
        .map_err(|id| format!("token id {id} is outside the vocabulary of {vocab_size}"))?;
    if let Some(k) = ids[..ids.len().saturating_sub(1)].iter().position(|id| stop_ids.contains(id)) {
        return Err(format!("stop token {} at position {k} is not the last of {} tokens", ids[k], ids.len()));
    }
    let logprobs: Vec<f32> = logprobs
        .iter()
        .enumerate()
        .map(|(k, lp)| match lp {
            Some(lp) if lp.is_finite() && *lp <= 1e-3 => Ok(*lp as f32),
            Some(lp) => Err(format!("the log-prob of token {k} is {lp}")),
            None => Err(format!("the log-prob of token {k} is null")),
        })
        .collect::<Result<_, _>>()?;
    Ok(Completion { ids, logprobs, prefilled })
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ModelEntry {
    pub id: String,
    #[serde(default)]
    pub root: Option<String>,
    #[serde(default)]
    pub parent: Option<String>,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

/// The entries of a `GET /v1/models` reply.
pub(crate) fn parse_models(body: &str) -> Result<Vec<ModelEntry>, String> {
    serde_json::from_str::<ModelList>(body)
        .map(|list| list.data)
        .map_err(|e| format!("not a model list ({e})"))
}

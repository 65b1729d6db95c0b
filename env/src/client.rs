//! The blocking OpenAI-compatible chat client: timeouts, retries with backoff, concurrency and
//! rate caps, and failure counters.

use std::fmt;
use std::io;
use std::time::{Duration, Instant};

use crate::backoff::{parse_retry_after, retry_wait};
use crate::chat::{
    parse_chat_reply, parse_completion_reply, ChatMessage, ChatReply, ChatRequest,
    CompletionRequest, SamplingParams,
};
use crate::config::ClientConfig;
use crate::error::EnvError;
use crate::http::{error_message, excerpt, is_loopback};
use crate::secret::ApiKey;
use crate::stats::{ClientStats, StatsSnapshot};
use crate::throttle::{RateLimiter, Semaphore};

/// A blocking client for `POST {base_url}/chat/completions` (and `…/completions` for raw text
/// prompts). `Send + Sync`: share one client between threads so that its concurrency cap, rate
/// cap and counters cover them all.
pub struct OpenAiClient {
    config: ClientConfig,
    endpoint: String,
    completions_endpoint: String,
    api_key: Option<ApiKey>,
    http: ureq::Agent,
    in_flight: Semaphore,
    limiter: Option<RateLimiter>,
    stats: ClientStats,
    on_retry: Option<Box<dyn Fn(&RetryNotice<'_>) + Send + Sync>>,
}

/// A failed attempt about to be retried: what failed, how long the client waits, and which
/// attempt follows. Given to the hook of [`OpenAiClient::on_retry`].
#[derive(Debug, Clone, Copy)]
pub struct RetryNotice<'a> {
    /// The URL the attempt went to.
    pub url: &'a str,
    /// Why the attempt failed.
    pub error: &'a EnvError,
    /// The wait before the next attempt.
    pub wait: Duration,
    /// The attempt that follows (2 for the first retry).
    pub next_attempt: u32,
    /// The most attempts a call makes.
    pub max_attempts: u32,
}

impl fmt::Display for RetryNotice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; retrying in {:.1} s (attempt {} of {})",
            self.error,
            self.wait.as_secs_f64(),
            self.next_attempt,
            self.max_attempts
        )
    }
}

/// One failed request and whether another may follow.
struct FailedAttempt {
    error: EnvError,
    retryable: bool,
    retry_after: Option<Duration>,
}

impl OpenAiClient {
    /// A client for `config`, with the API key read from the variable `config.api_key_env`
    /// (unset or empty: requests carry no `Authorization` header, as local servers expect).
    pub fn new(config: ClientConfig) -> Result<Self, EnvError> {
        config.validate()?;
        let api_key = ApiKey::from_env(&config.api_key_env)?;
        Self::with_api_key(config, api_key)
    }

    /// A client with an explicitly given key (for embedding; the CLI always uses [`Self::new`]).
    pub fn with_api_key(config: ClientConfig, api_key: Option<ApiKey>) -> Result<Self, EnvError> {
        config.validate()?;
        let base = config.base_url.trim().trim_end_matches('/');
        let root = base.strip_suffix("/chat/completions").unwrap_or(base);
        let endpoint = format!("{root}/chat/completions");
        let completions_endpoint = format!("{root}/completions");
        let mut builder = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .max_redirects_will_error(false)
            .timeout_connect(Some(config.connect_timeout()))
            .timeout_send_request(Some(config.read_timeout()))
            .timeout_send_body(Some(config.read_timeout()))
            .timeout_recv_response(Some(config.read_timeout()))
            .timeout_recv_body(Some(config.read_timeout()))
            .user_agent(concat!("prompt-r1/", env!("CARGO_PKG_VERSION")));
        if is_loopback(&endpoint) {
            builder = builder.proxy(None);
        }
        let http = ureq::Agent::new_with_config(builder.build());
        Ok(Self {
            in_flight: Semaphore::new(config.max_concurrency),
            limiter: config.requests_per_minute.map(RateLimiter::per_minute),
            stats: ClientStats::default(),
            on_retry: None,
            config,
            endpoint,
            completions_endpoint,
            api_key,
            http,
        })
    }

    /// Calls `hook` before each retry's wait (for instance to tell a user at a terminal why
    /// nothing happens yet); without it retries are silent, counted in [`Self::stats`].
    pub fn on_retry(mut self, hook: impl Fn(&RetryNotice<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Box::new(hook));
        self
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The full URL requests go to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether a key was found.
    pub fn has_api_key(&self) -> bool {
        self.api_key.is_some()
    }

    /// The counters so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// The URL text completions go to.
    pub fn completions_endpoint(&self) -> &str {
        &self.completions_endpoint
    }

    /// Sends one chat completion request, retrying transient failures (connection errors,
    /// timeouts, HTTP 408, 409, 429 and 5xx) with jittered exponential backoff or the server's
    /// `Retry-After`. Other errors return at once.
    pub fn chat(
        &self,
        messages: &[ChatMessage],
        params: &SamplingParams,
    ) -> Result<ChatReply, EnvError> {
        let request = ChatRequest {
            model: &self.config.model,
            messages,
            params,
            stream: false,
        };
        self.post(&self.endpoint, &request, parse_chat_reply)
    }

    /// Sends one text completion request (`…/completions`): `prompt` goes to the model as it
    /// is, without a chat template; the reply's `content` is the generated text. Retries as
    /// [`Self::chat`].
    pub fn complete_text(
        &self,
        prompt: &str,
        params: &SamplingParams,
    ) -> Result<ChatReply, EnvError> {
        let request = CompletionRequest {
            model: &self.config.model,
            prompt,
            params,
            stream: false,
        };
        self.post(&self.completions_endpoint, &request, parse_completion_reply)
    }

    /// Posts `request` to `url` with retries and parses a 2xx body with `parse`.
    fn post<R: serde::Serialize>(
        &self,
        url: &str,
        request: &R,
        parse: fn(&str) -> Result<ChatReply, String>,
    ) -> Result<ChatReply, EnvError> {
        self.stats.call_started();
        let body = match serde_json::to_vec(request) {
            Ok(body) => body,
            Err(err) => {
                let error = EnvError::Config(format!("cannot encode the request: {err}"));
                self.stats.call_failed(error.kind());
                return Err(error);
            }
        };
        let deadline = Instant::now() + self.config.call_timeout();
        let mut attempt = 1;
        let mut last: Option<EnvError> = None;
        loop {
            let Some(permit) = self.wait_for_caps(deadline) else {
                let error = self.past_deadline(url, attempt - 1, last.as_ref());
                self.stats.call_failed(error.kind());
                return Err(error);
            };
            self.stats.request_sent();
            let outcome = self.send_once(url, &body, parse, deadline);
            drop(permit);
            let failed = match outcome {
                Ok(reply) => {
                    self.stats.call_succeeded();
                    return Ok(reply);
                }
                Err(failed) => failed,
            };
            let kind = failed.error.kind();
            self.stats.attempt_failed(kind);
            if failed.retryable && attempt < self.config.retry.max_attempts {
                let wait = retry_wait(
                    &self.config.retry,
                    attempt,
                    failed.retry_after,
                    rand::random::<f64>(),
                );
                if Instant::now() + wait < deadline {
                    self.stats.retrying(wait);
                    if let Some(hook) = &self.on_retry {
                        hook(&RetryNotice {
                            url,
                            error: &failed.error.clone().with_attempts(attempt),
                            wait,
                            next_attempt: attempt + 1,
                            max_attempts: self.config.retry.max_attempts,
                        });
                    }
                    std::thread::sleep(wait);
                    attempt += 1;
                    last = Some(failed.error);
                    continue;
                }
                let error = self.past_deadline(url, attempt, Some(&failed.error));
                self.stats.call_failed(error.kind());
                return Err(error);
            }
            self.stats.call_failed(kind);
            return Err(failed.error.with_attempts(attempt));
        }
    }

    /// Waits for the rate cap and a concurrency slot, or gives `None` when either wait would
    /// pass `deadline`.
    fn wait_for_caps(&self, deadline: Instant) -> Option<crate::throttle::Permit<'_>> {
        if let Some(limiter) = &self.limiter {
            if !limiter.wait_until(deadline) {
                return None;
            }
        }
        self.in_flight.acquire_until(deadline)
    }

    /// The error of a call stopped by its deadline after `attempts` attempts, the last of which
    /// failed with `last` (if any was sent).
    fn past_deadline(&self, url: &str, attempts: u32, last: Option<&EnvError>) -> EnvError {
        let mut detail = format!(
            "the call's deadline of {} s passed (call_timeout_secs, --env-call-timeout; each \
             attempt has read_timeout_secs, --env-timeout)",
            self.config.call_timeout_secs
        );
        match last {
            Some(error) => detail.push_str(&format!("; the last attempt: {error}")),
            None => detail.push_str(" before a request could start (concurrency or rate cap)"),
        }
        EnvError::Timeout {
            url: url.to_string(),
            detail,
            attempts,
        }
    }

    /// One attempt, cut at `deadline` whatever its own timeouts allow.
    fn send_once(
        &self,
        url: &str,
        body: &[u8],
        parse: fn(&str) -> Result<ChatReply, String>,
        deadline: Instant,
    ) -> Result<ChatReply, FailedAttempt> {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut request = self
            .http
            .post(url)
            .config()
            .timeout_global(Some(left))
            .build()
            .header("content-type", "application/json")
            .header("accept", "application/json");
        if let Some(key) = &self.api_key {
            request = request.header("authorization", key.bearer());
        }
        let mut response = request
            .send(body)
            .map_err(|err| self.transport_failure(url, err))?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|value| value.to_str().ok())
            .and_then(parse_retry_after);
        let location = response
            .headers()
            .get("location")
            .and_then(|value| value.to_str().ok())
            .map(str::to_string);
        let body = match response.body_mut().read_to_vec() {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(err) if (200..300).contains(&status) => {
                return Err(self.transport_failure(url, err))
            }
            Err(_) => String::new(),
        };
        if (200..300).contains(&status) {
            return parse(&body).map_err(|detail| FailedAttempt {
                error: EnvError::Malformed {
                    url: url.to_string(),
                    detail,
                    attempts: 1,
                },
                retryable: false,
                retry_after: None,
            });
        }
        let mut message = error_message(&body);
        if message.is_empty() {
            message = http_reason(status).to_string();
        }
        let url = url.to_string();
        let (error, retryable) = match status {
            401 | 403 => (
                EnvError::Unauthorized {
                    url,
                    status,
                    message,
                    key_var: self.config.api_key_env.clone(),
                    key_set: self.api_key.is_some(),
                },
                false,
            ),
            404 => (
                EnvError::NotFound {
                    url,
                    model: self.config.model.clone(),
                    message,
                },
                false,
            ),
            300..=399 => {
                let target = location.unwrap_or_else(|| "an unknown location".to_string());
                let message =
                    format!("unexpected redirect to {target}; use the final URL as the base URL");
                (
                    EnvError::Http {
                        url,
                        status,
                        message,
                        attempts: 1,
                    },
                    false,
                )
            }
            408 | 409 | 429 | 500..=599 => (
                EnvError::Http {
                    url,
                    status,
                    message,
                    attempts: 1,
                },
                true,
            ),
            _ => (
                EnvError::Http {
                    url,
                    status,
                    message,
                    attempts: 1,
                },
                false,
            ),
        };
        Err(FailedAttempt {
            error,
            retryable,
            retry_after,
        })
    }

    fn transport_failure(&self, url: &str, err: ureq::Error) -> FailedAttempt {
        let url = url.to_string();
        let timeout = |detail: String| EnvError::Timeout {
            url: url.clone(),
            detail,
            attempts: 1,
        };
        let connection = |detail: String| EnvError::Connection {
            url: url.clone(),
            detail,
            attempts: 1,
        };
        let read_secs = self.config.read_timeout_secs;
        let (error, retryable) = match err {
            ureq::Error::Timeout(ureq::Timeout::Global) => (
                timeout(format!(
                    "the call's deadline of {} s passed during an attempt (call_timeout_secs, \
                     --env-call-timeout)",
                    self.config.call_timeout_secs
                )),
                false,
            ),
            ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => (
                timeout(format!(
                    "no connection within {} s",
                    self.config.connect_timeout_secs
                )),
                true,
            ),
            ureq::Error::Timeout(_) => (
                timeout(format!("no complete reply within {read_secs} s")),
                true,
            ),
            ureq::Error::Io(io)
                if matches!(
                    io.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                (
                    timeout(format!("no complete reply within {read_secs} s")),
                    true,
                )
            }
            ureq::Error::BodyExceedsLimit(limit) => (
                EnvError::Malformed {
                    url: url.clone(),
                    detail: format!(
                        "the reply is larger than {:.0} MiB, the most this client reads",
                        limit as f64 / (1024.0 * 1024.0)
                    ),
                    attempts: 1,
                },
                false,
            ),
            ureq::Error::Io(io) => (connection(describe_io(&io)), true),
            ureq::Error::HostNotFound => (connection("host not found".to_string()), true),
            ureq::Error::ConnectionFailed => (connection("could not connect".to_string()), true),
            ureq::Error::Protocol(err) => (connection(format!("invalid HTTP reply ({err})")), true),
            ureq::Error::BadUri(_) | ureq::Error::Http(_) | ureq::Error::InvalidProxyUrl => (
                EnvError::Config(format!("cannot build a request for {url}: {err}")),
                false,
            ),
            other => (connection(excerpt(&other.to_string())), false),
        };
        FailedAttempt {
            error,
            retryable,
            retry_after: None,
        }
    }
}

impl fmt::Debug for OpenAiClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiClient")
            .field("endpoint", &self.endpoint)
            .field("model", &self.config.model)
            .field("api_key_env", &self.config.api_key_env)
            .field("api_key", &self.api_key)
            .finish_non_exhaustive()
    }
}

fn describe_io(err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::ConnectionRefused => {
            "connection refused (is the server running?)".to_string()
        }
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe => {
            format!("the server closed the connection without a complete reply ({err})")
        }
        _ => err.to_string(),
    }
}

fn http_reason(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "no explanation given",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_is_derived_from_the_base_url() {
        let client =
            OpenAiClient::with_api_key(ClientConfig::new("http://127.0.0.1:9/v1/", "m"), None)
                .unwrap();
        assert_eq!(client.endpoint(), "http://127.0.0.1:9/v1/chat/completions");
        let client = OpenAiClient::with_api_key(
            ClientConfig::new("http://h/v1/chat/completions", "m"),
            None,
        )
        .unwrap();
        assert_eq!(client.endpoint(), "http://h/v1/chat/completions");
        assert_eq!(client.completions_endpoint(), "http://h/v1/completions");
    }

    #[test]
    fn debug_output_hides_the_key() {
        let key = ApiKey::new("sk-test-hidden-value");
        let client =
            OpenAiClient::with_api_key(ClientConfig::new("http://h/v1", "m"), key).unwrap();
        let shown = format!("{client:?}");
        assert!(!shown.contains("sk-test-hidden-value"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn client_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<OpenAiClient>();
    }
}

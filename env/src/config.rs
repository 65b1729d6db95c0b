//! Settings of the environment client: where to send requests, timeouts, retries and caps.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::chat::SamplingParams;
use crate::error::EnvError;

/// The environment variable the API key is read from unless configured otherwise.
pub const DEFAULT_API_KEY_ENV: &str = "OPENAI_API_KEY";

/// Configuration of an [`OpenAiClient`](crate::OpenAiClient). Holds the *name* of the API-key
/// variable, never the key, so it can be written to a config file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// Base URL of the API, e.g. `https://api.openai.com/v1` or `http://127.0.0.1:8000/v1`;
    /// requests go to `{base_url}/chat/completions`.
    pub base_url: String,
    /// Model name sent with every request.
    pub model: String,
    /// Environment variable holding the API key (unset or empty: no `Authorization` header).
    pub api_key_env: String,
    /// Seconds allowed for connecting (DNS, TCP and TLS).
    pub connect_timeout_secs: f64,
    /// Seconds allowed for sending the request and for receiving the reply headers, and again
    /// for the reply body: one attempt.
    pub read_timeout_secs: f64,
    /// Seconds one call may take in all: its attempts, the waits between them (backoff and
    /// `Retry-After`) and the waits for the concurrency and rate caps. An attempt is cut at the
    /// deadline and no retry starts that would begin past it.
    pub call_timeout_secs: f64,
    /// When and how often failed requests are retried.
    pub retry: RetryPolicy,
    /// Most requests in flight at once through one client.
    pub max_concurrency: usize,
    /// Most requests started per minute (retries included); `None` for no cap.
    pub requests_per_minute: Option<u32>,
    /// Sampling parameters used when the client serves as the environment.
    pub sampling: SamplingParams,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            base_url: String::new(),
            model: String::new(),
            api_key_env: DEFAULT_API_KEY_ENV.to_string(),
            connect_timeout_secs: 10.0,
            read_timeout_secs: 300.0,
            call_timeout_secs: 900.0,
            retry: RetryPolicy::default(),
            max_concurrency: 32,
            requests_per_minute: None,
            sampling: SamplingParams::default(),
        }
    }
}

impl ClientConfig {
    /// Defaults for everything but the server and the model.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            ..Self::default()
        }
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.connect_timeout_secs)
    }

    /// The read timeout.
    pub fn read_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.read_timeout_secs)
    }

    /// The deadline of one call, retries included.
    pub fn call_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.call_timeout_secs)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), EnvError> {
        let bad = |message: String| Err(EnvError::Config(message));
        let url = self.base_url.trim();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return bad(format!(
                "base URL {url:?} must start with http:// or https://"
            ));
        }
        match url.parse::<ureq::http::Uri>() {
            Err(e) => return bad(format!("base URL {url:?} is not a URL: {e}")),
            Ok(uri) if uri.host().is_none_or(str::is_empty) => return bad(format!("base URL {url:?} names no host")),
            Ok(uri) => {
                let written = uri.authority().and_then(|a| written_port(a.as_str()));
                if let Some(port) = written.filter(|p| !matches!(p.parse::<u16>(), Ok(1..))) {
                    return bad(format!("base URL {url:?}: {port:?} is not a port (1 to 65535)"));
                }
            }
        }
        if self.model.trim().is_empty() {
            return bad("model name is empty".to_string());
        }
        self.validate_limits()
    }

    /// Checks every field but the server and the model (which a run's settings may leave to
    /// the command line): key variable, timeouts, retries, caps and sampling.
    pub fn validate_limits(&self) -> Result<(), EnvError> {
        let bad = |message: String| Err(EnvError::Config(message));
        if self.api_key_env.is_empty() || self.api_key_env.contains(['=', '\0']) {
            return bad(format!(
                "{:?} is not a valid environment variable name",
                self.api_key_env
            ));
        }
        check_seconds("connect timeout", self.connect_timeout_secs, false)?;
        check_seconds("read timeout", self.read_timeout_secs, false)?;
        check_seconds("call timeout", self.call_timeout_secs, false)?;
        self.retry.validate()?;
        if self.max_concurrency == 0 {
            return bad("max concurrency must be at least 1".to_string());
        }
        if self.requests_per_minute == Some(0) {
            return bad("requests per minute must be at least 1 (or unset)".to_string());
        }
        self.sampling.validate().or_else(|e| bad(format!("sampling: {e}")))
    }
}

/// The port as written in a URL's `authority` (`user@host:port`, `[v6]:port`), if any.
fn written_port(authority: &str) -> Option<&str> {
    let host_port = authority.rsplit('@').next()?;
    if host_port.ends_with(']') {
        return None;
    }
    host_port.rsplit_once(':').map(|(_, port)| port)
}

/// Retries with jittered exponential backoff.
///
/// Retry number `n` (1-based) waits a random time in `[d/2, d]` with
/// `d = min(max_delay, base_delay · 2^(n-1))`, unless the server sent `Retry-After`, which is
/// honoured (capped at `max_retry_after_secs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Requests sent at most for one call, the first included (1 = no retries).
    pub max_attempts: u32,
    /// Backoff before the first retry, in seconds.
    pub base_delay_secs: f64,
    /// Longest backoff, in seconds.
    pub max_delay_secs: f64,
    /// Longest wait a server's `Retry-After` can ask for, in seconds.
    pub max_retry_after_secs: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 6,
            base_delay_secs: 1.0,
            max_delay_secs: 30.0,
            max_retry_after_secs: 120.0,
        }
    }
}

impl RetryPolicy {
    /// No retries: every failure is reported at once.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<(), EnvError> {
        if self.max_attempts == 0 {
            return Err(EnvError::Config(
                "max attempts must be at least 1".to_string(),
            ));
        }
        check_seconds("base retry delay", self.base_delay_secs, true)?;
        check_seconds("max retry delay", self.max_delay_secs, true)?;
        check_seconds("max Retry-After wait", self.max_retry_after_secs, true)
    }
}

fn check_seconds(what: &str, secs: f64, zero_ok: bool) -> Result<(), EnvError> {
    let ok = secs.is_finite() && secs < 1e9 && (secs > 0.0 || (zero_ok && secs == 0.0));
    if ok {
        Ok(())
    } else {
        Err(EnvError::Config(format!(
            "{what} of {secs} s is out of range"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        ClientConfig::new("http://127.0.0.1:8000/v1", "m")
            .validate()
            .unwrap();
    }

    #[test]
    fn the_base_url_needs_a_host_and_a_port_in_range() {
        for url in ["http://127.0.0.1:99999/v1", "http://h:0/v1", "https://h:/v1", "http://h:80x/v1", "http://[::1]:70000"] {
            let err = ClientConfig::new(url, "m").validate().unwrap_err().to_string();
            assert!(err.contains("is not a port (1 to 65535)"), "{url}: {err}");
        }
        let err = ClientConfig::new("http:///v1", "m").validate().unwrap_err().to_string();
        assert!(err.contains("http:///v1"), "{err}");
        for url in ["http://127.0.0.1:65535/v1", "https://api.openai.com/v1", "http://[::1]:8000/v1", "http://[::1]/v1", "http://user:pw@h:8080/v1"] {
            ClientConfig::new(url, "m").validate().unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    /// Sampling values outside OpenAI's ranges are refused before any call; the edges pass.
    #[test]
    fn sampling_out_of_range_is_named() {
        let with = |sampling: SamplingParams| ClientConfig { sampling, ..ClientConfig::new("http://h/v1", "m") }.validate();
        for (bad, named) in [
            (SamplingParams { temperature: Some(-3.0), ..Default::default() }, "temperature -3"),
            (SamplingParams { temperature: Some(f64::NAN), ..Default::default() }, "temperature NaN"),
            (SamplingParams { top_p: Some(7.0), ..Default::default() }, "top_p 7"),
            (SamplingParams { top_p: Some(0.0), ..Default::default() }, "top_p 0"),
            (SamplingParams { max_tokens: Some(0), ..Default::default() }, "max_tokens"),
        ] {
            let err = with(bad).unwrap_err().to_string();
            assert!(err.contains("sampling: ") && err.contains(named), "{named}: {err}");
        }
        with(SamplingParams { temperature: Some(0.0), top_p: Some(1.0), max_tokens: Some(1), ..Default::default() }).unwrap();
        with(SamplingParams { temperature: Some(2.0), ..Default::default() }).unwrap();
    }

    #[test]
    fn bad_fields_are_named() {
        let base = ClientConfig::new("http://h/v1", "m");
        let cases: Vec<(ClientConfig, &str)> = vec![
            (
                ClientConfig {
                    base_url: "h/v1".into(),
                    ..base.clone()
                },
                "http://",
            ),
            (
                ClientConfig {
                    model: " ".into(),
                    ..base.clone()
                },
                "model",
            ),
            (
                ClientConfig {
                    read_timeout_secs: 0.0,
                    ..base.clone()
                },
                "read timeout",
            ),
            (
                ClientConfig {
                    connect_timeout_secs: f64::NAN,
                    ..base.clone()
                },
                "connect timeout",
            ),
            (
                ClientConfig {
                    call_timeout_secs: -1.0,
                    ..base.clone()
                },
                "call timeout",
            ),
            (
                ClientConfig {
                    max_concurrency: 0,
                    ..base.clone()
                },
                "concurrency",
            ),
            (
                ClientConfig {
                    requests_per_minute: Some(0),
                    ..base.clone()
                },
                "per minute",
            ),
            (
                ClientConfig {
                    api_key_env: "A=B".into(),
                    ..base.clone()
                },
                "variable",
            ),
            (
                ClientConfig {
                    retry: RetryPolicy {
                        max_attempts: 0,
                        ..RetryPolicy::default()
                    },
                    ..base
                },
                "attempts",
            ),
        ];
        for (config, word) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(word), "{err}");
        }
    }

    #[test]
    fn reads_a_partial_config_file() {
        let config: ClientConfig = serde_json::from_str(
            r#"{"base_url":"http://h/v1","model":"m","retry":{"max_attempts":2}}"#,
        )
        .unwrap();
        assert_eq!(config.retry.max_attempts, 2);
        assert_eq!(
            config.retry.max_delay_secs,
            RetryPolicy::default().max_delay_secs
        );
        assert_eq!(config.api_key_env, DEFAULT_API_KEY_ENV);
        assert!(serde_json::from_str::<ClientConfig>(r#"{"api_key":"sk-x"}"#).is_err());
    }
}

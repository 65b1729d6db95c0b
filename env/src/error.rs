//! Errors of the environment client and the kinds they are counted under.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Why a request to an OpenAI-compatible server failed, with the number of attempts made.
///
/// The text never contains the API key.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EnvError {
    /// The client configuration cannot work (bad URL, zero timeout, ...). Nothing was sent.
    #[error("invalid environment client configuration: {0}")]
    Config(String),
    /// The connection could not be made or broke before a complete reply arrived.
    #[error("connection to {url} failed: {detail} ({})", attempts_text(*.attempts))]
    Connection {
        /// Endpoint that was called.
        url: String,
        /// What went wrong (connection refused, reset, DNS, TLS, ...).
        detail: String,
        /// Attempts made.
        attempts: u32,
    },
    /// Connecting or waiting for the reply took longer than the configured timeout.
    #[error("timed out talking to {url}: {detail} ({})", attempts_text(*.attempts))]
    Timeout {
        /// Endpoint that was called.
        url: String,
        /// Which timeout fired.
        detail: String,
        /// Attempts made.
        attempts: u32,
    },
    /// HTTP 401/403: the key is missing, wrong or lacks access. Never retried.
    #[error(
        "authentication failed (HTTP {status}) at {url}: {message}; check ${key_var}{}",
        if *.key_set { "" } else { " (it is not set)" }
    )]
    Unauthorized {
        /// Endpoint that was called.
        url: String,
        /// 401 or 403.
        status: u16,
        /// The server's explanation.
        message: String,
        /// Name of the environment variable the key is read from.
        key_var: String,
        /// Whether that variable held a key.
        key_set: bool,
    },
    /// HTTP 404: the model is unknown to the server, or the base URL is wrong. Never retried.
    #[error(
        "HTTP 404 from {url}: model {model:?} not found, or the base URL is wrong (it usually ends in /v1): {message}"
    )]
    NotFound {
        /// Endpoint that was called.
        url: String,
        /// Model that was asked for.
        model: String,
        /// The server's explanation.
        message: String,
    },
    /// Any other HTTP error status (408, 409, 429 and 5xx after the last retry; other 4xx at once).
    #[error("HTTP {status} from {url}: {message} ({})", attempts_text(*.attempts))]
    Http {
        /// Endpoint that was called.
        url: String,
        /// HTTP status code.
        status: u16,
        /// The server's explanation.
        message: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A 2xx reply that is not a usable chat completion (not JSON, no choices, no content).
    #[error("malformed reply from {url}: {detail} ({})", attempts_text(*.attempts))]
    Malformed {
        /// Endpoint that was called.
        url: String,
        /// What is wrong with the reply.
        detail: String,
        /// Attempts made.
        attempts: u32,
    },
}

fn attempts_text(attempts: u32) -> String {
    if attempts == 1 {
        "1 attempt".to_string()
    } else {
        format!("{attempts} attempts")
    }
}

impl EnvError {
    /// The kind this error is counted under.
    pub fn kind(&self) -> FailureKind {
        match self {
            EnvError::Config(_) => FailureKind::Config,
            EnvError::Connection { .. } => FailureKind::Connection,
            EnvError::Timeout { .. } => FailureKind::Timeout,
            EnvError::Unauthorized { .. } => FailureKind::Unauthorized,
            EnvError::NotFound { .. } => FailureKind::NotFound,
            EnvError::Http { status, .. } => match status {
                408 => FailureKind::Timeout,
                429 => FailureKind::RateLimited,
                500..=599 => FailureKind::ServerError,
                _ => FailureKind::Rejected,
            },
            EnvError::Malformed { .. } => FailureKind::Malformed,
        }
    }

    /// Requests sent before giving up (0 for configuration errors).
    pub fn attempts(&self) -> u32 {
        match self {
            EnvError::Config(_) => 0,
            EnvError::Unauthorized { .. } | EnvError::NotFound { .. } => 1,
            EnvError::Connection { attempts, .. }
            | EnvError::Timeout { attempts, .. }
            | EnvError::Http { attempts, .. }
            | EnvError::Malformed { attempts, .. } => *attempts,
        }
    }

    pub(crate) fn with_attempts(mut self, n: u32) -> Self {
        match &mut self {
            EnvError::Connection { attempts, .. }
            | EnvError::Timeout { attempts, .. }
            | EnvError::Http { attempts, .. }
            | EnvError::Malformed { attempts, .. } => *attempts = n,
            EnvError::Config(_) | EnvError::Unauthorized { .. } | EnvError::NotFound { .. } => {}
        }
        self
    }
}

/// Failure classes, for counters and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// Invalid client configuration.
    Config,
    /// Connection refused, reset or dropped; DNS or TLS failure.
    Connection,
    /// A timeout (ours, or HTTP 408 from the server).
    Timeout,
    /// HTTP 401/403.
    Unauthorized,
    /// HTTP 404.
    NotFound,
    /// HTTP 429.
    RateLimited,
    /// HTTP 5xx.
    ServerError,
    /// Any other HTTP 4xx (or unexpected status).
    Rejected,
    /// A 2xx reply that is not a usable chat completion.
    Malformed,
}

impl FailureKind {
    /// Every kind, in counter order.
    pub const ALL: [FailureKind; 9] = [
        FailureKind::Config,
        FailureKind::Connection,
        FailureKind::Timeout,
        FailureKind::Unauthorized,
        FailureKind::NotFound,
        FailureKind::RateLimited,
        FailureKind::ServerError,
        FailureKind::Rejected,
        FailureKind::Malformed,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_status() {
        let http = |status| EnvError::Http {
            url: "u".into(),
            status,
            message: "m".into(),
            attempts: 3,
        };
        assert_eq!(http(429).kind(), FailureKind::RateLimited);
        assert_eq!(http(503).kind(), FailureKind::ServerError);
        assert_eq!(http(408).kind(), FailureKind::Timeout);
        assert_eq!(http(400).kind(), FailureKind::Rejected);
        assert_eq!(http(400).attempts(), 3);
    }

    #[test]
    fn counter_order_matches_index() {
        for (i, kind) in FailureKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }

    #[test]
    fn unauthorized_names_the_variable() {
        let err = EnvError::Unauthorized {
            url: "http://x/v1/chat/completions".into(),
            status: 401,
            message: "Incorrect API key provided".into(),
            key_var: "OPENAI_API_KEY".into(),
            key_set: false,
        };
        let text = err.to_string();
        assert!(
            text.starts_with("authentication failed (HTTP 401)"),
            "{text}"
        );
        assert!(
            text.contains("check $OPENAI_API_KEY (it is not set)"),
            "{text}"
        );
        assert_eq!(err.attempts(), 1);
    }

    #[test]
    fn attempts_are_spelled_out() {
        let err = EnvError::Timeout {
            url: "u".into(),
            detail: "d".into(),
            attempts: 1,
        };
        assert!(err.to_string().ends_with("(1 attempt)"));
        assert!(err.with_attempts(4).to_string().ends_with("(4 attempts)"));
    }
}

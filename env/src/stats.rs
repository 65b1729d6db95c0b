//! Counters of everything the client did, shared by all threads using one client.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::FailureKind;

/// Live counters of one client (lock-free, updated by every request).
#[derive(Debug, Default)]
pub struct ClientStats {
    calls: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    succeeded: AtomicU64,
    backoff_ms: AtomicU64,
    failed_attempts: [AtomicU64; FailureKind::ALL.len()],
    failed_calls: [AtomicU64; FailureKind::ALL.len()],
}

impl ClientStats {
    pub(crate) fn call_started(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn request_sent(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn attempt_failed(&self, kind: FailureKind) {
        self.failed_attempts[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn retrying(&self, wait: Duration) {
        self.retries.fetch_add(1, Ordering::Relaxed);
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        self.backoff_ms.fetch_add(ms, Ordering::Relaxed);
    }

    pub(crate) fn call_succeeded(&self) {
        self.succeeded.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn call_failed(&self, kind: FailureKind) {
        self.failed_calls[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A consistent-enough copy of the counters for reporting.
    pub fn snapshot(&self) -> StatsSnapshot {
        let by_kind = |counters: &[AtomicU64]| {
            FailureKind::ALL
                .iter()
                .zip(counters)
                .map(|(kind, n)| (*kind, n.load(Ordering::Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect()
        };
        StatsSnapshot {
            calls: self.calls.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            backoff_ms: self.backoff_ms.load(Ordering::Relaxed),
            failed_attempts: by_kind(&self.failed_attempts),
            failed_calls: by_kind(&self.failed_calls),
        }
    }
}

/// Counters at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Calls made (one call may send several requests).
    pub calls: u64,
    /// HTTP requests sent, retries included.
    pub requests: u64,
    /// Retries made.
    pub retries: u64,
    /// Calls that returned a reply.
    pub succeeded: u64,
    /// Total time chosen for backoff waits, in milliseconds.
    pub backoff_ms: u64,
    /// Failed requests by kind, retried ones included (kinds with zero left out).
    pub failed_attempts: BTreeMap<FailureKind, u64>,
    /// Calls that failed for good, by kind of the last failure.
    pub failed_calls: BTreeMap<FailureKind, u64>,
}

impl StatsSnapshot {
    /// Calls that failed for good.
    pub fn failed(&self) -> u64 {
        self.failed_calls.values().sum()
    }

    /// Failed requests of one kind, retried ones included.
    pub fn failed_attempts_of(&self, kind: FailureKind) -> u64 {
        self.failed_attempts.get(&kind).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_counts_and_serialises() {
        let stats = ClientStats::default();
        stats.call_started();
        stats.request_sent();
        stats.attempt_failed(FailureKind::RateLimited);
        stats.retrying(Duration::from_millis(1500));
        stats.request_sent();
        stats.attempt_failed(FailureKind::ServerError);
        stats.call_failed(FailureKind::ServerError);
        let snap = stats.snapshot();
        assert_eq!(
            (snap.calls, snap.requests, snap.retries, snap.succeeded),
            (1, 2, 1, 0)
        );
        assert_eq!(snap.backoff_ms, 1500);
        assert_eq!(snap.failed(), 1);
        assert_eq!(snap.failed_attempts_of(FailureKind::RateLimited), 1);
        let json = serde_json::to_value(&snap).unwrap();
        assert_eq!(json["failed_attempts"]["server_error"], 1);
        assert_eq!(json["failed_calls"], serde_json::json!({"server_error": 1}));
    }
}

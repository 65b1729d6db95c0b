//! How long to wait before a retry: jittered exponential backoff or the server's `Retry-After`.

use std::time::Duration;

use crate::config::RetryPolicy;

/// The wait before retry number `retry` (1-based). `unit` is a random number in `[0, 1)` that
/// picks the point in the jitter window `[d/2, d]`.
pub(crate) fn retry_wait(
    policy: &RetryPolicy,
    retry: u32,
    retry_after: Option<Duration>,
    unit: f64,
) -> Duration {
    if let Some(wait) = retry_after {
        return wait.min(Duration::from_secs_f64(policy.max_retry_after_secs));
    }
    let exponent = retry.saturating_sub(1).min(30) as i32;
    let ceiling = (policy.base_delay_secs * 2f64.powi(exponent)).min(policy.max_delay_secs);
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    Duration::from_secs_f64(ceiling * (0.5 + 0.5 * unit))
}

/// Parses a `Retry-After` value given in seconds (integer or decimal). The HTTP-date form is
/// not supported and gives `None`, so the normal backoff applies.
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let secs: f64 = value.trim().parse().ok()?;
    (0.0..1e9)
        .contains(&secs)
        .then(|| Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 10,
            base_delay_secs: 1.0,
            max_delay_secs: 5.0,
            max_retry_after_secs: 60.0,
        }
    }

    #[test]
    fn backoff_doubles_within_the_jitter_window_and_is_capped() {
        let p = policy();
        assert_eq!(retry_wait(&p, 1, None, 0.0), Duration::from_millis(500));
        assert_eq!(retry_wait(&p, 1, None, 1.0), Duration::from_secs(1));
        assert_eq!(retry_wait(&p, 3, None, 1.0), Duration::from_secs(4));
        assert_eq!(retry_wait(&p, 9, None, 1.0), Duration::from_secs(5));
        assert_eq!(retry_wait(&p, 200, None, 0.0), Duration::from_millis(2500));
        let jittered = retry_wait(&p, 2, None, 0.3);
        assert!(jittered >= Duration::from_secs(1) && jittered <= Duration::from_secs(2));
    }

    #[test]
    fn retry_after_overrides_backoff_up_to_its_cap() {
        let p = policy();
        assert_eq!(retry_wait(&p, 5, Some(Duration::ZERO), 1.0), Duration::ZERO);
        assert_eq!(
            retry_wait(&p, 1, Some(Duration::from_secs(7)), 0.0),
            Duration::from_secs(7)
        );
        assert_eq!(
            retry_wait(&p, 1, Some(Duration::from_secs(600)), 0.0),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn retry_after_parsing() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_retry_after(" 0.25 "),
            Some(Duration::from_millis(250))
        );
        assert_eq!(parse_retry_after("-1"), None);
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
    }
}

//! When and how long to wait before retrying an ORS request.
//!
//! Transient failures are 429/502/503/504 and transport errors (the SDK's "env-server"
//! policy: a 500 is a bug in the tool and would fail again). A 503 with
//! `X-Backend-State: starting` means the environment is still booting: it is retried until
//! `starting_budget` runs out, honouring `Retry-After`.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use super::error::OrsError;

/// Backoff settings shared by every retried ORS call.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Most attempts for an ordinary transient failure (first try included).
    pub max_attempts: u32,
    /// First backoff; doubled per attempt, up to `max_delay`, with ±50 % jitter.
    pub base_delay: Duration,
    /// Cap on one wait, `Retry-After` included.
    pub max_delay: Duration,
    /// How long to ride out a backend reported as starting.
    pub starting_budget: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(10),
            starting_budget: Duration::from_secs(600),
        }
    }
}

/// Whether an error may go away by itself.
pub(crate) fn is_transient(err: &OrsError) -> bool {
    match err {
        OrsError::Http { status, .. } => matches!(status, 429 | 502 | 503 | 504),
        OrsError::Transport { .. } | OrsError::Stream { .. } | OrsError::Timeout { .. } => true,
        _ => false,
    }
}

/// Whether the server said the backend is still starting (so the request never ran).
pub(crate) fn backend_starting(err: &OrsError) -> bool {
    matches!(
        err,
        OrsError::Http {
            status: 503,
            backend_starting: true,
            ..
        }
    )
}

impl RetryPolicy {
    /// The wait before the next try after `failures` failed attempts (`elapsed` since the
    /// first), or `None` to give up and return `err`.
    pub(crate) fn next_delay(
        &self,
        err: &OrsError,
        failures: u32,
        elapsed: Duration,
    ) -> Option<Duration> {
        if !is_transient(err) {
            return None;
        }
        if backend_starting(err) {
            if elapsed >= self.starting_budget {
                return None;
            }
        } else if failures >= self.max_attempts {
            return None;
        }
        if let OrsError::Http {
            retry_after: Some(after),
            ..
        } = err
        {
            return Some((*after).min(self.max_delay));
        }
        let exp = self
            .base_delay
            .saturating_mul(1u32 << failures.saturating_sub(1).min(16));
        Some(jitter(exp.min(self.max_delay)))
    }
}

/// Scales `d` by a random factor in [0.5, 1.5) so parallel episodes do not retry in step.
fn jitter(d: Duration) -> Duration {
    // std's RandomState is randomly keyed per instance: a dependency-free random source.
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let factor = 0.5 + (r >> 11) as f64 / (1u64 << 53) as f64;
    d.mul_f64(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(status: u16, retry_after: Option<u64>, starting: bool) -> OrsError {
        OrsError::Http {
            url: "u".into(),
            status,
            body: String::new(),
            retry_after: retry_after.map(Duration::from_secs),
            backend_starting: starting,
        }
    }

    #[test]
    fn only_transient_statuses_are_retried() {
        let p = RetryPolicy::default();
        for s in [429, 502, 503, 504] {
            assert!(
                p.next_delay(&http(s, None, false), 1, Duration::ZERO)
                    .is_some(),
                "{s}"
            );
        }
        for s in [400, 404, 410, 422, 500] {
            assert!(
                p.next_delay(&http(s, None, false), 1, Duration::ZERO)
                    .is_none(),
                "{s}"
            );
        }
    }

    #[test]
    fn backoff_grows_with_jitter_and_stops_after_max_attempts() {
        let p = RetryPolicy::default();
        let e = http(502, None, false);
        let d1 = p.next_delay(&e, 1, Duration::ZERO).expect("retry 1");
        let d3 = p.next_delay(&e, 3, Duration::ZERO).expect("retry 3");
        assert!(
            d1 >= Duration::from_millis(250) && d1 < Duration::from_millis(750),
            "{d1:?}"
        );
        assert!(
            d3 >= Duration::from_millis(1000) && d3 < Duration::from_millis(3000),
            "{d3:?}"
        );
        assert!(p.next_delay(&e, 4, Duration::ZERO).is_none());
    }

    #[test]
    fn starting_backend_honours_retry_after_until_the_budget() {
        let p = RetryPolicy::default();
        let e = http(503, Some(2), true);
        assert_eq!(
            p.next_delay(&e, 50, Duration::from_secs(60)),
            Some(Duration::from_secs(2))
        );
        assert_eq!(p.next_delay(&e, 50, Duration::from_secs(601)), None);
        let capped = http(429, Some(120), false);
        assert_eq!(
            p.next_delay(&capped, 1, Duration::ZERO),
            Some(Duration::from_secs(10))
        );
    }
}

//! Leases: a driver that dies without stopping its actors (SIGKILL, a lost machine)
//! must not leave them running on the workers. Each driver-side placer (the rollout
//! pool, a remote trainer) holds a lease that its heartbeats and spawns renew; a worker
//! that hears nothing from a holder for the lease's timeout stops that holder's actors.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use manta_proto::cluster as cpb;

/// A placer's lease: who holds it and how long a worker waits without news.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub holder: u64,
    pub timeout: Duration,
}

impl Lease {
    /// A lease with a fresh holder id (unique per process and call).
    pub fn new(timeout: Duration) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let salt = (u64::from(std::process::id()) << 32) ^ NEXT.fetch_add(1, Ordering::Relaxed);
        Self {
            holder: nanos ^ salt.rotate_left(17),
            timeout,
        }
    }

    pub(crate) fn to_pb(self) -> cpb::Lease {
        cpb::Lease {
            holder: self.holder,
            timeout_ms: self.timeout.as_millis() as u64,
        }
    }

    /// `None` for an unset or zero lease (the actor then lives until stopped).
    pub(crate) fn from_pb(lease: Option<&cpb::Lease>) -> Option<Self> {
        lease.filter(|l| l.timeout_ms > 0).map(|l| Self {
            holder: l.holder,
            timeout: Duration::from_millis(l.timeout_ms),
        })
    }
}

struct Entry {
    timeout: Duration,
    renewed: Instant,
    /// Spawns of this holder in flight: a holder loading a model is alive.
    spawning: u32,
}

/// The worker's view of every holder: when it was last heard from.
#[derive(Default)]
pub(crate) struct LeaseBook {
    entries: HashMap<u64, Entry>,
}

impl LeaseBook {
    /// Records news from the holder (a heartbeat or a spawn).
    pub fn renew(&mut self, lease: Lease) {
        let entry = self.entries.entry(lease.holder).or_insert(Entry {
            timeout: lease.timeout,
            renewed: Instant::now(),
            spawning: 0,
        });
        entry.timeout = lease.timeout;
        entry.renewed = Instant::now();
    }

    /// A spawn of the holder starts (`true`) or ends (`false`); both count as news.
    pub fn spawning(&mut self, lease: Lease, started: bool) {
        self.renew(lease);
        if let Some(e) = self.entries.get_mut(&lease.holder) {
            e.spawning = if started {
                e.spawning + 1
            } else {
                e.spawning.saturating_sub(1)
            };
        }
    }

    /// Removes and returns the leases not renewed within their timeout.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Lease> {
        let expired: Vec<Lease> = self
            .entries
            .iter()
            .filter(|(_, e)| e.spawning == 0 && now.duration_since(e.renewed) >= e.timeout)
            .map(|(&holder, e)| Lease {
                holder,
                timeout: e.timeout,
            })
            .collect();
        for lease in &expired {
            self.entries.remove(&lease.holder);
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_expires_unless_renewed_or_spawning() {
        let lease = Lease::new(Duration::from_millis(10));
        let mut book = LeaseBook::default();
        book.renew(lease);
        let later = Instant::now() + Duration::from_millis(20);
        book.spawning(lease, true);
        assert!(book.take_expired(later).is_empty());
        book.spawning(lease, false);
        assert_eq!(book.take_expired(later), vec![lease]);
        assert!(book.take_expired(later).is_empty());
        assert_ne!(Lease::new(lease.timeout).holder, lease.holder);
    }
}

//! Which of this worker's engines are receiving a broadcast, by group, so the driver can
//! end their receive at once when rank 0's side failed (`AbortBroadcast`) rather than
//! leave them waiting for the group's timeout (on NCCL, for c10d's watchdog, which may
//! take the whole worker down).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use manta_cuda::weight_group::GroupAborter;
use manta_engine::AbortHook;
use tracing::{debug, warn};

/// Aborted group names remembered for engines that join after the abort (names are
/// unique, so a few recent ones suffice).
const REMEMBERED: usize = 64;

/// The aborters of the engines receiving now, shared by every clone.
#[derive(Clone, Default)]
pub struct BroadcastAborts {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    next_round: u64,
    /// By group name: (round, aborter) of each engine receiving in it.
    receiving: HashMap<String, Vec<(u64, GroupAborter)>>,
    /// Groups aborted lately, oldest first.
    aborted: VecDeque<String>,
}

impl BroadcastAborts {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Nothing here is left half-updated by a panic: keep going.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `group` was aborted here (lately).
    pub fn was_aborted(&self, group: &str) -> bool {
        self.lock().aborted.iter().any(|g| g == group)
    }

    /// One `ReceiveBroadcast`'s engines: its hook registers each engine's aborter, and
    /// dropping the round forgets them.
    pub fn round(&self) -> Round {
        let id = {
            let mut inner = self.lock();
            inner.next_round += 1;
            inner.next_round
        };
        Round {
            aborts: self.clone(),
            id,
        }
    }

    /// Aborts every engine receiving in `group` and remembers the name; answers how many.
    pub fn abort(&self, group: &str) -> usize {
        let aborters = {
            let mut inner = self.lock();
            if !inner.aborted.iter().any(|g| g == group) {
                inner.aborted.push_back(group.to_string());
                if inner.aborted.len() > REMEMBERED {
                    inner.aborted.pop_front();
                }
            }
            inner.receiving.remove(group).unwrap_or_default()
        };
        // Outside the lock: an NCCL abort may take a while.
        for (_, aborter) in &aborters {
            abort_one(group, aborter);
        }
        aborters.len()
    }

    fn register(&self, round: u64, group: &str, aborter: GroupAborter) {
        {
            let mut inner = self.lock();
            if !inner.aborted.iter().any(|g| g == group) {
                inner
                    .receiving
                    .entry(group.to_string())
                    .or_default()
                    .push((round, aborter));
                return;
            }
        }
        debug!(
            group,
            "an engine joined a group already aborted: aborting it"
        );
        abort_one(group, &aborter);
    }

    fn forget(&self, round: u64) {
        let mut inner = self.lock();
        inner.receiving.retain(|_, engines| {
            engines.retain(|(r, _)| *r != round);
            !engines.is_empty()
        });
    }
}

fn abort_one(group: &str, aborter: &GroupAborter) {
    if let Err(e) = aborter.abort() {
        warn!(group, error = %e, "aborting an engine's broadcast receive failed");
    }
}

/// The engines of one `ReceiveBroadcast` (forgotten when dropped).
pub struct Round {
    aborts: BroadcastAborts,
    id: u64,
}

impl Round {
    /// What each engine of this round is handed in its feed.
    pub fn hook(&self) -> AbortHook {
        let (aborts, id) = (self.aborts.clone(), self.id);
        AbortHook::new(move |group, aborter| aborts.register(id, group, aborter))
    }
}

impl Drop for Round {
    fn drop(&mut self) {
        self.aborts.forget(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn flag() -> (Arc<AtomicBool>, GroupAborter) {
        let f = Arc::new(AtomicBool::new(false));
        (f.clone(), GroupAborter::Store(f))
    }

    #[test]
    fn an_abort_reaches_the_engines_of_its_group_and_later_joiners() {
        let aborts = BroadcastAborts::default();
        let round = aborts.round();
        let (a, other) = (flag(), flag());
        round.hook().publish("g1", a.1);
        round.hook().publish("g2", other.1);
        assert_eq!(aborts.abort("g1"), 1);
        assert!(a.0.load(Ordering::SeqCst));
        assert!(
            !other.0.load(Ordering::SeqCst),
            "another group is left alone"
        );
        // Joining g1 after its abort: aborted at once.
        let late = flag();
        aborts.round().hook().publish("g1", late.1);
        assert!(late.0.load(Ordering::SeqCst));
        assert!(aborts.was_aborted("g1"));
        // A finished round is forgotten.
        drop(round);
        assert_eq!(aborts.abort("g2"), 0);
        for i in 0..REMEMBERED {
            aborts.abort(&format!("x{i}"));
        }
        assert!(
            !aborts.was_aborted("g1"),
            "the remembered names are bounded"
        );
    }
}

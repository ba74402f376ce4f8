//! Which rollout actor a group of episodes goes to: the one with the fewest episodes in
//! flight (in this process, or among a pool's live worker actors). A whole group goes
//! to one actor, and each episode runs every turn on the engine it started on, so the
//! group's shared prompt and each episode's earlier turns are in that engine's prefix
//! cache when the next request comes (prefix affinity).

use std::sync::{Arc, Mutex, PoisonError};

/// Episodes in flight per engine, as the driver sent them.
#[derive(Debug, Clone)]
pub struct LoadBalancer {
    in_flight: Arc<Mutex<Vec<usize>>>,
}

/// Episodes counted against an engine until this is dropped (the engine answered, or
/// the call was abandoned).
#[derive(Debug)]
pub struct Assignment {
    engine: usize,
    episodes: usize,
    in_flight: Arc<Mutex<Vec<usize>>>,
}

impl Assignment {
    /// The chosen engine's index.
    pub fn engine(&self) -> usize {
        self.engine
    }
}

impl Drop for Assignment {
    fn drop(&mut self) {
        let mut loads = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loads[self.engine] = loads[self.engine].saturating_sub(self.episodes);
    }
}

impl LoadBalancer {
    pub fn new(engines: usize) -> Self {
        Self {
            in_flight: Arc::new(Mutex::new(vec![0; engines])),
        }
    }

    /// Counts `episodes` of group `group_index` against the least-loaded engine; equal
    /// loads are broken by the group index, so an idle pool takes groups round robin.
    /// `None` without engines.
    pub fn assign(&self, group_index: u32, episodes: usize) -> Option<Assignment> {
        self.assign_among(group_index, episodes, |_| true)
    }

    /// As [`LoadBalancer::assign`], among the engines `allowed` accepts (say, those of
    /// live nodes); `None` when it accepts none.
    pub fn assign_among(
        &self,
        group_index: u32,
        episodes: usize,
        allowed: impl Fn(usize) -> bool,
    ) -> Option<Assignment> {
        let mut loads = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let engine = least_loaded(&loads, group_index, allowed)?;
        loads[engine] += episodes;
        Some(Assignment {
            engine,
            episodes,
            in_flight: self.in_flight.clone(),
        })
    }

    /// Episodes in flight per engine.
    pub fn loads(&self) -> Vec<usize> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The allowed engine with the smallest load, searching from `group_index % engines`.
fn least_loaded(
    loads: &[usize],
    group_index: u32,
    allowed: impl Fn(usize) -> bool,
) -> Option<usize> {
    let n = loads.len();
    if n == 0 {
        return None;
    }
    let start = group_index as usize % n;
    (0..n)
        .map(|k| (start + k) % n)
        .filter(|&i| allowed(i))
        .min_by_key(|&i| loads[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_engines_take_groups_round_robin() {
        let lb = LoadBalancer::new(3);
        let held: Vec<_> = (0..3).map(|g| lb.assign(g, 8).unwrap()).collect();
        let engines: Vec<_> = held.iter().map(Assignment::engine).collect();
        assert_eq!(engines, vec![0, 1, 2]);
        assert_eq!(lb.loads(), vec![8, 8, 8]);
    }

    #[test]
    fn a_group_goes_to_the_engine_with_fewest_episodes_in_flight() {
        let lb = LoadBalancer::new(2);
        let big = lb.assign(0, 16).unwrap(); // engine 0
        let small = lb.assign(1, 2).unwrap(); // engine 1
        assert_eq!((big.engine(), small.engine()), (0, 1));
        // Group 2 would be engine 0 round robin; engine 1 has fewer episodes.
        let next = lb.assign(2, 4).unwrap();
        assert_eq!(next.engine(), 1);
        assert_eq!(lb.loads(), vec![16, 6]);
        // Engine 0's group finishes: it is the emptier one now.
        drop(big);
        assert_eq!(lb.assign(3, 1).unwrap().engine(), 0);
    }

    #[test]
    fn only_allowed_engines_are_chosen() {
        let lb = LoadBalancer::new(3);
        let _busy = lb.assign(0, 10).unwrap(); // engine 0
                                               // Engine 1 is out (a dead node): the least loaded of the rest is engine 2.
        let a = lb.assign_among(1, 1, |i| i != 1).unwrap();
        assert_eq!(a.engine(), 2);
        assert!(lb.assign_among(2, 1, |_| false).is_none());
        assert!(LoadBalancer::new(0).assign_among(0, 1, |_| true).is_none());
    }

    #[test]
    fn finished_groups_release_their_count() {
        let lb = LoadBalancer::new(2);
        {
            let _a = lb.assign(0, 5).unwrap();
            let _b = lb.assign(1, 7).unwrap();
            assert_eq!(lb.loads(), vec![5, 7]);
        }
        assert_eq!(lb.loads(), vec![0, 0]);
    }
}

//! The engine's counters, shared between the engine thread and its handles.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters the engine keeps (read by benchmarks and `/get_server_info`).
#[derive(Debug, Default)]
pub struct EngineStats {
    pub steps: AtomicU64,
    pub tokens_computed: AtomicU64,
    pub tokens_sampled: AtomicU64,
    /// Running requests sent back to the queue to free KV blocks (recomputed later).
    pub preemptions: AtomicU64,
    /// Decode steps launched before the host had read the step before them (overlap
    /// scheduling; see `NativeEngineOptions::disable_overlap_schedule`).
    pub steps_ahead: AtomicU64,
}

impl EngineStats {
    pub(super) fn add_step(&self, computed: usize, sampled: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.tokens_computed
            .fetch_add(computed as u64, Ordering::Relaxed);
        self.tokens_sampled
            .fetch_add(sampled as u64, Ordering::Relaxed);
    }
}

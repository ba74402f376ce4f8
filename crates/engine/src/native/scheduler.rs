//! Continuous batching: which sequences run in the next model step, and with how many
//! tokens. Running sequences decode one token per step; sequences still prefilling take
//! chunks under a token budget; waiting requests join as long as the running set, the
//! budget and the KV pool allow. When the pool runs dry, cached prefixes are evicted
//! first, then the newest running sequence is preempted (its blocks freed, its tokens kept,
//! recomputed when it is admitted again) — requests queue, they never fail for lack of KV.

use std::collections::VecDeque;

use super::block_pool::BlockPool;
use super::prefix_cache::PrefixCache;
use super::sequence::Sequence;
use crate::EngineError;

/// One sequence's part of a step: `running[index]` computes its next `q_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub index: usize,
    pub q_len: usize,
}

/// The requests of one engine and the KV blocks they hold. Its state is its own: the
/// engine thread admits, plans, reads and finishes sequences through these methods.
pub struct Scheduler {
    pool: BlockPool,
    cache: PrefixCache,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    block_size: usize,
    max_running: usize,
    /// Most tokens computed in one step (decodes count one each).
    step_tokens: usize,
    /// Sequences preempted so far (they were recomputed later, not failed).
    preemptions: u64,
}

impl Scheduler {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        max_running: usize,
        step_tokens: usize,
    ) -> Self {
        Self {
            pool: BlockPool::new(num_blocks),
            cache: PrefixCache::new(block_size),
            waiting: VecDeque::new(),
            running: Vec::new(),
            block_size,
            max_running: max_running.max(1),
            step_tokens: step_tokens.max(1),
            preemptions: 0,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Most sequences running at once.
    pub fn max_running(&self) -> usize {
        self.max_running
    }

    /// Tokens the whole KV pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.num_blocks() * self.block_size
    }

    /// Sequences preempted so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// The running sequences, in the order [`Planned::index`] refers to.
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    /// The running sequences, to append sampled tokens and advance their generators.
    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }

    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Queues a new request.
    pub fn admit(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Whether a request with an id below `id` is still running, or waiting.
    pub fn holds_requests_before(&self, id: u64) -> (bool, bool) {
        (
            self.running.iter().any(|s| s.id < id),
            self.waiting.iter().any(|s| s.id < id),
        )
    }

    /// Takes out every waiting and running sequence `hit` selects, their blocks freed.
    pub fn remove_where(&mut self, hit: impl Fn(&Sequence) -> bool) -> Vec<Sequence> {
        let mut out = Vec::new();
        for seq in std::mem::take(&mut self.waiting) {
            if hit(&seq) {
                out.push(seq);
            } else {
                self.waiting.push_back(seq);
            }
        }
        for seq in std::mem::take(&mut self.running) {
            if hit(&seq) {
                out.push(self.release(seq));
            } else {
                self.running.push(seq);
            }
        }
        out
    }

    /// Takes out every running sequence, their blocks freed (a failed step).
    pub fn take_running(&mut self) -> Vec<Sequence> {
        let running = std::mem::take(&mut self.running);
        running.into_iter().map(|s| self.release(s)).collect()
    }

    /// Takes out the finished running sequence at `index`, its blocks freed.
    pub fn finish(&mut self, index: usize) -> Sequence {
        let seq = self.running.remove(index);
        self.release(seq)
    }

    /// Forgets every cached prefix (new weights, or the pool is about to go).
    pub fn clear_prefix_cache(&mut self) {
        self.cache.clear(&mut self.pool);
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Makes `n` blocks free, evicting cached prefixes if needed.
    fn ensure_free(&mut self, n: usize) -> bool {
        let free = self.pool.num_free();
        if free < n {
            self.cache.evict(n - free, &mut self.pool);
        }
        self.pool.num_free() >= n
    }

    fn release_blocks(&mut self, seq: &mut Sequence) {
        for b in seq.blocks.drain(..) {
            self.pool.decref(b);
        }
        seq.num_computed = 0;
        seq.cached_blocks = 0;
        seq.cache_key = None;
    }

    /// Frees a finished or aborted sequence's blocks.
    fn release(&mut self, mut seq: Sequence) -> Sequence {
        self.release_blocks(&mut seq);
        seq
    }

    fn preempt_newest(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            self.release_blocks(&mut seq);
            self.preemptions += 1;
            self.waiting.push_front(seq);
        }
    }

    fn grow(&mut self, index: usize, tokens: usize) {
        let need = self.blocks_for(tokens);
        while self.running[index].blocks.len() < need {
            let b = self
                .pool
                .alloc()
                .expect("blocks were reserved before growing");
            self.running[index].blocks.push(b);
        }
    }

    /// Plans the next step. `may_admit(seq)` says whether a waiting request may start now
    /// (pauses and weight-update barriers hold some back). Requests that can never fit
    /// the pool are returned to be failed.
    pub fn plan(
        &mut self,
        may_admit: impl Fn(&Sequence) -> bool,
    ) -> (Vec<Planned>, Vec<(Sequence, EngineError)>) {
        let mut rejected = Vec::new();
        // Decodes first: every running sequence with one pending token.
        loop {
            let need = self
                .running
                .iter()
                .filter(|s| {
                    s.pending() == 1 && self.blocks_for(s.num_computed + 1) > s.blocks.len()
                })
                .count();
            if self.ensure_free(need) || self.running.is_empty() {
                break;
            }
            self.preempt_newest();
        }
        let mut plan = Vec::new();
        for i in 0..self.running.len() {
            if self.running[i].pending() == 1 {
                let upto = self.running[i].num_computed + 1;
                self.grow(i, upto);
                plan.push(Planned { index: i, q_len: 1 });
            }
        }
        let mut budget = self.step_tokens.saturating_sub(plan.len());
        // Sequences part-way through their prefill go on.
        for i in 0..self.running.len() {
            let pending = self.running[i].pending();
            if pending <= 1 || budget == 0 {
                continue;
            }
            let q = pending.min(budget);
            let need = self
                .blocks_for(self.running[i].num_computed + q)
                .saturating_sub(self.running[i].blocks.len());
            if !self.ensure_free(need) {
                break;
            }
            let upto = self.running[i].num_computed + q;
            self.grow(i, upto);
            plan.push(Planned { index: i, q_len: q });
            budget -= q;
        }
        // New (or preempted) requests join.
        while budget > 0 && self.running.len() < self.max_running {
            let Some(front) = self.waiting.front() else {
                break;
            };
            if !may_admit(front) {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if self.blocks_for(seq.tokens.len()) > self.pool.num_blocks() {
                let err = EngineError::BadRequest(format!(
                    "{} tokens need more KV cache than the engine holds ({} tokens)",
                    seq.tokens.len(),
                    self.pool.num_blocks() * self.block_size
                ));
                rejected.push((seq, err));
                continue;
            }
            let (blocks, key) =
                self.cache
                    .lookup(&seq.tokens, seq.tokens.len() - 1, &mut self.pool);
            seq.num_computed = blocks.len() * self.block_size;
            seq.cached_blocks = blocks.len();
            seq.cache_key = key;
            seq.blocks = blocks;
            seq.cached_tokens.get_or_insert(seq.num_computed);
            let q = seq.pending().min(budget);
            let need = self
                .blocks_for(seq.num_computed + q)
                .saturating_sub(seq.blocks.len());
            // Keep a block of headroom per running sequence so decodes do not preempt at once.
            if !self.ensure_free(need + self.running.len()) {
                self.release_blocks(&mut seq);
                self.waiting.push_front(seq);
                break;
            }
            self.running.push(seq);
            let i = self.running.len() - 1;
            let upto = self.running[i].num_computed + q;
            self.grow(i, upto);
            plan.push(Planned { index: i, q_len: q });
            budget -= q;
        }
        (plan, rejected)
    }

    /// Gives every running sequence the KV blocks for one position past its tokens: the
    /// step launched ahead computes the token still being sampled (see the engine's
    /// overlapped steps). Evicts cached prefixes if needed but never preempts: `false`
    /// when the pool cannot spare the blocks (the engine then waits instead).
    pub fn reserve_ahead(&mut self) -> bool {
        let need = self
            .running
            .iter()
            .filter(|s| self.blocks_for(s.tokens.len() + 1) > s.blocks.len())
            .count();
        if !self.ensure_free(need) {
            return false;
        }
        for i in 0..self.running.len() {
            let upto = self.running[i].tokens.len() + 1;
            self.grow(i, upto);
        }
        true
    }

    /// Records that `running[index]` computed `q_len` more tokens, and offers its newly
    /// full blocks to the prefix cache.
    pub fn computed(&mut self, index: usize, q_len: usize) {
        let bs = self.block_size;
        let seq = &mut self.running[index];
        seq.num_computed += q_len;
        let full = seq.num_computed / bs;
        if full > seq.cached_blocks {
            let range = seq.cached_blocks..full;
            let tokens = &seq.tokens[range.start * bs..range.end * bs];
            let key = if seq.cached_blocks > 0 && seq.cache_key.is_none() {
                Err(()) // an earlier collision: this chain is not cached
            } else {
                self.cache
                    .insert(seq.cache_key, tokens, &seq.blocks[range], &mut self.pool)
            };
            seq.cache_key = key.ok().flatten();
            seq.cached_blocks = full;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::stop::StopCheck;
    use crate::SamplingParams;

    /// A sequence of `len` prompt tokens, admitted and prefilled (its KV blocks held).
    fn decoding(sched: &mut Scheduler, id: u64, len: usize) {
        let params = SamplingParams {
            max_new_tokens: 100,
            ..SamplingParams::default()
        };
        let stop = StopCheck::new(&params, &[]);
        sched.waiting.push_back(Sequence::new(
            format!("r{id}"),
            (0..len as u32).map(|t| t + 1000 * id as u32).collect(),
            params,
            stop,
            id,
            0,
            None,
        ));
        if let Some(seq) = sched.waiting.back_mut() {
            seq.id = id;
        }
        let (plan, _) = sched.plan(|_| true);
        for p in plan {
            sched.computed(p.index, p.q_len);
        }
    }

    #[test]
    fn reserving_ahead_adds_the_block_the_next_position_needs() {
        let mut sched = Scheduler::new(8, 4, 4, 64);
        // Blocks of 4. With 7 tokens the step ahead computes position 7 (the token being
        // sampled), still in the second block; with 8, position 8 needs a third.
        decoding(&mut sched, 1, 7);
        decoding(&mut sched, 2, 8);
        let held: Vec<usize> = sched.running.iter().map(|s| s.blocks.len()).collect();
        assert!(sched.reserve_ahead());
        let now: Vec<usize> = sched.running.iter().map(|s| s.blocks.len()).collect();
        assert_eq!(held, vec![2, 2]);
        assert_eq!(now, vec![2, 3]);
        assert_eq!(sched.preemptions, 0);
    }

    #[test]
    fn reserving_ahead_never_preempts() {
        // Three blocks, two held by full blocks of the two sequences: their next positions
        // need one more each, and only one is free.
        let mut sched = Scheduler::new(3, 4, 4, 64);
        decoding(&mut sched, 1, 4);
        decoding(&mut sched, 2, 4);
        assert_eq!(sched.running.len(), 2);
        assert_eq!(sched.pool.num_free(), 1);
        assert!(!sched.reserve_ahead());
        // Nothing taken, nobody preempted: the engine runs the step synchronously.
        assert_eq!(sched.pool.num_free(), 1);
        let held: Vec<usize> = sched.running.iter().map(|s| s.blocks.len()).collect();
        assert_eq!(held, vec![1, 1]);
        assert_eq!(sched.preemptions, 0);
    }
}

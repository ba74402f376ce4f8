//! The engine thread's loop, shaped like SGLang's scheduler event loop: receive the
//! commands that arrived, schedule the next batch, launch it on the [`ModelRunner`], and
//! process the previous step's result. With the overlap schedule the next decode step is
//! launched before the one in flight is read, so the host's turn overlaps the device's.
//! The loop decides what runs; the runner owns everything on the device.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use manta_tokenizer::Tokenizer;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::model_runner::{FedRow, ModelRunner, StepOutput, StepRow};
use super::sampler::RowSampling;
use super::scheduler::{Planned, Scheduler};
use super::sequence::Sequence;
use super::stats::EngineStats;
use crate::{BroadcastFeed, EngineError, FinishReason, NamedTensors, PauseMode};

/// What the engine thread is asked to do; each carries the channel its answer goes to.
pub enum Command {
    Generate(Box<Sequence>),
    /// New weights, applied once the requests that arrived before them finish.
    UpdateWeights(WeightUpdate),
    /// Every parameter's name, shape and dtype, sorted by name (no copies).
    WeightShapes {
        reply: oneshot::Sender<Vec<(String, Vec<i64>, tch::Kind)>>,
    },
    /// Ends one request (`rid`) or every request (`None`).
    Abort {
        rid: Option<String>,
        reply: oneshot::Sender<()>,
    },
    Pause {
        mode: PauseMode,
        reply: oneshot::Sender<()>,
    },
    Resume {
        reply: oneshot::Sender<()>,
    },
    /// Clears the prefix cache when idle (`false`: requests are running).
    Flush {
        reply: oneshot::Sender<bool>,
    },
    /// Copies of the parameters, by name (weight-sync verification).
    ReadWeights {
        reply: oneshot::Sender<NamedTensors>,
    },
    /// Free the KV cache while idle (`false`: requests are running).
    ReleaseMemory {
        reply: oneshot::Sender<bool>,
    },
    /// Allocate the KV cache again.
    ResumeMemory {
        reply: oneshot::Sender<()>,
    },
}

/// Where new weights come from.
pub enum WeightSource {
    /// Every parameter.
    All(NamedTensors),
    /// Some of the parameters (SGLang's bucketed `/update_weights_from_distributed`).
    Some(NamedTensors),
    /// A model directory's safetensors.
    Disk(PathBuf),
    /// Every parameter, broadcast by rank 0 of a weight-update group.
    Broadcast(BroadcastFeed),
    /// Every parameter, a group at a time as the sender gathers them (ZeRO-3).
    Parts(crate::WeightParts),
}

/// A weight change and who waits for it.
pub struct WeightUpdate {
    pub source: WeightSource,
    /// The engine's weight version once applied.
    pub version: u64,
    pub reply: oneshot::Sender<Result<(), EngineError>>,
}

/// A weight change waiting for the requests that arrived before it to finish.
struct PendingUpdate {
    /// Requests with a smaller id arrived first.
    after_request: u64,
    update: WeightUpdate,
}

/// One row of a launched step, as the loop records it when the step is read.
#[derive(Clone, Copy)]
struct LaunchedRow {
    /// The sequence's id (its running index may change before the step is read).
    seq: u64,
    /// Where it was running at launch.
    index: usize,
    /// Tokens the row computes.
    q_len: usize,
    /// Whether it samples a next token.
    samples: bool,
}

/// A step on the device and the rows it computes, in row order.
struct LaunchedStep {
    rows: Vec<LaunchedRow>,
    output: StepOutput,
}

/// The engine thread: the scheduler and every request's state, the model runner, and
/// what waits between steps (weight updates, pauses, a released KV pool).
pub struct EngineLoop {
    runner: ModelRunner,
    sched: Scheduler,
    tokenizer: Option<Arc<Tokenizer>>,
    context_length: usize,
    version: Arc<AtomicU64>,
    stats: Arc<EngineStats>,
    /// Requests with an id below this run on the old weights; later ones wait for the update.
    updates: VecDeque<PendingUpdate>,
    paused: Option<PauseMode>,
    drain_waiters: Vec<oneshot::Sender<()>>,
    next_id: u64,
    /// Blocks (scratch block included) of the KV pool while it is released.
    released_blocks: Option<usize>,
    /// Launch decode steps ahead of reading the previous one ([`EngineLoop::launch_ahead`]).
    overlap: bool,
    /// A step whose tokens are not read yet (only between steps; commands other than
    /// new requests read it first, see [`EngineLoop::settle`]).
    in_flight: Option<LaunchedStep>,
}

impl EngineLoop {
    /// A loop over `runner` and `sched`; sequences may hold `context_length` tokens
    /// (at most what the pool holds, so preemption can always make progress).
    pub(super) fn new(
        runner: ModelRunner,
        sched: Scheduler,
        tokenizer: Option<Arc<Tokenizer>>,
        context_length: usize,
        version: Arc<AtomicU64>,
        stats: Arc<EngineStats>,
    ) -> Self {
        Self {
            runner,
            context_length: context_length.min(sched.capacity_tokens()),
            sched,
            tokenizer,
            version,
            stats,
            updates: VecDeque::new(),
            paused: None,
            drain_waiters: Vec::new(),
            next_id: 0,
            released_blocks: None,
            overlap: false,
            in_flight: None,
        }
    }

    /// Turns overlapped decode steps on or off (off while profiling, which synchronises).
    pub fn overlap_schedule(mut self, on: bool) -> Self {
        self.overlap = on && !self.runner.profiling();
        self
    }

    /// Serves until every handle is dropped: receive, apply due weight updates, run a
    /// step (schedule, launch, process), answer drains.
    pub fn serve(mut self, rx: mpsc::Receiver<Command>) {
        let _guard = tch::no_grad_guard();
        while self.receive(&rx) {
            self.apply_due_updates();
            if self.paused != Some(PauseMode::InPlace) && self.released_blocks.is_none() {
                self.step();
            }
            if self.sched.running().is_empty() {
                for w in self.drain_waiters.drain(..) {
                    let _ = w.send(());
                }
            }
        }
        debug!("native engine thread exiting");
    }

    /// Takes every command that has arrived, first waiting for one when nothing can run;
    /// `false` once every handle is gone.
    fn receive(&mut self, rx: &mpsc::Receiver<Command>) -> bool {
        let busy = self.released_blocks.is_none()
            && (!self.sched.running().is_empty()
                || (self.sched.has_waiting() && self.paused.is_none()));
        // Released: nothing can run until a command arrives (the resume, or an update
        // applied next), so wait for one instead of spinning.
        if (!busy && self.updates.is_empty()) || self.released_blocks.is_some() {
            match rx.recv() {
                Ok(cmd) => self.handle(cmd),
                Err(_) => return false,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Takes one command; any other than a new request first reads the step in flight,
    /// so it sees every running request as it is.
    fn handle(&mut self, cmd: Command) {
        if !matches!(cmd, Command::Generate(_)) {
            self.settle();
        }
        match cmd {
            Command::Generate(mut seq) => {
                seq.id = self.next_id;
                self.next_id += 1;
                if seq.tokens.len() >= self.context_length {
                    seq.fail(EngineError::BadRequest(format!(
                        "input_ids: {} tokens do not fit the context length {}",
                        seq.tokens.len(),
                        self.context_length
                    )));
                    return;
                }
                self.sched.admit(*seq);
            }
            Command::UpdateWeights(update) => self.updates.push_back(PendingUpdate {
                after_request: self.next_id,
                update,
            }),
            Command::WeightShapes { reply } => {
                let _ = reply.send(self.runner.weight_shapes());
            }
            Command::Abort { rid, reply } => {
                self.abort(rid.as_deref());
                let _ = reply.send(());
            }
            Command::Pause { mode, reply } => {
                match mode {
                    PauseMode::Abort => {
                        self.abort(None);
                        self.paused = Some(PauseMode::Abort);
                        let _ = reply.send(());
                    }
                    PauseMode::InPlace => {
                        self.paused = Some(PauseMode::InPlace);
                        let _ = reply.send(());
                    }
                    // Answered once the running requests are done.
                    PauseMode::Drain => {
                        self.paused = Some(PauseMode::Drain);
                        self.drain_waiters.push(reply);
                    }
                }
            }
            Command::Resume { reply } => {
                self.paused = None;
                let _ = reply.send(());
            }
            Command::ReadWeights { reply } => {
                let _ = reply.send(self.runner.read_weights());
            }
            Command::ReleaseMemory { reply } => {
                let _ = reply.send(self.release_memory());
            }
            Command::ResumeMemory { reply } => {
                self.resume_memory();
                let _ = reply.send(());
            }
            Command::Flush { reply } => {
                let idle = self.sched.is_idle();
                if idle {
                    self.sched.clear_prefix_cache();
                }
                let _ = reply.send(idle);
            }
        }
    }

    /// Frees the KV pool (and the decode graphs that point into it) while no request runs.
    fn release_memory(&mut self) -> bool {
        if !self.sched.running().is_empty() {
            return false;
        }
        if self.released_blocks.is_some() {
            return true;
        }
        self.sched.clear_prefix_cache();
        let blocks = self.runner.release_kv();
        self.released_blocks = Some(blocks);
        info!(blocks, "native engine released its KV cache");
        true
    }

    /// Allocates the KV pool again after [`EngineLoop::release_memory`].
    fn resume_memory(&mut self) {
        if let Some(blocks) = self.released_blocks.take() {
            self.runner.allocate_kv(blocks);
            info!(blocks, "native engine allocated its KV cache again");
        }
    }

    fn abort(&mut self, rid: Option<&str>) {
        for seq in self.sched.running_mut() {
            if rid.is_none_or(|r| seq.rid == r) {
                attach_routed_experts(&self.runner, seq);
            }
        }
        for mut seq in self.sched.remove_where(|s| rid.is_none_or(|r| s.rid == r)) {
            seq.finish(FinishReason::Abort, None);
        }
    }

    /// Applies weight updates once no request from before them is running.
    fn apply_due_updates(&mut self) {
        while let Some(pending) = self.updates.front() {
            let barrier = pending.after_request;
            let (old_running, old_waiting) = self.sched.holds_requests_before(barrier);
            if old_running || (old_waiting && self.paused.is_none()) {
                return;
            }
            let Some(PendingUpdate { update, .. }) = self.updates.pop_front() else {
                return;
            };
            let WeightUpdate {
                source,
                version,
                reply,
            } = update;
            let result = match source {
                WeightSource::All(w) => self.runner.load_tensors(w, true),
                WeightSource::Some(w) => self.runner.load_tensors(w, false),
                WeightSource::Disk(dir) => self.runner.load_from_disk(&dir),
                WeightSource::Broadcast(feed) => self.runner.receive_broadcast(feed),
                WeightSource::Parts(parts) => self.runner.load_parts(parts),
            };
            if result.is_ok() {
                // Cached keys and values were computed by the old weights.
                self.sched.clear_prefix_cache();
                self.version.store(version, Ordering::SeqCst);
                info!(version, "native engine weights updated");
            }
            let _ = reply.send(result);
        }
    }

    /// One step; a failing step fails its requests and the engine keeps serving. With a
    /// step in flight the next one is launched ahead when it can be, then the one in
    /// flight is processed; else a batch is scheduled, launched and — unless it stays in
    /// flight — processed.
    fn step(&mut self) {
        let result = catch_unwind(AssertUnwindSafe(|| match self.in_flight.take() {
            Some(previous) => {
                let ahead = self.launch_ahead(&previous);
                self.process(previous);
                self.in_flight = ahead;
            }
            None => {
                if let Some(plan) = self.schedule() {
                    let launched = self.launch(&plan);
                    match launched.output {
                        StepOutput::InFlight(_) => self.in_flight = Some(launched),
                        StepOutput::Ready(..) => self.process(launched),
                    }
                }
            }
        }));
        if let Err(panic) = result {
            self.fail_running(&panic_message(panic.as_ref()));
        }
    }

    /// Processes the step in flight, if any, before a command looks at the running
    /// requests.
    fn settle(&mut self) {
        if let Some(previous) = self.in_flight.take() {
            let result = catch_unwind(AssertUnwindSafe(|| self.process(previous)));
            if let Err(panic) = result {
                self.fail_running(&panic_message(panic.as_ref()));
            }
        }
    }

    /// Fails every running request after a failed step.
    fn fail_running(&mut self, msg: &str) {
        warn!(error = %msg, "engine step failed; failing its requests");
        self.in_flight = None;
        // Work the failed step queued may still run (a graph's input copy reads a pinned
        // buffer the next step rewrites): let it finish first.
        self.runner.synchronize_after_failure();
        for mut seq in self.sched.take_running() {
            seq.fail(EngineError::Stopped(format!("model step failed: {msg}")));
        }
    }

    /// Chooses the next batch (`None`: nothing to run). Paused engines and weight-update
    /// barriers hold new requests back.
    fn schedule(&mut self) -> Option<Vec<Planned>> {
        let barrier = self.updates.front().map(|u| u.after_request);
        let paused = self.paused.is_some();
        let (plan, rejected) = self
            .sched
            .plan(|s| !paused && barrier.is_none_or(|b| s.id < b));
        self.stats
            .preemptions
            .store(self.sched.preemptions(), Ordering::Relaxed);
        // A request's weight version is the one it starts on (a weight update waits for
        // requests that arrived before it, so later ones start on the new weights).
        let version = self.version.load(Ordering::SeqCst);
        for p in &plan {
            let seq = &mut self.sched.running_mut()[p.index];
            if !seq.started {
                seq.started = true;
                seq.weight_version = version;
            }
        }
        for (mut seq, err) in rejected {
            seq.fail(err);
        }
        (!plan.is_empty()).then_some(plan)
    }

    /// Launches `plan` on the runner. A row whose last pending token runs now samples
    /// the next one (its draw is taken here, once per token).
    fn launch(&mut self, plan: &[Planned]) -> LaunchedStep {
        let mut launched = Vec::with_capacity(plan.len());
        let mut sampling: Vec<Option<RowSampling>> = Vec::with_capacity(plan.len());
        for p in plan {
            let seq = &mut self.sched.running_mut()[p.index];
            let samples = seq.num_computed + p.q_len == seq.tokens.len();
            sampling.push(samples.then(|| seq.row_sampling()));
            launched.push(LaunchedRow {
                seq: seq.id,
                index: p.index,
                q_len: p.q_len,
                samples,
            });
        }
        let running = self.sched.running();
        let rows: Vec<StepRow> = plan
            .iter()
            .zip(sampling)
            .map(|(p, sample)| {
                let seq = &running[p.index];
                let start = seq.num_computed;
                StepRow {
                    tokens: &seq.tokens[start..start + p.q_len],
                    start,
                    blocks: &seq.blocks,
                    sample,
                }
            })
            .collect();
        let output = self.runner.launch(&rows, self.overlap, &self.stats);
        LaunchedStep {
            rows: launched,
            output,
        }
    }

    /// Launches the decode step after `current` (in flight) before `current`'s tokens are
    /// read: the same sequences, in the same rows, each computing the token `current` is
    /// sampling, which the graph feeds itself on the device. Only when nothing else could
    /// run next: no request waits to be admitted, no pause or weight update is pending, no
    /// sequence reaches its token limit with `current`'s token, and the pool has the
    /// blocks. A sequence that `current`'s token stops (a stop id or string) wasted one
    /// row of this step, which is dropped when it is read.
    fn launch_ahead(&mut self, current: &LaunchedStep) -> Option<LaunchedStep> {
        let copying = matches!(&current.output, StepOutput::InFlight(p) if p.copying());
        if !self.overlap || self.paused.is_some() || !self.updates.is_empty() || !copying {
            return None;
        }
        let sched = &self.sched;
        if sched.has_waiting() && sched.running().len() < sched.max_running() {
            return None;
        }
        let same_rows = sched.running().len() == current.rows.len()
            && sched
                .running()
                .iter()
                .zip(&current.rows)
                .all(|(s, r)| s.id == r.seq);
        // With `current`'s token a sequence holds tokens.len() + 1 tokens; the step ahead
        // computes the last of them.
        let continues = |s: &Sequence| {
            s.output().len() + 1 < s.params.max_new_tokens
                && s.tokens.len() + 1 < self.context_length
        };
        if !same_rows || !sched.running().iter().all(continues) {
            return None;
        }
        let longest = sched.running().iter().map(|s| s.tokens.len() + 1).max()?;
        if !self.runner.can_feed(sched.running().len(), longest) || !self.sched.reserve_ahead() {
            return None;
        }
        // The draws are put back if nothing is launched, so seeded requests sample the
        // same tokens either way.
        let draws: Vec<_> = self.sched.running().iter().map(|s| s.rng.clone()).collect();
        let sampling: Vec<RowSampling> = self
            .sched
            .running_mut()
            .iter_mut()
            .map(Sequence::row_sampling)
            .collect();
        let rows: Vec<FedRow> = self
            .sched
            .running()
            .iter()
            .zip(sampling)
            .map(|(s, sample)| FedRow {
                position: s.tokens.len(),
                blocks: &s.blocks,
                sample,
            })
            .collect();
        match self.runner.launch_fed(&rows) {
            Some(pending) => {
                self.stats.steps_ahead.fetch_add(1, Ordering::Relaxed);
                Some(LaunchedStep {
                    rows: current
                        .rows
                        .iter()
                        .enumerate()
                        .map(|(index, r)| LaunchedRow { index, ..*r })
                        .collect(),
                    output: StepOutput::InFlight(pending),
                })
            }
            None => {
                for (s, rng) in self.sched.running_mut().iter_mut().zip(draws) {
                    s.rng = rng;
                }
                None
            }
        }
    }

    /// Reads a launched step's tokens (waiting for the device if it is in flight) and
    /// records them: its rows' tokens are computed, the sampling rows take their new
    /// tokens, and finished sequences answer and leave. Rows whose sequence finished or
    /// was aborted since the launch are skipped.
    fn process(&mut self, step: LaunchedStep) {
        let sampled_rows = step.rows.iter().filter(|r| r.samples).count();
        let (next, logprobs) = match step.output {
            StepOutput::Ready(next, logprobs) => (next, logprobs),
            StepOutput::InFlight(pending) => pending.read(sampled_rows),
        };
        self.stats
            .add_step(step.rows.iter().map(|r| r.q_len).sum(), sampled_rows);
        let indices = self.running_indices(&step.rows);
        let mut tokens = next.into_iter().zip(logprobs);
        let mut finished = Vec::new();
        for (row, index) in step.rows.iter().zip(indices) {
            let token = if row.samples { tokens.next() } else { None };
            let Some(index) = index else { continue };
            self.sched.computed(index, row.q_len);
            let Some((tok, lp)) = token else { continue };
            let seq = &mut self.sched.running_mut()[index];
            seq.tokens.push(tok as u32);
            seq.logprobs.push(lp);
            let done = seq
                .stop
                .check(seq.output(), self.tokenizer.as_ref())
                .or_else(|| {
                    (seq.tokens.len() >= self.context_length)
                        .then_some((FinishReason::Length, None))
                });
            if let Some(done) = done {
                finished.push((index, done));
            }
        }
        // Remove finished sequences from the back so indices stay valid.
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (index, (reason, matched)) in finished {
            attach_routed_experts(&self.runner, &mut self.sched.running_mut()[index]);
            self.sched.finish(index).finish(reason, matched);
        }
    }

    /// Where each row's sequence runs now (`None`: it left since the launch); the
    /// launch-time index unless sequences left meanwhile.
    fn running_indices(&self, rows: &[LaunchedRow]) -> Vec<Option<usize>> {
        let running = self.sched.running();
        if rows
            .iter()
            .all(|r| running.get(r.index).is_some_and(|s| s.id == r.seq))
        {
            return rows.iter().map(|r| Some(r.index)).collect();
        }
        let index_of: HashMap<u64, usize> =
            running.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        rows.iter().map(|r| index_of.get(&r.seq).copied()).collect()
    }
}

/// Reads a finishing sequence's routed experts while its blocks are still its own, when
/// it asked for them: one row per token but the last (which never ran), as SGLang does.
fn attach_routed_experts(runner: &ModelRunner, seq: &mut Sequence) {
    if seq.return_routed_experts {
        let n = seq.tokens.len().saturating_sub(1).min(seq.num_computed);
        seq.routed_experts = runner.routed_experts(&seq.blocks, n);
    }
}

/// What a caught panic said.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

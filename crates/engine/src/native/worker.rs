//! The engine thread: owns the model, the paged KV cache and the scheduler, takes
//! commands between steps, and runs one batched model step at a time.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use manta_model::{CausalLm, PagedKvCache, PagedSeq};
use manta_tokenizer::Tokenizer;
use tch::{nn, Device, Tensor};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::decode_graphs::{DecodeGraphs, DecodeRow};
use super::sampler::{self, sample, RowSampling};
use super::scheduler::{Planned, Scheduler};
use super::sequence::Sequence;
use super::EngineStats;
use crate::{BroadcastFeed, EngineError, FinishReason, NamedTensors, PauseMode};
use manta_cuda::process_group::GroupSpec;
use manta_cuda::weight_group::{Backend, WeightGroup};

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

pub struct Worker {
    pub vs: nn::VarStore,
    pub model: CausalLm,
    pub kv: PagedKvCache,
    pub sched: Scheduler,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub device: Device,
    pub context_length: usize,
    pub version: Arc<AtomicU64>,
    pub stats: Arc<EngineStats>,
    /// Requests with an id below this run on the old weights; later ones wait for the update.
    updates: VecDeque<PendingUpdate>,
    paused: Option<PauseMode>,
    /// CUDA graphs of decode steps (CUDA devices only).
    graphs: Option<DecodeGraphs>,
    /// `MANTA_ENGINE_PROFILE=1`: time each step's phases (synchronising the device).
    profile: bool,
    drain_waiters: Vec<oneshot::Sender<()>>,
    next_id: u64,
    /// Blocks (scratch block included) of the KV pool while it is released.
    released_blocks: Option<usize>,
    /// Launch decode steps ahead of reading the previous one ([`Worker::launch_ahead`]).
    overlap: bool,
    /// A decode step whose tokens are not read yet (only between steps; commands other
    /// than new requests read it first, see [`Worker::settle`]).
    in_flight: Option<InFlight>,
    /// The weight-update group this engine receives broadcasts in, once joined.
    weight_group: Option<WeightGroup>,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vs: nn::VarStore,
        model: CausalLm,
        kv: PagedKvCache,
        sched: Scheduler,
        tokenizer: Option<Arc<Tokenizer>>,
        device: Device,
        context_length: usize,
        version: Arc<AtomicU64>,
        stats: Arc<EngineStats>,
    ) -> Self {
        // A sequence alone must always fit the pool, so preemption can always make progress.
        let context_length = context_length.min(sched.capacity_tokens());
        // Decode steps read the pool in place (block tables) for the kernels, and for
        // batch-invariant attention.
        let graphs = DecodeGraphs::new(
            device,
            model.decode_kernels_enabled() || model.invariant_attention_enabled(),
            sched.max_running(),
            context_length,
            sched.block_size(),
            0,
        );
        Self {
            vs,
            model,
            kv,
            sched,
            tokenizer,
            device,
            context_length,
            version,
            stats,
            updates: VecDeque::new(),
            paused: None,
            graphs,
            profile: manta_knobs::engine_profile(),
            drain_waiters: Vec::new(),
            next_id: 0,
            released_blocks: None,
            overlap: false,
            in_flight: None,
            weight_group: None,
        }
    }

    /// Turns overlapped decode steps on or off (off while profiling, which synchronises).
    pub fn overlap_schedule(mut self, on: bool) -> Self {
        self.overlap = on && !self.profile;
        self
    }

    /// Serves until every handle is dropped.
    pub fn serve(mut self, rx: mpsc::Receiver<Command>) {
        let _guard = tch::no_grad_guard();
        loop {
            let busy = self.released_blocks.is_none()
                && (!self.sched.running().is_empty()
                    || (self.sched.has_waiting() && self.paused.is_none()));
            // Released: nothing can run until a command arrives (the resume, or an
            // update applied below), so wait for one instead of spinning.
            if (!busy && self.updates.is_empty()) || self.released_blocks.is_some() {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
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
                let mut shapes: Vec<_> = self
                    .vs
                    .variables()
                    .into_iter()
                    .map(|(k, t)| (k, t.size(), t.kind()))
                    .collect();
                shapes.sort_by(|a, b| a.0.cmp(&b.0));
                let _ = reply.send(shapes);
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
                let mut named: NamedTensors = self
                    .vs
                    .variables()
                    .into_iter()
                    .map(|(k, t)| (k, t.copy()))
                    .collect();
                named.sort_by(|a, b| a.0.cmp(&b.0));
                let _ = reply.send(named);
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
        let blocks = self.kv.num_slots() / self.sched.block_size();
        let cfg = self.model.config().clone();
        self.kv = PagedKvCache::new(
            &cfg,
            0,
            self.sched.block_size(),
            self.kv.kind(),
            self.device,
        );
        if let Some(graphs) = self.graphs.as_mut() {
            graphs.clear();
        }
        if self.device.is_cuda() {
            if let Err(e) = manta_cuda::empty_cache() {
                tracing::warn!(error = %e, "could not return the released KV cache to the device");
            }
        }
        self.released_blocks = Some(blocks);
        tracing::info!(blocks, "native engine released its KV cache");
        true
    }

    /// Allocates the KV pool again after [`Worker::release_memory`].
    fn resume_memory(&mut self) {
        if let Some(blocks) = self.released_blocks.take() {
            let cfg = self.model.config().clone();
            self.kv = PagedKvCache::new(
                &cfg,
                blocks,
                self.sched.block_size(),
                self.kv.kind(),
                self.device,
            );
            tracing::info!(blocks, "native engine allocated its KV cache again");
        }
    }

    fn abort(&mut self, rid: Option<&str>) {
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
                WeightSource::All(w) => self.load_tensors(w, true),
                WeightSource::Some(w) => self.load_tensors(w, false),
                WeightSource::Disk(dir) => {
                    manta_model::load_weights(&mut self.vs, &dir).map_err(EngineError::from)
                }
                WeightSource::Broadcast(feed) => self.receive_broadcast(feed),
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

    /// Copies `weights` into the parameters; `whole`: they must be all of them.
    fn load_tensors(&mut self, weights: NamedTensors, whole: bool) -> Result<(), EngineError> {
        let mut vars = self.vs.variables();
        if whole && weights.len() != vars.len() {
            return Err(EngineError::Weights(format!(
                "got {} tensors, the engine's model has {}",
                weights.len(),
                vars.len()
            )));
        }
        for (name, src) in &weights {
            let dst = vars
                .get(name)
                .ok_or_else(|| EngineError::Weights(format!("unknown tensor {name}")))?;
            if dst.size() != src.size() {
                return Err(EngineError::Weights(format!(
                    "tensor {name} has shape {:?}, the engine expects {:?}",
                    src.size(),
                    dst.size()
                )));
            }
        }
        for (name, src) in weights {
            if let Some(dst) = vars.get_mut(&name) {
                // Straight into the parameter: from another GPU this is one peer copy
                // (no staging tensor on this device), a dtype change is done in it.
                dst.copy_(&src);
            }
        }
        Ok(())
    }

    /// Receives every parameter from rank 0 of `feed`'s group straight into the model's
    /// memory, joining the group first when this engine is not in it. A failed broadcast
    /// leaves the group (the next update joins a new one); the parameters may then be
    /// partly written, so the sender follows with another update.
    fn receive_broadcast(&mut self, feed: BroadcastFeed) -> Result<(), EngineError> {
        let vars = self.vs.variables();
        let mut tensors = Vec::with_capacity(feed.names.len());
        for name in &feed.names {
            let t = vars
                .get(name)
                .ok_or_else(|| EngineError::Weights(format!("unknown tensor {name}")))?;
            tensors.push((name.clone(), t.shallow_clone()));
        }
        let device = match (feed.backend, self.device) {
            (Backend::Nccl, Device::Cuda(device)) => device,
            (Backend::Store, Device::Cpu) => 0,
            (backend, device) => {
                return Err(EngineError::Unsupported(format!(
                    "a {backend:?} weight broadcast cannot feed an engine on {device:?} \
                     (NCCL needs a CUDA device, the store backend host memory)"
                )))
            }
        };
        let group = match self.weight_group.take() {
            Some(group)
                if group.spec().group_name == feed.group_name
                    && group.backend() == feed.backend =>
            {
                self.weight_group.insert(group)
            }
            _ => {
                let spec = GroupSpec {
                    master_address: feed.master_address,
                    master_port: feed.master_port,
                    rank: feed.rank,
                    world_size: feed.world_size,
                    group_name: feed.group_name,
                    device,
                    timeout: feed.timeout,
                };
                info!(group = %spec.group_name, rank = spec.rank, backend = ?feed.backend, device, "joining the weight-update group");
                let joined = WeightGroup::join(spec, feed.backend)
                    .map_err(|e| EngineError::Weights(e.to_string()))?;
                self.weight_group.insert(joined)
            }
        };
        let received = group.broadcast(&tensors, 0);
        if received.is_err() {
            self.weight_group = None;
        }
        received.map_err(|e| EngineError::Weights(e.to_string()))
    }

    /// One model step; a failing step fails its requests and the engine keeps serving.
    /// With a step in flight, the next one is launched ahead when it can be (see
    /// [`Worker::launch_ahead`]) before the one in flight is read, so the host's turn
    /// overlaps the device's work.
    fn step(&mut self) {
        let result = catch_unwind(AssertUnwindSafe(|| match self.in_flight.take() {
            Some(current) => {
                let ahead = self.launch_ahead(&current);
                self.complete(current);
                self.in_flight = ahead;
            }
            None => self.plan_and_run(),
        }));
        if let Err(panic) = result {
            self.fail_running(&panic_message(panic.as_ref()));
        }
    }

    /// Reads the step in flight, if any, before a command looks at the running requests.
    fn settle(&mut self) {
        if let Some(current) = self.in_flight.take() {
            let result = catch_unwind(AssertUnwindSafe(|| self.complete(current)));
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
        if let Device::Cuda(index) = self.device {
            let synced = catch_unwind(|| tch::Cuda::synchronize(index as i64));
            if synced.is_err() {
                warn!("device synchronisation after the failed step failed too");
            }
        }
        for mut seq in self.sched.take_running() {
            seq.fail(EngineError::Stopped(format!("model step failed: {msg}")));
        }
    }

    /// Plans a step and runs it.
    fn plan_and_run(&mut self) {
        let barrier = self.updates.front().map(|u| u.after_request);
        let paused = self.paused.is_some();
        // Paused engines and weight-update barriers hold new requests back.
        let (plan, rejected) = self
            .sched
            .plan(|s| !paused && barrier.is_none_or(|b| s.id < b));
        self.stats.preemptions.store(
            self.sched.preemptions(),
            std::sync::atomic::Ordering::Relaxed,
        );
        // A request's weight version is the one it starts on (a weight update waits for
        // requests that arrived before it, so later ones start on the new weights).
        let version = self.version.load(std::sync::atomic::Ordering::SeqCst);
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
        if !plan.is_empty() {
            self.run(&plan);
        }
    }

    fn run(&mut self, plan: &[Planned]) {
        let mut prof = self.profile.then(|| StepProfile::start(self.device));
        let bs = self.sched.block_size();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        // The rows whose last pending token runs now sample a next token: their flat row
        // index, sequence index and controls (the draw is taken here, once per token).
        let mut sample_rows = Vec::new();
        let mut sampled_seqs = Vec::new();
        let mut rows: Vec<RowSampling> = Vec::new();
        for p in plan {
            let seq = &mut self.sched.running_mut()[p.index];
            let start = seq.num_computed;
            let end = start + p.q_len;
            ids.extend(seq.tokens[start..end].iter().map(|&t| t as i64));
            positions.extend((start..end).map(|p| p as i64));
            if end == seq.tokens.len() {
                sample_rows.push((ids.len() - 1) as i64);
                sampled_seqs.push(p.index);
                rows.push(seq.row_sampling());
            }
        }
        if let Some(p) = prof.as_mut() {
            p.lap(0);
        }
        let vocab = self.model.lm_head_weight().size()[0];
        let graphed = match self.graphs.as_mut() {
            Some(graphs) if plan.iter().all(|p| p.q_len == 1) => {
                let running = &self.sched.running();
                let sample = graph_samples(&rows, plan.len(), vocab);
                // When the graph samples, every plan row samples: rows[i] is plan[i]'s.
                let decode_rows: Vec<DecodeRow> = plan
                    .iter()
                    .zip(ids.iter().zip(&positions))
                    .enumerate()
                    .map(|(i, (p, (&token, &position)))| DecodeRow {
                        token,
                        position,
                        blocks: &running[p.index].blocks,
                        sample: if sample {
                            rows[i].kernel_pair()
                        } else {
                            [0.0; 2]
                        },
                    })
                    .collect();
                graphs.run(&self.model, &self.kv, &decode_rows, sample, false)
            }
            _ => None,
        };
        let (hidden, sampled) = match graphed {
            Some(out) => {
                // A graph that sampled took every row (all decodes): it can stay in
                // flight while the host moves on.
                let tokens = out.sampled.map(|s| Pending::from_device(s, out.to_host));
                match tokens {
                    Some(tokens) if self.overlap => {
                        self.in_flight = Some(InFlight {
                            seq_ids: plan
                                .iter()
                                .map(|p| self.sched.running()[p.index].id)
                                .collect(),
                            tokens,
                        });
                        return;
                    }
                    tokens => (out.hidden, tokens),
                }
            }
            None => {
                let seqs: Vec<PagedSeq> = plan
                    .iter()
                    .map(|p| {
                        let seq = &self.sched.running()[p.index];
                        let end = seq.num_computed + p.q_len;
                        PagedSeq {
                            q_len: p.q_len,
                            slots: (0..end)
                                .map(|pos| cache_slot(&seq.blocks, pos, bs))
                                .collect(),
                        }
                    })
                    .collect();
                let batch = self.model.paged_batch(&seqs, self.device, bs);
                let input = Tensor::from_slice(&ids).to(self.device);
                let pos = Tensor::from_slice(&positions).to(self.device);
                (
                    self.model.forward_paged(&input, &pos, &batch, &self.kv),
                    None,
                )
            }
        };
        if let Some(p) = prof.as_mut() {
            p.lap(1);
        }
        let (next, logprobs) = if rows.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            match sampled {
                Some(sampled) => sampled.read(rows.len()),
                None => {
                    // Decode steps sample every row, in order: no gather needed.
                    let every_row = sample_rows.len() == ids.len();
                    let sampled_hidden = if every_row {
                        hidden
                    } else {
                        hidden.index_select(0, &Tensor::from_slice(&sample_rows).to(self.device))
                    };
                    sample(&self.model.logits_f32(&sampled_hidden), &rows)
                }
            }
        };
        self.stats.add_step(ids.len(), sample_rows.len());
        self.record(plan, &sampled_seqs, next, logprobs);
        if let Some(p) = prof.as_mut() {
            p.lap(2);
            p.report(plan.len(), &self.stats);
        }
    }

    /// Launches the decode step after `current` (in flight) before `current`'s tokens are
    /// read: the same sequences, in the same rows, each computing the token `current` is
    /// sampling, which the graph feeds itself on the device. Only when nothing else could
    /// run next: no request waits to be admitted, no pause or weight update is pending, no
    /// sequence reaches its token limit with `current`'s token, and the pool has the
    /// blocks. A sequence that `current`'s token stops (a stop id or string) wasted one
    /// row of this step, which is dropped when it is read.
    fn launch_ahead(&mut self, current: &InFlight) -> Option<InFlight> {
        if !self.overlap
            || self.paused.is_some()
            || !self.updates.is_empty()
            || !current.tokens.copying()
        {
            return None;
        }
        let sched = &self.sched;
        if sched.has_waiting() && sched.running().len() < sched.max_running() {
            return None;
        }
        let same_rows = sched.running().len() == current.seq_ids.len()
            && sched
                .running()
                .iter()
                .zip(&current.seq_ids)
                .all(|(s, &id)| s.id == id);
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
        if !self
            .graphs
            .as_ref()?
            .can_feed(sched.running().len(), longest)
        {
            return None;
        }
        if !self.sched.reserve_ahead() {
            return None;
        }
        // The draws are put back if nothing is launched, so seeded requests sample the
        // same tokens either way.
        let draws: Vec<_> = self.sched.running().iter().map(|s| s.rng.clone()).collect();
        let rows: Vec<RowSampling> = self
            .sched
            .running_mut()
            .iter_mut()
            .map(Sequence::row_sampling)
            .collect();
        let vocab = self.model.lm_head_weight().size()[0];
        let launched = if graph_samples(&rows, rows.len(), vocab) {
            let decode_rows: Vec<DecodeRow> = self
                .sched
                .running()
                .iter()
                .zip(&rows)
                .map(|(s, r)| DecodeRow {
                    token: 0,
                    position: s.tokens.len() as i64,
                    blocks: &s.blocks,
                    sample: r.kernel_pair(),
                })
                .collect();
            match self.graphs.as_mut() {
                Some(graphs) => graphs.run(&self.model, &self.kv, &decode_rows, true, true),
                None => None,
            }
        } else {
            None
        };
        match launched.and_then(|out| Some((out.sampled?, out.to_host))) {
            Some((sampled, to_host)) => {
                self.stats.steps_ahead.fetch_add(1, Ordering::Relaxed);
                Some(InFlight {
                    seq_ids: current.seq_ids.clone(),
                    tokens: Pending::from_device(sampled, to_host),
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

    /// Reads a step that was left in flight and records it for the sequences still
    /// running (one that finished or was aborted meanwhile is skipped).
    fn complete(&mut self, step: InFlight) {
        let (next, logprobs) = step.tokens.read(step.seq_ids.len());
        let index_of: HashMap<u64, usize> = self
            .sched
            .running()
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id, i))
            .collect();
        let mut plan = Vec::with_capacity(step.seq_ids.len());
        let (mut kept_next, mut kept_logprobs) = (Vec::new(), Vec::new());
        for ((id, tok), lp) in step.seq_ids.iter().zip(next).zip(logprobs) {
            if let Some(&index) = index_of.get(id) {
                plan.push(Planned { index, q_len: 1 });
                kept_next.push(tok);
                kept_logprobs.push(lp);
            }
        }
        self.stats.add_step(step.seq_ids.len(), step.seq_ids.len());
        let sampled: Vec<usize> = plan.iter().map(|p| p.index).collect();
        self.record(&plan, &sampled, kept_next, kept_logprobs);
    }

    /// Records a step's results: `plan`'s tokens are computed; the sequences at
    /// `sampled` (running indices, in the order of `next`) take their new tokens; the
    /// finished ones answer and leave.
    fn record(&mut self, plan: &[Planned], sampled: &[usize], next: Vec<i64>, logprobs: Vec<f32>) {
        for p in plan {
            self.sched.computed(p.index, p.q_len);
        }
        let mut finished = Vec::new();
        for ((&index, tok), lp) in sampled.iter().zip(next).zip(logprobs) {
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
            self.sched.finish(index).finish(reason, matched);
        }
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

/// A decode step launched on the device whose sampled tokens the host has not read yet.
struct InFlight {
    /// The sequences of its rows, in row order.
    seq_ids: Vec<u64>,
    tokens: Pending,
}

/// A sampling kernel's output on its way to the host.
enum Pending {
    /// Being copied into a pinned host buffer; the event follows the copy.
    Copying(Tensor, manta_cuda::CudaEvent),
    /// Still on the device only (no copy could be queued): read with a blocking copy,
    /// before anything can overwrite it.
    OnDevice(Tensor),
}

impl Pending {
    fn from_device(sampled: Tensor, to_host: Option<(Tensor, manta_cuda::CudaEvent)>) -> Self {
        match to_host {
            Some((host, event)) => Self::Copying(host, event),
            None => Self::OnDevice(sampled),
        }
    }

    /// Whether later steps may run before this one is read (its output is safe on the host).
    fn copying(&self) -> bool {
        matches!(self, Self::Copying(..))
    }

    /// The first `rows` (token id, log-prob) pairs; waits for the device. Panics (caught
    /// by the engine's step, which fails the requests) if the device reports an error.
    fn read(self, rows: usize) -> (Vec<i64>, Vec<f32>) {
        match self {
            Self::Copying(host, event) => {
                if let Err(e) = event.synchronize() {
                    panic!("waiting for a decode step: {e}");
                }
                sampler::read_kernel_output(&host, rows)
            }
            Self::OnDevice(sampled) => sampler::kernel_output_to_host(&sampled, rows),
        }
    }
}

/// Whether a decode-only step of `steps` rows, of which `rows` sample, samples inside its
/// graph: when every row samples (a one-token prefill chunk with more to come does not),
/// the sampling kernel can take every row, and `MANTA_GRAPH_SAMPLING` is not `0` (A/B runs;
/// read once).
fn graph_samples(rows: &[RowSampling], steps: usize, vocab: i64) -> bool {
    manta_knobs::graph_sampling() && rows.len() == steps && sampler::kernel_handles(rows, vocab)
}

/// The KV cache's block for pool block `block`: pool block b is cache block b + 1 (cache
/// block 0 is the scratch block that padding rows write to).
pub(super) fn cache_block(block: u32) -> i64 {
    block as i64 + 1
}

/// The KV-cache slot of position `pos` of a sequence holding pool `blocks`.
pub(super) fn cache_slot(blocks: &[u32], pos: usize, block_size: usize) -> i64 {
    cache_block(blocks[pos / block_size]) * block_size as i64 + (pos % block_size) as i64
}

/// Where a step's time goes: host-side preparation, the model, sampling.
struct StepProfile {
    device: Device,
    last: std::time::Instant,
    phases: [f64; 3],
}

impl StepProfile {
    fn start(device: Device) -> Self {
        Self {
            device,
            last: std::time::Instant::now(),
            phases: [0.0; 3],
        }
    }

    fn lap(&mut self, phase: usize) {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        let now = std::time::Instant::now();
        self.phases[phase] = (now - self.last).as_secs_f64() * 1e3;
        self.last = now;
    }

    fn report(&self, rows: usize, stats: &EngineStats) {
        let step = stats.steps.load(Ordering::Relaxed);
        if step.is_multiple_of(32) {
            // Printed, not logged: benchmarks run without a subscriber.
            eprintln!(
                "engine step {step}: {rows} rows, prepare {:.2} ms, forward {:.2} ms, sample {:.2} ms",
                self.phases[0], self.phases[1], self.phases[2]
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(top_p: f64) -> RowSampling {
        RowSampling {
            greedy: false,
            temperature: 1.0,
            top_k: -1,
            top_p,
            min_p: 0.0,
            uniform: 0.5,
        }
    }

    #[test]
    fn graphs_sample_only_when_every_row_samples_with_the_kernel() {
        assert!(graph_samples(&[row(1.0), row(1.0)], 2, 1000));
        // A row still prefilling (one-token chunk, more to come) samples nothing: its
        // step's sampled rows are not the graph's first rows.
        assert!(!graph_samples(&[row(1.0)], 2, 1000));
        // top-p needs the tensor-op sampler.
        assert!(!graph_samples(&[row(1.0), row(0.9)], 2, 1000));
    }
}

//! The device side of an engine step. The event loop (`event_loop.rs`) decides which
//! rows run; the runner turns them into the model's inputs, runs them — a captured
//! decode graph when one fits, else the eager paged forward with the attention the model
//! chose at start — and samples. It owns everything on the device: weights, the paged KV
//! pool, the decode graphs and the weight-update group.

use std::path::Path;
use std::sync::atomic::Ordering;

use manta_cuda::process_group::GroupSpec;
use manta_cuda::weight_group::{Backend, WeightGroup};
use manta_model::{CausalLm, PagedKvCache, PagedSeq};
use tch::{nn, Device, Tensor};
use tracing::{info, warn};

use super::block_pool::cache_slot;
use super::decode_graphs::{DecodeGraphs, DecodeRow};
use super::routed_experts::RoutingStore;
use super::sampler::{self, sample, RowSampling};
use super::stats::EngineStats;
use crate::{BroadcastFeed, EngineError, NamedTensors};

/// One row of a step: a sequence's `tokens`, at positions `start..start + tokens.len()`,
/// computed over the pool `blocks` that hold its context.
pub(super) struct StepRow<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub blocks: &'a [u32],
    /// Set when the row's last token is the sequence's last: it samples the next one.
    pub sample: Option<RowSampling>,
}

/// A decode row of a step launched ahead: its token is the one the step in flight is
/// sampling, which the graph feeds itself on the device.
pub(super) struct FedRow<'a> {
    /// The position that token takes.
    pub position: usize,
    pub blocks: &'a [u32],
    pub sample: RowSampling,
}

/// What a launched step produced for its sampling rows.
pub(super) enum StepOutput {
    /// Token ids and log-probs, one per sampling row, in row order.
    Ready(Vec<i64>, Vec<f32>),
    /// Still being computed: a graphed decode step in which every row samples.
    InFlight(Pending),
}

/// Owns the model and what it runs on.
pub(super) struct ModelRunner {
    vs: nn::VarStore,
    model: CausalLm,
    kv: PagedKvCache,
    /// CUDA graphs of decode steps (CUDA devices only).
    graphs: Option<DecodeGraphs>,
    device: Device,
    block_size: usize,
    vocab: i64,
    /// The weight-update group this engine receives broadcasts in, once joined.
    weight_group: Option<WeightGroup>,
    /// `MANTA_ENGINE_PROFILE=1`: time each step's phases (synchronising the device).
    profile: bool,
    /// Each KV slot's routed experts, when the engine returns them.
    routing: Option<RoutingStore>,
}

impl ModelRunner {
    /// A runner over a loaded model and its KV pool; decode graphs hold up to
    /// `max_rows` rows of `context_length` tokens.
    pub fn new(
        vs: nn::VarStore,
        model: CausalLm,
        kv: PagedKvCache,
        device: Device,
        block_size: usize,
        max_rows: usize,
        context_length: usize,
    ) -> Self {
        // Decode steps read the pool in place (block tables) for the kernels, and for
        // batch-invariant attention.
        let graphs = DecodeGraphs::new(
            device,
            model.decode_kernels_enabled() || model.invariant_attention_enabled(),
            max_rows,
            context_length,
            block_size,
            0,
        );
        let vocab = model.lm_head_weight().size()[0];
        Self {
            vs,
            model,
            kv,
            graphs,
            device,
            block_size,
            vocab,
            weight_group: None,
            profile: manta_knobs::engine_profile(),
            routing: None,
        }
    }

    /// Records every computed token's routed experts from now on (a mixture-of-experts
    /// model). Decode graphs are dropped: their replays cannot hand the record out.
    pub fn record_routed_experts(&mut self) {
        self.routing = RoutingStore::new(&self.model, self.kv.num_slots());
        if self.routing.is_some() {
            self.model.record_routing(true);
            self.graphs = None;
        }
    }

    /// The routed experts of positions `0..n` of a sequence holding `blocks`.
    pub fn routed_experts(&self, blocks: &[u32], n: usize) -> Option<crate::RoutedExperts> {
        let store = self.routing.as_ref()?;
        Some(store.read(blocks, n, self.block_size))
    }

    /// Whether steps are timed phase by phase (which synchronises the device, so no
    /// step may stay in flight).
    pub fn profiling(&self) -> bool {
        self.profile
    }

    /// Runs one step of `rows` (decode rows first, as the scheduler plans them). With
    /// `may_stay_in_flight`, a graphed step whose rows all sample is left running and
    /// returned as [`StepOutput::InFlight`].
    pub fn launch(
        &mut self,
        rows: &[StepRow],
        may_stay_in_flight: bool,
        stats: &EngineStats,
    ) -> StepOutput {
        let mut prof = self.profile.then(|| StepProfile::start(self.device));
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut sample_rows = Vec::new();
        let mut sampling = Vec::new();
        for row in rows {
            ids.extend(row.tokens.iter().map(|&t| t as i64));
            positions.extend((row.start..row.start + row.tokens.len()).map(|p| p as i64));
            if let Some(s) = &row.sample {
                sample_rows.push((ids.len() - 1) as i64);
                sampling.push(*s);
            }
        }
        if let Some(p) = prof.as_mut() {
            p.lap(0);
        }
        let (hidden, graph_sampled) = match self.run_graphed(rows, &sampling) {
            Some(out) => {
                let tokens = out.sampled.map(|s| Pending::from_device(s, out.to_host));
                match tokens {
                    // A graph that sampled took every row: it can stay in flight.
                    Some(tokens) if may_stay_in_flight => return StepOutput::InFlight(tokens),
                    tokens => (out.hidden, tokens),
                }
            }
            None => {
                let hidden = self.run_eager(rows, &ids, &positions);
                if let Some(store) = self.routing.as_mut() {
                    if let Some(recorded) = self.model.take_routed_experts() {
                        let spans = rows.iter().map(|r| (r.blocks, r.start, r.tokens.len()));
                        store.write(spans, &recorded, self.block_size);
                    }
                }
                (hidden, None)
            }
        };
        if let Some(p) = prof.as_mut() {
            p.lap(1);
        }
        let (next, logprobs) = match graph_sampled {
            _ if sampling.is_empty() => (Vec::new(), Vec::new()),
            Some(tokens) => tokens.read(sampling.len()),
            None => {
                // Decode steps sample every row, in order: no gather needed.
                let sampled_hidden = if sample_rows.len() == ids.len() {
                    hidden
                } else {
                    hidden.index_select(0, &Tensor::from_slice(&sample_rows).to(self.device))
                };
                sample(&self.model.logits_f32(&sampled_hidden), &sampling)
            }
        };
        if let Some(p) = prof.as_mut() {
            p.lap(2);
            p.report(rows.len(), stats);
        }
        StepOutput::Ready(next, logprobs)
    }

    /// A decode-only step through a captured graph, sampling in it when every row samples
    /// with the kernel; `None` when the step runs eagerly.
    fn run_graphed(
        &mut self,
        rows: &[StepRow],
        sampling: &[RowSampling],
    ) -> Option<super::decode_graphs::DecodeOutput> {
        let graphs = self.graphs.as_mut()?;
        if !rows.iter().all(|r| r.tokens.len() == 1) {
            return None;
        }
        let sample = graph_samples(sampling, rows.len(), self.vocab);
        // When the graph samples, every row samples: sampling[i] is rows[i]'s.
        let decode_rows: Vec<DecodeRow> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| DecodeRow {
                token: r.tokens[0] as i64,
                position: r.start as i64,
                blocks: r.blocks,
                sample: if sample {
                    sampling[i].kernel_pair()
                } else {
                    [0.0; 2]
                },
            })
            .collect();
        graphs.run(&self.model, &self.kv, &decode_rows, sample, false)
    }

    /// The paged forward, outside any graph: hidden states of every row's tokens.
    fn run_eager(&self, rows: &[StepRow], ids: &[i64], positions: &[i64]) -> Tensor {
        let bs = self.block_size;
        let seqs: Vec<PagedSeq> = rows
            .iter()
            .map(|r| PagedSeq {
                q_len: r.tokens.len(),
                slots: (0..r.start + r.tokens.len())
                    .map(|pos| cache_slot(r.blocks, pos, bs))
                    .collect(),
            })
            .collect();
        let batch = self.model.paged_batch(&seqs, self.device, bs);
        let input = Tensor::from_slice(ids).to(self.device);
        let pos = Tensor::from_slice(positions).to(self.device);
        self.model.forward_paged(&input, &pos, &batch, &self.kv)
    }

    /// Whether a step of `rows` rows, the longest context `longest` tokens, can be
    /// launched with [`ModelRunner::launch_fed`] after the step just launched.
    pub fn can_feed(&self, rows: usize, longest: usize) -> bool {
        self.graphs
            .as_ref()
            .is_some_and(|g| g.can_feed(rows, longest))
    }

    /// Launches the decode step after the one in flight, in the same rows, its tokens
    /// fed on the device; `None` when it cannot be (the caller then reads the step in
    /// flight first and plans again).
    pub fn launch_fed(&mut self, rows: &[FedRow]) -> Option<Pending> {
        let sampling: Vec<RowSampling> = rows.iter().map(|r| r.sample).collect();
        if !graph_samples(&sampling, rows.len(), self.vocab) {
            return None;
        }
        let decode_rows: Vec<DecodeRow> = rows
            .iter()
            .map(|r| DecodeRow {
                token: 0,
                position: r.position as i64,
                blocks: r.blocks,
                sample: r.sample.kernel_pair(),
            })
            .collect();
        let out = self
            .graphs
            .as_mut()?
            .run(&self.model, &self.kv, &decode_rows, true, true)?;
        Some(Pending::from_device(out.sampled?, out.to_host))
    }

    /// Waits for the device after a failed step: work it queued may still read buffers
    /// the next step rewrites.
    pub fn synchronize_after_failure(&self) {
        if let Device::Cuda(index) = self.device {
            let synced = std::panic::catch_unwind(|| tch::Cuda::synchronize(index as i64));
            if synced.is_err() {
                warn!("device synchronisation after the failed step failed too");
            }
        }
    }

    /// Frees the KV pool (and the graphs that point into it); returns its blocks, scratch
    /// block included, for [`ModelRunner::allocate_kv`].
    pub fn release_kv(&mut self) -> usize {
        let blocks = self.kv.num_slots() / self.block_size;
        self.kv = self.new_kv(0);
        if let Some(graphs) = self.graphs.as_mut() {
            graphs.clear();
        }
        if self.device.is_cuda() {
            if let Err(e) = manta_cuda::empty_cache() {
                warn!(error = %e, "could not return the released KV cache to the device");
            }
        }
        blocks
    }

    /// Allocates a KV pool of `blocks` blocks again.
    pub fn allocate_kv(&mut self, blocks: usize) {
        self.kv = self.new_kv(blocks);
    }

    fn new_kv(&self, blocks: usize) -> PagedKvCache {
        PagedKvCache::new(
            self.model.config(),
            blocks,
            self.block_size,
            self.kv.kind(),
            self.device,
        )
    }

    /// Every parameter's name, shape and dtype, sorted by name.
    pub fn weight_shapes(&self) -> Vec<(String, Vec<i64>, tch::Kind)> {
        let mut shapes: Vec<_> = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.size(), t.kind()))
            .collect();
        shapes.sort_by(|a, b| a.0.cmp(&b.0));
        shapes
    }

    /// Copies of the parameters, sorted by name.
    pub fn read_weights(&self) -> NamedTensors {
        let mut named: NamedTensors = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.copy()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }

    /// Loads a model directory's safetensors into the parameters.
    pub fn load_from_disk(&mut self, dir: &Path) -> Result<(), EngineError> {
        manta_model::load_weights(&mut self.vs, dir).map_err(EngineError::from)
    }

    /// Copies `weights` into the parameters; `whole`: they must be all of them. Nothing
    /// is written unless every name and shape matches.
    pub fn load_tensors(&mut self, weights: NamedTensors, whole: bool) -> Result<(), EngineError> {
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

    /// Copies every group of `parts` into the parameters as it arrives, answering each
    /// once its tensors are dropped (the sender gathers the next only then); the update
    /// must cover every parameter. A group that does not match fails the update there:
    /// the groups before it are already written, so the sender follows with another
    /// update (as after a failed broadcast).
    pub fn load_parts(&mut self, mut parts: crate::WeightParts) -> Result<(), EngineError> {
        let total = self.vs.variables().len();
        let mut seen = std::collections::HashSet::new();
        while let Some(part) = parts.blocking_recv() {
            let (tensors, copied) = part.into_parts();
            seen.extend(tensors.iter().map(|(name, _)| name.clone()));
            self.load_tensors(tensors, false)?;
            copied.done();
        }
        if seen.len() != total {
            return Err(EngineError::Weights(format!(
                "the update in parts ended with {} of the engine's {total} parameters",
                seen.len()
            )));
        }
        Ok(())
    }

    /// Receives every parameter from rank 0 of `feed`'s group straight into the model's
    /// memory, joining the group first when this engine is not in it. A failed broadcast
    /// leaves the group (the next update joins a new one); the parameters may then be
    /// partly written, so the sender follows with another update. The group's aborter
    /// goes to `feed.on_receive` first, so the host can end a receive rank 0 abandoned.
    pub fn receive_broadcast(&mut self, feed: BroadcastFeed) -> Result<(), EngineError> {
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
        let on_receive = feed.on_receive.clone();
        let group = match self.weight_group.take() {
            Some(group)
                if group.spec().group_name == feed.group_name
                    && group.backend() == feed.backend =>
            {
                self.weight_group.insert(group)
            }
            stale => {
                // The old group's peers may be gone (a new group means its members
                // changed): abort it, so dropping it waits on nobody.
                abort_group(stale);
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
        if let Some(hook) = &on_receive {
            hook.publish(&group.spec().group_name, group.aborter());
        }
        let started = std::time::Instant::now();
        let received = broadcast_rounds(group, &tensors, &feed.rounds);
        if received.is_err() {
            abort_group(self.weight_group.take());
        } else {
            // The receive alone (the root's figure also waits for this engine to pause):
            // what to set beside a bare torch.distributed broadcast.
            let bytes: usize = tensors
                .iter()
                .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
                .sum();
            let seconds = started.elapsed().as_secs_f64();
            info!(
                tensors = tensors.len(),
                bytes,
                seconds,
                enqueue_s = group.last_enqueue().map(|d| d.as_secs_f64()),
                gb_per_s = bytes as f64 / seconds.max(1e-9) / 1e9,
                "weights received into the engine's parameters"
            );
        }
        received
    }
}

/// Receives `tensors` in the rounds rank 0 sends them (`rounds`: tensors per round,
/// consecutive; empty: one round of all), each round one broadcast of the group.
fn broadcast_rounds(
    group: &mut WeightGroup,
    tensors: &[(String, tch::Tensor)],
    rounds: &[usize],
) -> Result<(), EngineError> {
    let whole = [tensors.len()];
    let rounds = if rounds.is_empty() {
        &whole[..]
    } else {
        rounds
    };
    if rounds.iter().sum::<usize>() != tensors.len() {
        return Err(EngineError::Weights(format!(
            "the broadcast's rounds carry {} tensors, its names {}",
            rounds.iter().sum::<usize>(),
            tensors.len()
        )));
    }
    let mut at = 0;
    for &n in rounds {
        group
            .broadcast(&tensors[at..at + n], 0)
            .map_err(|e| EngineError::Weights(e.to_string()))?;
        at += n;
    }
    Ok(())
}

/// Aborts a weight-update group this engine is leaving before it is dropped: dropping a
/// live NCCL communicator finalizes it, which can wait on a peer that died.
fn abort_group(group: Option<WeightGroup>) {
    if let Some(group) = group {
        if let Err(e) = group.aborter().abort() {
            warn!(group = %group.spec().group_name, error = %e, "aborting the old weight-update group failed");
        }
    }
}

/// A sampling kernel's output on its way to the host.
pub(super) enum Pending {
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
    pub fn copying(&self) -> bool {
        matches!(self, Self::Copying(..))
    }

    /// The first `rows` (token id, log-prob) pairs; waits for the device. Panics (caught
    /// by the engine's step, which fails the requests) if the device reports an error.
    pub fn read(self, rows: usize) -> (Vec<i64>, Vec<f32>) {
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

    /// Prints one profiled step in 32.
    fn report(&self, rows: usize, stats: &EngineStats) {
        let n = stats.steps.load(Ordering::Relaxed);
        if n.is_multiple_of(32) {
            // Printed, not logged: benchmarks run without a subscriber.
            eprintln!(
                "engine step {n}: {rows} rows, prepare {:.2} ms, forward {:.2} ms, sample {:.2} ms",
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

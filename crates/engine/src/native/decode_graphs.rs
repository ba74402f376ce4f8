//! CUDA graphs for decode steps. A decode step of a small model is hundreds of tiny kernel
//! launches whose host-side cost dwarfs the GPU work; captured once per (batch bucket,
//! context bucket, whether it samples), the whole step replays with one launch over fixed
//! input buffers.
//! Rows past the real batch point at a scratch slot that no sequence owns.
//!
//! A graph can end with the LM head and the sampling kernel too, so that a decode step is
//! one input copy, one replay and one copy of the chosen tokens back: nothing between the
//! forward and the sampler waits for the host. Such a graph also writes the chosen tokens
//! into its own input ids, so its next replay can start before the host has read them
//! (`feed`, the engine's overlapped steps); pinned buffers alternate between calls, so one
//! step's copies never touch the buffers the step before it is still using.

use std::collections::HashMap;

use manta_cuda::CudaGraph;
use manta_model::{CausalLm, PagedBatch, PagedKvCache};
use tch::{Device, Kind, Tensor};
use tracing::{debug, warn};

use super::block_pool::{cache_block, cache_slot};
use super::sampler;

/// The fixed input buffers a captured step reads.
enum Inputs {
    /// Padded slot matrix [B, W] and mask [B, 1, 1, W], gathered by index_select.
    Gather {
        ids: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        slots: Tensor,
        keep: Tensor,
        /// The sampling kernel's [2, B] parameters.
        params: Tensor,
    },
    /// For the paged kernel, everything in one i64 buffer (one host-to-device copy per
    /// step): ids [B], positions [B], new slots [B], lengths [B], the sampling kernel's
    /// [2, B] f32 parameters packed two to an i64 ([`pack_f32_pairs`]), block tables
    /// [B × W / bs]; two pinned host buffers it is copied from without blocking, one per
    /// call parity (none if pinning failed); and the kernel's split counters (zeroed once,
    /// left zero by every replay).
    Paged {
        packed: Tensor,
        staging: [Option<Tensor>; 2],
        counters: Tensor,
    },
}

struct Captured {
    graph: CudaGraph,
    inputs: Inputs,
    hidden: Tensor,
    /// The sampling kernel's (token id, log-prob) [2, B], when the graph samples, and two
    /// pinned host buffers like it to copy it into, one per call parity (none if pinning
    /// failed).
    sampled: Option<Tensor>,
    sampled_host: [Option<Tensor>; 2],
}

/// What a graphed decode step left on the device.
pub struct DecodeOutput {
    /// Final-normed hidden states of the real rows, [rows, H].
    pub hidden: Tensor,
    /// The sampling kernel's output [2, B] (B ≥ rows: the graph's batch bucket), when the
    /// step was asked to sample and the kernel is usable.
    pub sampled: Option<Tensor>,
    /// Where that output is being copied to the host (a pinned [2, B] f64 buffer) and the
    /// event after the copy: wait for it, then read the buffer with
    /// [`sampler::read_kernel_output`]. `None` when no copy could be queued; the caller
    /// then reads `sampled` itself.
    pub to_host: Option<(Tensor, manta_cuda::CudaEvent)>,
}

/// One decode row: its next token, its position (the context is positions 0..=position)
/// and the pool blocks holding that context (see [`cache_slot`] for their slots).
pub struct DecodeRow<'a> {
    pub token: i64,
    pub position: i64,
    pub blocks: &'a [u32],
    /// The sampling kernel's parameters for this row: temperature (0: greedy) and the
    /// uniform draw ([`RowSampling::kernel_pair`](super::sampler::RowSampling::kernel_pair)).
    pub sample: [f32; 2],
}

impl DecodeRow<'_> {
    fn context_len(&self) -> usize {
        self.position as usize + 1
    }
}

pub struct DecodeGraphs {
    device: usize,
    max_batch: usize,
    max_width: usize,
    /// Slot that padding rows read and write; owned by no sequence.
    scratch_slot: i64,
    /// Keyed by (batch bucket, context bucket, samples).
    graphs: HashMap<(usize, usize, bool), Captured>,
    /// Set after a capture fails: decode runs eagerly from then on.
    disabled: bool,
    /// Use the paged attention kernel (models with decode kernels; falls back to
    /// gathering if a capture with it fails).
    paged_kernel: bool,
    block_size: usize,
    /// Which of each graph's two pinned buffers this call uses (flips every call).
    parity: usize,
    /// Per parity, an event after the last input copy from a pinned buffer of that parity:
    /// the buffer is rewritten only once its copy has run, whether or not the caller read
    /// that step's outputs (a step whose rows all sample nothing leaves nothing to read).
    staged: [Option<manta_cuda::CudaEvent>; 2],
    /// The graph the last call replayed, if it sampled: its next replay may take its ids
    /// from the device ([`DecodeGraphs::can_feed`]).
    last_sampling_key: Option<(usize, usize, bool)>,
}

fn bucket(n: usize, min: usize) -> usize {
    n.max(min).next_power_of_two()
}

impl DecodeGraphs {
    pub fn new(
        device: Device,
        paged_kernel: bool,
        max_batch: usize,
        context_length: usize,
        block_size: usize,
        scratch_slot: i64,
    ) -> Option<Self> {
        let Device::Cuda(index) = device else {
            return None;
        };
        if !manta_cuda::built_with_cuda() || !manta_knobs::cuda_graphs() {
            return None;
        }
        Some(Self {
            device: index,
            max_batch: bucket(max_batch.min(512), 1),
            max_width: bucket(context_length, 256),
            scratch_slot,
            graphs: HashMap::new(),
            disabled: false,
            paged_kernel,
            block_size,
            parity: 0,
            staged: [None, None],
            last_sampling_key: None,
        })
    }

    /// Drops every captured graph (they point into a KV pool that is going away); the
    /// next steps capture again.
    pub fn clear(&mut self) {
        self.graphs.clear();
        self.last_sampling_key = None;
    }

    /// The graph a step of `rows` rows whose longest context is `longest` tokens replays.
    fn key(&self, rows: usize, longest: usize, sample: bool) -> (usize, usize, bool) {
        (
            bucket(rows, 1),
            bucket(longest, 256).min(self.max_width),
            sample,
        )
    }

    /// Whether a sampling step of `rows` rows, the longest `longest` tokens, can take its
    /// input ids from the step just launched (`run` with `feed`): it replays the same graph,
    /// which wrote its sampled tokens into its ids. The caller must also keep the rows in
    /// the same order.
    pub fn can_feed(&self, rows: usize, longest: usize) -> bool {
        !self.disabled
            && longest <= self.max_width
            && self.last_sampling_key == Some(self.key(rows, longest, true))
    }

    /// Runs a decode-only step through a graph, with the LM head and the sampling kernel
    /// in it when `sample`; `None` when this step cannot use one (too many rows, or graphs
    /// disabled), and the caller runs it eagerly.
    ///
    /// `feed`: the rows' tokens are the ones the previous call sampled, in the same rows,
    /// and stay on the device (only valid where [`DecodeGraphs::can_feed`] said so; the
    /// rows' `token` is ignored).
    ///
    /// The caller must read a step's sampled tokens (after its `to_host` event) before the
    /// call after next, whose output copy reuses that pinned buffer. Input buffers need
    /// nothing from the caller: a call waits for the copy out of the buffer it rewrites.
    pub fn run(
        &mut self,
        model: &CausalLm,
        kv: &PagedKvCache,
        rows: &[DecodeRow],
        sample: bool,
        feed: bool,
    ) -> Option<DecodeOutput> {
        if self.disabled || rows.is_empty() || rows.len() > self.max_batch {
            return None;
        }
        let longest = rows.iter().map(|r| r.context_len()).max().unwrap_or(1);
        let key = self.key(rows.len(), longest, sample);
        if longest > key.1 || (feed && !self.can_feed(rows.len(), longest)) {
            return None;
        }
        if !self.graphs.contains_key(&key) {
            let mut captured = self.capture(model, kv, key, self.paged_kernel);
            if self.paged_kernel && captured.is_err() {
                warn!("paged attention kernel unusable; gathering keys and values instead");
                self.paged_kernel = false;
                self.graphs.clear();
                captured = self.capture(model, kv, key, false);
            }
            match captured {
                Ok(c) => {
                    self.graphs.insert(key, c);
                }
                Err(e) => {
                    warn!(error = %e, "CUDA graph capture failed; decoding without graphs");
                    self.disabled = true;
                    return None;
                }
            }
        }
        let parity = self.parity;
        self.parity ^= 1;
        self.last_sampling_key = None;
        let c = self.graphs.get_mut(&key)?;
        let (b, w, _) = key;
        let block_size = self.block_size;
        // Padding rows sample greedily (temperature 0) and are never read.
        let mut params = vec![0f32; 2 * b];
        for (i, r) in rows.iter().enumerate() {
            params[i] = r.sample[0];
            params[b + i] = r.sample[1];
        }
        match &mut c.inputs {
            Inputs::Paged {
                packed, staging, ..
            } => {
                let mb = w / block_size;
                let mut v = vec![0i64; 5 * b + b * mb];
                v[2 * b..3 * b].fill(self.scratch_slot);
                v[3 * b..4 * b].fill(1);
                pack_f32_pairs(&params, &mut v[4 * b..5 * b]);
                for (i, r) in rows.iter().enumerate() {
                    let len = r.context_len();
                    v[i] = r.token;
                    v[b + i] = r.position;
                    v[2 * b + i] = cache_slot(r.blocks, len - 1, block_size);
                    v[3 * b + i] = len as i64;
                    // The kernel's block ids are cache blocks (slot = id × block_size + offset).
                    for (j, &block) in r.blocks[..len.div_ceil(block_size)].iter().enumerate() {
                        v[5 * b + i * mb + j] = cache_block(block);
                    }
                }
                let host = Tensor::from_slice(&v);
                // Fed ids are already on the device: everything after them is copied.
                let skip = if feed { b as i64 } else { 0 };
                let len = v.len() as i64 - skip;
                let mut dst = packed.narrow(0, skip, len);
                // From pinned memory the copy is queued without waiting for the device.
                let device = self.device;
                let staged = &mut self.staged[parity];
                let free = staged.take().is_none_or(|copied| {
                    copied
                        .synchronize()
                        .inspect_err(|e| debug!(error = %e, "waiting for an input copy failed"))
                        .is_ok()
                });
                let queued = free
                    && staging[parity].as_mut().is_some_and(|staging| {
                        staging.copy_(&host);
                        manta_cuda::copy_nonblocking(&mut dst, &staging.narrow(0, skip, len))
                            .inspect_err(|e| debug!(error = %e, "non-blocking input copy failed"))
                            .is_ok()
                    });
                if queued {
                    *staged = manta_cuda::CudaEvent::record(device).ok();
                } else {
                    dst.copy_(&host.narrow(0, skip, len));
                }
            }
            Inputs::Gather {
                ids: ids_t,
                positions: pos_t,
                slot_mapping: map_t,
                slots: slots_t,
                keep: keep_t,
                params: params_t,
            } => {
                let mut ids = vec![0i64; b];
                let mut pos = vec![0i64; b];
                let mut mapping = vec![self.scratch_slot; b];
                let mut slots = vec![self.scratch_slot; b * w];
                let mut keep = vec![false; b * w];
                for (i, r) in rows.iter().enumerate() {
                    let len = r.context_len();
                    ids[i] = r.token;
                    pos[i] = r.position;
                    mapping[i] = cache_slot(r.blocks, len - 1, block_size);
                    for (p, slot) in slots[i * w..i * w + len].iter_mut().enumerate() {
                        *slot = cache_slot(r.blocks, p, block_size);
                    }
                    keep[i * w..i * w + len].fill(true);
                }
                for i in rows.len()..b {
                    keep[i * w] = true;
                }
                if !feed {
                    ids_t.copy_(&Tensor::from_slice(&ids));
                }
                pos_t.copy_(&Tensor::from_slice(&pos));
                map_t.copy_(&Tensor::from_slice(&mapping));
                slots_t.copy_(&Tensor::from_slice(&slots).view([b as i64, w as i64]));
                keep_t.copy_(&Tensor::from_slice(&keep).view([b as i64, 1, 1, w as i64]));
                params_t.copy_(&Tensor::from_slice(&params).view([2, b as i64]));
            }
        }
        if let Err(e) = c.graph.replay() {
            warn!(error = %e, "CUDA graph replay failed; decoding without graphs");
            self.disabled = true;
            return None;
        }
        // The tokens' copy to the host is queued now, before any later step can overwrite
        // the graph's output, with an event after it.
        let to_host = match (&c.sampled, &mut c.sampled_host[parity]) {
            (Some(sampled), Some(host)) => manta_cuda::copy_nonblocking(host, sampled)
                .and_then(|()| manta_cuda::CudaEvent::record(self.device))
                .inspect_err(|e| debug!(error = %e, "could not queue the sampled tokens' copy"))
                .ok()
                .map(|event| (host.shallow_clone(), event)),
            _ => None,
        };
        if c.sampled.is_some() {
            self.last_sampling_key = Some(key);
        }
        Some(DecodeOutput {
            hidden: c.hidden.narrow(0, 0, rows.len() as i64),
            sampled: c.sampled.as_ref().map(Tensor::shallow_clone),
            to_host,
        })
    }

    fn capture(
        &self,
        model: &CausalLm,
        kv: &PagedKvCache,
        (b, w, sample): (usize, usize, bool),
        paged_kernel: bool,
    ) -> Result<Captured, String> {
        let dev = Device::Cuda(self.device);
        let (bi, wi) = (b as i64, w as i64);
        let block_size = self.block_size;
        let mb = (w / block_size) as i64;
        let inputs = if paged_kernel {
            let packed = Tensor::zeros([5 * bi + bi * mb], (Kind::Int64, dev));
            let _ = packed.narrow(0, 2 * bi, bi).fill_(self.scratch_slot);
            let _ = packed.narrow(0, 3 * bi, bi).fill_(1);
            let staging = [(); 2].map(|()| {
                manta_cuda::pin_memory(&Tensor::zeros(
                    [5 * bi + bi * mb],
                    (Kind::Int64, Device::Cpu),
                ))
                .inspect_err(|e| debug!(error = %e, "no pinned input buffer; copies will wait"))
                .ok()
            });
            Inputs::Paged {
                packed,
                staging,
                counters: manta_model::decode_counters(bi, dev),
            }
        } else {
            let keep = Tensor::zeros([bi, 1, 1, wi], (Kind::Bool, dev));
            let _ = keep.narrow(3, 0, 1).fill_(1);
            Inputs::Gather {
                ids: Tensor::zeros([bi], (Kind::Int64, dev)),
                positions: Tensor::zeros([bi], (Kind::Int64, dev)),
                slot_mapping: Tensor::full([bi], self.scratch_slot, (Kind::Int64, dev)),
                slots: Tensor::full([bi, wi], self.scratch_slot, (Kind::Int64, dev)),
                keep,
                params: Tensor::zeros([2, bi], (Kind::Float, dev)),
            }
        };
        // The step as captured: views of the input buffers (the paged kernel's int32
        // tables and lengths are converted inside the graph), then the forward.
        let forward = || match &inputs {
            Inputs::Paged {
                packed, counters, ..
            } => {
                let view = |start: i64, len: i64| packed.narrow(0, start, len);
                let lens = view(3 * bi, bi).to_kind(Kind::Int);
                let tables = view(5 * bi, bi * mb).view([bi, mb]).to_kind(Kind::Int);
                let batch = PagedBatch::decode_paged(
                    &view(2 * bi, bi),
                    &tables,
                    &lens,
                    counters,
                    block_size,
                );
                model.forward_paged(&view(0, bi), &view(bi, bi), &batch, kv)
            }
            Inputs::Gather {
                ids,
                positions,
                slot_mapping,
                slots,
                keep,
                ..
            } => {
                let batch = PagedBatch::decode_only(slot_mapping, slots, keep);
                model.forward_paged(ids, positions, &batch, kv)
            }
        };
        let params = match &inputs {
            Inputs::Paged { packed, .. } => packed
                .narrow(0, 4 * bi, bi)
                .view_dtype(Kind::Float)
                .view([2, bi]),
            Inputs::Gather { params, .. } => params.shallow_clone(),
        };
        let sampled =
            |hidden: &Tensor| sampler::sample_on_device(&model.logits_f32(hidden), &params);
        // The sampled tokens become the graph's next input ids (see `feed`).
        let ids = match &inputs {
            Inputs::Paged { packed, .. } => packed.narrow(0, 0, bi),
            Inputs::Gather { ids, .. } => ids.shallow_clone(),
        };
        // Warm-up outside the capture: lazy initialisation (and the kernels' compilation),
        // allocator growth; a failure here leaves no capture open. A failing sampling
        // kernel leaves the sampling to the caller.
        let sample = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let hidden = forward();
            sample && sampler::kernel_usable() && sampled(&hidden).is_some()
        }))
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "decode step panicked".into())
        })?;
        let share = self.graphs.values().next().map(|c| &c.graph);
        let (graph, (hidden, sampled)) = CudaGraph::capture(self.device, share, || {
            let hidden = forward();
            let sampled = if sample { sampled(&hidden) } else { None };
            if let Some(s) = &sampled {
                ids.shallow_clone().copy_(&s.get(0));
            }
            (hidden, sampled)
        })
        .map_err(|e| e.to_string())?;
        if sample && sampled.is_none() {
            return Err("the sampling kernel failed during capture".into());
        }
        debug!(
            batch = b,
            width = w,
            paged_kernel,
            sample,
            "captured a decode CUDA graph"
        );
        let sampled_host = [(); 2].map(|()| {
            sampled.as_ref().and_then(|s| {
                manta_cuda::pin_memory(&Tensor::zeros(s.size(), (Kind::Double, Device::Cpu)))
                    .inspect_err(
                        |e| debug!(error = %e, "no pinned output buffer; copies will stage"),
                    )
                    .ok()
            })
        });
        Ok(Captured {
            graph,
            inputs,
            hidden,
            sampled,
            sampled_host,
        })
    }
}

/// Packs `values` (an even number of f32) two to an i64, first of each pair in the low
/// half: on a little-endian machine the i64 buffer then reads as the same f32 sequence.
fn pack_f32_pairs(values: &[f32], out: &mut [i64]) {
    const _: () = assert!(
        cfg!(target_endian = "little"),
        "packed inputs assume little-endian"
    );
    for (slot, pair) in out.iter_mut().zip(values.chunks_exact(2)) {
        *slot = (u64::from(pair[0].to_bits()) | (u64::from(pair[1].to_bits()) << 32)) as i64;
    }
}

#[cfg(test)]
mod tests {
    use super::pack_f32_pairs;
    use tch::{Kind, Tensor};

    #[test]
    fn packed_f32_pairs_read_back_as_the_same_floats() {
        let values = [0.0f32, 1.5, -2.25, 0.7, f32::MIN_POSITIVE, 3.0e38];
        let mut packed = [0i64; 3];
        pack_f32_pairs(&values, &mut packed);
        let read = Tensor::from_slice(&packed).view_dtype(Kind::Float);
        assert_eq!(Vec::<f32>::try_from(&read).unwrap(), values);
    }
}

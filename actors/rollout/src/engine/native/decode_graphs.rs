//! CUDA graphs for decode steps. A decode step of a small model is hundreds of tiny kernel
//! launches whose host-side cost dwarfs the GPU work; captured once per (batch bucket,
//! context bucket), the whole step replays with one launch over fixed input buffers.
//! Rows past the real batch point at a scratch slot that no sequence owns.

use std::collections::HashMap;

use manta_cuda::CudaGraph;
use manta_model::{CausalLm, PagedBatch, PagedKvCache};
use tch::{Device, Kind, Tensor};
use tracing::{debug, warn};

/// The fixed buffers a captured step reads and writes.
struct Captured {
    graph: CudaGraph,
    ids: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    slots: Tensor,
    keep: Tensor,
    hidden: Tensor,
}

/// One decode row: its next token, position, new slot and context slots (new one included).
pub struct DecodeRow<'a> {
    pub token: i64,
    pub position: i64,
    pub slots: &'a [i64],
}

pub struct DecodeGraphs {
    device: usize,
    max_batch: usize,
    max_width: usize,
    /// Slot that padding rows read and write; owned by no sequence.
    scratch_slot: i64,
    graphs: HashMap<(usize, usize), Captured>,
    /// Set after a capture fails: decode runs eagerly from then on.
    disabled: bool,
}

fn bucket(n: usize, min: usize) -> usize {
    n.max(min).next_power_of_two()
}

impl DecodeGraphs {
    pub fn new(
        device: Device,
        max_batch: usize,
        context_length: usize,
        scratch_slot: i64,
    ) -> Option<Self> {
        let Device::Cuda(index) = device else {
            return None;
        };
        if !manta_cuda::built_with_cuda() || std::env::var_os("MANTA_DISABLE_CUDA_GRAPHS").is_some()
        {
            return None;
        }
        Some(Self {
            device: index,
            max_batch: bucket(max_batch.min(512), 1),
            max_width: bucket(context_length, 256),
            scratch_slot,
            graphs: HashMap::new(),
            disabled: false,
        })
    }

    /// Runs a decode-only step through a graph; `None` when this step cannot use one
    /// (too many rows, or graphs disabled), and the caller runs it eagerly.
    pub fn run(
        &mut self,
        model: &CausalLm,
        kv: &PagedKvCache,
        rows: &[DecodeRow],
    ) -> Option<Tensor> {
        if self.disabled || rows.is_empty() || rows.len() > self.max_batch {
            return None;
        }
        let longest = rows.iter().map(|r| r.slots.len()).max().unwrap_or(1);
        let key = (
            bucket(rows.len(), 1),
            bucket(longest, 256).min(self.max_width),
        );
        if longest > key.1 {
            return None;
        }
        if !self.graphs.contains_key(&key) {
            match self.capture(model, kv, key) {
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
        let c = self.graphs.get_mut(&key)?;
        let (b, w) = key;
        let mut ids = vec![0i64; b];
        let mut pos = vec![0i64; b];
        let mut mapping = vec![self.scratch_slot; b];
        let mut slots = vec![self.scratch_slot; b * w];
        let mut keep = vec![false; b * w];
        for (i, r) in rows.iter().enumerate() {
            ids[i] = r.token;
            pos[i] = r.position;
            mapping[i] = *r.slots.last().unwrap_or(&self.scratch_slot);
            slots[i * w..i * w + r.slots.len()].copy_from_slice(r.slots);
            keep[i * w..i * w + r.slots.len()].fill(true);
        }
        for i in rows.len()..b {
            keep[i * w] = true;
        }
        c.ids.copy_(&Tensor::from_slice(&ids));
        c.positions.copy_(&Tensor::from_slice(&pos));
        c.slot_mapping.copy_(&Tensor::from_slice(&mapping));
        c.slots
            .copy_(&Tensor::from_slice(&slots).view([b as i64, w as i64]));
        c.keep
            .copy_(&Tensor::from_slice(&keep).view([b as i64, 1, 1, w as i64]));
        if let Err(e) = c.graph.replay() {
            warn!(error = %e, "CUDA graph replay failed; decoding without graphs");
            self.disabled = true;
            return None;
        }
        Some(c.hidden.narrow(0, 0, rows.len() as i64))
    }

    fn capture(
        &self,
        model: &CausalLm,
        kv: &PagedKvCache,
        (b, w): (usize, usize),
    ) -> Result<Captured, manta_cuda::CudaError> {
        let dev = Device::Cuda(self.device);
        let (bi, wi) = (b as i64, w as i64);
        let ids = Tensor::zeros([bi], (Kind::Int64, dev));
        let positions = Tensor::zeros([bi], (Kind::Int64, dev));
        let slot_mapping = Tensor::full([bi], self.scratch_slot, (Kind::Int64, dev));
        let slots = Tensor::full([bi, wi], self.scratch_slot, (Kind::Int64, dev));
        let keep = Tensor::zeros([bi, 1, 1, wi], (Kind::Bool, dev));
        let _ = keep.narrow(3, 0, 1).fill_(1);
        let batch = PagedBatch::decode_only(&slot_mapping, &slots, &keep);
        // Warm-up outside the capture: lazy initialisation and allocator growth.
        let _ = model.forward_paged(&ids, &positions, &batch, kv);
        let share = self.graphs.values().next().map(|c| &c.graph);
        let (graph, hidden) = CudaGraph::capture(self.device, share, || {
            model.forward_paged(&ids, &positions, &batch, kv)
        })?;
        debug!(batch = b, width = w, "captured a decode CUDA graph");
        Ok(Captured {
            graph,
            ids,
            positions,
            slot_mapping,
            slots,
            keep,
            hidden,
        })
    }
}

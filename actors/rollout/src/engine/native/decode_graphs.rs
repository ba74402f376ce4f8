//! CUDA graphs for decode steps. A decode step of a small model is hundreds of tiny kernel
//! launches whose host-side cost dwarfs the GPU work; captured once per (batch bucket,
//! context bucket), the whole step replays with one launch over fixed input buffers.
//! Rows past the real batch point at a scratch slot that no sequence owns.

use std::collections::HashMap;

use manta_cuda::CudaGraph;
use manta_model::{CausalLm, PagedBatch, PagedKvCache};
use tch::{Device, Kind, Tensor};
use tracing::{debug, warn};

/// How a captured step's attention finds each row's keys and values.
enum Context {
    /// Padded slot matrix [B, W] and mask [B, 1, 1, W], gathered by index_select.
    Gather { slots: Tensor, keep: Tensor },
    /// Block tables [B, W / block_size] and lengths [B], read in place by the paged kernel.
    Paged { tables: Tensor, lens: Tensor },
}

/// The fixed buffers a captured step reads and writes.
struct Captured {
    graph: CudaGraph,
    ids: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    context: Context,
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
    /// Use the paged attention kernel (`MANTA_PAGED_KERNEL=1`, bf16; falls back to
    /// gathering if it fails to build or run).
    paged_kernel: bool,
    block_size: usize,
}

fn bucket(n: usize, min: usize) -> usize {
    n.max(min).next_power_of_two()
}

impl DecodeGraphs {
    pub fn new(
        device: Device,
        kind: Kind,
        max_batch: usize,
        context_length: usize,
        block_size: usize,
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
            // Opt-in until its GPU test passes on the device (BENCHMARKS.md, engine decode).
            paged_kernel: kind == Kind::BFloat16
                && std::env::var_os("MANTA_PAGED_KERNEL").is_some(),
            block_size,
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
        let block_size = self.block_size;
        match &mut c.context {
            Context::Gather { slots: s, keep: k } => {
                s.copy_(&Tensor::from_slice(&slots).view([b as i64, w as i64]));
                k.copy_(&Tensor::from_slice(&keep).view([b as i64, 1, 1, w as i64]));
            }
            Context::Paged { tables, lens } => {
                let mb = w / block_size;
                let mut t = vec![0i32; b * mb];
                let mut l = vec![1i32; b];
                for (i, r) in rows.iter().enumerate() {
                    // A block's slots are consecutive: its id is any of its slots / block_size.
                    for (j, chunk) in r.slots.chunks(block_size).enumerate() {
                        t[i * mb + j] = (chunk[0] / block_size as i64) as i32;
                    }
                    l[i] = r.slots.len() as i32;
                }
                tables.copy_(&Tensor::from_slice(&t).view([b as i64, mb as i64]));
                lens.copy_(&Tensor::from_slice(&l));
            }
        }
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
        paged_kernel: bool,
    ) -> Result<Captured, String> {
        let dev = Device::Cuda(self.device);
        let (bi, wi) = (b as i64, w as i64);
        let ids = Tensor::zeros([bi], (Kind::Int64, dev));
        let positions = Tensor::zeros([bi], (Kind::Int64, dev));
        let slot_mapping = Tensor::full([bi], self.scratch_slot, (Kind::Int64, dev));
        let (context, batch) = if paged_kernel {
            let mb = (w / self.block_size) as i64;
            let tables = Tensor::zeros([bi, mb], (Kind::Int, dev));
            let lens = Tensor::ones([bi], (Kind::Int, dev));
            let batch = PagedBatch::decode_paged(&slot_mapping, &tables, &lens, self.block_size);
            (Context::Paged { tables, lens }, batch)
        } else {
            let slots = Tensor::full([bi, wi], self.scratch_slot, (Kind::Int64, dev));
            let keep = Tensor::zeros([bi, 1, 1, wi], (Kind::Bool, dev));
            let _ = keep.narrow(3, 0, 1).fill_(1);
            let batch = PagedBatch::decode_only(&slot_mapping, &slots, &keep);
            (Context::Gather { slots, keep }, batch)
        };
        // Warm-up outside the capture: lazy initialisation (and the kernel's compilation),
        // allocator growth; a failure here leaves no capture open.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = model.forward_paged(&ids, &positions, &batch, kv);
        }))
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "decode step panicked".into())
        })?;
        let share = self.graphs.values().next().map(|c| &c.graph);
        let (graph, hidden) = CudaGraph::capture(self.device, share, || {
            model.forward_paged(&ids, &positions, &batch, kv)
        })
        .map_err(|e| e.to_string())?;
        debug!(
            batch = b,
            width = w,
            paged_kernel,
            "captured a decode CUDA graph"
        );
        Ok(Captured {
            graph,
            ids,
            positions,
            slot_mapping,
            context,
            hidden,
        })
    }
}

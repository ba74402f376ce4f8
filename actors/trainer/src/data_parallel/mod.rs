//! Data parallel training: one trainer rank per GPU, any count, with ZeRO-2 (or ZeRO-3:
//! the parameters sharded too, see [`zero`]).
//!
//! - [`Collective`]: what a rank needs from its group (reduce-scatter, all-gather,
//!   all-reduce, broadcast on flat contiguous tensors), with two backends:
//!   [`ThreadCollective`] (ranks as threads of one process, on the CPU: tests and
//!   multi-rank CPU training) and [`NcclCollective`] (the NCCL libtorch loaded, on tch
//!   CUDA tensors and libtorch's current stream, or a side stream for ZeRO-3's
//!   prefetch), and [`StoreCollective`] (ranks in
//!   separate processes on the CPU, through rank 0's torch `TCPStore`: trainer ranks on
//!   worker daemons without GPUs).
//! - [`layout`]: the flattened parameter list cut into buckets, each bucket split
//!   evenly across the ranks.
//! - [`zero`]: the ZeRO-2 optimizer — fp32 masters and AdamW moments of this rank's
//!   shard only; gradients reduce-scattered bucket by bucket; updated shards all-gathered
//!   into every rank's model. ZeRO-3 ([`ZeroAdamW::new_stage3`]): a bucket per decoder
//!   layer, gathered into the model when the decoder reaches it
//!   (`manta_model::LayerHooks`) and reduce-scattered as its backward ends; [`prefetch`]
//!   gathers the next layer on a side stream while the current one computes.
//! - [`metrics`]: summing the step's loss metrics over the ranks.
//!
//! Loss normalisation: each rank's loss weights divide by the *global* count (samples,
//! or trained tokens with `calculate_per_token_loss`, summed over the ranks by an
//! all-reduce before the step), so a rank's loss is its share of the global mean and the
//! gradients are *summed* over the ranks. That equals one rank's step on the union of
//! the ranks' samples whatever the split; averaging per-rank means (each normalised by
//! its own count) would only match when every rank holds as many samples and tokens.

pub mod layout;
pub mod metrics;
pub mod nccl;
mod nccl_api;
pub mod prefetch;
pub mod store;
pub mod thread;
pub mod zero;

pub use layout::FlatLayout;
pub use nccl::{NcclAborter, NcclCollective};
pub use prefetch::PrefetchStats;
pub use store::{StoreAborter, StoreCollective, StoreGroupSpec};
pub use thread::{ThreadCollective, ThreadGroup};
pub use zero::{RankOptimizer, ShardBytes, Zero3Pass, ZeroAdamW};

use manta_cuda::CudaStream;
use tch::{Device, Kind, Tensor};

/// How a collective combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size.
    Mean,
    Max,
}

/// Why a collective (or setting up a group) failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("data parallel: world size must be at least 1, got {0}")]
    EmptyWorld(usize),
    #[error("data parallel: rank {rank} is outside a world of {world} ranks")]
    RankOutOfRange { rank: usize, world: usize },
    #[error("data parallel: rank {0} of the thread group was already taken")]
    RankTaken(usize),
    #[error("data parallel {op}: {message}")]
    BadTensor { op: &'static str, message: String },
    #[error("data parallel {op}: ranks disagree: {message}")]
    Mismatch { op: &'static str, message: String },
    #[error("data parallel: the group failed: {0}")]
    PeerFailed(String),
    #[error("NCCL unavailable: {0}")]
    Unavailable(String),
    #[error("NCCL {op}: {message}")]
    Nccl { op: &'static str, message: String },
    #[error("data parallel: CUDA stream ({op}): {message}")]
    Stream { op: &'static str, message: String },
}

/// Checks a (rank, world size) pair before any backend is touched.
pub fn check_rank(rank: usize, world: usize) -> Result<(), CollectiveError> {
    if world == 0 {
        return Err(CollectiveError::EmptyWorld(world));
    }
    if rank >= world {
        return Err(CollectiveError::RankOutOfRange { rank, world });
    }
    Ok(())
}

/// A rank's view of its data-parallel group. Every rank calls the same collectives in
/// the same order with tensors of the same size and kind; tensors are flat (1-D) and
/// contiguous, on [`Collective::device`].
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Where this rank's tensors live.
    fn device(&self) -> Device;
    /// Combines every rank's `input` (`world × output.numel()` elements) and writes
    /// this rank's slice `[rank × n, (rank + 1) × n)` of the result into `output`.
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CollectiveError>;
    /// Concatenates every rank's `input` in rank order into `output`
    /// (`world × input.numel()` elements).
    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError>;
    /// Combines `tensor` over the ranks, in place on every rank.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CollectiveError>;
    /// Overwrites `tensor` on every rank with rank `root`'s.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CollectiveError>;

    /// Whether [`Collective::all_gather_on`] and [`Collective::reduce_scatter_on`] queue
    /// on the stream they are given (NCCL). The CPU backends run every collective at
    /// once on the calling thread: they have no streams and ignore them.
    fn takes_streams(&self) -> bool {
        false
    }

    /// [`Collective::all_gather`] queued on `stream` (a side stream of this rank's GPU)
    /// instead of libtorch's current stream; ordering it with the tensor ops around it is
    /// the caller's (events). Backends without streams ignore `stream`.
    fn all_gather_on(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        stream: &CudaStream,
    ) -> Result<(), CollectiveError> {
        let _ = stream;
        self.all_gather(input, output)
    }

    /// [`Collective::reduce_scatter`] queued on `stream`, as [`Collective::all_gather_on`].
    fn reduce_scatter_on(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<(), CollectiveError> {
        let _ = stream;
        self.reduce_scatter(input, output, op)
    }

    /// [`Collective::all_reduce`] of a few scalars (loss metrics, counts, the squared
    /// gradient norm), in fp64.
    fn all_reduce_f64(&self, values: &mut [f64], op: ReduceOp) -> Result<(), CollectiveError> {
        if values.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::from_slice(values).to_device(self.device());
        self.all_reduce(&mut t, op)?;
        let out =
            Vec::<f64>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Double)).map_err(|e| {
                CollectiveError::BadTensor {
                    op: "all_reduce",
                    message: e.to_string(),
                }
            })?;
        values.copy_from_slice(&out);
        Ok(())
    }
}

/// The ranks' parts (one per rank, in rank order) combined in rank order, so every rank
/// that combines the same parts gets the same bits; [`ReduceOp::Mean`] divides by `world`.
pub(crate) fn combine_in_rank_order(parts: &[Tensor], op: ReduceOp, world: usize) -> Tensor {
    let mut acc = parts[0].copy();
    for p in &parts[1..] {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                let _ = acc.g_add_(p);
            }
            ReduceOp::Max => acc = acc.maximum(p),
        }
    }
    if op == ReduceOp::Mean {
        let _ = acc.g_div_scalar_(world as f64);
    }
    acc
}

/// Checks what every backend needs of a collective's tensors: flat, contiguous, on the
/// group's device, one kind, and `big = world × small` elements.
pub(crate) fn check_pair(
    op: &'static str,
    device: Device,
    big: &Tensor,
    small: &Tensor,
    world: usize,
) -> Result<(), CollectiveError> {
    for t in [big, small] {
        check_flat(op, device, t)?;
    }
    if big.kind() != small.kind() {
        return Err(CollectiveError::BadTensor {
            op,
            message: format!("kinds differ: {:?} and {:?}", big.kind(), small.kind()),
        });
    }
    if big.numel() != small.numel() * world {
        return Err(CollectiveError::BadTensor {
            op,
            message: format!(
                "{} elements are not {world} ranks × {} elements",
                big.numel(),
                small.numel()
            ),
        });
    }
    Ok(())
}

pub(crate) fn check_flat(
    op: &'static str,
    device: Device,
    t: &Tensor,
) -> Result<(), CollectiveError> {
    if t.dim() != 1 || !t.is_contiguous() {
        return Err(CollectiveError::BadTensor {
            op,
            message: format!(
                "expected a flat contiguous tensor, got shape {:?}",
                t.size()
            ),
        });
    }
    if t.device() != device {
        return Err(CollectiveError::BadTensor {
            op,
            message: format!("tensor on {:?}, the group is on {device:?}", t.device()),
        });
    }
    Ok(())
}

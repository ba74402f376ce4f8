//! ZeRO-3's collectives in flight: the prefetch state a pass of the decoder drives.

use manta_cuda::{CudaEvent, CudaStream};
use tch::{Device, Tensor};

use super::super::prefetch::{PrefetchPlanner, PrefetchStats};
use super::super::{Collective, CollectiveError};
use super::flat::stream_error;

/// ZeRO-3's collectives in flight within a pass of the decoder ([`ZeroAdamW::layer_pass`]).
///
/// On a GPU with NCCL they are queued on `side`, ordered with the compute stream
/// (libtorch's current one) by events alone: the side stream waits for an event recorded
/// on the compute stream after the collective's input is made and its output allocated
/// (so after every earlier user of that memory too), and the compute stream waits for an
/// event recorded on the side stream after the collective before it reads the output.
/// Every buffer the side stream touches is allocated on the compute stream and freed only
/// after the compute stream has waited ([`ZeroAdamW::land`]), so libtorch's caching
/// allocator, which orders reuse within the allocating stream only, cannot hand it out
/// while the collective still runs. All of a pass's layer collectives go to the one side
/// stream, so the communicator's collectives run on the GPU in the order every rank
/// queued them; the pass ends with the compute stream waiting for the last of them, so
/// whatever follows on the compute stream (the head's reduce-scatter, the optimizer) is
/// ordered after all of them. On the CPU backends a queued collective has already run.
pub(super) struct Prefetch {
    /// `MANTA_ZERO3_PREFETCH`, read when the optimizer is built (ZeRO-3 only).
    pub(super) enabled: bool,
    /// The side stream (NCCL ranks); `None` where collectives run at once (CPU backends).
    pub(super) side: Option<CudaStream>,
    /// The current pass's guesses; `None` between passes.
    pub(super) planner: Option<PrefetchPlanner>,
    /// The all-gather of the layer guessed next.
    pub(super) ahead: Option<InFlight>,
    /// The last layer's reduce-scatter, whose slice is added into the gradient shard when
    /// the next layer is reduced or the pass ends.
    pub(super) reducing: Option<InFlight>,
    pub(super) stats: PrefetchStats,
}

/// A collective queued on the side stream (on the CPU: already run) with the buffers it
/// reads and writes, kept until the compute stream has waited for it.
pub(super) struct InFlight {
    pub(super) bucket: usize,
    pub(super) output: Tensor,
    pub(super) input: Tensor,
    /// Recorded on the side stream after the collective; `None`: it ran at once.
    pub(super) done: Option<CudaEvent>,
}

impl Prefetch {
    /// ZeRO-3 prefetches unless `MANTA_ZERO3_PREFETCH` is off; on a GPU whose collective
    /// takes streams (NCCL) through a side stream of the highest priority.
    pub(super) fn new(stage3: bool, comm: &dyn Collective) -> Result<Self, CollectiveError> {
        let enabled = stage3 && manta_knobs::zero3_prefetch();
        let side = match comm.device() {
            Device::Cuda(i) if enabled && comm.takes_streams() => {
                Some(CudaStream::new(i, true).map_err(stream_error("create side stream"))?)
            }
            _ => None,
        };
        Ok(Self {
            enabled,
            side,
            planner: None,
            ahead: None,
            reducing: None,
            stats: PrefetchStats::default(),
        })
    }
}

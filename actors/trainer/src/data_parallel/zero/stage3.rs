//! ZeRO-3's side of the optimizer: a bucket per decoder layer gathered when the decoder
//! reaches it and reduce-scattered as its backward ends, with the next layer's gather
//! prefetched on a side stream ([`super::super::prefetch`] guesses which).

use manta_cuda::CudaStream;
use manta_model::{LayerHooks, NamedTensors};
use tch::{Device, Tensor};

use super::super::prefetch::{PrefetchPlanner, PrefetchStats};
use super::super::{CollectiveError, ReduceOp};
use super::flat::stream_error;
use super::in_flight::InFlight;
use super::optimizer::ZeroAdamW;
use crate::profile::{self, Phase};

impl ZeroAdamW {
    /// Bucket `b`'s full values in the parameters' kind: every rank's slice
    /// all-gathered into one new flat buffer (a collective), and each parameter's view
    /// of it by name.
    pub(super) fn gathered_bucket(
        &self,
        b: usize,
    ) -> Result<(Tensor, NamedTensors), CollectiveError> {
        let src = self.param_slice(b);
        let bucket = &self.layout.buckets[b];
        let mut flat = Tensor::empty(
            [bucket.padded(self.layout.world) as i64],
            (self.kind, self.comm.device()),
        );
        tch::no_grad(|| self.comm.all_gather(&src, &mut flat))?;
        let views = self.views(b, &flat);
        Ok((flat, views))
    }

    /// Each of bucket `b`'s parameters as a view of its gathered `flat` values, by name.
    pub(super) fn views(&self, b: usize, flat: &Tensor) -> NamedTensors {
        self.layout.buckets[b]
            .params
            .clone()
            .map(|i| {
                let slot = &self.layout.params[i];
                let view = flat
                    .narrow(0, slot.offset as i64, slot.numel as i64)
                    .view(slot.shape.as_slice());
                (slot.name.clone(), view)
            })
            .collect()
    }

    /// Bucket `b`'s parameters take their values from its gathered `flat` buffer.
    pub(super) fn install(&mut self, b: usize, flat: &Tensor) {
        let views = self.views(b, flat);
        let range = self.layout.buckets[b].params.clone();
        tch::no_grad(|| {
            for (p, (_, view)) in self.params[range].iter_mut().zip(&views) {
                p.set_data(view);
            }
        });
    }

    /// ZeRO-3: bucket `b`'s parameters take their full values (views of one gathered
    /// buffer) until [`ZeroAdamW::release_bucket`] or [`ZeroAdamW::reduce_bucket`].
    pub fn gather_bucket(&mut self, b: usize) -> Result<(), CollectiveError> {
        profile::scoped(Phase::ParamGather, || {
            let (flat, _) = self.gathered_bucket(b)?;
            self.install(b, &flat);
            Ok(())
        })
    }

    /// ZeRO-3: the [`LayerHooks`](manta_model::LayerHooks) of one pass of the decoder
    /// (decoder layer `i` is bucket `i + 1`; the embedding, norm and head are the
    /// caller's to gather), which prefetches the next layer unless
    /// `MANTA_ZERO3_PREFETCH` is off ([`super::prefetch`]). End it with
    /// [`Zero3Pass::finish`].
    pub fn layer_pass(&mut self) -> Zero3Pass<'_> {
        Zero3Pass::new(self)
    }

    /// Whether passes prefetch (`MANTA_ZERO3_PREFETCH` when the optimizer was built).
    pub fn prefetches(&self) -> bool {
        self.prefetch.enabled
    }

    /// How this rank's prefetches went so far.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.prefetch.stats
    }

    pub(crate) fn begin_layer_pass(&mut self) {
        if self.prefetch.enabled {
            let layers = self.layout.buckets.len().saturating_sub(1);
            self.prefetch.planner = Some(PrefetchPlanner::new(layers));
        }
    }

    /// Ends a pass: the gather guessed ahead and never asked for is dropped and the last
    /// reduce-scatter's slice added, so the compute stream has waited for every
    /// collective of the pass. Both are tried even if the first fails.
    pub(crate) fn end_layer_pass(&mut self) -> Result<(), CollectiveError> {
        self.prefetch.planner = None;
        let dropped = profile::scoped(Phase::ParamGather, || self.drop_ahead());
        let reduced = profile::scoped(Phase::GradReduce, || self.complete_reduce());
        dropped.and(reduced)
    }

    /// Decoder layer `layer` is asked for: its parameters gathered (or its prefetched
    /// gather waited for), and the layer guessed next queued.
    ///
    /// The profile's `param_gather` counts what the compute stream spends here: rounding
    /// the slices, and waiting for the gather — for a prefetched layer only the part of
    /// its all-gather that had not finished while the layers before it ran.
    pub(crate) fn gather_layer(&mut self, layer: usize) -> Result<(), CollectiveError> {
        let b = layer + 1;
        let Some(planner) = self.prefetch.planner.as_mut() else {
            return self.gather_bucket(b);
        };
        let plan = planner.gather(layer);
        profile::scoped(Phase::ParamGather, || {
            let flat = match self.prefetch.ahead.take() {
                Some(g) if plan.prefetched && g.bucket == b => {
                    self.prefetch.stats.used += 1;
                    self.land(g)?
                }
                other => {
                    // Not the layer guessed (or nothing was): drop the guess.
                    self.prefetch.ahead = other;
                    self.drop_ahead()?;
                    let g = self.start_gather(b)?;
                    self.land(g)?
                }
            };
            self.install(b, &flat);
            if let Some(next) = plan.ahead {
                self.prefetch.ahead = Some(self.start_gather(next + 1)?);
                self.prefetch.stats.issued += 1;
            }
            Ok(())
        })
    }

    /// Decoder layer `layer`'s forward is done: its parameters released.
    pub(crate) fn release_layer(&mut self, layer: usize) -> Result<(), CollectiveError> {
        if let Some(planner) = self.prefetch.planner.as_mut() {
            if planner.release(layer).is_some() {
                profile::scoped(Phase::ParamGather, || self.drop_ahead())?;
            }
        }
        self.release_bucket(layer + 1);
        Ok(())
    }

    /// Decoder layer `layer`'s backward is done: its gradients reduce-scattered. In a
    /// prefetching pass the reduce-scatter is queued on the side stream (overlapping the
    /// next layer's backward) and its slice added into the gradient shard when the next
    /// layer is reduced or the pass ends; the same sum and the same add as
    /// [`ZeroAdamW::reduce_bucket`], later. `grad_reduce` counts the staging and the
    /// compute stream's wait for the previous layer's reduce-scatter.
    pub(crate) fn reduce_layer(&mut self, layer: usize) -> Result<(), CollectiveError> {
        let b = layer + 1;
        let Some(planner) = self.prefetch.planner.as_mut() else {
            return self.reduce_bucket(b);
        };
        if planner.reduce(layer).is_some() {
            profile::scoped(Phase::ParamGather, || self.drop_ahead())?;
        }
        self.allocate_state();
        profile::scoped(Phase::GradReduce, || {
            self.complete_reduce()?;
            let input = tch::no_grad(|| self.take_bucket_grads(b))?;
            let shard = self.layout.buckets[b].shard as i64;
            let mut output = Tensor::empty([shard], (self.grad_kind, self.comm.device()));
            let done = match &self.prefetch.side {
                None => {
                    tch::no_grad(|| self.comm.reduce_scatter(&input, &mut output, ReduceOp::Sum))?;
                    None
                }
                Some(side) => {
                    self.side_waits_for_compute(side)?;
                    tch::no_grad(|| {
                        self.comm
                            .reduce_scatter_on(&input, &mut output, ReduceOp::Sum, side)
                    })?;
                    Some(side.record().map_err(stream_error("record"))?)
                }
            };
            self.prefetch.stats.on_side_stream += u64::from(done.is_some());
            self.prefetch.reducing = Some(InFlight {
                bucket: b,
                output,
                input,
                done,
            });
            Ok(())
        })?;
        self.release_bucket(b);
        Ok(())
    }

    /// Bucket `b`'s all-gather into a new buffer, queued on the side stream after the
    /// compute stream's work so far (the rounding of the slice, the buffer's earlier
    /// users), or run at once without one.
    pub(super) fn start_gather(&mut self, b: usize) -> Result<InFlight, CollectiveError> {
        let input = self.param_slice(b);
        let padded = self.layout.buckets[b].padded(self.layout.world) as i64;
        let mut output = Tensor::empty([padded], (self.kind, self.comm.device()));
        let done = match &self.prefetch.side {
            None => {
                tch::no_grad(|| self.comm.all_gather(&input, &mut output))?;
                None
            }
            Some(side) => {
                self.side_waits_for_compute(side)?;
                tch::no_grad(|| self.comm.all_gather_on(&input, &mut output, side))?;
                Some(side.record().map_err(stream_error("record"))?)
            }
        };
        self.prefetch.stats.on_side_stream += u64::from(done.is_some());
        Ok(InFlight {
            bucket: b,
            output,
            input,
            done,
        })
    }

    /// The compute stream (libtorch's current one on this rank's GPU).
    pub(super) fn compute_stream(&self) -> Result<CudaStream, CollectiveError> {
        match self.comm.device() {
            Device::Cuda(i) => CudaStream::current(i).map_err(stream_error("current stream")),
            other => Err(CollectiveError::Stream {
                op: "current stream",
                message: format!("no CUDA stream on {other:?}"),
            }),
        }
    }

    /// Makes `side` wait for the work queued on the compute stream so far.
    pub(super) fn side_waits_for_compute(&self, side: &CudaStream) -> Result<(), CollectiveError> {
        let ready = self
            .compute_stream()?
            .record()
            .map_err(stream_error("record"))?;
        side.wait(&ready).map_err(stream_error("wait"))
    }

    /// `f`'s output, once the compute stream has waited for its collective: from then on
    /// the compute stream may read it, and may reuse both buffers once freed. If the wait
    /// cannot be queued the host waits instead; if that fails too the buffers are leaked
    /// rather than handed back while the collective may still write them.
    pub(super) fn land(&self, f: InFlight) -> Result<Tensor, CollectiveError> {
        let InFlight {
            output,
            input,
            done,
            ..
        } = f;
        let Some(done) = done else {
            return Ok(output);
        };
        let waited = self
            .compute_stream()
            .and_then(|s| s.wait(&done).map_err(stream_error("wait")));
        if let Err(e) = waited {
            if done.synchronize().is_err() {
                std::mem::forget(input);
                std::mem::forget(output);
            }
            return Err(e);
        }
        drop(input);
        Ok(output)
    }

    /// Drops the gather guessed ahead (a wrong guess, or the pass ended first).
    pub(super) fn drop_ahead(&mut self) -> Result<(), CollectiveError> {
        match self.prefetch.ahead.take() {
            Some(g) => {
                self.prefetch.stats.wasted += 1;
                self.land(g).map(drop)
            }
            None => Ok(()),
        }
    }

    /// Adds the last layer's reduce-scattered slice into the gradient shard.
    pub(super) fn complete_reduce(&mut self) -> Result<(), CollectiveError> {
        let Some(r) = self.prefetch.reducing.take() else {
            return Ok(());
        };
        let b = r.bucket;
        let part = self.land(r)?;
        let bucket = &self.layout.buckets[b];
        let (offset, shard) = (bucket.shard_offset as i64, bucket.shard as i64);
        tch::no_grad(|| {
            let _ = self.grad.narrow(0, offset, shard).g_add_(&part);
        });
        Ok(())
    }

    /// ZeRO-3: bucket `b`'s parameters hold no values (their storage is freed once no
    /// autograd graph reads it).
    pub fn release_bucket(&mut self, b: usize) {
        let empty = Tensor::empty([0], (self.kind, self.comm.device()));
        let range = self.layout.buckets[b].params.clone();
        tch::no_grad(|| {
            for p in &mut self.params[range] {
                p.set_data(&empty);
            }
        });
    }

    /// Every bucket released ([`ZeroAdamW::release_bucket`]): the parameters at rest,
    /// and (ZeRO-3) the moments and gradient shard allocated in the room they leave.
    pub fn release_all(&mut self) {
        for b in 0..self.layout.buckets.len() {
            self.release_bucket(b);
        }
        self.allocate_state();
    }

    /// ZeRO-3, after bucket `b`'s backward: its gradients summed over the ranks, this
    /// rank's slice added to `grad` (in [`ZeroAdamW::grad_kind`]), then the full
    /// gradients dropped and the parameters released. Parameters without a gradient
    /// count as zero.
    pub fn reduce_bucket(&mut self, b: usize) -> Result<(), CollectiveError> {
        self.allocate_state();
        profile::scoped(Phase::GradReduce, || {
            let flat = tch::no_grad(|| self.take_bucket_grads(b))?;
            let bucket = &self.layout.buckets[b];
            let (offset, shard) = (bucket.shard_offset as i64, bucket.shard as i64);
            let mut part = Tensor::empty([shard], (self.grad_kind, self.comm.device()));
            tch::no_grad(|| -> Result<(), CollectiveError> {
                self.comm.reduce_scatter(&flat, &mut part, ReduceOp::Sum)?;
                let _ = self.grad.narrow(0, offset, shard).g_add_(&part);
                Ok(())
            })
        })?;
        self.release_bucket(b);
        Ok(())
    }

    /// ZeRO-3: every parameter's full value, one bucket (a decoder layer) gathered at a
    /// time and handed to `visit` (a collective: every rank calls it; the tensors are
    /// views of a buffer that lives as long as `visit` keeps them). `E` is the caller's
    /// error, which a failed gather converts into.
    pub fn visit_buckets<E: From<CollectiveError>>(
        &self,
        mut visit: impl FnMut(NamedTensors) -> Result<(), E>,
    ) -> Result<(), E> {
        for b in 0..self.layout.buckets.len() {
            let (_flat, views) = self.gathered_bucket(b)?;
            visit(views)?;
        }
        Ok(())
    }
}

/// ZeRO-3's [`LayerHooks`] for one pass of the decoder: decoder layer `i` is the
/// optimizer's bucket `i + 1`. [`Zero3Pass::finish`] ends the pass — a gather queued
/// ahead and never asked for is dropped, and the last reduce-scatter's slice added into
/// the gradient shard — so nothing of a pass is in flight outside it; dropped unfinished
/// (an error or a panic in the pass), it does the same and logs what failed.
pub struct Zero3Pass<'a> {
    zero: &'a mut ZeroAdamW,
    finished: bool,
}

impl<'a> Zero3Pass<'a> {
    pub(crate) fn new(zero: &'a mut ZeroAdamW) -> Self {
        zero.begin_layer_pass();
        Self {
            zero,
            finished: false,
        }
    }

    /// Ends the pass (see [`Zero3Pass`]).
    pub fn finish(mut self) -> Result<(), CollectiveError> {
        self.finished = true;
        self.zero.end_layer_pass()
    }
}

impl Drop for Zero3Pass<'_> {
    fn drop(&mut self) {
        if !self.finished {
            if let Err(e) = self.zero.end_layer_pass() {
                tracing::warn!(error = %e, "ZeRO-3: ending an interrupted pass failed");
            }
        }
    }
}

impl LayerHooks for Zero3Pass<'_> {
    type Error = CollectiveError;

    fn gather(&mut self, layer: usize) -> Result<(), CollectiveError> {
        self.zero.gather_layer(layer)
    }

    fn release(&mut self, layer: usize) -> Result<(), CollectiveError> {
        self.zero.release_layer(layer)
    }

    fn reduce(&mut self, layer: usize) -> Result<(), CollectiveError> {
        self.zero.reduce_layer(layer)
    }
}

//! Where a training step's time goes (`MANTA_TRAINER_PROFILE=1`): the step is cut into
//! [`Phase`]s, the compute stream (libtorch's current one) synchronized at every boundary
//! so that a phase's seconds are its own GPU work rather than the launch queue's, and [`Trainer::train_step`] returns
//! each phase's seconds for the step, summed over its micro-batches (and optimizer steps),
//! as `perf/trainer/<phase>_s`, with the whole step as `perf/trainer/total_s`. The
//! figures are this rank's.
//!
//! Phases are disjoint and cover the step: a collective inside a pass (a ZeRO-3 layer
//! gather in the forward, a context-parallel k/v all-gather) counts in its own phase and
//! not in the pass around it, and whatever no phase names (checks, metric all-reduces,
//! zeroing gradients) is `other`, so the phases sum to `total`.
//!
//! Work on a side stream — ZeRO-3's prefetched layer gathers and overlapped per-layer
//! reduce-scatters — is not waited for at the boundaries: it counts where the compute
//! stream waits for it, so `param_gather` and `grad_reduce` are the time a step loses to
//! those collectives (the part of a prefetched gather that had not finished when its
//! layer was reached), not their length. With `MANTA_ZERO3_PREFETCH=0` every collective
//! runs on the compute stream and they are their whole length.
//!
//! The syncs take away the CPU's lead over the GPU (and, around collectives, any waiting
//! for the slowest rank shows up in the collective), so a profiled step is slower than an
//! unprofiled one: compare `total_s` against the unprofiled step time. Off (the default)
//! the phase calls find no profile in their thread and do nothing: no sync, no allocation.
//!
//! The profile lives in a thread-local because the boundaries sit in code reached from
//! inside the model's passes (the loss closure, ZeRO-3's layer hooks, the CP group's
//! collectives) where threading a `&mut` through would fight the borrows of the model
//! and the optimizer; a step runs on one thread (data-parallel ranks in one process each
//! have their own).
//!
//! [`Trainer::train_step`]: crate::Trainer::train_step

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

use tch::Device;

/// The prefix of every profile metric.
pub const METRIC_PREFIX: &str = "perf/trainer/";

/// One part of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Anything no other phase names: batch checks, metric and count all-reduces,
    /// zeroing gradients.
    Other,
    /// Laying out a micro-batch: packing its samples, copying them to the device, and
    /// (context parallel) splitting the row over the ranks.
    Prepare,
    /// π_old's log-probs before the first of several updates per rollout (its packing
    /// included).
    OldLogprobs,
    /// The frozen reference model's log-probs (`use_kl_loss`).
    RefLogprobs,
    /// The forward pass and the loss.
    Forward,
    /// The backward pass (recomputed layers' forward included).
    Backward,
    /// ZeRO-3: the all-gathers of a layer's (or the embedding, norm and head's)
    /// parameters — with the prefetch, only the compute stream's wait for a gather queued
    /// ahead, plus the rounding of the slices; ZeRO-2: the all-gather of the updated
    /// parameters after the AdamW step.
    ParamGather,
    /// ZeRO-2: the reduce-scatter of the gradients; ZeRO-3: each layer's reduce-scatter
    /// as its backward ends (the flattening of the gradients included) — with the
    /// prefetch, queued on the side stream, so only the compute stream's wait for it.
    GradReduce,
    /// ZeRO-3: a two-token pass a rank with fewer micro-batches runs so its collectives
    /// pair with the others'.
    Filler,
    /// Context parallel: the per-layer all-gathers of k and v (forward, recompute and
    /// log-prob passes).
    CpAllGather,
    /// Context parallel: the per-layer reduce-scatters of k's and v's gradients.
    CpReduceScatter,
    /// Context parallel: the all-reduces that assemble the per-token log-probs and
    /// entropies on every rank.
    CpAllReduce,
    /// The gradient norm (its all-reduce included), clipping and the AdamW update.
    Optimizer,
}

impl Phase {
    /// Every phase, in the order of a step.
    pub const ALL: [Phase; 13] = [
        Phase::Other,
        Phase::Prepare,
        Phase::OldLogprobs,
        Phase::RefLogprobs,
        Phase::Forward,
        Phase::Backward,
        Phase::ParamGather,
        Phase::GradReduce,
        Phase::Filler,
        Phase::CpAllGather,
        Phase::CpReduceScatter,
        Phase::CpAllReduce,
        Phase::Optimizer,
    ];

    /// The phase's name in its metric (`perf/trainer/<name>_s`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Other => "other",
            Phase::Prepare => "prepare",
            Phase::OldLogprobs => "old_logprobs",
            Phase::RefLogprobs => "ref_logprobs",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::ParamGather => "param_gather",
            Phase::GradReduce => "grad_reduce",
            Phase::Filler => "filler",
            Phase::CpAllGather => "cp_all_gather",
            Phase::CpReduceScatter => "cp_reduce_scatter",
            Phase::CpAllReduce => "cp_all_reduce",
            Phase::Optimizer => "optimizer",
        }
    }

    /// The phase's metric name.
    pub fn metric(self) -> String {
        format!("{METRIC_PREFIX}{}_s", self.name())
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The whole step's metric name.
pub fn total_metric() -> String {
    format!("{METRIC_PREFIX}total_s")
}

/// A step being profiled on this thread.
struct Active {
    device: Device,
    seconds: [f64; Phase::ALL.len()],
    current: Phase,
    /// The last boundary.
    lap: Instant,
    start: Instant,
}

impl Active {
    /// Ends the current phase now (after the device's queued work) and starts `next`.
    fn switch(&mut self, next: Phase) -> Phase {
        sync(self.device);
        let now = Instant::now();
        self.seconds[self.current.index()] += (now - self.lap).as_secs_f64();
        self.lap = now;
        std::mem::replace(&mut self.current, next)
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// Waits for the work queued on `device`'s compute stream (libtorch's current one, where
/// the tensor ops and the collectives not overlapped run), not for side streams (see the
/// module doc); the whole device if the stream cannot be had. The CPU's work is done
/// when its ops return.
fn sync(device: Device) {
    if let Device::Cuda(index) = device {
        let synced = manta_cuda::CudaStream::current(index).and_then(|s| s.synchronize());
        if let Err(e) = synced {
            tracing::debug!(error = %e, "profile: synchronizing the whole device instead");
            tch::Cuda::synchronize(index as i64);
        }
    }
}

/// Ends the current phase and starts `phase`; returns the phase it ended. Does nothing
/// (and returns [`Phase::Other`]) when no step is being profiled on this thread.
pub(crate) fn enter(phase: Phase) -> Phase {
    ACTIVE.with(|a| match a.borrow_mut().as_mut() {
        Some(active) => active.switch(phase),
        None => Phase::Other,
    })
}

/// Runs `f` as `phase`, then goes back to the phase it interrupted (a panic inside `f`
/// leaves `phase` current until the next boundary).
pub(crate) fn scoped<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let outer = enter(phase);
    let out = f();
    enter(outer);
    out
}

/// A step being profiled on this thread, from [`StepProfile::start`] to
/// [`StepProfile::finish`]; dropped early (a failed step), it stops the profile.
pub(crate) struct StepProfile {
    /// Tied to the thread whose thread-local it owns.
    _thread: std::marker::PhantomData<*const ()>,
}

impl StepProfile {
    /// Starts profiling a step on `device` when `MANTA_TRAINER_PROFILE` is on; the
    /// device's earlier work is waited for first, so it is not counted.
    pub(crate) fn start(device: Device) -> Option<Self> {
        if !manta_knobs::trainer_profile() {
            return None;
        }
        sync(device);
        let now = Instant::now();
        ACTIVE.with(|a| {
            *a.borrow_mut() = Some(Active {
                device,
                seconds: [0.0; Phase::ALL.len()],
                current: Phase::Other,
                lap: now,
                start: now,
            })
        });
        Some(StepProfile {
            _thread: std::marker::PhantomData,
        })
    }

    /// Ends the step: every phase's seconds (zero for those it did not run) and the
    /// total, as metrics.
    pub(crate) fn finish(self) -> BTreeMap<String, f64> {
        let active = ACTIVE.with(|a| a.borrow_mut().take());
        let mut out = BTreeMap::new();
        if let Some(mut active) = active {
            active.switch(Phase::Other);
            for phase in Phase::ALL {
                out.insert(phase.metric(), active.seconds[phase.index()]);
            }
            out.insert(total_metric(), (active.lap - active.start).as_secs_f64());
        }
        out
    }
}

impl Drop for StepProfile {
    fn drop(&mut self) {
        // After finish this finds nothing; after a failed step it stops the profile, so
        // the thread's next unprofiled work is not timed.
        let _ = ACTIVE.try_with(|a| a.borrow_mut().take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_every_phase_is_listed_at_its_index() {
        let mut names: Vec<_> = Phase::ALL.iter().map(|p| p.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Phase::ALL.len());
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(p.index(), i, "{p:?}");
        }
    }

    /// Without a started profile the boundaries do nothing; with one, nested phases are
    /// taken out of the phase around them and the phases add up to the total.
    #[test]
    fn nested_phases_are_disjoint_and_sum_to_the_total() {
        assert_eq!(enter(Phase::Forward), Phase::Other, "no profile: a no-op");
        let active = |f: &dyn Fn(&Active)| ACTIVE.with(|a| f(a.borrow().as_ref().unwrap()));
        ACTIVE.with(|a| {
            let now = Instant::now();
            *a.borrow_mut() = Some(Active {
                device: Device::Cpu,
                seconds: [0.0; Phase::ALL.len()],
                current: Phase::Other,
                lap: now,
                start: now,
            })
        });
        let profile = StepProfile {
            _thread: std::marker::PhantomData,
        };
        let wait = || std::thread::sleep(std::time::Duration::from_millis(20));
        scoped(Phase::Forward, || {
            wait();
            scoped(Phase::CpAllGather, wait);
            active(&|a| assert_eq!(a.current, Phase::Forward));
            wait();
        });
        active(&|a| assert_eq!(a.current, Phase::Other));
        let m = profile.finish();
        assert!(ACTIVE.with(|a| a.borrow().is_none()), "finish ends it");
        let (fwd, gather, total) = (
            m[&Phase::Forward.metric()],
            m[&Phase::CpAllGather.metric()],
            m[&total_metric()],
        );
        assert!((0.035..0.5).contains(&fwd), "forward {fwd}");
        assert!((0.015..0.5).contains(&gather), "gather {gather}");
        let sum: f64 = Phase::ALL.iter().map(|p| m[&p.metric()]).sum();
        assert!((sum - total).abs() < 1e-9, "{sum} vs {total}");
        assert_eq!(m.len(), Phase::ALL.len() + 1);
    }
}

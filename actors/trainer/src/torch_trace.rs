//! `MANTA_TORCH_PROFILE=DIR`: a Kineto Chrome trace of one whole train step (forward,
//! backward, optimizer; every kernel when the model is on CUDA) in
//! `DIR/trainer_step{N}_rank{R}.json`, to see where a step's device time goes beyond
//! [`crate::profile`]'s per-phase seconds. Step N (`MANTA_TORCH_PROFILE_STEP`, default
//! 2) counts this trainer's steps from 1, so the first step's warm-up is left out. A
//! profiler that fails costs a warning, never the step.

use std::path::PathBuf;
use std::sync::Once;

use manta_cuda::TorchProfile;
use tch::Device;
use tracing::{info, warn};

/// A step being traced: from [`StepTrace::start`] to [`StepTrace::finish`] on the thread
/// that runs the step (Kineto records the CPU ops of the starting thread). Dropped early
/// (a failed step), it discards the trace.
pub(crate) struct StepTrace {
    profile: TorchProfile,
    path: PathBuf,
}

impl StepTrace {
    /// Starts tracing when `step` (this trainer's, from 1) is the one the knob asks for;
    /// the device's earlier work is waited for first, so none of it lands in the trace.
    pub(crate) fn start(step: u64, rank: usize, device: Device) -> Option<Self> {
        let at = match manta_knobs::torch_profile() {
            Ok(Some(at)) if at.step == step => at,
            Ok(_) => return None,
            Err(e) => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| warn!(%e, "no torch profile"));
                return None;
            }
        };
        let path = at.dir.join(format!("trainer_step{step}_rank{rank}.json"));
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        match TorchProfile::start(device.is_cuda()) {
            Ok(profile) => Some(Self { profile, path }),
            Err(e) => {
                warn!(%e, path = %path.display(), "torch profile of a train step not started");
                None
            }
        }
    }

    /// Writes the trace; call it once the step's device work has finished (the step
    /// synchronizes at its end), so the last kernels are in it.
    pub(crate) fn finish(self) {
        match self.profile.finish(&self.path) {
            Ok(()) => info!(path = %self.path.display(), "torch profile of a train step written"),
            Err(e) => warn!(%e, "torch profile of a train step not written"),
        }
    }
}

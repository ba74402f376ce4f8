//! Whether a family of NVRTC kernels compiles for a GPU, asked once per (family, GPU): the
//! model's fused paths fall back to tensor ops (the same bits) where it does not, rather
//! than failing a step.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

/// The fused CUDA ops of the training forward and scoring, for [`fused_runs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fused {
    RmsNorm,
    Rope,
    Swiglu,
    /// The log-prob and entropy kernels (scoring and their gradient).
    Logprobs,
}

/// One counter per [`Fused`] variant (the last one's index + 1).
static RUNS: [AtomicU64; Fused::Logprobs as usize + 1] =
    [const { AtomicU64::new(0) }; Fused::Logprobs as usize + 1];

/// How many calls in this process took `op`'s fused path (one per norm, rotation or
/// activation; one per scoring pass for the log-probs, however many chunks it has). The
/// fused paths give the values of the tensor ops they replace, so a test comparing the two
/// asserts through this that the fused one was taken at all.
pub fn fused_runs(op: Fused) -> u64 {
    RUNS[op as usize].load(Ordering::Relaxed)
}

/// A fused CUDA op the training forward (or scoring) takes where it applies, and the tensor ops it
/// replaces (the same values) where it does not: off CUDA, outside bf16/fp16, with its
/// knob off, or where its kernels do not compile.
pub(crate) struct FusedOp {
    /// Which op, for [`fused_runs`].
    pub op: Fused,
    /// The op, as logged ("fused RMSNorm").
    pub name: &'static str,
    /// What the model does instead, as logged ("norming through tensor ops").
    pub instead: &'static str,
    /// Its `MANTA_FUSED_*` knob.
    pub enabled: fn() -> bool,
    /// Compiles its kernels for an architecture (`sm_<arch>`).
    pub compile: fn(u32) -> Result<(), manta_cuda::CudaError>,
}

impl FusedOp {
    /// Whether the op may take `x` (the caller checks shapes): a bf16/fp16 CUDA tensor,
    /// the knob on, the kernels compiling for its GPU.
    pub fn applies_to(&self, x: &Tensor) -> bool {
        let Device::Cuda(index) = x.device() else {
            return false;
        };
        matches!(x.kind(), Kind::BFloat16 | Kind::Half)
            && (self.enabled)()
            && compiles_once(self.name, self.instead, index, self.compile)
    }

    /// The op's output, or `None` after a logged failure, and the caller takes the tensor
    /// ops. Every input was checked before the call: a failure is a bug, not a state of
    /// the GPU.
    pub fn output(&self, result: Result<Tensor, manta_cuda::CudaError>) -> Option<Tensor> {
        result
            .inspect(|_| self.ran())
            .map_err(|e| tracing::warn!("{} failed, {}: {e}", self.name, self.instead))
            .ok()
    }

    /// Counts one run of the op's kernels ([`fused_runs`]).
    pub fn ran(&self) {
        RUNS[self.op as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether `kernels` (a family's name, as logged) compile for GPU `index`: `compile` checks
/// them for the GPU's architecture on the first call, and a failure (no NVRTC in this
/// install, an unsupported GPU) is logged once, saying what the model does `instead`.
fn compiles_once(
    kernels: &'static str,
    instead: &'static str,
    index: usize,
    compile: fn(u32) -> Result<(), manta_cuda::CudaError>,
) -> bool {
    static USABLE: Mutex<BTreeMap<(&'static str, usize), bool>> = Mutex::new(BTreeMap::new());
    let mut usable = USABLE.lock().unwrap_or_else(|p| p.into_inner());
    *usable.entry((kernels, index)).or_insert_with(|| {
        match manta_cuda::device_arch(index).and_then(|arch| compile(arch).map(|()| arch)) {
            Ok(arch) => {
                tracing::debug!("{kernels} compiled for sm_{arch} (cuda:{index})");
                true
            }
            Err(e) => {
                tracing::warn!("{kernels} unavailable on cuda:{index}, {instead}: {e}");
                false
            }
        }
    })
}

//! Whether a family of NVRTC kernels compiles for a GPU, asked once per (family, GPU): the
//! model's fused paths fall back to tensor ops (the same bits) where it does not, rather
//! than failing a step.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Whether `kernels` (a family's name, as logged) compile for GPU `index`: `compile` checks
/// them for the GPU's architecture on the first call, and a failure (no NVRTC in this
/// install, an unsupported GPU) is logged once, saying what the model does `instead`.
pub(crate) fn compiles_once(
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

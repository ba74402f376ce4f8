//! Weights on disk between a trainer and the engines that load them (local-model
//! mode's weight sync: same machine or shared disk).

use std::path::Path;

use anyhow::Context;
use manta_trainer::NamedTensors;

/// The file engines load from a weights directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Writes `weights` as `dir/model.safetensors`, through a temporary file and a rename,
/// so a reader never sees half a file.
pub fn write_weights(dir: &Path, weights: &NamedTensors) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!("{WEIGHTS_FILE}.tmp"));
    tch::Tensor::write_safetensors(weights, &tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    let file = dir.join(WEIGHTS_FILE);
    std::fs::rename(&tmp, &file)
        .with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
    Ok(())
}

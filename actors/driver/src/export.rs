//! `driver export` and `--save-hf`: a checkpoint as a Hugging Face model directory
//! (manta_trainer::export does the reading, checking and writing). This module only
//! finds which checkpoint a directory means and runs the export off the async runtime.

use std::path::{Path, PathBuf};

use anyhow::Context;
use manta_trainer::export::{ExportOptions, Exported};

use crate::cli::ExportArgs;
use crate::driver_actor::latest_checkpoint;

/// The checkpoint `load` names: itself when it is one (`trainer_state.json`), else the
/// one its `latest` file points at (a `--save` directory).
pub fn checkpoint_dir(load: &Path) -> anyhow::Result<PathBuf> {
    if load.join("trainer_state.json").is_file() {
        return Ok(load.to_path_buf());
    }
    if load.join("latest").is_file() {
        return latest_checkpoint(load);
    }
    anyhow::bail!(
        "--load {}: neither a checkpoint (no trainer_state.json) nor a --save directory \
         (no `latest` file)",
        load.display()
    )
}

/// `driver export`.
pub async fn run(args: &ExportArgs) -> anyhow::Result<Exported> {
    let dir = checkpoint_dir(&args.load)?;
    let opts = ExportOptions {
        dtype: args.dtype,
        tokenizer_from: args.tokenizer_from.clone(),
    };
    export(dir, args.out.clone(), opts).await
}

/// Exports checkpoint `dir` to `out` on a blocking thread (it reads and writes the whole
/// model).
pub async fn export(dir: PathBuf, out: PathBuf, opts: ExportOptions) -> anyhow::Result<Exported> {
    let shown = format!("exporting {} to {}", dir.display(), out.display());
    let _progress = manta_telemetry::Progress::start(shown.clone());
    tokio::task::spawn_blocking(move || {
        // The checkpoint must match its manifest before anything is read from it.
        crate::checkpoint_manifest::verify(&dir)
            .with_context(|| format!("checkpoint {} is damaged", dir.display()))?;
        manta_trainer::export::export(&dir, &out, &opts).map_err(anyhow::Error::from)
    })
    .await
    .with_context(|| shown.clone())?
    .with_context(|| shown)
}

/// One line saying what an export wrote.
pub fn summary(e: &Exported) -> String {
    let tokenizer = if e.copied.is_empty() {
        "no tokenizer files".to_string()
    } else {
        e.copied.join(", ")
    };
    format!(
        "exported step {} ({}) to {}: {} tensors in {}{}; {tokenizer}",
        e.step,
        e.written_by,
        e.out.display(),
        e.tensors,
        e.dtype,
        if e.from_masters {
            " from the fp32 master weights"
        } else {
            ""
        },
    )
}

//! A Manta checkpoint as a Hugging Face model directory (`driver export`, `--save-hf`):
//! `model.safetensors` + `config.json` (+ the run model's tokenizer files) that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads, whether one trainer or
//! data-parallel ranks (ZeRO-2 or ZeRO-3 shards) wrote the checkpoint.
//!
//! - [`checkpoint`]: opens the checkpoint and checks its files against each other
//!   (every shard present and of this run, none truncated).
//! - [`hf_dir`]: writes the export into a temporary directory and renames it into place,
//!   so a failed export never leaves a half-written one under the requested name.

pub mod checkpoint;
pub mod hf_dir;

use std::path::{Path, PathBuf};

pub use checkpoint::Checkpoint;
pub use hf_dir::{export, ExportDtype, ExportOptions, Exported, EXPORT_MANIFEST};

/// Why an export failed; every variant names the file (and tensor) at fault.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: tensor `{key}`: {message}")]
    Tensor {
        path: PathBuf,
        key: String,
        message: String,
    },
}

impl ExportError {
    fn file(path: &Path, message: String) -> Self {
        Self::File {
            path: path.to_path_buf(),
            message,
        }
    }

    fn tensor(path: &Path, key: &str, message: String) -> Self {
        Self::Tensor {
            path: path.to_path_buf(),
            key: key.to_string(),
            message,
        }
    }
}

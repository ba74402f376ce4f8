//! Errors of this crate. Every variant names the file and, where there is one, the key,
//! tensor or value at fault, so a user can fix a bad checkpoint without reading code.

use std::path::PathBuf;

/// Anything that can go wrong reading a config or reading/writing weights.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file is malformed or a key has the wrong type; `key` is the JSON path
    /// (for example `rope_scaling.factor`), empty when the document itself is broken.
    #[error("{origin}: bad value for key `{key}`: {message}")]
    Json {
        origin: String,
        key: String,
        message: String,
    },

    /// A key parsed but its value is not acceptable (zero sizes, heads that do not
    /// divide, an unsupported model type or rope scaling).
    #[error("{origin}: key `{key}` has unsupported value {value}: {reason}")]
    ConfigValue {
        origin: String,
        key: String,
        value: String,
        reason: String,
    },

    /// A safetensors file could not be parsed.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },

    /// The model expects a tensor that no checkpoint file provides.
    #[error("{dir}: checkpoint lacks tensor `{name}` (and {more} more missing)")]
    MissingTensor {
        dir: PathBuf,
        name: String,
        more: usize,
    },

    /// A checkpoint file holds a tensor the model does not have.
    #[error("{path}: unexpected tensor `{name}` (the model has no such parameter)")]
    UnexpectedTensor { path: PathBuf, name: String },

    /// A checkpoint tensor has a different shape from the model's parameter.
    #[error("{path}: tensor `{name}` has shape {found:?}, the model expects {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },

    /// A checkpoint tensor has a dtype libtorch cannot hold.
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype}")]
    Dtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },

    /// A sharded checkpoint's index names a file that is not there, or is malformed.
    #[error("{path}: {message}")]
    Index { path: PathBuf, message: String },

    /// libtorch refused an operation (device copy, dtype conversion).
    #[error("{context}: {source}")]
    Torch {
        context: String,
        #[source]
        source: tch::TchError,
    },
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn torch(context: impl Into<String>, source: tch::TchError) -> Self {
        ModelError::Torch {
            context: context.into(),
            source,
        }
    }
}

//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong loading a tokenizer, encoding, decoding or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `tokenizer.json` could not be parsed by the `tokenizers` library.
    #[error("{path}: cannot load tokenizer: {message}")]
    Load { path: PathBuf, message: String },
    /// A configuration file holds a key with a value we cannot use.
    #[error("{path}: key `{key}`: {message}")]
    Config {
        path: PathBuf,
        key: String,
        message: String,
    },
    /// Encoding text failed.
    #[error("cannot encode text: {0}")]
    Encode(String),
    /// Decoding ids failed (for example an id outside the vocabulary).
    #[error("cannot decode ids: {0}")]
    Decode(String),
    /// Building a tokenizer in code failed.
    #[error("cannot build tokenizer: {0}")]
    Build(String),
    /// A chat template failed to compile or render.
    #[error("chat template `{template}`: {source:#}")]
    Template {
        template: String,
        #[source]
        source: minijinja::Error,
    },
    /// A chat template called `raise_exception(message)`: the conversation is not one it accepts.
    #[error("chat template `{template}` raised an exception: {message}")]
    TemplateException { template: String, message: String },
    /// A caller passed arguments that cannot be rendered (for example a reserved template variable).
    #[error("invalid chat template argument: {0}")]
    InvalidArgument(String),
}

impl TokenizerError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

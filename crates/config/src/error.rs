use std::path::PathBuf;

/// A configuration problem, always with the file it came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file does not parse or has a key of the wrong type / an unknown key.
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A key parsed but its value is not acceptable.
    #[error("{path}: key `{key}` has invalid value {value}: {reason}")]
    Invalid {
        path: PathBuf,
        key: String,
        value: String,
        reason: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(
        path: &std::path::Path,
        key: impl Into<String>,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            path: path.to_path_buf(),
            key: key.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

pub(crate) fn read(path: &std::path::Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })
}

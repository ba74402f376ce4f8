//! A training-settings file (`driver --train-settings FILE`): a `[train]` table on its
//! own, with cluster.toml's `[train]` keys, so one example's settings (the tiny local
//! model's) live beside it and a cluster file describes placement only.

use std::path::Path;

use serde::Deserialize;

use crate::error::{read, ConfigError};
use crate::settings::TrainOverrides;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrainFile {
    #[serde(default)]
    train: TrainOverrides,
}

impl TrainOverrides {
    /// Reads and validates a settings file's `[train]` table.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read(path)?;
        Self::from_toml_str(&text, path)
    }

    /// Parses `text` as if read from `path`.
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let raw: RawTrainFile = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        raw.train.validate(path, "train.")?;
        Ok(raw.train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_train_table_and_names_bad_keys() {
        let o = TrainOverrides::from_toml_str("[train]\nlr = 0.5\n", Path::new("t.toml")).unwrap();
        assert_eq!(o.lr, Some(0.5));
        let err = TrainOverrides::from_toml_str("[train]\nlrr = 1\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.toml") && err.contains("lrr"), "{err}");
        let err = TrainOverrides::from_toml_str("[rollout]\nengines = 1\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rollout"), "{err}");
        let err = TrainOverrides::from_toml_str("[train]\nn_samples = 0\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.n_samples"), "{err}");
    }
}

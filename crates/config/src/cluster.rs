//! `cluster.toml`: where the actors run.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{read, ConfigError};
use crate::settings::TrainOverrides;

/// Where the driver places actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClusterMode {
    /// One in-process worker inside the driver: no daemons, no GPU needed.
    #[default]
    Local,
    /// Worker daemons listed under `[[nodes]]`.
    Remote,
}

/// Which inference engine rollout actors drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Manta's tch engine, sharing the trainer's model code.
    #[default]
    Native,
    /// An SGLang server launched as a child process.
    Sglang,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClusterSection {
    #[serde(default)]
    mode: ClusterMode,
    /// train_config.yaml to use when `--config` is not given, relative to cluster.toml.
    train_config: Option<PathBuf>,
}

/// `[rollout]`: engines and episode concurrency.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    #[serde(default)]
    pub engine: EngineKind,
    /// Number of rollout actors (engines) in local mode.
    #[serde(default = "one")]
    pub engines: usize,
    /// Episodes in flight per rollout actor.
    #[serde(default = "default_concurrency")]
    pub max_concurrent_episodes: usize,
    /// Largest batch the native engine decodes at once.
    #[serde(default = "default_engine_batch")]
    pub max_batch_size: usize,
}

fn one() -> usize {
    1
}
fn default_concurrency() -> usize {
    64
}
fn default_engine_batch() -> usize {
    64
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            engine: EngineKind::Native,
            engines: 1,
            max_concurrent_episodes: default_concurrency(),
            max_batch_size: default_engine_batch(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    cluster: ClusterSection,
    #[serde(default)]
    rollout: RolloutSection,
    #[serde(default)]
    train: TrainOverrides,
}

/// The parsed `cluster.toml`.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The file it was read from (for messages and relative paths).
    pub path: PathBuf,
    pub mode: ClusterMode,
    /// Absolute (resolved) path of the default train_config.yaml, if named.
    pub train_config: Option<PathBuf>,
    pub rollout: RolloutSection,
    /// Defaults for the training flags (`[train]`), below the command line.
    pub train: TrainOverrides,
}

impl ClusterConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read(path)?;
        Self::from_toml_str(&text, path)
    }

    /// Parses `text` as if read from `path` (used for messages and relative paths).
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let raw: RawCluster = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        if raw.cluster.mode == ClusterMode::Remote {
            return Err(ConfigError::invalid(
                path,
                "cluster.mode",
                "\"remote\"",
                "worker daemons are not available in this build yet; use \"local\"",
            ));
        }
        if raw.rollout.engine == EngineKind::Sglang {
            return Err(ConfigError::invalid(
                path,
                "rollout.engine",
                "\"sglang\"",
                "the SGLang engine is not available in this build yet; use \"native\"",
            ));
        }
        for (key, value) in [
            ("rollout.engines", raw.rollout.engines),
            (
                "rollout.max_concurrent_episodes",
                raw.rollout.max_concurrent_episodes,
            ),
            ("rollout.max_batch_size", raw.rollout.max_batch_size),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(path, key, value, "must be at least 1"));
            }
        }
        raw.train.validate(path, "train.")?;
        let base = path.parent().unwrap_or(Path::new("."));
        Ok(ClusterConfig {
            path: path.to_path_buf(),
            mode: raw.cluster.mode,
            train_config: raw.cluster.train_config.map(|p| base.join(p)),
            rollout: raw.rollout,
            train: raw.train,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ClusterConfig, ConfigError> {
        ClusterConfig::from_toml_str(text, Path::new("conf/cluster.toml"))
    }

    #[test]
    fn empty_file_is_local_mode_with_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.mode, ClusterMode::Local);
        assert_eq!(c.rollout.max_concurrent_episodes, 64);
        assert!(c.train_config.is_none());
    }

    #[test]
    fn train_config_is_relative_to_the_cluster_file() {
        let c = parse("[cluster]\ntrain_config = \"t.yaml\"\n").unwrap();
        assert_eq!(c.train_config.unwrap(), Path::new("conf/t.yaml"));
    }

    #[test]
    fn unknown_key_is_named_with_the_file() {
        let err = parse("[rollout]\nengins = 2\n").unwrap_err().to_string();
        assert!(err.starts_with("conf/cluster.toml"), "{err}");
        assert!(err.contains("engins"), "{err}");
    }

    #[test]
    fn wrong_type_is_named() {
        let err = parse("[train]\nlr = \"fast\"\n").unwrap_err().to_string();
        assert!(err.contains("lr"), "{err}");
        assert!(err.contains("fast") || err.contains("string"), "{err}");
    }

    #[test]
    fn bad_value_names_key_and_value() {
        let err = parse("[rollout]\nmax_batch_size = 0\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rollout.max_batch_size") && err.contains(" 0"),
            "{err}"
        );
        let err = parse("[train]\nlr = -1.0\n").unwrap_err().to_string();
        assert!(err.contains("train.lr") && err.contains("-1"), "{err}");
        let err = parse("[rollout]\nengine = \"vllm\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("vllm"), "{err}");
    }
}

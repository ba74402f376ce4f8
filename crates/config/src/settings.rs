//! Training hyperparameters: the cookbook's run.sh flags, resolved from the command
//! line, then cluster.toml's `[train]`, then the cookbook's defaults.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// Every training setting, each optional: one layer of configuration (a `[train]`
/// table or the command line). Names are run.sh's flags with `_` for `-`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainOverrides {
    pub model: Option<PathBuf>,
    pub lr: Option<f64>,
    pub n_samples: Option<usize>,
    pub rollout_batch_size: Option<usize>,
    pub max_response_len: Option<usize>,
    pub max_tokens_per_gpu: Option<usize>,
    pub temperature: Option<f64>,
    pub save: Option<PathBuf>,
    pub load: Option<PathBuf>,
    pub save_interval: Option<usize>,
    pub num_rollout: Option<usize>,
    pub seed: Option<u64>,
    pub weight_decay: Option<f64>,
    pub adam_beta1: Option<f64>,
    pub adam_beta2: Option<f64>,
    pub adam_eps: Option<f64>,
    pub eps_clip: Option<f64>,
    pub eps_clip_high: Option<f64>,
    pub clip_grad: Option<f64>,
    pub gradient_checkpointing: Option<bool>,
    pub context_len: Option<usize>,
    pub task_data: Option<PathBuf>,
    pub run_name: Option<String>,
    pub runs_dir: Option<PathBuf>,
    pub wandb_project: Option<String>,
    pub wandb_run: Option<String>,
}

/// Resolved settings the driver runs with.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TrainSettings {
    /// Model directory in HF layout (config.json, tokenizer files, optional weights).
    pub model: PathBuf,
    pub lr: f64,
    /// Samples per prompt (the GRPO group size).
    pub n_samples: usize,
    /// Prompts per step.
    pub rollout_batch_size: usize,
    /// Most tokens one generate call may produce.
    pub max_response_len: usize,
    /// Training token budget per micro-batch.
    pub max_tokens_per_gpu: usize,
    pub temperature: f64,
    /// Checkpoint directory; `None` disables checkpoints.
    pub save: Option<PathBuf>,
    /// Resume from the latest checkpoint in this directory.
    pub load: Option<PathBuf>,
    /// Steps between checkpoints (0 = only at the end).
    pub save_interval: usize,
    /// Number of training steps.
    pub num_rollout: usize,
    pub seed: u64,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub eps_clip: f64,
    pub eps_clip_high: f64,
    pub clip_grad: f64,
    /// Recompute layers in backward instead of storing activations.
    pub gradient_checkpointing: bool,
    /// Whole-episode token budget (prompt + all turns).
    pub context_len: usize,
    /// tasks.jsonl to train from; `None` lists tasks from the environment servers.
    pub task_data: Option<PathBuf>,
    pub run_name: Option<String>,
    /// Where `runs/<run>/metrics.jsonl` goes.
    pub runs_dir: PathBuf,
    /// Weights & Biases project; `None` keeps W&B off.
    pub wandb_project: Option<String>,
    /// W&B run name [the run's directory name].
    pub wandb_run: Option<String>,
}

impl TrainOverrides {
    /// `self` wins over `lower` key by key.
    pub fn over(self, lower: TrainOverrides) -> TrainOverrides {
        macro_rules! pick {
            ($($f:ident),*) => { TrainOverrides { $($f: self.$f.or(lower.$f)),* } };
        }
        pick!(
            model,
            lr,
            n_samples,
            rollout_batch_size,
            max_response_len,
            max_tokens_per_gpu,
            temperature,
            save,
            load,
            save_interval,
            num_rollout,
            seed,
            weight_decay,
            adam_beta1,
            adam_beta2,
            adam_eps,
            eps_clip,
            eps_clip_high,
            clip_grad,
            gradient_checkpointing,
            context_len,
            task_data,
            run_name,
            runs_dir,
            wandb_project,
            wandb_run
        )
    }

    /// Checks values that parse but make no sense; `prefix` is the key's table (`train.`
    /// in cluster.toml, `--` on the command line).
    pub fn validate(&self, origin: &Path, prefix: &str) -> Result<(), ConfigError> {
        // On the command line keys are flags: `--n-samples`, not `n_samples`.
        let key = |k: &str| {
            if prefix == "--" {
                format!("--{}", k.replace('_', "-"))
            } else {
                format!("{prefix}{k}")
            }
        };
        let positive_f = [
            ("lr", self.lr),
            ("temperature", self.temperature),
            ("adam_eps", self.adam_eps),
            ("clip_grad", self.clip_grad),
        ];
        for (name, value) in positive_f {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        v,
                        "must be a finite number > 0",
                    ));
                }
            }
        }
        let unit = [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
            ("eps_clip", self.eps_clip),
            ("eps_clip_high", self.eps_clip_high),
            ("weight_decay", self.weight_decay),
        ];
        for (name, value) in unit {
            if let Some(v) = value {
                if !(0.0..1.0).contains(&v) {
                    return Err(ConfigError::invalid(
                        origin,
                        key(name),
                        v,
                        "must be in [0, 1)",
                    ));
                }
            }
        }
        let at_least_one = [
            ("n_samples", self.n_samples),
            ("rollout_batch_size", self.rollout_batch_size),
            ("max_response_len", self.max_response_len),
            ("max_tokens_per_gpu", self.max_tokens_per_gpu),
            ("num_rollout", self.num_rollout),
            ("context_len", self.context_len),
        ];
        for (name, value) in at_least_one {
            if value == Some(0) {
                return Err(ConfigError::invalid(
                    origin,
                    key(name),
                    0,
                    "must be at least 1",
                ));
            }
        }
        let non_empty = [
            ("run_name", &self.run_name),
            ("wandb_project", &self.wandb_project),
            ("wandb_run", &self.wandb_run),
        ];
        for (name, value) in non_empty {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return Err(ConfigError::invalid(
                    origin,
                    key(name),
                    "\"\"",
                    "must not be empty",
                ));
            }
        }
        Ok(())
    }

    /// Fills what is still unset with the cookbook's defaults.
    pub fn resolve(self) -> TrainSettings {
        let eps_clip = self.eps_clip.unwrap_or(0.2);
        TrainSettings {
            model: self
                .model
                .unwrap_or_else(|| PathBuf::from("assets/tiny-qwen3")),
            lr: self.lr.unwrap_or(1e-5),
            n_samples: self.n_samples.unwrap_or(16),
            rollout_batch_size: self.rollout_batch_size.unwrap_or(32),
            max_response_len: self.max_response_len.unwrap_or(4096),
            max_tokens_per_gpu: self.max_tokens_per_gpu.unwrap_or(8192),
            temperature: self.temperature.unwrap_or(1.0),
            save: self.save,
            load: self.load,
            save_interval: self.save_interval.unwrap_or(10),
            num_rollout: self.num_rollout.unwrap_or(3000),
            seed: self.seed.unwrap_or(42),
            weight_decay: self.weight_decay.unwrap_or(0.0),
            adam_beta1: self.adam_beta1.unwrap_or(0.9),
            adam_beta2: self.adam_beta2.unwrap_or(0.999),
            adam_eps: self.adam_eps.unwrap_or(1e-8),
            eps_clip,
            eps_clip_high: self.eps_clip_high.unwrap_or(eps_clip),
            clip_grad: self.clip_grad.unwrap_or(1.0),
            gradient_checkpointing: self.gradient_checkpointing.unwrap_or(true),
            context_len: self.context_len.unwrap_or(8192),
            task_data: self.task_data,
            run_name: self.run_name,
            runs_dir: self.runs_dir.unwrap_or_else(|| PathBuf::from("runs")),
            wandb_project: self.wandb_project,
            wandb_run: self.wandb_run,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_layer_wins_and_defaults_fill_the_rest() {
        let flags = TrainOverrides {
            lr: Some(0.01),
            ..Default::default()
        };
        let file = TrainOverrides {
            lr: Some(0.5),
            n_samples: Some(4),
            ..Default::default()
        };
        let s = flags.over(file).resolve();
        assert_eq!(s.lr, 0.01);
        assert_eq!(s.n_samples, 4);
        assert_eq!(s.rollout_batch_size, 32);
        assert_eq!(s.eps_clip_high, 0.2);
    }

    #[test]
    fn an_empty_wandb_project_is_named() {
        let o = TrainOverrides {
            wandb_project: Some(" ".into()),
            ..Default::default()
        };
        let err = o
            .validate(Path::new("command line"), "--")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--wandb-project") && err.contains("must not be empty"),
            "{err}"
        );
    }

    #[test]
    fn zero_and_out_of_range_values_are_named() {
        let o = TrainOverrides {
            n_samples: Some(0),
            ..Default::default()
        };
        let err = o
            .validate(Path::new("command line"), "--")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--n-samples") && err.contains("at least 1"),
            "{err}"
        );
        let o = TrainOverrides {
            adam_beta2: Some(1.5),
            ..Default::default()
        };
        let err = o
            .validate(Path::new("c.toml"), "train.")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.adam_beta2") && err.contains("1.5"),
            "{err}"
        );
    }
}

//! Evaluation during training, as slime's `--eval-*` flags define it: which tasks.jsonl
//! files are evaluated, how often, and the sampling settings of evaluation episodes
//! (each one falls back to the rollout's own, as slime's eval dataset config does).

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::checks;
use crate::error::ConfigError;

/// The name slime gives a lone `--eval-prompt-data PATH` (its legacy single-file form).
pub const LEGACY_EVAL_NAME: &str = "aime";

/// One evaluation set: `eval/<name>/...` metrics over the tasks of `path`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EvalDataset {
    pub name: String,
    /// A tasks.jsonl file (the cookbook's schema, as `prepare-tasks` writes it).
    pub path: PathBuf,
}

/// Evaluation settings, resolved. Field names serialize as the flags' keys.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EvalSettings {
    /// Evaluate after every step that is a multiple of this (slime counts rollouts);
    /// `None`: never.
    #[serde(rename = "eval_interval")]
    pub interval: Option<u64>,
    #[serde(rename = "eval_prompt_data")]
    pub datasets: Vec<EvalDataset>,
    /// Episodes per eval task [1].
    #[serde(rename = "n_samples_per_eval_prompt")]
    pub n_samples: usize,
    /// Most tokens per generate call [the rollout's].
    #[serde(rename = "eval_max_response_len")]
    pub max_response_len: usize,
    /// Whole-episode token budget [the rollout's].
    #[serde(rename = "eval_max_context_len")]
    pub context_len: usize,
    /// [the rollout's]; 0 is greedy.
    #[serde(rename = "eval_temperature")]
    pub temperature: f64,
    #[serde(rename = "eval_top_p")]
    pub top_p: f64,
    #[serde(rename = "eval_top_k")]
    pub top_k: i64,
    /// slime evaluates once before the first step unless this is set.
    #[serde(rename = "skip_eval_before_train")]
    pub skip_before_train: bool,
}

impl EvalSettings {
    /// Whether step `step` is followed by an evaluation (step 0: before training).
    pub fn after_step(&self, step: u64) -> bool {
        match self.interval {
            Some(n) if !self.datasets.is_empty() => {
                if step == 0 {
                    !self.skip_before_train
                } else {
                    step.is_multiple_of(n)
                }
            }
            _ => false,
        }
    }
}

/// The rollout's sampling settings, resolved: what evaluation falls back to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RolloutSampling {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub max_response_len: usize,
    pub context_len: usize,
}

/// `--eval-prompt-data`'s values as slime reads them: NAME PATH pairs, or one PATH.
pub fn eval_datasets(values: &[String]) -> Result<Vec<EvalDataset>, String> {
    if let [path] = values {
        return Ok(vec![EvalDataset {
            name: LEGACY_EVAL_NAME.into(),
            path: PathBuf::from(path),
        }]);
    }
    if values.is_empty() || !values.len().is_multiple_of(2) {
        return Err(format!(
            "takes NAME PATH pairs (or one PATH), got {} value{}",
            values.len(),
            if values.len() == 1 { "" } else { "s" }
        ));
    }
    let mut out: Vec<EvalDataset> = Vec::new();
    for pair in values.chunks(2) {
        let (name, path) = (pair[0].trim(), &pair[1]);
        if name.is_empty() || name.contains('/') {
            return Err(format!(
                "{name:?} is not a set name (metrics are eval/<name>: no '/', not empty)"
            ));
        }
        if out.iter().any(|d| d.name == name) {
            return Err(format!("names the set {name:?} twice"));
        }
        out.push(EvalDataset {
            name: name.to_string(),
            path: PathBuf::from(path),
        });
    }
    Ok(out)
}

/// Sampling values the engines accept: top-p in (0, 1], top-k -1, 0 (both off) or ≥ 1.
fn check_top_p_k(
    origin: &Path,
    key: &dyn Fn(&str) -> String,
    (p_name, p): (&str, Option<f64>),
    (k_name, k): (&str, Option<i64>),
) -> Result<(), ConfigError> {
    if let Some(p) = p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ConfigError::invalid(
                origin,
                key(p_name),
                p,
                "must be in (0, 1] (1.0: off)",
            ));
        }
    }
    if let Some(k) = k {
        if k < -1 {
            return Err(ConfigError::invalid(
                origin,
                key(k_name),
                k,
                "must be -1 or 0 (off) or at least 1",
            ));
        }
    }
    Ok(())
}

/// One configuration layer's eval keys (and the rollout's top-p/top-k), as
/// `TrainOverrides` holds them.
pub(crate) struct EvalLayer<'a> {
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub eval_interval: Option<u64>,
    pub eval_prompt_data: Option<&'a [String]>,
    pub n_samples_per_eval_prompt: Option<usize>,
    pub eval_max_response_len: Option<usize>,
    pub eval_max_context_len: Option<usize>,
    pub eval_temperature: Option<f64>,
    pub eval_top_p: Option<f64>,
    pub eval_top_k: Option<i64>,
    pub skip_eval_before_train: Option<bool>,
}

impl EvalLayer<'_> {
    /// Checks one layer's values; `key` spells a key as that layer does.
    pub(crate) fn validate(
        &self,
        origin: &Path,
        key: &dyn Fn(&str) -> String,
    ) -> Result<(), ConfigError> {
        check_top_p_k(origin, key, ("top_p", self.top_p), ("top_k", self.top_k))?;
        check_top_p_k(
            origin,
            key,
            ("eval_top_p", self.eval_top_p),
            ("eval_top_k", self.eval_top_k),
        )?;
        let at_least_one = [
            ("eval_interval", self.eval_interval.map(|n| n as usize)),
            ("n_samples_per_eval_prompt", self.n_samples_per_eval_prompt),
            ("eval_max_response_len", self.eval_max_response_len),
            ("eval_max_context_len", self.eval_max_context_len),
        ];
        checks::each(origin, key, &at_least_one, |v| v != 0, "must be at least 1")?;
        checks::each(
            origin,
            key,
            &[("eval_temperature", self.eval_temperature)],
            |t| t.is_finite() && t >= 0.0,
            "must be a finite number >= 0 (0: greedy)",
        )?;
        if let Some(values) = self.eval_prompt_data {
            eval_datasets(values).map_err(|reason| {
                ConfigError::invalid(origin, key("eval_prompt_data"), values.join(" "), reason)
            })?;
        }
        Ok(())
    }

    /// slime: evaluating (`--eval-interval`) needs something to evaluate.
    pub(crate) fn validate_merged(&self) -> Result<(), ConfigError> {
        if let (Some(n), None) = (self.eval_interval, self.eval_prompt_data) {
            return Err(ConfigError::invalid(
                Path::new("command line or cluster.toml [train]"),
                "--eval-interval",
                n,
                "needs --eval-prompt-data NAME PATH [NAME PATH ...] (tasks.jsonl files, \
                 e.g. from `driver prepare-tasks` on a test split)",
            ));
        }
        Ok(())
    }

    /// Eval settings, each unset one falling back to the rollout's (slime's order:
    /// the eval flag, then the rollout flag).
    pub(crate) fn resolve(&self, rollout: &RolloutSampling) -> EvalSettings {
        EvalSettings {
            interval: self.eval_interval,
            // Validated; a layer that skipped validation evaluates nothing.
            datasets: self
                .eval_prompt_data
                .and_then(|v| eval_datasets(v).ok())
                .unwrap_or_default(),
            n_samples: self.n_samples_per_eval_prompt.unwrap_or(1),
            max_response_len: self
                .eval_max_response_len
                .unwrap_or(rollout.max_response_len),
            context_len: self.eval_max_context_len.unwrap_or(rollout.context_len),
            temperature: self.eval_temperature.unwrap_or(rollout.temperature),
            top_p: self.eval_top_p.unwrap_or(rollout.top_p),
            top_k: self.eval_top_k.unwrap_or(rollout.top_k),
            skip_before_train: self.skip_eval_before_train.unwrap_or(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::TrainOverrides;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn eval_flags_fall_back_to_the_rollout_settings() {
        let o = TrainOverrides {
            temperature: Some(0.8),
            top_p: Some(0.9),
            max_response_len: Some(64),
            eval_interval: Some(5),
            eval_prompt_data: Some(strings(&["math", "m.jsonl", "code", "c.jsonl"])),
            eval_top_k: Some(20),
            ..Default::default()
        };
        o.validate(Path::new("command line"), "--").unwrap();
        o.validate_merged().unwrap();
        let e = o.resolve().eval;
        assert_eq!(e.interval, Some(5));
        assert_eq!(
            e.datasets
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>(),
            ["math", "code"]
        );
        assert_eq!(e.datasets[1].path, PathBuf::from("c.jsonl"));
        assert_eq!((e.temperature, e.top_p, e.top_k), (0.8, 0.9, 20));
        assert_eq!(
            (e.max_response_len, e.context_len, e.n_samples),
            (64, 8192, 1)
        );
        assert!(!e.skip_before_train);
        // slime: before training (step 0), then after every 5th rollout.
        let at: Vec<u64> = (0..=12).filter(|s| e.after_step(*s)).collect();
        assert_eq!(at, [0, 5, 10]);
        let skip = EvalSettings {
            skip_before_train: true,
            ..e.clone()
        };
        assert!(!skip.after_step(0) && skip.after_step(10));
        let off = TrainOverrides::default().resolve().eval;
        assert!((0..4).all(|s| !off.after_step(s)));
    }

    #[test]
    fn eval_prompt_data_reads_as_slime_and_bad_values_are_named() {
        let one = eval_datasets(&strings(&["t.jsonl"])).unwrap();
        assert_eq!(one[0].name, LEGACY_EVAL_NAME);
        for bad in [&["a", "x", "b"][..], &["a", "x", "a", "y"], &["a/b", "x"]] {
            let o = TrainOverrides {
                eval_prompt_data: Some(strings(bad)),
                ..Default::default()
            };
            let err = o
                .validate(Path::new("command line"), "--")
                .unwrap_err()
                .to_string();
            assert!(err.contains("--eval-prompt-data"), "{err}");
        }
        let interval_only = TrainOverrides {
            eval_interval: Some(2),
            ..Default::default()
        };
        let err = interval_only.validate_merged().unwrap_err().to_string();
        assert!(
            err.contains("--eval-interval") && err.contains("--eval-prompt-data"),
            "{err}"
        );
        for (o, name) in [
            (
                TrainOverrides {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "train.top_p",
            ),
            (
                TrainOverrides {
                    eval_top_k: Some(-2),
                    ..Default::default()
                },
                "train.eval_top_k",
            ),
            (
                TrainOverrides {
                    eval_temperature: Some(-1.0),
                    ..Default::default()
                },
                "train.eval_temperature",
            ),
            (
                TrainOverrides {
                    n_samples_per_eval_prompt: Some(0),
                    ..Default::default()
                },
                "train.n_samples_per_eval_prompt",
            ),
        ] {
            let err = o
                .validate(Path::new("c.toml"), "train.")
                .unwrap_err()
                .to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}

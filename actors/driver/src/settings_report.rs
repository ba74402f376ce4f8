//! The start of a run says what it runs with: every resolved training setting and where
//! it came from (a flag as spelt, slime's spelling, a `--train-settings` file, cluster.toml's
//! `[train]`, or the default), in `RUN_DIR/settings.txt`, in driver.log, and (those not
//! at their default) on the console.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::CommandFactory;
use manta_config::{Layer, ResolvedSetting, SettingSource, TrainOverrides, TrainSettings};

use crate::cli::Cli;

/// The configuration layers of a run, highest first, with where each came from.
#[derive(Debug, Clone, Default)]
pub struct SettingLayers {
    pub flags: TrainOverrides,
    /// Setting key → the flag as given (`--hf-checkpoint`), from [`spellings`].
    pub spellings: BTreeMap<String, String>,
    /// `--train-settings FILE`'s `[train]`.
    pub file: Option<(PathBuf, TrainOverrides)>,
    /// cluster.toml's `[train]`.
    pub cluster: (PathBuf, TrainOverrides),
}

impl SettingLayers {
    /// Every setting of `settings` with its source.
    pub fn resolved(&self, settings: &TrainSettings) -> Vec<ResolvedSetting> {
        let aliases = slime_aliases();
        let from_flag = |key: &str| match self.spellings.get(key) {
            Some(spelt) if aliases.contains(spelt) => SettingSource::SlimeFlag(spelt.clone()),
            Some(spelt) => SettingSource::Flag(spelt.clone()),
            None => SettingSource::Flag(format!("--{}", key.replace('_', "-"))),
        };
        let file_path = self
            .file
            .as_ref()
            .map(|(p, _)| p.clone())
            .unwrap_or_default();
        let from_file = move |_: &str| SettingSource::File(file_path.clone());
        let cluster_path = self.cluster.0.clone();
        let from_cluster = move |_: &str| SettingSource::File(cluster_path.clone());
        let mut layers = vec![Layer {
            values: &self.flags,
            source: &from_flag,
        }];
        if let Some((_, values)) = &self.file {
            layers.push(Layer {
                values,
                source: &from_file,
            });
        }
        layers.push(Layer {
            values: &self.cluster.1,
            source: &from_cluster,
        });
        manta_config::resolved_settings(&layers, settings)
    }

    /// Writes `run_dir/settings.txt` and logs the list: every line to driver.log, the
    /// settings not at their default to the console.
    pub fn report(&self, run_dir: &Path, settings: &TrainSettings) -> anyhow::Result<()> {
        let list = self.resolved(settings);
        let text = manta_config::render_settings(&list);
        let path = run_dir.join("settings.txt");
        std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
        for line in text.lines() {
            manta_telemetry::run_log::line(&format!("setting {line}"));
        }
        let given: Vec<&ResolvedSetting> = list
            .iter()
            .filter(|s| !matches!(s.source, SettingSource::Default | SettingSource::Derived))
            .collect();
        println!(
            "settings ({} given, the rest defaults; all in {}):",
            given.len(),
            path.display()
        );
        print!(
            "{}",
            manta_config::render_settings(&given.into_iter().cloned().collect::<Vec<_>>())
        );
        tracing::info!(settings = list.len(), file = %path.display(), "resolved settings written");
        Ok(())
    }
}

/// The visible aliases of the training flags: slime's and Miles' spellings.
fn slime_aliases() -> std::collections::BTreeSet<String> {
    Cli::command()
        .get_arguments()
        .flat_map(|a| a.get_visible_aliases().into_iter().flatten())
        .map(|alias| format!("--{alias}"))
        .collect()
}

/// Which spelling of each training flag a command line used (the last one wins, as
/// the flag's value does): setting key (clap's id, the `[train]` key) → `--flag`.
pub fn spellings(args: &[OsString]) -> BTreeMap<String, String> {
    let command = Cli::command();
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str().to_string();
        let longs = arg
            .get_long()
            .into_iter()
            .chain(arg.get_all_aliases().into_iter().flatten());
        for long in longs {
            names.insert(format!("--{long}"), id.clone());
        }
    }
    let mut out = BTreeMap::new();
    for token in args.iter().skip(1).filter_map(|a| a.to_str()) {
        let flag = token.split_once('=').map_or(token, |(f, _)| f);
        if let Some(id) = names.get(flag) {
            out.insert(id.clone(), flag.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slime_spelling_is_named_as_such() {
        let args: Vec<OsString> = [
            "driver",
            "--hf-checkpoint",
            "/m",
            "--lr=1e-5",
            "--n-samples",
            "4",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let spelt = spellings(&args);
        assert_eq!(spelt["model"], "--hf-checkpoint");
        assert_eq!(spelt["lr"], "--lr");
        let layers = SettingLayers {
            flags: TrainOverrides {
                model: Some("/m".into()),
                lr: Some(1e-5),
                n_samples: Some(4),
                ..Default::default()
            },
            spellings: spelt,
            file: None,
            cluster: (
                "cluster.toml".into(),
                TrainOverrides {
                    n_samples: Some(8),
                    seed: Some(1),
                    ..Default::default()
                },
            ),
        };
        let settings = layers
            .flags
            .clone()
            .over(layers.cluster.1.clone())
            .unwrap()
            .resolve();
        let list = layers.resolved(&settings);
        let source = |key: &str| list.iter().find(|s| s.key == key).unwrap().source.clone();
        assert_eq!(
            source("model"),
            SettingSource::SlimeFlag("--hf-checkpoint".into())
        );
        assert_eq!(source("lr"), SettingSource::Flag("--lr".into()));
        assert_eq!(
            source("n_samples"),
            SettingSource::Flag("--n-samples".into())
        );
        assert_eq!(source("seed"), SettingSource::File("cluster.toml".into()));
        assert_eq!(source("rollout_batch_size"), SettingSource::Default);
    }
}

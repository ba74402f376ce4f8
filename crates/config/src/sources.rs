//! Where each resolved training setting came from: a flag (as Manta or slime spells
//! it), a settings file's or cluster.toml's `[train]` table, or the default. The list
//! of settings is [`TrainOverrides`]' own fields (read through serde), so a new setting
//! shows up here without being named again.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;
use serde_json::Value;

use crate::settings::{TrainOverrides, TrainSettings};

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SettingSource {
    /// A Manta flag, as given (`--lr`).
    Flag(String),
    /// A slime/Miles spelling of a Manta flag, as given (`--hf-checkpoint`).
    SlimeFlag(String),
    /// A `[train]` table of this file (cluster.toml or a `--train-settings` file).
    File(PathBuf),
    /// Not set anywhere: the cookbook's (or slime's) default.
    Default,
    /// Computed from other settings (e.g. the recompute plan from the recompute flags).
    Derived,
}

impl std::fmt::Display for SettingSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingSource::Flag(flag) => write!(f, "flag {flag}"),
            SettingSource::SlimeFlag(flag) => write!(f, "slime flag {flag}"),
            SettingSource::File(path) => write!(f, "{} [train]", path.display()),
            SettingSource::Default => f.write_str("default"),
            SettingSource::Derived => f.write_str("derived"),
        }
    }
}

/// One configuration layer with where it came from, highest first in a list.
pub struct Layer<'a> {
    pub values: &'a TrainOverrides,
    /// The source of a key this layer sets; `key` is the setting's name.
    pub source: &'a dyn Fn(&str) -> SettingSource,
}

/// One resolved setting: its key (cluster.toml's `[train]` name), the value the run
/// uses, and where that came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResolvedSetting {
    pub key: String,
    pub value: Value,
    pub source: SettingSource,
}

/// A layer's keys, set or not (`None` serializes as null).
fn keys_of(layer: &TrainOverrides) -> BTreeMap<String, Value> {
    match serde_json::to_value(layer) {
        Ok(Value::Object(map)) => map.into_iter().collect(),
        _ => BTreeMap::new(),
    }
}

/// The resolved settings as one flat map: the nested groups (`algo`, `sampling`,
/// `eval`) are lifted to the top, where their keys are the layers' keys.
fn flat_settings(settings: &TrainSettings) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    if let Ok(Value::Object(map)) = serde_json::to_value(settings) {
        for (key, value) in map {
            match value {
                Value::Object(group) if ["algo", "sampling", "eval"].contains(&key.as_str()) => {
                    out.extend(group);
                }
                value => {
                    out.insert(key, value);
                }
            }
        }
    }
    out
}

/// Every setting with its resolved value and source. A key a layer sets takes that
/// layer's source (the first layer setting it wins, as in resolution); a key no layer
/// sets is a default. Its value is the resolved setting of the same name, or else the
/// layers' value (null when unset: a switch whose effect shows in a derived setting);
/// resolved settings no layer has a key for are listed as derived.
pub fn resolved_settings(layers: &[Layer<'_>], settings: &TrainSettings) -> Vec<ResolvedSetting> {
    let resolved = flat_settings(settings);
    let layer_keys: Vec<BTreeMap<String, Value>> =
        layers.iter().map(|l| keys_of(l.values)).collect();
    let all_keys = keys_of(&TrainOverrides::default());
    let mut out = Vec::new();
    for key in all_keys.keys() {
        let set = layers
            .iter()
            .zip(&layer_keys)
            .find_map(|(layer, keys)| keys.get(key).filter(|v| !v.is_null()).map(|v| (layer, v)));
        let (source, given) = match set {
            Some((layer, value)) => ((layer.source)(key), value.clone()),
            None => (SettingSource::Default, Value::Null),
        };
        let value = resolved.get(key).cloned().unwrap_or(given);
        out.push(ResolvedSetting {
            key: key.clone(),
            value,
            source,
        });
    }
    for (key, value) in &resolved {
        if !all_keys.contains_key(key) {
            out.push(ResolvedSetting {
                key: key.clone(),
                value: value.clone(),
                source: SettingSource::Derived,
            });
        }
    }
    out
}

/// `key = value  (source)` lines, one per setting, for the log and the run directory.
pub fn render(settings: &[ResolvedSetting]) -> String {
    let width = settings.iter().map(|s| s.key.len()).max().unwrap_or(0);
    settings
        .iter()
        .map(|s| format!("{:width$} = {}  ({})\n", s.key, s.value, s.source))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_names_the_layer_that_set_it() {
        let flags = TrainOverrides {
            lr: Some(2e-5),
            model: Some("/m".into()),
            ..Default::default()
        };
        let file = TrainOverrides {
            lr: Some(0.5),
            n_samples: Some(4),
            ..Default::default()
        };
        let from_flag = |key: &str| {
            if key == "model" {
                SettingSource::SlimeFlag("--hf-checkpoint".into())
            } else {
                SettingSource::Flag(format!("--{}", key.replace('_', "-")))
            }
        };
        let from_file = |_: &str| SettingSource::File("cluster.toml".into());
        let settings = flags.clone().over(file.clone()).unwrap().resolve();
        let list = resolved_settings(
            &[
                Layer {
                    values: &flags,
                    source: &from_flag,
                },
                Layer {
                    values: &file,
                    source: &from_file,
                },
            ],
            &settings,
        );
        let get = |key: &str| list.iter().find(|s| s.key == key).unwrap();
        assert_eq!(get("lr").source, SettingSource::Flag("--lr".into()));
        assert_eq!(get("lr").value, serde_json::json!(2e-5));
        assert_eq!(
            get("model").source,
            SettingSource::SlimeFlag("--hf-checkpoint".into())
        );
        assert_eq!(
            get("n_samples").source,
            SettingSource::File("cluster.toml".into())
        );
        assert_eq!(get("n_samples").value, serde_json::json!(4));
        // Defaults carry the resolved value, nested groups included.
        assert_eq!(get("rollout_batch_size").source, SettingSource::Default);
        assert_eq!(get("rollout_batch_size").value, serde_json::json!(32));
        assert_eq!(get("kl_loss_type").value, serde_json::json!("k1"));
        assert_eq!(get("eval_temperature").value, serde_json::json!(1.0));
        assert_eq!(get("recompute").source, SettingSource::Derived);
        // Every layer key is listed once.
        let keys = keys_of(&TrainOverrides::default());
        for key in keys.keys() {
            assert_eq!(list.iter().filter(|s| &s.key == key).count(), 1, "{key}");
        }
        let text = render(&list);
        assert!(text.contains("(flag --lr)") && text.contains("(cluster.toml [train])"));
    }
}

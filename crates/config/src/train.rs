//! `train_config.yaml`: the OpenReward cookbook's environment and agent settings,
//! accepted unchanged, plus a few Manta keys (marked below).

use std::collections::BTreeMap;

use indexmap::IndexMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{read, ConfigError};

/// How step rewards become one episode reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RewardReduction {
    #[default]
    Sum,
    Mean,
    Max,
    Min,
}

impl RewardReduction {
    /// Reduces step rewards; an empty list gives 0.0 (as the cookbook does).
    pub fn reduce(self, rewards: &[f64]) -> f64 {
        if rewards.is_empty() {
            return 0.0;
        }
        match self {
            RewardReduction::Sum => rewards.iter().sum(),
            RewardReduction::Mean => rewards.iter().sum::<f64>() / rewards.len() as f64,
            RewardReduction::Max => rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            RewardReduction::Min => rewards.iter().copied().fold(f64::INFINITY, f64::min),
        }
    }
}

/// One entry under `environments:` (key = `Owner/Name`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentConfig {
    #[serde(default = "default_splits")]
    pub splits: Vec<String>,
    /// Cap on tasks per split; `None` = all.
    #[serde(default)]
    pub num_samples: Option<u64>,
    /// Appended as a step reward when the episode did not reach a terminal state.
    #[serde(default)]
    pub nonterminal_reward: Option<f64>,
    #[serde(default)]
    pub reward_reduction: RewardReduction,
    #[serde(default)]
    pub min_reward: Option<f64>,
    #[serde(default)]
    pub max_reward: Option<f64>,
    #[serde(default = "default_max_turns")]
    pub max_turns: usize,
    /// Per-environment secrets; a `null` value is read from the environment variable
    /// named by the key in upper case.
    #[serde(default)]
    pub secrets: BTreeMap<String, Option<String>>,
    /// **Manta:** ORS server base URL. Default: `OPENREWARD_SESSION_URL` or
    /// openreward.ai's session host. `builtin` starts Manta's built-in server.
    #[serde(default)]
    pub url: Option<String>,
    /// **Manta:** the environment variant (path prefix on the server).
    #[serde(default)]
    pub variant: Option<String>,
}

fn default_splits() -> Vec<String> {
    vec!["train".to_string()]
}
fn default_max_turns() -> usize {
    20
}

impl EnvironmentConfig {
    /// Reward reduction, nonterminal reward and clamps of the cookbook, in its order.
    pub fn episode_reward(&self, step_rewards: &[f64], reached_terminal: bool) -> f64 {
        let mut rewards = step_rewards.to_vec();
        if !reached_terminal {
            if let Some(r) = self.nonterminal_reward {
                rewards.push(r);
            }
        }
        let mut reward = self.reward_reduction.reduce(&rewards);
        if let Some(lo) = self.min_reward {
            reward = reward.max(lo);
        }
        if let Some(hi) = self.max_reward {
            reward = reward.min(hi);
        }
        reward
    }
}

/// The default `system_prompt_template`: the cookbook's config.py default, to the byte
/// (Hermes-style tool calls, which the Qwen family is trained on). `{tools}` is replaced
/// by one JSON object per tool; `{{`/`}}` are literal braces (Python `str.format`).
pub const DEFAULT_SYSTEM_PROMPT: &str = concat!(
    "You are an agent that takes actions in a stateful environment to achieve a goal.\n\n",
    "# Tools\n\n",
    "You may call one or more functions to assist with the user query.\n\n",
    "You are provided with function signatures within <tools></tools> XML tags:\n",
    "<tools>\n{tools}\n</tools>\n\n",
    "For each function call, return a json object with function name and arguments ",
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n",
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
);

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrainConfig {
    #[serde(deserialize_with = "environments_in_file_order")]
    environments: IndexMap<String, EnvironmentConfig>,
    #[serde(default)]
    secrets: BTreeMap<String, Option<String>>,
    #[serde(default)]
    system_prompt_template: Option<String>,
    #[serde(default)]
    thinking: bool,
    #[serde(default)]
    openreward_run_name: Option<String>,
}

/// `environments:` with its entries in the order the file lists them.
fn environments_in_file_order<'de, D>(
    deserializer: D,
) -> Result<IndexMap<String, EnvironmentConfig>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct InOrder;
    impl<'de> serde::de::Visitor<'de> for InOrder {
        type Value = IndexMap<String, EnvironmentConfig>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of Owner/Name to environment options")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = IndexMap::new();
            while let Some((name, config)) = map.next_entry::<String, EnvironmentConfig>()? {
                if out.insert(name.clone(), config).is_some() {
                    return Err(serde::de::Error::custom(format!(
                        "environment {name} is listed twice"
                    )));
                }
            }
            Ok(out)
        }
    }
    deserializer.deserialize_map(InOrder)
}

/// The parsed `train_config.yaml`.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub path: PathBuf,
    /// `Owner/Name` → options, in the file's order (the cookbook walks them so).
    pub environments: IndexMap<String, EnvironmentConfig>,
    pub secrets: BTreeMap<String, Option<String>>,
    pub system_prompt_template: String,
    pub thinking: bool,
    pub openreward_run_name: Option<String>,
}

impl TrainConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read(path)?;
        Self::from_yaml_str(&text, path)
    }

    pub fn from_yaml_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let raw: RawTrainConfig = serde_norway::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if raw.environments.is_empty() {
            return Err(ConfigError::invalid(
                path,
                "environments",
                "{}",
                "name at least one environment",
            ));
        }
        for (name, env) in &raw.environments {
            let key = |k: &str| format!("environments.{name}.{k}");
            if !name.contains('/') {
                return Err(ConfigError::invalid(
                    path,
                    format!("environments.{name}"),
                    format!("{name:?}"),
                    "environment names are Owner/Name",
                ));
            }
            if env.splits.is_empty() {
                return Err(ConfigError::invalid(
                    path,
                    key("splits"),
                    "[]",
                    "name at least one split",
                ));
            }
            if env.max_turns == 0 {
                return Err(ConfigError::invalid(
                    path,
                    key("max_turns"),
                    0,
                    "must be at least 1",
                ));
            }
            if let (Some(lo), Some(hi)) = (env.min_reward, env.max_reward) {
                if lo > hi {
                    return Err(ConfigError::invalid(
                        path,
                        key("min_reward"),
                        lo,
                        format!("is above max_reward {hi}"),
                    ));
                }
            }
        }
        let template = raw
            .system_prompt_template
            .unwrap_or_else(|| DEFAULT_SYSTEM_PROMPT.to_string());
        format_system_prompt(&template, "").map_err(|reason| {
            ConfigError::invalid(
                path,
                "system_prompt_template",
                format!("{:?}", abbreviate(&template)),
                reason,
            )
        })?;
        Ok(TrainConfig {
            path: path.to_path_buf(),
            environments: raw.environments,
            secrets: raw.secrets,
            system_prompt_template: template,
            thinking: raw.thinking,
            openreward_run_name: raw.openreward_run_name,
        })
    }

    /// Secrets for one environment: global ones overlaid by the environment's own;
    /// `null` values come from the upper-cased environment variable (missing = skipped).
    pub fn resolved_secrets(&self, env_name: &str) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let env_secrets = self.environments.get(env_name).map(|e| &e.secrets);
        for (k, v) in self.secrets.iter().chain(env_secrets.into_iter().flatten()) {
            let value = v.clone().or_else(|| std::env::var(k.to_uppercase()).ok());
            match value {
                Some(v) => {
                    out.insert(k.clone(), v);
                }
                None => {
                    out.remove(k);
                }
            }
        }
        out
    }
}

fn abbreviate(s: &str) -> String {
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(60).collect::<String>())
    } else {
        s.to_string()
    }
}

/// Python `str.format(tools=...)` semantics: `{tools}` is replaced, `{{`/`}}` are
/// literal braces, anything else in braces is an error (Python would raise KeyError).
pub fn format_system_prompt(template: &str, tools: &str) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + tools.len());
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                out.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                out.push('}');
            }
            '{' => {
                let mut field = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(ch) => field.push(ch),
                        None => return Err("unclosed '{' (write '{{' for a literal brace)".into()),
                    }
                }
                if field != "tools" {
                    return Err(format!("unknown placeholder {{{field}}}; only {{tools}} is replaced (write '{{{{' for a literal brace)"));
                }
                out.push_str(tools);
            }
            '}' => return Err("single '}' (write '}}' for a literal brace)".into()),
            c => out.push(c),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOKBOOK: &str = r#"
environments:
  GeneralReasoning/WhoDunit:  # Browse at https://openreward.ai/environments
    splits: [train]
    nonterminal_reward: 0.0
    reward_reduction: sum
    max_turns: 20

secrets:
  openai_api_key: null  # null = read from OPENAI_API_KEY env var

system_prompt_template: |
  You are an agent that takes actions in a stateful environment to achieve a goal.

  # Tools
  ...
  {tools}
  ...

thinking: false
openreward_run_name: miles-rl-openreward
"#;

    fn parse(text: &str) -> Result<TrainConfig, ConfigError> {
        TrainConfig::from_yaml_str(text, Path::new("train_config.yaml"))
    }

    #[test]
    fn cookbook_example_parses_unchanged() {
        let c = parse(COOKBOOK).unwrap();
        let env = &c.environments["GeneralReasoning/WhoDunit"];
        assert_eq!(env.splits, vec!["train"]);
        assert_eq!(env.nonterminal_reward, Some(0.0));
        assert_eq!(env.max_turns, 20);
        assert!(!c.thinking);
        assert_eq!(
            c.openreward_run_name.as_deref(),
            Some("miles-rl-openreward")
        );
        assert!(c.system_prompt_template.contains("{tools}"));
    }

    #[test]
    fn unknown_environment_key_is_rejected_by_name() {
        let err = parse("environments:\n  A/B:\n    max_turn: 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train_config.yaml") && err.contains("max_turn"),
            "{err}"
        );
        // Where in the file: the key's line and column.
        assert!(err.contains("line 3 column 5"), "{err}");
        let err = parse("environments:\n  A/B:\n    splits: [train\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train_config.yaml") && err.contains("line "),
            "{err}"
        );
    }

    #[test]
    fn bad_reduction_value_is_named() {
        let err = parse("environments:\n  A/B:\n    reward_reduction: avg\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("avg") && err.contains("sum"), "{err}");
    }

    #[test]
    fn bad_values_name_key_and_value() {
        let err = parse("environments:\n  A/B:\n    max_turns: 0\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("environments.A/B.max_turns") && err.contains(" 0"),
            "{err}"
        );
        let err = parse("environments:\n  A/B:\n    min_reward: 2\n    max_reward: 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("min_reward"), "{err}");
        let err = parse("environments:\n  A/B: {}\nsystem_prompt_template: 'use {tool}'\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("system_prompt_template") && err.contains("{tool}"),
            "{err}"
        );
        let err = parse("environments: {}\n").unwrap_err().to_string();
        assert!(err.contains("environments"), "{err}");
    }

    #[test]
    fn python_format_semantics() {
        assert_eq!(
            format_system_prompt("a {tools} {{x}}", "T").unwrap(),
            "a T {x}"
        );
        assert!(format_system_prompt("a } b", "T").is_err());
        assert!(format_system_prompt("a {tools", "T").is_err());
    }

    #[test]
    fn reduction_nonterminal_and_clamps() {
        let mut env = parse("environments:\n  A/B: {}\n").unwrap().environments["A/B"].clone();
        assert_eq!(env.episode_reward(&[], true), 0.0);
        assert_eq!(env.episode_reward(&[0.5, 0.25], true), 0.75);
        env.reward_reduction = RewardReduction::Mean;
        env.nonterminal_reward = Some(-1.0);
        assert_eq!(env.episode_reward(&[0.5, 0.5], false), 0.0);
        assert_eq!(env.episode_reward(&[0.5, 0.5], true), 0.5);
        env.reward_reduction = RewardReduction::Max;
        assert_eq!(env.episode_reward(&[0.1, 0.9, 0.3], true), 0.9);
        env.reward_reduction = RewardReduction::Min;
        assert_eq!(env.episode_reward(&[0.1, 0.9, 0.3], true), 0.1);
        env.reward_reduction = RewardReduction::Sum;
        env.max_reward = Some(1.0);
        env.min_reward = Some(0.0);
        assert_eq!(env.episode_reward(&[0.8, 0.8], true), 1.0);
        assert_eq!(env.episode_reward(&[0.2], false), 0.0);
    }

    #[test]
    fn secrets_merge_and_read_environment_variables() {
        std::env::set_var("MANTA_TEST_SECRET_XYZ", "from-env");
        let c = parse(
            "environments:\n  A/B:\n    secrets: {own: v2, manta_test_secret_xyz: null}\nsecrets:\n  global: v1\n  manta_test_secret_xyz: explicit\n",
        )
        .unwrap();
        let s = c.resolved_secrets("A/B");
        assert_eq!(s["global"], "v1");
        assert_eq!(s["own"], "v2");
        assert_eq!(s["manta_test_secret_xyz"], "from-env");
    }
}

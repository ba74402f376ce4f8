//! The model's hyper-parameters, read from and written to a Hugging Face `config.json`.
//!
//! Both the classic layout (`rope_theta` and `rope_scaling` at top level, as on the Hub)
//! and the transformers 5 layout (`rope_parameters`) are accepted; the classic layout is
//! written, which every transformers version reads. Keys this crate does not use are kept
//! and written back unchanged.

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::error::ModelError;
use crate::moe::MoeConfig;

/// Which architecture variant a config describes; decides q/k norms and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFamily {
    /// Qwen3: RMSNorm over each head's q and k before RoPE, no attention bias.
    Qwen3,
    /// Qwen2 / Qwen2.5: q/k/v projections carry a bias.
    Qwen2,
    /// Llama 2 / 3: the plain decoder, optionally with llama3 rope scaling.
    Llama,
}

/// Llama 3 style frequency-dependent RoPE scaling (`rope_type: "llama3"`), the only
/// scaling type supported; others are refused when the config is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: i64,
}

/// Hyper-parameters of a decoder-only model, named as in Hugging Face `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub model_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    /// Filled with `num_attention_heads` when the file omits it.
    pub num_key_value_heads: i64,
    /// Filled with `hidden_size / num_attention_heads` when the file omits it.
    pub head_dim: i64,
    pub vocab_size: i64,
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections; defaults to true for Qwen2, false otherwise.
    pub attention_bias: bool,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: i64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub bos_token_id: Option<i64>,
    /// One id or a list in the file; always a list here.
    #[serde(
        default,
        deserialize_with = "de_token_ids",
        serialize_with = "ser_token_ids"
    )]
    pub eos_token_id: Vec<i64>,
    #[serde(default, alias = "dtype", skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Keys read from the file that this crate does not interpret, written back as read.
    #[serde(skip)]
    pub extra: Map<String, Value>,
    /// The experts of a `qwen3_moe` model (its keys also stay in `extra`); `None` for
    /// dense models.
    #[serde(skip)]
    pub moe: Option<MoeConfig>,
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_max_positions() -> i64 {
    2048
}
fn default_init_range() -> f64 {
    0.02
}
fn default_act() -> String {
    "silu".to_string()
}

fn de_token_ids<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Ids {
        One(i64),
        Many(Vec<i64>),
    }
    Ok(match Option::<Ids>::deserialize(d)? {
        None => Vec::new(),
        Some(Ids::One(id)) => vec![id],
        Some(Ids::Many(ids)) => ids,
    })
}

fn ser_token_ids<S: Serializer>(ids: &[i64], s: S) -> Result<S::Ok, S::Error> {
    match ids {
        [] => s.serialize_none(),
        [one] => s.serialize_i64(*one),
        many => many.serialize(s),
    }
}

/// Keys that are consumed into typed fields (or replaced by them) and so are not kept in `extra`.
const KNOWN_KEYS: &[&str] = &[
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "attention_bias",
    "max_position_embeddings",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "dtype",
    "initializer_range",
    "hidden_act",
];

impl ModelConfig {
    /// Reads a `config.json`; errors name the file and the offending key.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses config JSON; `origin` (a file name or description) prefixes every error.
    pub fn from_json_str(s: &str, origin: &str) -> Result<Self, ModelError> {
        let value: Value = serde_json::from_str(s).map_err(|e| ModelError::Json {
            origin: origin.to_string(),
            key: String::new(),
            message: e.to_string(),
        })?;
        let Value::Object(mut obj) = value else {
            return Err(ModelError::Json {
                origin: origin.to_string(),
                key: String::new(),
                message: "the document is not a JSON object".to_string(),
            });
        };
        normalize(&mut obj, origin)?;
        let extra: Map<String, Value> = obj
            .iter()
            .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut cfg: ModelConfig =
            serde_path_to_error::deserialize(Value::Object(obj)).map_err(|e| {
                let message = e.inner().to_string();
                let mut key = e.path().to_string();
                if key == "." {
                    // serde reports a missing field at the parent; pull its name out.
                    key = message
                        .strip_prefix("missing field `")
                        .and_then(|rest| rest.split('`').next())
                        .unwrap_or_default()
                        .to_string();
                }
                ModelError::Json {
                    origin: origin.to_string(),
                    key,
                    message,
                }
            })?;
        if cfg.model_type == "qwen3_moe" {
            cfg.moe = Some(MoeConfig::from_keys(&extra, origin)?);
        }
        cfg.extra = extra;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// The architecture variant, from `model_type` (validated when the config was read).
    pub fn family(&self) -> ModelFamily {
        match self.model_type.as_str() {
            "qwen3" | "qwen3_moe" => ModelFamily::Qwen3,
            "qwen2" => ModelFamily::Qwen2,
            _ => ModelFamily::Llama,
        }
    }

    /// Width of one attention head; may differ from `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> i64 {
        self.head_dim
    }

    /// The experts, for a mixture-of-experts model.
    pub fn moe(&self) -> Option<&MoeConfig> {
        self.moe.as_ref()
    }

    /// The end-of-sequence ids (a config may list several).
    pub fn eos_token_ids(&self) -> &[i64] {
        &self.eos_token_id
    }

    /// A Hugging Face compatible `config.json`, including the unknown keys that were read.
    pub fn to_json_pretty(&self) -> String {
        let mut obj = match serde_json::to_value(self) {
            Ok(Value::Object(obj)) => obj,
            // A struct of plain numbers and strings always serializes to an object.
            _ => Map::new(),
        };
        for (k, v) in &self.extra {
            obj.entry(k.clone()).or_insert_with(|| v.clone());
        }
        serde_json::to_string_pretty(&Value::Object(obj)).unwrap_or_default()
    }

    fn validate(&self, origin: &str) -> Result<(), ModelError> {
        let bad = |key: &str, value: String, reason: &str| ModelError::ConfigValue {
            origin: origin.to_string(),
            key: key.to_string(),
            value,
            reason: reason.to_string(),
        };
        if !matches!(
            self.model_type.as_str(),
            "qwen3" | "qwen3_moe" | "qwen2" | "llama"
        ) {
            return Err(bad(
                "model_type",
                format!("{:?}", self.model_type),
                "supported model types are qwen3, qwen3_moe, qwen2 and llama",
            ));
        }
        for (key, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v <= 0 {
                return Err(bad(key, v.to_string(), "must be positive"));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(bad(
                "num_key_value_heads",
                self.num_key_value_heads.to_string(),
                &format!(
                    "must divide num_attention_heads ({})",
                    self.num_attention_heads
                ),
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(bad(
                "head_dim",
                self.head_dim.to_string(),
                "rotary embeddings need an even head_dim",
            ));
        }
        if !exceeds(self.rms_norm_eps, 0.0) {
            return Err(bad(
                "rms_norm_eps",
                self.rms_norm_eps.to_string(),
                "must be positive",
            ));
        }
        if !exceeds(self.rope_theta, 0.0) {
            return Err(bad(
                "rope_theta",
                self.rope_theta.to_string(),
                "must be positive",
            ));
        }
        if self.hidden_act != "silu" {
            return Err(bad(
                "hidden_act",
                format!("{:?}", self.hidden_act),
                "only silu (SwiGLU) is supported",
            ));
        }
        for flag in ["use_sliding_window", "mlp_bias"] {
            if self.extra.get(flag) == Some(&Value::Bool(true)) {
                return Err(bad(flag, "true".to_string(), "not supported"));
            }
        }
        if let Some(rs) = &self.rope_scaling {
            if !exceeds(rs.factor, 0.0) {
                return Err(bad(
                    "rope_scaling.factor",
                    rs.factor.to_string(),
                    "must be positive",
                ));
            }
            if !exceeds(rs.high_freq_factor, rs.low_freq_factor) {
                return Err(bad(
                    "rope_scaling.high_freq_factor",
                    rs.high_freq_factor.to_string(),
                    "must exceed low_freq_factor",
                ));
            }
            if !exceeds(rs.low_freq_factor, 0.0) {
                return Err(bad(
                    "rope_scaling.low_freq_factor",
                    rs.low_freq_factor.to_string(),
                    "must be positive",
                ));
            }
            if rs.original_max_position_embeddings <= 0 {
                return Err(bad(
                    "rope_scaling.original_max_position_embeddings",
                    rs.original_max_position_embeddings.to_string(),
                    "must be positive",
                ));
            }
        }
        Ok(())
    }
}

/// `a > b`, false when either is NaN (so NaN values are rejected).
fn exceeds(a: f64, b: f64) -> bool {
    a > b
}

fn is_missing(obj: &Map<String, Value>, key: &str) -> bool {
    matches!(obj.get(key), None | Some(Value::Null))
}

/// Fills defaults that depend on other keys and folds the transformers 5 `rope_parameters`
/// layout into `rope_theta` / `rope_scaling`, before typed deserialization.
fn normalize(obj: &mut Map<String, Value>, origin: &str) -> Result<(), ModelError> {
    let unsupported = |key: &str, value: &Value, reason: &str| ModelError::ConfigValue {
        origin: origin.to_string(),
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    };
    if let Some(Value::Object(params)) = obj.get("rope_parameters").cloned() {
        if is_missing(obj, "rope_theta") {
            if let Some(theta) = params.get("rope_theta") {
                obj.insert("rope_theta".to_string(), theta.clone());
            }
        }
        if is_missing(obj, "rope_scaling") {
            let mut scaling = params.clone();
            scaling.remove("rope_theta");
            obj.insert("rope_scaling".to_string(), Value::Object(scaling));
        }
    }
    if let Some(Value::Object(scaling)) = obj.get("rope_scaling") {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .cloned()
            .unwrap_or(Value::Null);
        match kind.as_str() {
            Some("default") => {
                obj.insert("rope_scaling".to_string(), Value::Null);
            }
            Some("llama3") => {}
            _ => {
                return Err(unsupported(
                    "rope_scaling.rope_type",
                    &kind,
                    "only llama3 rope scaling (or none) is supported",
                ))
            }
        }
    }
    if is_missing(obj, "num_key_value_heads") {
        if let Some(heads) = obj.get("num_attention_heads").cloned() {
            obj.insert("num_key_value_heads".to_string(), heads);
        }
    }
    if is_missing(obj, "head_dim") {
        let hidden = obj.get("hidden_size").and_then(Value::as_i64);
        let heads = obj.get("num_attention_heads").and_then(Value::as_i64);
        if let (Some(hidden), Some(heads)) = (hidden, heads) {
            if heads <= 0 || hidden % heads != 0 {
                return Err(unsupported(
                    "num_attention_heads",
                    &Value::from(heads),
                    &format!("must divide hidden_size ({hidden}) when head_dim is not given"),
                ));
            }
            obj.insert("head_dim".to_string(), Value::from(hidden / heads));
        }
    }
    if is_missing(obj, "attention_bias") {
        let qwen2 = obj.get("model_type").and_then(Value::as_str) == Some("qwen2");
        obj.insert("attention_bias".to_string(), Value::Bool(qwen2));
    }
    Ok(())
}

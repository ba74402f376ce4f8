//! The mixture-of-experts keys of a `qwen3_moe` config.json, typed and checked.
//!
//! The keys stay in the config's `extra` map too, so a config is written back as it was
//! read; this struct is the interpretation the model builds from.

use serde_json::{Map, Value};

use crate::error::ModelError;

/// Experts of the sparse layers and which layers are sparse, as transformers'
/// `Qwen3MoeConfig` defines them.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_experts`; transformers 5 also `num_local_experts`).
    pub num_experts: i64,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: i64,
    /// Width of one expert's SwiGLU (`moe_intermediate_size`).
    pub moe_intermediate_size: i64,
    /// Whether the k selected routing probabilities are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Layer i is sparse when (i + 1) is a multiple of this (and i is not in `mlp_only_layers`).
    pub decoder_sparse_step: i64,
    /// Layers that keep a dense MLP whatever `decoder_sparse_step` says.
    pub mlp_only_layers: Vec<i64>,
    /// The checkpoint's load-balancing coefficient (informational: the trainer's
    /// `--moe-aux-loss-coeff` decides the loss).
    pub router_aux_loss_coef: f64,
}

impl MoeConfig {
    /// Reads the MoE keys of a `qwen3_moe` config; absent keys take transformers' defaults.
    pub(crate) fn from_keys(obj: &Map<String, Value>, origin: &str) -> Result<Self, ModelError> {
        let bad = |key: &str, value: &Value, reason: &str| ModelError::ConfigValue {
            origin: origin.to_string(),
            key: key.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
        };
        let int = |key: &str, default: i64| -> Result<i64, ModelError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_i64()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| bad(key, v, "must be a positive integer")),
            }
        };
        let experts_key = if obj.get("num_experts").is_some_and(|v| !v.is_null()) {
            "num_experts"
        } else {
            "num_local_experts"
        };
        let num_experts = int(experts_key, 128)?;
        if let (Some(a), Some(b)) = (obj.get("num_experts"), obj.get("num_local_experts")) {
            if !a.is_null() && !b.is_null() && a != b {
                return Err(bad(
                    "num_local_experts",
                    b,
                    &format!("disagrees with num_experts ({a})"),
                ));
            }
        }
        let top_k = int("num_experts_per_tok", 8)?;
        if top_k > num_experts {
            return Err(bad(
                "num_experts_per_tok",
                &Value::from(top_k),
                &format!("must not exceed num_experts ({num_experts})"),
            ));
        }
        let norm_topk_prob = match obj.get("norm_topk_prob") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(bad("norm_topk_prob", v, "must be true or false")),
        };
        let mlp_only_layers = match obj.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64()
                        .filter(|n| *n >= 0)
                        .ok_or_else(|| bad("mlp_only_layers", v, "must list layer indices"))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(bad("mlp_only_layers", v, "must be a list of layer indices")),
        };
        let router_aux_loss_coef = match obj.get("router_aux_loss_coef") {
            None | Some(Value::Null) => 0.001,
            Some(v) => v
                .as_f64()
                .filter(|c| *c >= 0.0)
                .ok_or_else(|| bad("router_aux_loss_coef", v, "must be a number >= 0"))?,
        };
        if obj
            .get("shared_expert_intermediate_size")
            .is_some_and(|v| v.as_i64().unwrap_or(0) > 0)
        {
            return Err(bad(
                "shared_expert_intermediate_size",
                &obj["shared_expert_intermediate_size"],
                "shared experts are not supported (qwen3_moe has none)",
            ));
        }
        Ok(MoeConfig {
            num_experts,
            top_k,
            moe_intermediate_size: int("moe_intermediate_size", 768)?,
            norm_topk_prob,
            decoder_sparse_step: int("decoder_sparse_step", 1)?,
            mlp_only_layers,
            router_aux_loss_coef,
        })
    }

    /// Whether decoder layer `layer` holds experts (transformers' rule, the same test).
    pub fn is_sparse(&self, layer: i64) -> bool {
        !self.mlp_only_layers.contains(&layer) && (layer + 1) % self.decoder_sparse_step == 0
    }

    /// The sparse layers of a model with `num_layers` layers, in order; routed-expert
    /// records have one row per entry, in this order.
    pub fn sparse_layers(&self, num_layers: i64) -> Vec<i64> {
        (0..num_layers).filter(|&l| self.is_sparse(l)).collect()
    }
}

//! Helpers shared by the integration tests: tiny configs and seeded models.
#![allow(dead_code)] // each test binary uses a different subset

use manta_model::{Attention, CausalLm, ModelConfig};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// A tiny config with head_dim != hidden/heads and GQA ratio 4.
pub fn config(model_type: &str, tied: bool) -> ModelConfig {
    let json = format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 12, "vocab_size": 53, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": {tied}, "max_position_embeddings": 128,
        "initializer_range": 0.2, "eos_token_id": [5, 6]}}"#
    );
    ModelConfig::from_json_str(&json, "test config").expect("valid test config")
}

pub fn model(cfg: &ModelConfig, seed: i64) -> (VarStore, CausalLm) {
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    let m = CausalLm::new(&vs.root(), cfg);
    // Perturb norms and biases so that they matter in every comparison.
    tch::no_grad(|| {
        // Sorted, so that the random draws (and so the weights) depend on the seed only.
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut var) in vars {
            if name.contains("norm") || name.ends_with("bias") {
                let _ = var.g_add_(&(var.randn_like() * 0.2));
            }
        }
    });
    (vs, m)
}

pub fn ids(rows: &[&[i64]]) -> Tensor {
    let b = rows.len() as i64;
    let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_slice(&flat).view([b, -1])
}

pub fn positions(b: i64, t: i64, start: i64) -> Tensor {
    Tensor::arange_start(start, start + t, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .expand([b, t], false)
        .contiguous()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

pub fn causal() -> Attention<'static> {
    Attention::Causal { key_mask: None }
}

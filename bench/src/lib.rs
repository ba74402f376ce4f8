//! What Manta's benchmark binaries share: the Qwen3 model shapes they measure, as HF
//! `config.json` text (random weights are made from them in each run; nothing is
//! downloaded) and as the list of a checkpoint's tensors, and the random GRPO batch the
//! trainer benchmarks step on.

use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use manta_trainer::TrainBatch;
use tch::{Device, Kind, Tensor};

/// Qwen3-0.6B's shape (tied embeddings).
pub const QWEN3_0_6B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
  "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "tie_word_embeddings": true, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
  "initializer_range": 0.02, "eos_token_id": 151645
}"#;

/// Qwen3-4B's shape (tied embeddings).
pub const QWEN3_4B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
  "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
  "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "tie_word_embeddings": true, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
  "initializer_range": 0.02, "eos_token_id": 151645
}"#;

/// Qwen3-8B's shape (separate LM head).
pub const QWEN3_8B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
  "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
  "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
  "initializer_range": 0.02, "eos_token_id": 151645
}"#;

/// (name, shape) of each tensor of a checkpoint.
pub type TensorShapes = Vec<(String, Vec<i64>)>;

/// The `config.json` of the benchmarks' model shape `shape` ("0.6b", "4b" or "8b").
pub fn decode_config(shape: &str) -> anyhow::Result<&'static str> {
    match shape {
        "0.6b" => Ok(QWEN3_0_6B),
        "4b" => Ok(QWEN3_4B),
        "8b" => Ok(QWEN3_8B),
        other => anyhow::bail!("unknown shape {other:?} (0.6b, 4b or 8b)"),
    }
}

/// (name, shape) of every tensor of a Qwen3 checkpoint of `shape` ("0.6b" or "8b"), in
/// the order transformers lists them, with its `config.json` text.
pub fn qwen3_tensor_shapes(shape: &str) -> anyhow::Result<(TensorShapes, &'static str)> {
    let (v, h, i, layers, nh, nkv, hd, tied, config) = match shape {
        "0.6b" => (151936, 1024, 3072, 28, 16, 8, 128, true, QWEN3_0_6B),
        "4b" => (151936, 2560, 9728, 36, 32, 8, 128, true, QWEN3_4B),
        "8b" => (151936, 4096, 12288, 36, 32, 8, 128, false, QWEN3_8B),
        other => anyhow::bail!("unknown shape {other:?} (0.6b, 4b or 8b)"),
    };
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..layers {
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![nh * hd, h]),
            ("self_attn.k_proj.weight", vec![nkv * hd, h]),
            ("self_attn.v_proj.weight", vec![nkv * hd, h]),
            ("self_attn.o_proj.weight", vec![h, nh * hd]),
            ("self_attn.q_norm.weight", vec![hd]),
            ("self_attn.k_norm.weight", vec![hd]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            t.push((format!("model.layers.{l}.{n}"), s));
        }
    }
    t.push(("model.norm.weight".into(), vec![h]));
    if !tied {
        t.push(("lm_head.weight".into(), vec![v, h]));
    }
    Ok((t, config))
}

/// Trained tokens of a benchmark sample of `seq` tokens: a quarter prompt, the rest the
/// response.
pub fn response_len(seq: usize) -> usize {
    seq - seq / 4
}

/// The benchmark's global batch, the same in every process and run (seed 1): random
/// token ids, rollout log-probs near a random model's (−ln vocab, plus noise) so that the
/// clipped ratio is exercised, advantages ±1 by sample.
pub fn grpo_batch(samples: usize, seq: usize, vocab: i64) -> TrainBatch {
    tch::manual_seed(1);
    let resp = response_len(seq);
    let base = -(vocab as f64).ln();
    let list = (0..samples)
        .map(|i| {
            let tokens: Vec<i64> = Vec::try_from(Tensor::randint(
                vocab,
                [seq as i64],
                (Kind::Int64, Device::Cpu),
            ))
            .unwrap_or_default();
            let noise: Vec<f32> =
                Vec::try_from(Tensor::randn([resp as i64], (Kind::Float, Device::Cpu)) * 0.2)
                    .unwrap_or_default();
            Sample {
                id: i as u64,
                group_index: 0,
                index: i as u32,
                tokens: tokens.iter().map(|&t| t as u32).collect(),
                response_length: resp,
                loss_mask: vec![1; resp],
                rollout_log_probs: noise.iter().map(|n| base as f32 + n).collect(),
                reward: 0.0,
                status: SampleStatus::Completed,
                weight_version: 0,
                metadata: EpisodeMetadata::default(),
                routed_experts: None,
            }
        })
        .collect();
    TrainBatch {
        samples: list,
        advantages: (0..samples)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        global_samples: samples,
    }
}

/// Parses a bench variant, `NAME` or `NAME:KEY=VALUE,KEY=VALUE` (the environment a
/// variant runs under: decode_step, paged_attention).
pub fn parse_variant(spec: &str) -> anyhow::Result<(String, Vec<(String, String)>)> {
    let (name, env) = spec.split_once(':').unwrap_or((spec, ""));
    let mut vars = Vec::new();
    for pair in env.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("variant {spec:?}: {pair:?} is not KEY=VALUE"))?;
        vars.push((k.to_string(), v.to_string()));
    }
    Ok((name.to_string(), vars))
}

#[cfg(test)]
mod tests {
    use super::parse_variant;

    #[test]
    fn variants_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_variant("default").unwrap(),
            ("default".into(), vec![])
        );
        let (name, env) = parse_variant("cold:MANTA_LOGITS_GEMV=0,X=a=b").unwrap();
        assert_eq!(name, "cold");
        assert_eq!(
            env,
            vec![
                ("MANTA_LOGITS_GEMV".to_string(), "0".to_string()),
                ("X".to_string(), "a=b".to_string())
            ]
        );
        let e = parse_variant("cold:MANTA_LOGITS_GEMV")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"MANTA_LOGITS_GEMV\" is not KEY=VALUE"), "{e}");
    }
}

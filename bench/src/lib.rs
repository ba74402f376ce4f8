//! What Manta's benchmark binaries share: the Qwen3 model shapes they measure, as HF
//! `config.json` text (random weights are made from them in each run; nothing is
//! downloaded).

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

//! Decoder-only transformers (Qwen3, Qwen3-MoE, Qwen2, Llama) in tch, shared by the trainer and the
//! native engine so that training and rollout compute identical log-probs.
//!
//! Parameters carry Hugging Face names, so checkpoints load from and save to the format
//! transformers and SGLang read.

pub mod config;
pub use config::{ModelConfig, ModelFamily, RopeScaling};
pub mod moe;
pub use moe::{MoeConfig, Routing};
pub mod transformer;
pub use transformer::{
    decode_counters, Attention, CausalLm, CpError, CpGroup, CpRow, KvCache, PagedAttention,
    PagedBatch, PagedKvCache, PagedSeq, SegmentKernel,
};
pub mod checkpoint;
pub use checkpoint::{load_weights, save_pretrained, save_pretrained_tensors};
pub mod logprobs;
pub use logprobs::{token_logprobs, DeferredLogprobs};
pub mod layer_hooks;
pub use layer_hooks::{LayerHooks, NoHooks};
pub mod recompute;
pub use recompute::{Recompute, RecomputeError, RecomputeMethod};
pub mod error;
mod kernel_check;
pub use error::ModelError;
pub use kernel_check::{fused_runs, Fused};

pub use tch;

/// Weights by Hugging Face name: what the trainer hands to weight sync and an engine
/// loads, defined here so that both sides name the one type.
pub type NamedTensors = Vec<(String, tch::Tensor)>;

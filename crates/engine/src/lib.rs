//! LLM inference engines behind one trait, [`Engine`]: what the rollout actor generates
//! through and what `driver serve` serves, with no knowledge of episodes or environments.
//!
//! - [`native`]: the tch engine (scheduler, paged KV cache, prefix cache, sampler, CUDA
//!   graphs) on its own thread.
//! - [`sglang`]: an SGLang server process, launched, health-checked, restarted and fed
//!   weights (from disk or over NCCL) by this crate.
//!
//! The request and answer types mirror SGLang's `/generate`, so the native engine, its
//! HTTP server and an SGLang client share them.

pub mod native;
pub mod sglang;
pub mod weight_parts;

use std::path::PathBuf;

use async_trait::async_trait;

pub use native::{NativeEngine, NativeEngineOptions};
pub use sglang::{NcclTarget, SglangEngine, SglangOptions, SglangServer};
pub use weight_parts::{WeightPart, WeightParts};

pub use manta_core::RoutedExperts;
pub use manta_model::NamedTensors;

/// Sampling controls of one request (SGLang's `sampling_params`).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches this (1 = off).
    pub top_p: f64,
    /// Keep only the k most likely tokens (0 or negative = off; SGLang uses -1).
    pub top_k: i64,
    /// Drop tokens less likely than `min_p` × the most likely one's probability (0 = off).
    pub min_p: f64,
    /// Per-request seed (`sampling_seed`): the same seed and prompt give the same tokens,
    /// whatever else the engine is running.
    pub seed: Option<u64>,
    /// Generation stops after emitting one of these (the stop token is kept).
    pub stop_token_ids: Vec<u32>,
    /// Generation stops once the decoded output contains one of these (kept in the output).
    pub stop: Vec<String>,
    /// Keep going past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Checks the values an engine cannot honour; the message names the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad =
            |field: &str, why: String| Err(EngineError::BadRequest(format!("{field}: {why}")));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "sampling_params.temperature",
                format!("{} must be a finite number >= 0", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(
                "sampling_params.top_p",
                format!("{} must be in (0, 1]", self.top_p),
            );
        }
        if self.top_k < -1 {
            return bad(
                "sampling_params.top_k",
                format!("{} must be -1 or 0 (off) or at least 1", self.top_k),
            );
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return bad(
                "sampling_params.min_p",
                format!("{} must be in [0, 1]", self.min_p),
            );
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("sampling_params.stop", "empty stop string".into());
        }
        Ok(())
    }

    /// Whether the next token is the argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

#[derive(Debug, Clone, Default)]
pub struct GenerateRequest {
    pub input_ids: Vec<u32>,
    pub params: SamplingParams,
    /// Request id for `abort`; the engine makes one up when absent.
    pub rid: Option<String>,
    /// SGLang's `return_routed_experts`: answer with the experts each sparse layer chose
    /// for every token but the last (rollout routing replay). Mixture-of-experts models
    /// on an engine started with `--enable-return-routed-experts` only.
    pub return_routed_experts: bool,
}

/// Why generation ended (SGLang: stop → completed, length → truncated, abort → aborted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string was produced (it ends the output).
    Stop,
    /// `max_new_tokens` (or the context length) was reached.
    Length,
    /// The engine aborted the request.
    Abort,
}

/// What ended a `Stop` (SGLang's `finish_reason.matched`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchedStop {
    Token(u32),
    Text(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    pub output_ids: Vec<u32>,
    /// Log-prob of each output id under the sampling distribution (logits / temperature).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    pub matched_stop: Option<MatchedStop>,
    /// The weight version that produced this output (the oldest, if it changed mid-request).
    pub weight_version: u64,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    /// With `return_routed_experts`: one row per token of prompt + output but the last
    /// (SGLang's `meta_info.routed_experts`), prefix-cached tokens included.
    pub routed_experts: Option<RoutedExperts>,
}

impl Default for GenerateOutput {
    fn default() -> Self {
        Self {
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            finish: FinishReason::Length,
            matched_stop: None,
            weight_version: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            routed_experts: None,
        }
    }
}

/// How `pause` treats requests in flight (SGLang's `/pause_generation` modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Finish every running request, start no new ones.
    Drain,
    /// Abort every running request (they answer with `Abort` and their partial output).
    Abort,
    /// Stop stepping, keep everything where it is; `resume` carries on.
    InPlace,
}

/// What the engine reports about itself (`/get_model_info`, `/get_server_info`).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    pub model_path: PathBuf,
    pub device: String,
    pub dtype: String,
    pub context_length: usize,
    pub max_running_requests: usize,
    pub max_total_tokens: usize,
    pub block_size: usize,
    pub vocab_size: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine is not running: {0}")]
    Stopped(String),
    #[error("bad generate request: {0}")]
    BadRequest(String),
    #[error("weight update refused: {0}")]
    Weights(String),
    #[error("not supported by this engine: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Model(#[from] manta_model::ModelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// A weight-update group an engine receives its weights in: broadcasts from rank 0
/// (the trainer), every engine of the run in one group, each at its own rank. Over NCCL
/// the engine joins on its own CUDA device; over the store backend (CPU engines) it
/// receives into host memory.
#[derive(Debug, Clone)]
pub struct BroadcastFeed {
    pub backend: manta_cuda::weight_group::Backend,
    /// The store rank 0 hosts.
    pub master_address: String,
    pub master_port: u16,
    /// This engine's rank (1..world_size).
    pub rank: usize,
    pub world_size: usize,
    /// An engine already in a group of this name stays in it.
    pub group_name: String,
    /// Bounds joining and each broadcast.
    pub timeout: std::time::Duration,
    /// Every parameter, in the order rank 0 broadcasts them.
    pub names: Vec<String>,
    /// How many consecutive `names` each broadcast round carries (a ZeRO-3 trainer sends
    /// one round per decoder layer as its ranks gather it); empty: one round of all.
    pub rounds: Vec<usize>,
    /// Given the group's aborter once the engine is in the group, right before it
    /// receives: lets the engine's host end the receive when rank 0's side fails.
    pub on_receive: Option<AbortHook>,
}

/// Takes the aborter of the group an engine is about to receive in (with the group's
/// name), so whoever handed out the feed can abort that receive from another thread.
#[derive(Clone)]
pub struct AbortHook(std::sync::Arc<PublishAborter>);

type PublishAborter = dyn Fn(&str, manta_cuda::weight_group::GroupAborter) + Send + Sync;

impl AbortHook {
    pub fn new(
        f: impl Fn(&str, manta_cuda::weight_group::GroupAborter) + Send + Sync + 'static,
    ) -> Self {
        Self(std::sync::Arc::new(f))
    }

    pub fn publish(&self, group_name: &str, aborter: manta_cuda::weight_group::GroupAborter) {
        (self.0)(group_name, aborter)
    }
}

impl std::fmt::Debug for AbortHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AbortHook")
    }
}

/// A parameter's name, shape and dtype.
pub type WeightShape = (String, Vec<i64>, tch::Kind);

/// What rollouts need from an inference engine.
#[async_trait]
pub trait Engine: Send + Sync {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError>;
    /// Replaces the weights between requests and sets the version reported from then on.
    async fn update_weights(&self, weights: NamedTensors, version: u64) -> Result<(), EngineError>;
    fn weight_version(&self) -> u64;

    /// Loads HF safetensors from `dir` (SGLang's `/update_weights_from_disk`).
    async fn update_weights_from_disk(
        &self,
        dir: PathBuf,
        version: u64,
    ) -> Result<(), EngineError> {
        let _ = (dir, version);
        Err(EngineError::Unsupported("update_weights_from_disk".into()))
    }
    /// Aborts the request with this id, or every request when `None`.
    async fn abort(&self, rid: Option<String>) -> Result<(), EngineError> {
        let _ = rid;
        Err(EngineError::Unsupported("abort".into()))
    }
    async fn pause(&self, mode: PauseMode) -> Result<(), EngineError> {
        let _ = mode;
        Err(EngineError::Unsupported("pause".into()))
    }
    async fn resume(&self) -> Result<(), EngineError> {
        Err(EngineError::Unsupported("resume".into()))
    }
    /// Receives every parameter by broadcast in `feed`'s group (joined on first use, kept
    /// for later updates) and sets `version`.
    async fn update_weights_broadcast(
        &self,
        feed: BroadcastFeed,
        version: u64,
    ) -> Result<(), EngineError> {
        let _ = (feed, version);
        Err(EngineError::Unsupported("update_weights_broadcast".into()))
    }
    /// Replaces the weights from groups of parameters as they arrive (each group
    /// answered once copied, so the sender never holds the whole model) and sets
    /// `version` once the sender closes `parts`. The default takes the update whole:
    /// every group is moved to the host as it comes, then [`Engine::update_weights`].
    async fn update_weights_in_parts(
        &self,
        parts: WeightParts,
        version: u64,
    ) -> Result<(), EngineError> {
        let all = weight_parts::collect_on_host(parts).await;
        self.update_weights(all, version).await
    }
    /// Every parameter's name, shape and dtype, sorted by name.
    async fn weight_shapes(&self) -> Result<Vec<WeightShape>, EngineError> {
        Err(EngineError::Unsupported("weight_shapes".into()))
    }
    /// A copy of the weights the engine computes with, by name (to verify a sync).
    async fn read_weights(&self) -> Result<NamedTensors, EngineError> {
        Err(EngineError::Unsupported("read_weights".into()))
    }
    /// Times the engine's server process was restarted (0 for in-process engines).
    fn restarts(&self) -> u64 {
        0
    }
    /// Drops every cached prefix; refused (`Ok(false)`) while requests are running.
    async fn flush_cache(&self) -> Result<bool, EngineError> {
        Err(EngineError::Unsupported("flush_cache".into()))
    }
    /// Frees the KV cache (SGLang's `/release_memory_occupation`) so a trainer sharing the
    /// GPU can use the memory; new requests wait until [`Engine::resume_memory_occupation`].
    /// Refused (`Ok(false)`) while requests are running.
    async fn release_memory_occupation(&self) -> Result<bool, EngineError> {
        Err(EngineError::Unsupported("release_memory_occupation".into()))
    }
    /// Allocates the KV cache again after a release; requests waiting for it go on.
    async fn resume_memory_occupation(&self) -> Result<(), EngineError> {
        Err(EngineError::Unsupported("resume_memory_occupation".into()))
    }
}

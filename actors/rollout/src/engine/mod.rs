//! The engine interface the rollout actor generates through, whatever runs behind it
//! (the native tch engine here; an SGLang server process in production).

pub mod native;

use async_trait::async_trait;
use tch::Tensor;

pub use native::{NativeEngine, NativeEngineOptions};

/// Weights by HF name, as weight sync hands them over.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Sampling controls of one request (SGLang's `sampling_params` subset we use).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// Generation stops after emitting one of these (the stop token is kept).
    pub stop_token_ids: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub input_ids: Vec<u32>,
    pub params: SamplingParams,
}

/// Why generation ended (SGLang: stop → completed, length → truncated, abort → aborted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced (it is the last output id).
    Stop,
    /// `max_new_tokens` was reached.
    Length,
    /// The engine aborted the request.
    Abort,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    pub output_ids: Vec<u32>,
    /// Log-prob of each output id under the sampling distribution (logits / temperature).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    /// The weight version that produced this output.
    pub weight_version: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine is not running: {0}")]
    Stopped(String),
    #[error("bad generate request: {0}")]
    BadRequest(String),
    #[error("weight update refused: {0}")]
    Weights(String),
    #[error(transparent)]
    Model(#[from] manta_model::ModelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// What rollouts need from an inference engine.
#[async_trait]
pub trait Engine: Send + Sync {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError>;
    /// Replaces the weights between requests and sets the version reported from then on.
    async fn update_weights(&self, weights: NamedTensors, version: u64) -> Result<(), EngineError>;
    fn weight_version(&self) -> u64;
}

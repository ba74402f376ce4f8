//! One request inside the engine: its tokens, the KV blocks holding them, and how far the
//! model has computed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::oneshot;

use super::sampler::RowSampling;
use super::stop::StopCheck;
use crate::{EngineError, FinishReason, GenerateOutput, MatchedStop, SamplingParams};

pub type Reply = oneshot::Sender<Result<GenerateOutput, EngineError>>;

pub struct Sequence {
    /// Arrival order; also orders admission after a weight-update barrier.
    pub id: u64,
    pub rid: String,
    /// Prompt followed by the output so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub logprobs: Vec<f32>,
    /// KV blocks holding `tokens[..num_computed]`, in order.
    pub blocks: Vec<u32>,
    pub num_computed: usize,
    /// Leading blocks already registered in the prefix cache, and the key of the last one.
    pub cached_blocks: usize,
    pub cache_key: Option<u64>,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_tokens: Option<usize>,
    pub params: SamplingParams,
    pub stop: StopCheck,
    pub rng: StdRng,
    pub weight_version: u64,
    /// Set when first scheduled; `weight_version` is read then.
    pub started: bool,
    pub reply: Option<Reply>,
    /// The request asked for its routed experts (`return_routed_experts`).
    pub return_routed_experts: bool,
    /// Read from the engine's per-slot record just before the sequence leaves.
    pub routed_experts: Option<crate::RoutedExperts>,
}

impl Sequence {
    /// A new request: `input_ids` as the prompt, nothing computed or cached yet, sampling
    /// from `seed`; the engine thread sets `id` when it takes the request.
    pub fn new(
        rid: String,
        input_ids: Vec<u32>,
        params: SamplingParams,
        stop: StopCheck,
        seed: u64,
        weight_version: u64,
        reply: Option<Reply>,
    ) -> Self {
        Self {
            id: 0,
            rid,
            prompt_len: input_ids.len(),
            tokens: input_ids,
            logprobs: Vec::new(),
            blocks: Vec::new(),
            num_computed: 0,
            cached_blocks: 0,
            cache_key: None,
            cached_tokens: None,
            params,
            stop,
            rng: StdRng::seed_from_u64(seed),
            weight_version,
            started: false,
            reply,
            return_routed_experts: false,
            routed_experts: None,
        }
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens still to run through the model before the next token can be sampled.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    pub fn row_sampling(&mut self) -> RowSampling {
        RowSampling {
            greedy: self.params.is_greedy(),
            temperature: self.params.temperature,
            top_k: self.params.top_k,
            top_p: self.params.top_p,
            min_p: self.params.min_p,
            uniform: self.rng.random::<f64>(),
        }
    }

    /// Sends the answer (once).
    pub fn finish(&mut self, finish: FinishReason, matched: Option<MatchedStop>) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Ok(GenerateOutput {
                output_ids: self.output().to_vec(),
                logprobs: self.logprobs.clone(),
                finish,
                matched_stop: matched,
                weight_version: self.weight_version,
                prompt_tokens: self.prompt_len,
                cached_tokens: self.cached_tokens.unwrap_or(0),
                routed_experts: self.routed_experts.take(),
            }));
        }
    }

    pub fn fail(&mut self, error: EngineError) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Err(error));
        }
    }
}

//! The sample: token ids, loss mask and log-probs of one episode.

use serde::{Deserialize, Serialize};

/// How an episode ended (slime/Miles' statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleStatus {
    /// The episode ended normally (terminal tool result or engine stop).
    Completed,
    /// A token budget or `max_turns` cut it short.
    Truncated,
    /// Generation was aborted (for example by a weight update).
    Aborted,
    /// The environment or engine failed; the sample is never trained on.
    Failed,
}

/// What happened during the episode, for metrics, traces and uploads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeMetadata {
    pub environment: String,
    pub task_hash: String,
    pub stop_reason: String,
    pub num_turns: u32,
    pub num_tool_calls: u32,
    pub num_failed_tool_calls: u32,
    pub step_rewards: Vec<f64>,
    /// Set when `status` is `Failed`: what went wrong.
    pub error: Option<String>,
    /// Restarts of the engine process that ran the episode, counted when it ended
    /// (`rollout/engine_restarts`; 0 for in-process engines).
    #[serde(default)]
    pub engine_restarts: u64,
    /// The weight version behind each response token: the generating version on
    /// generated tokens, the latest one on tokens the environment or template added.
    /// An episode that went on across a weight update (`--partial-rollout`) holds
    /// more than one.
    #[serde(default)]
    pub weight_versions: Vec<u64>,
    /// How much of each turn's prompt the engine found in its prefix cache.
    #[serde(default)]
    pub prefix_cache: PrefixCacheUse,
}

/// Prompt tokens an episode sent to its engine and how many of them the engine's
/// prefix cache held, for the first turn (the group's shared prompt) and for the
/// later turns (the episode's own earlier turns): `rollout/prefix_cache_hit_rate/*`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixCacheUse {
    pub first_turn_prompt: u64,
    pub first_turn_cached: u64,
    pub later_turns_prompt: u64,
    pub later_turns_cached: u64,
}

impl PrefixCacheUse {
    /// Adds one generate call of turn `turn` (0-based).
    pub fn record(&mut self, turn: usize, prompt_tokens: usize, cached_tokens: usize) {
        let (prompt, cached) = if turn == 0 {
            (&mut self.first_turn_prompt, &mut self.first_turn_cached)
        } else {
            (&mut self.later_turns_prompt, &mut self.later_turns_cached)
        };
        *prompt += prompt_tokens as u64;
        *cached += cached_tokens.min(prompt_tokens) as u64;
    }
}

/// One episode. `tokens` = prompt + response; `loss_mask` and `rollout_log_probs`
/// cover the response part only (`response_length` entries each).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Unique within a run; lets the driver detect lost or duplicated samples.
    pub id: u64,
    /// Which prompt group this belongs to (advantages are computed per group).
    pub group_index: u32,
    /// Position within its group.
    pub index: u32,
    pub tokens: Vec<u32>,
    pub response_length: usize,
    /// 1 on tokens the policy generated, 0 on tokens the environment or template added.
    pub loss_mask: Vec<u8>,
    /// The engine's log-prob of each response token (0 where `loss_mask` is 0).
    pub rollout_log_probs: Vec<f32>,
    pub reward: f64,
    pub status: SampleStatus,
    /// Weight version of the engine that generated it (the oldest, if it changed mid-episode).
    pub weight_version: u64,
    pub metadata: EpisodeMetadata,
    /// Rollout routing replay (R3): the experts the engine routed each token to, for
    /// mixture-of-experts models when the rollout asked for them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<RoutedExperts>,
}

/// The experts a rollout engine's sparse (MoE) layers chose for each token of an episode:
/// row i is `tokens[i]`'s routing. SGLang returns them for every token but the last
/// (which the engine never runs); a row of -1 is a token the engine did not record
/// (the trainer routes it by its own router).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedExperts {
    /// Sparse layers per row, in layer order.
    pub layers: u32,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: u32,
    /// Row-major [rows, layers, top_k] expert ids.
    pub ids: Vec<i32>,
}

impl RoutedExperts {
    /// Rows recorded (tokens covered, from the first).
    pub fn rows(&self) -> usize {
        let per_row = (self.layers * self.top_k) as usize;
        self.ids.len().checked_div(per_row).unwrap_or(0)
    }

    /// Checks the shape against a sample of `tokens` tokens; the message names the field.
    pub fn validate(&self, id: u64, tokens: usize) -> Result<(), String> {
        let per_row = (self.layers * self.top_k) as usize;
        if per_row == 0 || !self.ids.len().is_multiple_of(per_row) {
            return Err(format!(
                "sample {id}: routed_experts holds {} ids, not whole rows of {} layers x top-{}",
                self.ids.len(),
                self.layers,
                self.top_k
            ));
        }
        if self.rows() > tokens {
            return Err(format!(
                "sample {id}: routed_experts has {} rows for {tokens} tokens",
                self.rows()
            ));
        }
        if let Some(bad) = self.ids.iter().find(|&&e| e < -1) {
            return Err(format!(
                "sample {id}: routed_experts holds expert id {bad} (ids are >= 0, -1 = not recorded)"
            ));
        }
        Ok(())
    }
}

impl Sample {
    /// Number of prompt tokens.
    pub fn prompt_length(&self) -> usize {
        self.tokens.len() - self.response_length
    }

    /// Number of tokens the policy generated (the ones that are trained).
    pub fn generated_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m != 0).count()
    }

    /// Checks the invariants the trainer relies on; the message names the broken field.
    pub fn validate(&self) -> Result<(), String> {
        if self.response_length > self.tokens.len() {
            return Err(format!(
                "sample {}: response_length {} exceeds tokens length {}",
                self.id,
                self.response_length,
                self.tokens.len()
            ));
        }
        if self.loss_mask.len() != self.response_length {
            return Err(format!(
                "sample {}: loss_mask has {} entries, response_length is {}",
                self.id,
                self.loss_mask.len(),
                self.response_length
            ));
        }
        if self.rollout_log_probs.len() != self.response_length {
            return Err(format!(
                "sample {}: rollout_log_probs has {} entries, response_length is {}",
                self.id,
                self.rollout_log_probs.len(),
                self.response_length
            ));
        }
        if let Some(bad) = self.loss_mask.iter().find(|&&m| m > 1) {
            return Err(format!(
                "sample {}: loss_mask value {bad} is not 0 or 1",
                self.id
            ));
        }
        if !self.reward.is_finite() {
            return Err(format!(
                "sample {}: reward {} is not finite",
                self.id, self.reward
            ));
        }
        if let Some(routed) = &self.routed_experts {
            routed.validate(self.id, self.tokens.len())?;
        }
        let versions = self.metadata.weight_versions.len();
        if versions != 0 && versions != self.response_length {
            return Err(format!(
                "sample {}: metadata.weight_versions has {versions} entries, response_length is {}",
                self.id, self.response_length
            ));
        }
        Ok(())
    }
}

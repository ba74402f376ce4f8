//! When a request's generation ends: stop token ids (the model's end-of-sequence ids
//! unless `ignore_eos`), stop strings, `max_new_tokens` and the context length.

use std::sync::Arc;

use manta_tokenizer::Tokenizer;

use crate::{FinishReason, MatchedStop, SamplingParams};

/// Stop conditions of one request, checked after every generated token.
#[derive(Debug, Clone)]
pub struct StopCheck {
    token_ids: Vec<u32>,
    strings: Vec<String>,
    /// Output tokens decoded to look for stop strings: enough to hold the longest one.
    window: usize,
    max_new_tokens: usize,
}

impl StopCheck {
    pub fn new(params: &SamplingParams, eos_ids: &[u32]) -> Self {
        let mut token_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            for &e in eos_ids {
                if !token_ids.contains(&e) {
                    token_ids.push(e);
                }
            }
        }
        let longest = params.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        Self {
            token_ids,
            strings: params.stop.clone(),
            // A token covers at least one byte, plus slack for partial UTF-8 sequences.
            window: longest + 4,
            max_new_tokens: params.max_new_tokens,
        }
    }

    /// Whether the output (`output` ids, the last one just generated) is finished, and why.
    pub fn check(
        &self,
        output: &[u32],
        tokenizer: Option<&Arc<Tokenizer>>,
    ) -> Option<(FinishReason, Option<MatchedStop>)> {
        let last = *output.last()?;
        if self.token_ids.contains(&last) {
            return Some((FinishReason::Stop, Some(MatchedStop::Token(last))));
        }
        if !self.strings.is_empty() {
            if let Some(tok) = tokenizer {
                let tail = &output[output.len().saturating_sub(self.window)..];
                if let Ok(text) = tok.decode(tail, false) {
                    if let Some(s) = self.strings.iter().find(|s| text.contains(s.as_str())) {
                        return Some((FinishReason::Stop, Some(MatchedStop::Text(s.clone()))));
                    }
                }
            }
        }
        (output.len() >= self.max_new_tokens).then_some((FinishReason::Length, None))
    }
}

//! Token pieces of a conversation, rendered with the model's own chat template.
//!
//! Episodes never re-tokenize the whole conversation: generated ids are kept as the
//! engine returned them, and only the pieces between turns (closing the assistant turn,
//! a tool result or user message, opening the next assistant turn) are rendered and
//! tokenized. A piece is found as the difference between rendering a small anchor
//! conversation with and without the new message. Without a usable template the
//! Qwen/ChatML format is used.

use std::sync::Arc;

use manta_tokenizer::{Tokenizer, TokenizerError};
use serde_json::{json, Map, Value};

/// Content placed in the anchor's assistant turn to find where its text ends.
const SENTINEL: &str = "\u{2063}manta-anchor\u{2063}";

/// Renders prompts and between-turn pieces for one model.
pub struct ChatFormat {
    tokenizer: Arc<Tokenizer>,
    thinking: bool,
}

impl ChatFormat {
    pub fn new(tokenizer: Arc<Tokenizer>, thinking: bool) -> Self {
        Self {
            tokenizer,
            thinking,
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// train_config.yaml's `thinking`: the model writes its own `<think>` block.
    pub fn thinking(&self) -> bool {
        self.thinking
    }

    fn template_extra(&self) -> Map<String, Value> {
        let mut extra = Map::new();
        extra.insert("enable_thinking".into(), Value::Bool(self.thinking));
        extra
    }

    fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Option<Result<String, TokenizerError>> {
        let template = self.tokenizer.chat_template()?;
        Some(template.render(
            messages,
            None,
            add_generation_prompt,
            &self.template_extra(),
        ))
    }

    /// Text of the first prompt: system + user, with the assistant turn opened.
    pub fn prompt_text(&self, system: &str, user: &str) -> Result<String, TokenizerError> {
        let messages = [
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": user}),
        ];
        match self.render(&messages, true) {
            Some(rendered) => rendered,
            None => Ok(format!(
                "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n{}",
                self.fallback_generation_prompt()
            )),
        }
    }

    pub fn prompt_ids(&self, system: &str, user: &str) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer.encode(&self.prompt_text(system, user)?)
    }

    /// Text that follows a generated assistant turn (`generated`, decoded with special
    /// tokens): the rest of the turn's closing, then `message` (role `user` or `tool`),
    /// then the next assistant turn's opening.
    pub fn continuation_text(
        &self,
        generated: &str,
        message: &Value,
    ) -> Result<String, TokenizerError> {
        let anchor = [
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": "u"}),
            json!({"role": "assistant", "content": SENTINEL}),
        ];
        let from_template = match (self.render(&anchor, false), {
            let mut with = anchor.to_vec();
            with.push(message.clone());
            self.render(&with, true)
        }) {
            (Some(before), Some(after)) => {
                let (before, after) = (before?, after?);
                match (before.rfind(SENTINEL), after.strip_prefix(before.as_str())) {
                    (Some(pos), Some(delta)) => Some((
                        before[pos + SENTINEL.len()..].to_string(),
                        delta.to_string(),
                    )),
                    _ => None,
                }
            }
            _ => None,
        };
        let (closing, delta) = from_template
            .unwrap_or_else(|| ("<|im_end|>\n".to_string(), self.fallback_message(message)));
        Ok(format!(
            "{}{}",
            remaining_closing(generated, &closing),
            delta
        ))
    }

    pub fn continuation_ids(
        &self,
        generated: &str,
        message: &Value,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer
            .encode(&self.continuation_text(generated, message)?)
    }

    fn fallback_generation_prompt(&self) -> &'static str {
        if self.thinking {
            "<|im_start|>assistant\n"
        } else {
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        }
    }

    fn fallback_message(&self, message: &Value) -> String {
        let content = message
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let body = match message.get("role").and_then(Value::as_str) {
            Some("tool") => format!(
                "<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"
            ),
            _ => format!("<|im_start|>user\n{content}<|im_end|>\n"),
        };
        format!("{body}{}", self.fallback_generation_prompt())
    }
}

/// The part of `closing` not already at the end of `generated` (for example when the
/// engine stopped on `<|im_end|>`, only the newline after it remains).
fn remaining_closing<'a>(generated: &str, closing: &'a str) -> &'a str {
    for cut in (1..=closing.len()).rev() {
        if closing.is_char_boundary(cut) && generated.ends_with(&closing[..cut]) {
            return &closing[cut..];
        }
    }
    closing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_skips_what_was_generated() {
        assert_eq!(remaining_closing("hi<|im_end|>", "<|im_end|>\n"), "\n");
        assert_eq!(
            remaining_closing("</tool_call>", "<|im_end|>\n"),
            "<|im_end|>\n"
        );
        assert_eq!(remaining_closing("x", ""), "");
    }
}

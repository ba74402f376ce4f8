//! The byte-level tokenizer and tiny Qwen3 config of the small local model Manta ships
//! (`assets/tiny-qwen3`), used for local mode and fast tests.

use std::path::Path;

use serde_json::{json, Value};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use crate::TokenizerError;

/// Special tokens of the tiny tokenizer, with ids 256, 257, ... in this order.
pub const TINY_SPECIAL_TOKENS: [&str; 9] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
];

/// Context length of the tiny model (`model_max_length` / `max_position_embeddings`).
pub const TINY_MODEL_MAX_LENGTH: usize = 2048;

/// The ChatML-with-tools template (Qwen format): tools in the system turn, Hermes `<tool_call>` JSON for
/// assistant tool calls, tool results as a user turn of `<tool_response>` blocks, `add_generation_prompt`,
/// and `enable_thinking=false` opening the assistant turn with an empty `<think>\n\n</think>\n\n` block.
pub const CHATML_TOOLS_TEMPLATE: &str = include_str!("chatml_tools.jinja");

/// The 256 symbols byte-level BPE uses for the bytes 0..=255: printable Latin-1 bytes stand for
/// themselves, the others are moved to U+0100 and up, so every byte is one visible character.
fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut next_free = 0x100;
    (0u32..256)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next_free += 1;
                next_free - 1
            };
            char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER)
        })
        .collect()
}

/// Builds the tiny model's tokenizer: one token per byte (ids 0..=255 in byte order, a BPE model with no
/// merges behind a GPT-2 style ByteLevel pre-tokenizer without regex split or prefix space, and a
/// ByteLevel decoder), then [`TINY_SPECIAL_TOKENS`]. Any UTF-8 text round-trips.
pub fn build_tiny_tokenizer() -> Result<tokenizers::Tokenizer, TokenizerError> {
    let symbols = byte_symbols();
    let vocab: [(String, u32); 256] =
        std::array::from_fn(|byte| (symbols[byte].to_string(), byte as u32));
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, false);
    tokenizer.with_pre_tokenizer(Some(byte_level));
    tokenizer.with_decoder(Some(byte_level));
    let special: Vec<AddedToken> = TINY_SPECIAL_TOKENS
        .iter()
        .map(|token| AddedToken::from(*token, true))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    for (offset, token) in TINY_SPECIAL_TOKENS.iter().enumerate() {
        let expected = 256 + offset as u32;
        if tokenizer.token_to_id(token) != Some(expected) {
            return Err(TokenizerError::Build(format!(
                "special token {token} did not get id {expected}"
            )));
        }
    }
    Ok(tokenizer)
}

/// The tiny model's `tokenizer_config.json`: chat template, `<|im_end|>` as eos, `<|endoftext|>` as pad.
pub fn tiny_tokenizer_config() -> Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "model_max_length": TINY_MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": false,
        "split_special_tokens": false,
        "chat_template": CHATML_TOOLS_TEMPLATE,
    })
}

/// The tiny Qwen3 `config.json`: 2 layers of width 64 over the tiny tokenizer's vocabulary.
pub fn tiny_qwen3_config() -> Result<Value, TokenizerError> {
    let tokenizer = build_tiny_tokenizer()?;
    let vocab_size = tokenizer.get_vocab_size(true);
    let eos = tokenizer
        .token_to_id("<|im_end|>")
        .ok_or_else(|| TokenizerError::Build("<|im_end|> is missing".into()))?;
    Ok(json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": TINY_MODEL_MAX_LENGTH,
        "tie_word_embeddings": true,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": "float32",
        "bos_token_id": null,
        "eos_token_id": eos,
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }))
}

/// Writes `tokenizer.json` and `tokenizer_config.json` of the tiny model into `dir` (created if missing).
pub fn write_tiny_tokenizer_files(dir: &Path) -> Result<(), TokenizerError> {
    std::fs::create_dir_all(dir).map_err(|e| TokenizerError::io(dir, e))?;
    let tokenizer = build_tiny_tokenizer()?;
    let text = tokenizer
        .to_string(true)
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    write_text(&dir.join("tokenizer.json"), &text)?;
    write_json(&dir.join("tokenizer_config.json"), &tiny_tokenizer_config())
}

/// Writes the whole tiny model description into `dir`: the tokenizer files and `config.json`.
/// `cargo run -p manta-tokenizer --example write_tiny_assets` refreshes `assets/tiny-qwen3` with it.
pub fn write_tiny_model_files(dir: &Path) -> Result<(), TokenizerError> {
    write_tiny_tokenizer_files(dir)?;
    write_json(&dir.join("config.json"), &tiny_qwen3_config()?)
}

fn write_json(path: &Path, value: &Value) -> Result<(), TokenizerError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| TokenizerError::Json {
        path: path.to_owned(),
        source,
    })?;
    write_text(path, &text)
}

fn write_text(path: &Path, text: &str) -> Result<(), TokenizerError> {
    let mut text = text.to_owned();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| TokenizerError::io(path, e))
}

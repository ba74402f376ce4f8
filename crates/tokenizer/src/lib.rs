//! Tokenizers and chat templates for Manta.
//!
//! - [`Tokenizer`] loads a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`) and
//!   encodes/decodes with the `tokenizers` crate, so ids match the Python tokenizer exactly.
//! - [`ChatTemplate`] renders the model's Jinja chat template with minijinja in an environment that
//!   matches transformers' `apply_chat_template`.
//! - [`build_tiny_tokenizer`], [`CHATML_TOOLS_TEMPLATE`] and [`write_tiny_tokenizer_files`] define the
//!   byte-level tokenizer of the tiny local model shipped in `assets/tiny-qwen3`.

mod chat_template;
mod error;
mod tiny;
mod tokenizer;

pub use chat_template::ChatTemplate;
pub use error::TokenizerError;
pub use tiny::{
    build_tiny_tokenizer, tiny_qwen3_config, tiny_tokenizer_config, write_tiny_model_files,
    write_tiny_tokenizer_files, CHATML_TOOLS_TEMPLATE, TINY_MODEL_MAX_LENGTH, TINY_SPECIAL_TOKENS,
};
pub use tokenizer::Tokenizer;

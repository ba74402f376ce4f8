//! Loading a Hugging Face tokenizer (`tokenizer.json` + `tokenizer_config.json`) and encoding/decoding with it.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::{ChatTemplate, TokenizerError};

/// Special-token keys of `tokenizer_config.json` that transformers passes to chat templates.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model's tokenizer together with what `tokenizer_config.json` adds to it: the chat template and
/// the end-of-sequence / padding tokens.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    eos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Loads a HF `tokenizer.json`. No chat template or eos token: use [`Tokenizer::from_dir`] for those.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_str(&text).map_err(|e| TokenizerError::Load {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);
        Ok(Self {
            inner,
            vocab_size,
            eos_token_id: None,
            pad_token_id: None,
            chat_template: None,
        })
    }

    /// Loads a model directory: `tokenizer.json`, plus `tokenizer_config.json` for the special tokens
    /// and the chat template (`chat_template.jinja` overrides the config's template, as in transformers).
    pub fn from_dir(model_dir: &Path) -> Result<Self, TokenizerError> {
        let mut tokenizer = Self::from_file(&model_dir.join("tokenizer.json"))?;
        let config_path = model_dir.join("tokenizer_config.json");
        let config = read_json_object(&config_path)?;

        let mut special_tokens = Map::new();
        for key in SPECIAL_TOKEN_KEYS {
            if let Some(token) = special_token(&config, &config_path, key)? {
                special_tokens.insert(key.to_owned(), Value::String(token));
            }
        }
        tokenizer.eos_token_id =
            tokenizer.special_token_id(&special_tokens, &config_path, "eos_token")?;
        tokenizer.pad_token_id =
            tokenizer.special_token_id(&special_tokens, &config_path, "pad_token")?;

        let jinja_path = model_dir.join("chat_template.jinja");
        let template = if jinja_path.is_file() {
            let source = std::fs::read_to_string(&jinja_path)
                .map_err(|e| TokenizerError::io(&jinja_path, e))?;
            Some(ChatTemplate::named(
                &source,
                &jinja_path.display().to_string(),
            )?)
        } else {
            match template_source(&config, &config_path)? {
                Some(source) => Some(ChatTemplate::named(
                    &source,
                    &format!("{}:chat_template", config_path.display()),
                )?),
                None => None,
            }
        };
        tokenizer.chat_template = template.map(|t| t.with_defaults(special_tokens));
        Ok(tokenizer)
    }

    fn special_token_id(
        &self,
        special_tokens: &Map<String, Value>,
        config_path: &Path,
        key: &str,
    ) -> Result<Option<u32>, TokenizerError> {
        let Some(token) = special_tokens.get(key).and_then(Value::as_str) else {
            return Ok(None);
        };
        self.token_to_id(token)
            .map(Some)
            .ok_or_else(|| TokenizerError::Config {
                path: config_path.to_owned(),
                key: key.to_owned(),
                message: format!("token {token:?} is not in the vocabulary of tokenizer.json"),
            })
    }

    /// Token ids of `text`. No BOS/EOS or template tokens are added, but special tokens written in the
    /// text (`<|im_end|>`, `<tool_call>`, ...) become their single ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Text of `ids`; with `skip_special_tokens` the special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizerError::Decode(format!(
                "id {bad} is outside the vocabulary (size {})",
                self.vocab_size
            )));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// The id of one token (a vocabulary entry or an added token), if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of `id`, if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included: one more than the largest id.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The end-of-turn token generation stops at (`eos_token` of `tokenizer_config.json`).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// The padding token (`pad_token` of `tokenizer_config.json`).
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// The model's chat template, if its directory has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The underlying `tokenizers` tokenizer, for anything this wrapper does not expose.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn read_json_object(path: &Path) -> Result<Map<String, Value>, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(TokenizerError::Load {
            path: PathBuf::from(path),
            message: "expected a JSON object at the top level".into(),
        }),
        Err(source) => Err(TokenizerError::Json {
            path: path.to_owned(),
            source,
        }),
    }
}

/// A special token given either as a string or as an AddedToken object (`{"content": ...}`).
fn special_token(
    config: &Map<String, Value>,
    path: &Path,
    key: &str,
) -> Result<Option<String>, TokenizerError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(obj)) => match obj.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(config_error(
                path,
                key,
                "an AddedToken object needs a string `content`",
            )),
        },
        Some(other) => Err(config_error(
            path,
            key,
            &format!("expected a token string, an AddedToken object or null, got {other}"),
        )),
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is used.
fn template_source(
    config: &Map<String, Value>,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(named)) => {
            let default = named
                .iter()
                .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"));
            match default.and_then(|entry| entry.get("template")).and_then(Value::as_str) {
                Some(source) => Ok(Some(source.to_owned())),
                None => Err(config_error(
                    path,
                    "chat_template",
                    "a list of templates needs an entry {\"name\": \"default\", \"template\": <string>}",
                )),
            }
        }
        Some(other) => Err(config_error(
            path,
            "chat_template",
            &format!(
                "expected a string or a list of named templates, got {}",
                type_name(other)
            ),
        )),
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn config_error(path: &Path, key: &str, message: &str) -> TokenizerError {
    TokenizerError::Config {
        path: path.to_owned(),
        key: key.to_owned(),
        message: message.to_owned(),
    }
}

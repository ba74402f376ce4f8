//! Chat templates (the Jinja `chat_template` of `tokenizer_config.json`) rendered with minijinja.
//!
//! The environment mirrors the one transformers builds in `apply_chat_template`, so a model's own
//! template renders to the same text here as in Python: `trim_blocks`/`lstrip_blocks`, loop controls,
//! `raise_exception`, a `json.dumps`-compatible `tojson`, `namespace()`, and Python string/dict methods
//! (`.strip()`, `.startswith()`, `.split()`, `.items()`, ... via `minijinja-contrib`'s pycompat).

use std::fmt;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Map;

use crate::TokenizerError;
use manta_core::pyjson::{self, DumpOptions};

/// Variables that `render` sets itself; callers cannot pass them through `extra`.
const RESERVED_VARIABLES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Message keys transformers treats as a message's reasoning, the first being the one templates read.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A compiled chat template, ready to turn a conversation into the prompt text a model expects.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    name: String,
    defaults: Map<String, serde_json::Value>,
}

impl ChatTemplate {
    /// Compiles `source`; errors name the template `chat_template`.
    pub fn new(source: &str) -> Result<Self, TokenizerError> {
        Self::named(source, "chat_template")
    }

    /// Compiles `source` under `name` (for example the file it came from), which errors then mention.
    pub fn named(source: &str, name: &str) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        // Same whitespace handling as transformers' ImmutableSandboxedEnvironment.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(name.to_owned(), source.to_owned())
            .map_err(|source| TokenizerError::Template {
                template: name.to_owned(),
                source,
            })?;
        Ok(Self {
            env,
            name: name.to_owned(),
            defaults: Map::new(),
        })
    }

    /// Sets variables every render sees unless `extra` overrides them. Transformers passes the
    /// tokenizer's special tokens this way (`bos_token`, `eos_token`, ...), which some templates print.
    pub fn with_defaults(mut self, defaults: Map<String, serde_json::Value>) -> Self {
        self.defaults = defaults;
        self
    }

    /// The name errors use for this template.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renders a conversation like transformers'
    /// `apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False, **extra)`.
    ///
    /// `messages` are OpenAI/HF style objects (`role`, `content`, optional `tool_calls`,
    /// `reasoning_content`, ...). As transformers does, a message's `reasoning`/`thinking` is also
    /// offered to the template as `reasoning_content` (and the reverse). `tools` are JSON schemas.
    /// `extra` carries template switches such as `enable_thinking`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: &Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        if messages.is_empty() {
            // transformers refuses too; an empty prompt is always a caller bug.
            return Err(TokenizerError::InvalidArgument(
                "cannot apply a chat template to an empty conversation".into(),
            ));
        }
        if let Some(key) = extra
            .keys()
            .find(|k| RESERVED_VARIABLES.contains(&k.as_str()))
        {
            return Err(TokenizerError::InvalidArgument(format!(
                "`{key}` is set by render itself and cannot be passed in extra"
            )));
        }
        let mut context = self.defaults.clone();
        context.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        let messages: Vec<_> = messages.iter().map(alias_reasoning_fields).collect();
        context.insert("messages".into(), serde_json::Value::Array(messages));
        context.insert(
            "tools".into(),
            tools.map_or(serde_json::Value::Null, |t| {
                serde_json::Value::Array(t.to_vec())
            }),
        );
        context.insert("documents".into(), serde_json::Value::Null);
        context.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(add_generation_prompt),
        );

        let template = self
            .env
            .get_template(&self.name)
            .map_err(|source| self.template_error(source))?;
        template
            .render(Value::from_serialize(&context))
            .map_err(|source| self.template_error(source))
    }

    fn template_error(&self, source: Error) -> TokenizerError {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&source);
        while let Some(err) = cause {
            if let Some(raised) = err.downcast_ref::<RaisedException>() {
                return TokenizerError::TemplateException {
                    template: self.name.clone(),
                    message: raised.0.clone(),
                };
            }
            cause = err.source();
        }
        TokenizerError::Template {
            template: self.name.clone(),
            source,
        }
    }
}

/// Copies a message's reasoning under every name templates read it by, as transformers does
/// before rendering: `thinking` first (unless present), then the message, then `reasoning_content`.
fn alias_reasoning_fields(message: &serde_json::Value) -> serde_json::Value {
    let Some(fields) = message.as_object() else {
        return message.clone();
    };
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|key| fields.get(*key).filter(|v| !v.is_null()));
    let Some(reasoning) = reasoning else {
        return message.clone();
    };
    let mut aliased = Map::new();
    aliased.insert("thinking".into(), reasoning.clone());
    aliased.extend(fields.iter().map(|(k, v)| (k.clone(), v.clone())));
    aliased.insert("reasoning_content".into(), reasoning.clone());
    serde_json::Value::Object(aliased)
}

/// The message a template passed to `raise_exception`, carried as the source of the render error.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// `raise_exception(message)`: templates reject conversations they cannot format with it.
fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = message
        .as_str()
        .map_or_else(|| message.to_string(), str::to_owned);
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {message}"),
    )
    .with_source(RaisedException(message)))
}

/// `tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, the filter
/// transformers installs: `json.dumps` output, with no HTML escaping.
fn tojson(
    value: Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let ensure_ascii = match kwargs.get::<Option<Value>>("ensure_ascii")? {
        Some(v) => v.is_true(),
        None => ensure_ascii.is_some_and(|v| v.is_true()),
    };
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(v) => Some(v),
        None => indent,
    };
    let indent = indent.map(|v| indent_unit(&v)).transpose()?.flatten();
    let mut options = DumpOptions::python_defaults(ensure_ascii, indent);
    if let Some(separators) = kwargs.get::<Option<Value>>("separators")? {
        if !separators.is_none() {
            let (item, key): (String, String) = separator_pair(&separators)?;
            options.item_separator = item;
            options.key_separator = key;
        }
    }
    if let Some(sort_keys) = kwargs.get::<Option<Value>>("sort_keys")? {
        options.sort_keys = sort_keys.is_true();
    }
    kwargs.assert_all_used()?;

    if value.is_undefined() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: the value is undefined",
        ));
    }
    let json = serde_json::to_value(&value).map_err(|err| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: value is not JSON serialisable: {err}"),
        )
    })?;
    Ok(Value::from_safe_string(pyjson::dumps(&json, &options)))
}

/// Python's `indent`: `None` for one line, an integer for that many spaces, or a string.
fn indent_unit(indent: &Value) -> Result<Option<String>, Error> {
    if indent.is_none() || indent.is_undefined() {
        return Ok(None);
    }
    if let Some(unit) = indent.as_str() {
        return Ok(Some(unit.to_owned()));
    }
    match i64::try_from(indent.clone()) {
        Ok(n) => Ok(Some(" ".repeat(usize::try_from(n).unwrap_or(0)))),
        Err(_) => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: indent must be an integer or a string, got {indent}"),
        )),
    }
}

fn separator_pair(separators: &Value) -> Result<(String, String), Error> {
    let invalid = || {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: separators must be a pair of strings, got {separators}"),
        )
    };
    let parts: Vec<Value> = separators.try_iter().map_err(|_| invalid())?.collect();
    match parts.as_slice() {
        [item, key] => match (item.as_str(), key.as_str()) {
            (Some(item), Some(key)) => Ok((item.to_owned(), key.to_owned())),
            _ => Err(invalid()),
        },
        _ => Err(invalid()),
    }
}

//! Parity with Hugging Face transformers (the reference): the shipped tokenizer encodes and decodes like
//! `AutoTokenizer`, and chat templates render like `apply_chat_template`.

mod common;

use std::path::Path;

use manta_tokenizer::{write_tiny_tokenizer_files, Tokenizer, CHATML_TOOLS_TEMPLATE};
use serde_json::{json, Map, Value};

const TEXTS: &[&str] = &[
    "hello world",
    "",
    "multi\nline\r\n\ttabs and  double  spaces ",
    "emoji 😀👍🏽 and 中文, ünïcödé",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nhmm\n</think>\n\n<tool_call>\n{\"name\": \"x\", \"arguments\": {}}\n</tool_call>",
    "<tool_response>\nok\n</tool_response><|endoftext|>",
    "almost special: <|im_end <think <|im_start|",
    "control \u{0}\u{1}\u{7f} bytes",
];

#[test]
fn shipped_tokenizer_and_config_match_transformers() {
    let dir = common::tiny_assets_dir();
    let tokenizer = Tokenizer::from_dir(&dir).expect("load shipped tokenizer");
    let cases = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(cases.path(), serde_json::to_vec(TEXTS).expect("json")).expect("write cases");

    let reference = common::run_python_json("tokenizer_parity.py", &[&dir, cases.path()]);

    assert_eq!(reference["vocab_size"], json!(tokenizer.vocab_size()));
    assert_eq!(reference["eos_token_id"], json!(tokenizer.eos_token_id()));
    assert_eq!(reference["pad_token_id"], json!(tokenizer.pad_token_id()));
    assert_eq!(reference["bos_token_id"], Value::Null);
    for (text, expected) in TEXTS
        .iter()
        .zip(reference["encoded"].as_array().expect("encoded"))
    {
        let ids = tokenizer.encode(text).expect("encode");
        assert_eq!(json!(ids), expected["ids"], "ids of {text:?}");
        assert_eq!(
            json!(tokenizer.decode(&ids, false).expect("decode")),
            expected["decoded"],
            "decode of {text:?}"
        );
        assert_eq!(
            json!(tokenizer.decode(&ids, true).expect("decode")),
            expected["decoded_skip_special"],
            "decode (skip special) of {text:?}"
        );
    }

    // config.json builds a real Qwen3 with the tokenizer's vocabulary, tied embeddings, <|im_end|> as eos.
    assert_eq!(reference["model_class"], "Qwen3ForCausalLM");
    assert_eq!(
        reference["embedding_shape"],
        json!([tokenizer.vocab_size(), 64])
    );
    assert_eq!(reference["tied"], true);
    assert_eq!(
        reference["config_eos_token_id"],
        json!(tokenizer.eos_token_id())
    );
    assert_eq!(reference["model_max_length"], 2048);
}

/// A template using the environment features HF templates rely on, to compare the environments
/// themselves (whitespace control, loop controls, namespace, Python methods, tojson options, tests).
const ENVIRONMENT_TEMPLATE: &str = r#"{% set ns = namespace(count=0, last='') %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% set ns.last = m.role %}
[{{ loop.index }} {{ m.role | upper }}] {{ m.content.strip() }}|{{ m.content.lstrip() }}|{{ m.content.rstrip() }}|
    {%- if m.content.startswith('  He') %}S{% else %}s{% endif %}
    {%- if m.content.endswith('!') %}E{% else %}e{% endif %}|{{ m.content.split(',') | join('/') }}|{{ m.content.replace('l', 'L') }}
    {% if m.meta is mapping %}
meta={{ m.meta | tojson(indent=2, sort_keys=true) }}
ascii={{ m.meta | tojson(ensure_ascii=true) }} compact={{ m.meta | tojson(separators=(',', ':')) }}
        {% for k, v in m.meta.items() %} {{ k }}={{ v | tojson }}{% endfor %}

    {% endif %}
    {% if m.content is string and m.meta is not string %}  (string content)
    {% endif %}
{% endfor %}
count={{ ns.count }} last={{ ns.last }} eos={{ eos_token }} pad={{ pad_token }}
{%- if bos_token is defined %} bos={{ bos_token }}{% endif %}
{%- if tools %} tools={{ tools | tojson }}{% endif %}
{%- if add_generation_prompt %} [gen]{% endif %} flag={{ custom_flag | default('none') }}
"#;

fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

fn weather_tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather for a city, in °C.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "default": 1}
            }, "required": ["city"]}
        }}),
        json!({"type": "function", "function": {
            "name": "submit",
            "description": "Submit the final answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}}
        }}),
    ]
}

/// A full agentic conversation: system, user, assistant tool calls (with and without text, several per
/// turn, object and string arguments), several tool results in a row, and a final answer.
fn tool_conversation() -> Vec<Value> {
    vec![
        message("system", "You are a helpful agent."),
        message(
            "user",
            "What's the weather in Zürich and Paris? Answer \"briefly\".",
        ),
        json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "scale": 1.5, "exact": true, "note": null}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]}),
        json!({"role": "tool", "tool_call_id": "a", "content": "Zürich: 12°C, rain"}),
        json!({"role": "tool", "tool_call_id": "b", "content": "Paris: 15°C\nsunny"}),
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"type": "function", "function": {"name": "submit", "arguments": {"answer": "Zürich 12°C, Paris 15°C"}}}
        ]}),
        message("tool", "accepted"),
        message("assistant", "Done: Zürich 12°C, Paris 15°C."),
    ]
}

struct Case {
    dir: &'static str,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    extra: Map<String, Value>,
}

fn case(
    dir: &'static str,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    extra: Value,
) -> Case {
    let Value::Object(extra) = extra else {
        panic!("extra must be an object")
    };
    Case {
        dir,
        messages,
        tools,
        add_generation_prompt,
        extra,
    }
}

fn cases() -> Vec<Case> {
    let chat = "chatml";
    let env = "environment";
    let basic = vec![message("system", "Be terse."), message("user", "Hi there!")];
    let mut tool_turn = tool_conversation();
    tool_turn.truncate(5);
    vec![
        case(chat, basic.clone(), None, true, json!({})),
        case(chat, basic.clone(), None, false, json!({})),
        case(
            chat,
            basic.clone(),
            None,
            true,
            json!({"enable_thinking": false}),
        ),
        case(
            chat,
            basic.clone(),
            None,
            true,
            json!({"enable_thinking": true}),
        ),
        case(
            chat,
            vec![message("user", "no system")],
            None,
            true,
            json!({"enable_thinking": false}),
        ),
        case(
            chat,
            tool_conversation(),
            Some(weather_tools()),
            false,
            json!({}),
        ),
        case(
            chat,
            tool_turn.clone(),
            Some(weather_tools()),
            true,
            json!({"enable_thinking": false}),
        ),
        case(
            chat,
            tool_turn,
            Some(weather_tools()),
            true,
            json!({"enable_thinking": true}),
        ),
        case(
            chat,
            tool_conversation()[1..].to_vec(),
            Some(weather_tools()),
            true,
            json!({}),
        ),
        case(
            chat,
            vec![
                message("user", "think first"),
                json!({"role": "assistant", "reasoning_content": "\nstep 1\n", "content": "\nanswer"}),
                json!({"role": "assistant", "reasoning": "aliased", "content": "x",
                       "tool_calls": [{"name": "submit", "arguments": {}}]}),
                json!({"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}),
                message("system", "a later system message"),
            ],
            Some(vec![
                json!({"name": "bare_schema", "parameters": {"type": "object"}}),
            ]),
            true,
            json!({"enable_thinking": false}),
        ),
        case(chat, vec![], None, true, json!({})),
        case(
            env,
            vec![
                json!({"role": "user", "content": "  Hello, world!  ", "meta": {"b": [1, 2.5, "ü"], "a": {"z": null, "y": true}}}),
                message("skip", "not shown"),
                message("assistant", "  Hello again,lol\n"),
                message("stop", "end"),
                message("user", "after stop"),
            ],
            Some(weather_tools()[..1].to_vec()),
            true,
            json!({"custom_flag": 7}),
        ),
        case(env, vec![message("user", "plain")], None, false, json!({})),
    ]
}

/// Writes the shipped tokenizer with `template` as its chat template into `dir`.
fn write_template_dir(dir: &Path, template: &str) {
    write_tiny_tokenizer_files(dir).expect("write tokenizer files");
    let config_path = dir.join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("read config"))
            .expect("json");
    config["chat_template"] = json!(template);
    std::fs::write(
        &config_path,
        serde_json::to_vec_pretty(&config).expect("json"),
    )
    .expect("write config");
}

#[test]
fn chat_templates_render_like_transformers() {
    let root = tempfile::tempdir().expect("temp dir");
    let chat_dir = root.path().join("chatml");
    let env_dir = root.path().join("environment");
    write_template_dir(&chat_dir, CHATML_TOOLS_TEMPLATE);
    write_template_dir(&env_dir, ENVIRONMENT_TEMPLATE);
    let chat_tokenizer = Tokenizer::from_dir(&chat_dir).expect("load chatml dir");
    let env_tokenizer = Tokenizer::from_dir(&env_dir).expect("load environment dir");

    let cases = cases();
    let case_json: Vec<Value> = cases
        .iter()
        .map(|c| {
            json!({
                "dir": root.path().join(c.dir),
                "messages": c.messages,
                "tools": c.tools,
                "add_generation_prompt": c.add_generation_prompt,
                "extra": c.extra,
            })
        })
        .collect();
    let cases_path = root.path().join("cases.json");
    std::fs::write(&cases_path, serde_json::to_vec(&case_json).expect("json"))
        .expect("write cases");

    let reference = common::run_python_json("chat_template_parity.py", &[&cases_path]);
    let reference = reference.as_array().expect("a list of results");
    assert_eq!(reference.len(), cases.len());

    for (i, (c, expected)) in cases.iter().zip(reference).enumerate() {
        let tokenizer = if c.dir == "chatml" {
            &chat_tokenizer
        } else {
            &env_tokenizer
        };
        let template = tokenizer.chat_template().expect("template loaded");
        let rendered = template.render(
            &c.messages,
            c.tools.as_deref(),
            c.add_generation_prompt,
            &c.extra,
        );
        let Some(expected) = expected["ok"].as_str() else {
            // transformers rejects this conversation: so must we.
            assert!(
                c.messages.is_empty(),
                "case {i}: transformers failed: {}",
                expected["error"]
            );
            assert!(
                rendered.is_err(),
                "case {i}: transformers failed ({}) but we rendered",
                expected["error"]
            );
            continue;
        };
        let rendered = rendered.unwrap_or_else(|e| panic!("case {i}: render failed: {e}"));
        assert_eq!(
            rendered, expected,
            "case {i} ({}) differs from transformers",
            c.dir
        );
    }
}

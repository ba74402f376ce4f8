//! Chat template environment behaviour and loading errors.

use manta_tokenizer::{
    write_tiny_tokenizer_files, ChatTemplate, Tokenizer, TokenizerError, CHATML_TOOLS_TEMPLATE,
};
use serde_json::{json, Map, Value};

fn render(source: &str, messages: &[Value]) -> Result<String, TokenizerError> {
    ChatTemplate::new(source)?.render(messages, None, false, &Map::new())
}

#[test]
fn raise_exception_is_a_clear_error_naming_the_template() {
    let template = ChatTemplate::named(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}{% endif %}ok",
        "my-model/tokenizer_config.json",
    )
    .expect("compile");
    let ok = template.render(
        &[json!({"role": "user", "content": "x"})],
        None,
        false,
        &Map::new(),
    );
    assert_eq!(ok.expect("render"), "ok");
    let err = template
        .render(
            &[json!({"role": "assistant", "content": "x"})],
            None,
            false,
            &Map::new(),
        )
        .unwrap_err();
    match &err {
        TokenizerError::TemplateException { template, message } => {
            assert_eq!(template, "my-model/tokenizer_config.json");
            assert_eq!(message, "Conversations must start with a user turn");
        }
        other => panic!("expected TemplateException, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("my-model/tokenizer_config.json")
            && text.contains("must start with a user turn"),
        "{text}"
    );
}

#[test]
fn chatml_template_rejects_unknown_roles_and_bad_tool_calls() {
    let template = ChatTemplate::new(CHATML_TOOLS_TEMPLATE).expect("compile");
    let err = template
        .render(
            &[json!({"role": "robot", "content": "beep"})],
            None,
            false,
            &Map::new(),
        )
        .unwrap_err();
    assert!(
        matches!(&err, TokenizerError::TemplateException { message, .. } if message.contains("unknown message role: robot")),
        "{err}"
    );
    let err = template
        .render(
            &[json!({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]})],
            None,
            false,
            &Map::new(),
        )
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::TemplateException { .. }),
        "{err}"
    );
}

#[test]
fn syntax_errors_and_reserved_arguments_are_reported() {
    let err = ChatTemplate::new("{% for m in messages %}").unwrap_err();
    assert!(matches!(err, TokenizerError::Template { .. }), "{err}");
    assert!(err.to_string().contains("chat_template"), "{err}");

    let template = ChatTemplate::new("x").expect("compile");
    let mut extra = Map::new();
    extra.insert("messages".into(), json!([]));
    let err = template
        .render(&[json!({"role": "user"})], None, false, &extra)
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::InvalidArgument(ref m) if m.contains("messages")),
        "{err}"
    );
    let err = template.render(&[], None, false, &Map::new()).unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidArgument(_)), "{err}");
}

#[test]
fn tojson_writes_python_json_without_html_escaping() {
    let messages = [json!({"role": "user", "content": {"b": "<a & b>", "a": [1, 2.0, null]}})];
    assert_eq!(
        render("{{ messages[0].content | tojson }}", &messages).expect("render"),
        r#"{"b": "<a & b>", "a": [1, 2.0, null]}"#
    );
    assert_eq!(
        render(
            "{{ messages[0].content | tojson(indent=1, sort_keys=true) }}",
            &messages
        )
        .expect("render"),
        "{\n \"a\": [\n  1,\n  2.0,\n  null\n ],\n \"b\": \"<a & b>\"\n}"
    );
    let err = render(
        "{{ messages[0].content | tojson(colour='red') }}",
        &messages,
    )
    .unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");
}

#[test]
fn python_string_methods_and_tests_are_available() {
    let messages = [json!({"role": "user", "content": "  a,b,c  ", "meta": {"k": 1}})];
    let source =
        "{% set c = messages[0].content %}{{ c.strip() }}|{{ c.strip().split(',') | join('-') }}|\
        {{ c.lstrip().startswith('a') }}|{{ c.rstrip().endswith('c') }}|{{ c.replace(',', ';') }}|\
        {{ messages[0].meta is mapping }}|{{ c is string }}|{{ messages[0].meta.get('k') }}";
    assert_eq!(
        render(source, &messages).expect("render"),
        "a,b,c|a-b-c|True|True|  a;b;c  |True|True|1"
    );
}

fn write_dir_with_config(config: Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_tokenizer_files(dir.path()).expect("write");
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string())
        .expect("write config");
    dir
}

#[test]
fn from_dir_reads_added_token_objects_and_named_templates() {
    let dir = write_dir_with_config(json!({
        "eos_token": {"content": "<|endoftext|>", "special": true},
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ eos_token }}{{ messages | length }}"}
        ]
    }));
    let tokenizer = Tokenizer::from_dir(dir.path()).expect("load");
    assert_eq!(tokenizer.eos_token_id(), Some(256));
    let template = tokenizer.chat_template().expect("template");
    let text = template
        .render(&[json!({"role": "user"})], None, false, &Map::new())
        .expect("render");
    assert_eq!(text, "<|endoftext|>1");

    // chat_template.jinja takes precedence over the config's template, as in transformers.
    std::fs::write(dir.path().join("chat_template.jinja"), "from file").expect("write");
    let tokenizer = Tokenizer::from_dir(dir.path()).expect("load");
    let text = tokenizer
        .chat_template()
        .expect("template")
        .render(&[json!({"role": "user"})], None, false, &Map::new())
        .expect("render");
    assert_eq!(text, "from file");
}

#[test]
fn from_dir_errors_name_the_file_key_and_value() {
    let dir = write_dir_with_config(json!({"eos_token": "<|nope|>"}));
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json")
            && err.contains("eos_token")
            && err.contains("<|nope|>"),
        "{err}"
    );

    let dir = write_dir_with_config(json!({"chat_template": 42}));
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("chat_template") && err.contains("a number"),
        "{err}"
    );

    let dir =
        write_dir_with_config(json!({"chat_template": [{"name": "tool_use", "template": "x"}]}));
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("default"), "{err}");

    let dir = write_dir_with_config(json!({}));
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").expect("write");
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("invalid JSON"),
        "{err}"
    );

    std::fs::write(dir.path().join("tokenizer.json"), "{}").expect("write");
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("cannot load tokenizer"),
        "{err}"
    );

    let missing = dir.path().join("missing");
    let err = Tokenizer::from_dir(&missing).unwrap_err().to_string();
    assert!(err.contains("missing/tokenizer.json"), "{err}");
}

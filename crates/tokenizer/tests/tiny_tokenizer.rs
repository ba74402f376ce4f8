//! The tiny byte-level tokenizer: round trips, special tokens, and the shipped asset files.

mod common;

use manta_tokenizer::{
    build_tiny_tokenizer, write_tiny_model_files, Tokenizer, TokenizerError, TINY_SPECIAL_TOKENS,
};

fn shipped() -> Tokenizer {
    Tokenizer::from_dir(&common::tiny_assets_dir()).expect("load assets/tiny-qwen3")
}

#[test]
fn shipped_files_equal_generated_files() {
    let generated = tempfile::tempdir().expect("temp dir");
    write_tiny_model_files(generated.path()).expect("write tiny model files");
    for name in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        let want = std::fs::read_to_string(generated.path().join(name)).expect("generated file");
        let have = std::fs::read_to_string(common::tiny_assets_dir().join(name))
            .unwrap_or_else(|e| panic!("assets/tiny-qwen3/{name}: {e}"));
        assert!(
            want == have,
            "assets/tiny-qwen3/{name} is stale: run `cargo run -p manta-tokenizer --example write_tiny_assets`"
        );
    }
}

#[test]
fn vocabulary_layout() {
    let tokenizer = shipped();
    assert_eq!(tokenizer.vocab_size(), 256 + TINY_SPECIAL_TOKENS.len());
    assert_eq!(tokenizer.vocab_size(), 265);
    for (offset, token) in TINY_SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(
            tokenizer.token_to_id(token),
            Some(256 + offset as u32),
            "{token}"
        );
    }
    assert_eq!(
        tokenizer.eos_token_id(),
        tokenizer.token_to_id("<|im_end|>")
    );
    assert_eq!(
        tokenizer.pad_token_id(),
        tokenizer.token_to_id("<|endoftext|>")
    );
    assert!(tokenizer.chat_template().is_some());
    // The in-code tokenizer is the shipped one.
    let built = build_tiny_tokenizer().expect("build");
    assert_eq!(built.get_vocab(true), tokenizer.inner().get_vocab(true));
}

#[test]
fn arbitrary_utf8_round_trips_one_id_per_byte() {
    let tokenizer = shipped();
    let texts = [
        "plain ascii",
        " leading and trailing spaces ",
        "new\nlines\r\nand\ttabs\n\n",
        "emoji 😀🧑‍🚀👍🏽, CJK 中文, RTL עברית, combining é",
        "\u{0}\u{1}\u{7f}\u{80}\u{ff}\u{fffd}",
        "",
    ];
    for text in texts {
        let ids = tokenizer.encode(text).expect("encode");
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(
            ids, bytes,
            "one id per byte, equal to the byte, for {text:?}"
        );
        assert_eq!(tokenizer.decode(&ids, false).expect("decode"), text);
        assert_eq!(tokenizer.decode(&ids, true).expect("decode"), text);
    }
}

#[test]
fn special_tokens_are_single_ids_and_can_be_skipped() {
    let tokenizer = shipped();
    let im_start = tokenizer.token_to_id("<|im_start|>").expect("im_start");
    let im_end = tokenizer.token_to_id("<|im_end|>").expect("im_end");
    let text =
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>";
    let ids = tokenizer.encode(text).expect("encode");
    assert_eq!(ids.first(), Some(&im_start));
    assert_eq!(ids.last(), Some(&im_end));
    let special: Vec<u32> = ids.iter().copied().filter(|&id| id >= 256).collect();
    let names: Vec<String> = special
        .iter()
        .map(|&id| tokenizer.id_to_token(id).expect("token"))
        .collect();
    assert_eq!(
        names,
        [
            "<|im_start|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<|im_end|>"
        ]
    );
    assert_eq!(tokenizer.decode(&ids, false).expect("decode"), text);
    assert_eq!(
        tokenizer.decode(&ids, true).expect("decode"),
        "assistant\n\n\n\n\n\n{}\n"
    );
    // Text that only resembles a special token stays bytes.
    assert!(tokenizer
        .encode("<|im_end")
        .expect("encode")
        .iter()
        .all(|&id| id < 256));
}

#[test]
fn decoding_an_unknown_id_is_an_error() {
    let tokenizer = shipped();
    let err = tokenizer.decode(&[104, 265], false).unwrap_err();
    assert!(matches!(err, TokenizerError::Decode(_)), "{err}");
    assert!(err.to_string().contains("265"), "{err}");
}

#[test]
fn chat_prompt_tokens_extend_across_turns() {
    // Rendering the conversation after a turn must extend the previous prompt, so token-level
    // accounting (appending generated ids) matches a fresh render.
    let tokenizer = shipped();
    let template = tokenizer.chat_template().expect("template");
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "sys"}),
        serde_json::json!({"role": "user", "content": "go"}),
    ];
    let extra = serde_json::Map::new();
    let prompt = template
        .render(&messages, None, true, &extra)
        .expect("render");
    let completion = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
    messages.push(serde_json::json!({"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]}));
    let next = template
        .render(&messages, None, false, &extra)
        .expect("render");
    assert_eq!(next, format!("{prompt}{completion}<|im_end|>\n"));
    let prompt_ids = tokenizer.encode(&prompt).expect("encode");
    let next_ids = tokenizer.encode(&next).expect("encode");
    assert_eq!(&next_ids[..prompt_ids.len()], prompt_ids.as_slice());
}

#[test]
fn tokenizer_and_template_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<manta_tokenizer::ChatTemplate>();
}

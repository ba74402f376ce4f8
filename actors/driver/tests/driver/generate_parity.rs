//! `driver generate` against Hugging Face: the real binary's greedy output on a small
//! random Qwen3 checkpoint must equal transformers' `generate`, token for token.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

const PROMPT_IDS: &str = "5,17,42,280,7";
const NEW_TOKENS: usize = 32;

fn driver(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("driver runs")
}

/// Saves the reference checkpoint into `dir` and returns transformers' new ids.
fn hf_generate(dir: &Path) -> Vec<u32> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/hf_generate.py");
    let out = Command::new(common::python())
        .arg(&script)
        .arg(dir)
        .arg(PROMPT_IDS)
        .arg(NEW_TOKENS.to_string())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "hf_generate.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("hf_generate.py prints a JSON list of ids")
}

#[test]
fn greedy_generate_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let expected = hf_generate(&dir);
    assert_eq!(expected.len(), NEW_TOKENS, "reference stopped early");

    let n = NEW_TOKENS.to_string();
    let out = driver(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        PROMPT_IDS,
        "--max-new-tokens",
        &n,
        "--temperature",
        "0",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "driver generate failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).expect("stdout is JSON");
    let keys: Vec<&String> = json.as_object().expect("a JSON object").keys().collect();
    assert_eq!(keys.len(), 2, "unexpected keys in {json}");
    let ids: Vec<u32> = serde_json::from_value(json["output_ids"].clone()).unwrap();
    let logprobs: Vec<f64> = serde_json::from_value(json["logprobs"].clone()).unwrap();
    assert_eq!(ids, expected, "Manta and transformers disagree");
    assert_eq!(logprobs.len(), NEW_TOKENS);
    assert!(
        logprobs.iter().all(|lp| lp.is_finite() && *lp < 0.0),
        "bad logprobs {logprobs:?}"
    );
}

#[test]
fn bad_prompt_ids_name_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let out = driver(&[
        "generate",
        "--model",
        dir,
        "--prompt-ids",
        "1,x",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted --prompt-ids 1,x");
    assert!(
        stderr.contains("--prompt-ids") && stderr.contains('x'),
        "error does not name the flag and value: {stderr}"
    );
}

#[test]
fn directory_without_weights_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    hf_generate(&dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let out = driver(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "generated without weights");
    assert!(stderr.contains("no weights"), "unclear error: {stderr}");
}

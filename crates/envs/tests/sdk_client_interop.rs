//! The official `openreward` Python SDK client (from the project venv or `MANTA_PYTHON`)
//! runs episodes against the built-in server: proof that routes, JSON and SSE match.

use std::path::PathBuf;

use manta_envs::builtin_environments;
use serde_json::{json, Value};

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

#[tokio::test]
async fn sdk_client_runs_episodes_against_the_builtin_server() {
    let server = manta_envs::serve(([127, 0, 0, 1], 0).into(), builtin_environments())
        .await
        .expect("server");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/sdk_client_episode.py");
    let output = tokio::process::Command::new(python())
        .arg(&script)
        .arg(server.base_url())
        .env("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {}: {e}", python().display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "SDK client failed:\n{stderr}");
    let seen: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("bad JSON from the SDK script ({e}):\n{stderr}"));

    assert_eq!(seen["digits_splits"], json!(["train", "test"]));
    assert_eq!(seen["digits_num_tasks"], 100);
    assert_eq!(seen["digits_env_name"], "digits");
    let prompt = seen["digits_prompt"][0].as_str().expect("prompt");
    assert!(prompt.starts_with("Reply with the digit "), "{prompt}");
    assert_eq!(seen["digits_tools"], json!([]));
    assert_eq!(seen["digits_terminal"], json!(["answer", "answer"]));
    assert_eq!(seen["digits_result"][0], 1.0);
    assert_eq!(seen["digits_result"][1], true);

    assert_eq!(seen["counter_num_tasks"], 1000);
    assert_eq!(seen["counter_tools"], json!(["add", "submit"]));
    let steps = &seen["counter_steps"];
    assert_eq!(steps[0][0], 0.0, "adding 0 does not get closer: {steps}");
    assert_eq!(steps[0][1], false);
    assert_eq!(steps[1], json!(["ToolCallError", "input_validation"]));
    assert_eq!(
        steps[2][0], 0.0,
        "submitting at the start value misses: {steps}"
    );
    assert_eq!(steps[2][1], true);
    assert_eq!(
        server.live_sessions(),
        0,
        "the SDK's session exit deletes the sessions"
    );
    server.shutdown().await;
}

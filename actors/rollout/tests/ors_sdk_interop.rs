//! The ORS client against the real `openreward` SDK `Server` (Python, from the project
//! venv or `MANTA_PYTHON`), hosting `tests/py/ors_interop_env.py`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use manta_rollout::ors::{Block, OrsClient, OrsClientOptions, OrsError, ToolResult};
use serde_json::json;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".venv/bin/python"))
}

/// The Python server process; killed when dropped.
struct PyServer(Child);

impl Drop for PyServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start_sdk_server() -> (PyServer, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/ors_interop_env.py");
    let child = Command::new(python())
        .arg(&script)
        .args(["127.0.0.1", &port.to_string()])
        .env("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {} {}: {e}", python().display(), script.display()));
    let server = PyServer(child);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = http.get(format!("{base}/health")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "SDK server did not come up on {base}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (server, base)
}

fn text(blocks: &[Block]) -> String {
    blocks
        .iter()
        .filter_map(|b| match b {
            Block::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("|")
}

fn ok(result: Result<ToolResult, OrsError>) -> (String, Option<f64>, bool) {
    match result {
        Ok(ToolResult::Ok {
            blocks,
            reward,
            finished,
            ..
        }) => (text(&blocks), reward, finished),
        other => panic!("expected a tool result, got {other:?}"),
    }
}

fn rejected(result: Result<ToolResult, OrsError>) -> String {
    match result {
        Ok(ToolResult::Rejected { reason, .. }) => reason.unwrap_or_default(),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[tokio::test]
async fn episode_against_the_python_sdk_server() {
    let (_server, base) = start_sdk_server().await;
    let ors = OrsClient::new(OrsClientOptions {
        secrets: BTreeMap::from([("OPENAI_API_KEY".to_string(), "sk-interop".to_string())]),
        ..OrsClientOptions::new(&base)
    })
    .expect("client");

    // Bare paths: the SDK server redirects them to its only environment.
    let splits = ors.splits().await.expect("splits");
    assert_eq!(
        splits.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["train", "test"]
    );
    let list = ors.list_tasks("train").await.expect("tasks");
    assert_eq!(list.env_name, "interopenv");
    assert_eq!(list.tasks.len(), 5);
    assert_eq!(ors.num_tasks("test").await.expect("num"), 5);
    let listing = ors.tools().await.expect("tools");
    assert_eq!(
        listing
            .tools
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["add", "big", "boom"]
    );
    assert_eq!(
        listing
            .terminal_tool
            .as_ref()
            .and_then(|t| t.arg.as_deref()),
        Some("answer")
    );

    let task = list.tasks[1].clone();
    let session = ors.open_session(&list.env_name, &task).await.expect("open");
    assert_eq!(session.tools().await.expect("task tools"), listing);
    let prompt = text(&session.prompt().await.expect("prompt"));
    assert_eq!(
        prompt,
        r#"start 1 target 3|secrets {"OPENAI_API_KEY": "sk-interop"}"#
    );

    assert_eq!(
        ok(session.call("add", json!({ "amount": 1 })).await),
        ("value is now 2".into(), Some(0.1), false)
    );
    assert_eq!(
        ok(session.call("add", json!({ "amount": -1 })).await),
        ("value is now 1".into(), Some(0.0), false)
    );
    assert_eq!(
        rejected(session.call("add", json!({ "amount": "two" })).await),
        "input_validation"
    );
    assert_eq!(rejected(session.call("nope", json!({})).await), "not_found");
    let (big, reward, _) = ok(session.call("big", json!({})).await);
    assert_eq!((big.len(), reward), (18190, None));
    assert!(
        big.starts_with("line 0: xxx") && big.ends_with(&format!("line 299: {}\n", "x".repeat(50)))
    );
    ok(session.call("add", json!({ "amount": 2 })).await);
    assert_eq!(
        ok(session.call("answer", json!({ "answer": "3" })).await),
        ("correct".into(), Some(1.0), true)
    );
    assert_eq!(
        rejected(session.call("add", json!({ "amount": 1 })).await),
        "episode_finished"
    );
    session.close().await.expect("close");

    // A tool that raises: an SSE error, after which the session is dead.
    let session = ors.open_session(&list.env_name, &task).await.expect("open");
    match session.call("boom", json!({})).await {
        Err(OrsError::Sse { message, .. }) => {
            assert!(message.contains("interop tool exploded"), "{message}")
        }
        other => panic!("expected an SSE error, got {other:?}"),
    }
    assert!(matches!(
        session.call("add", json!({ "amount": 1 })).await,
        Err(OrsError::SessionGone { .. })
    ));
    session.close().await.expect("close");

    // A variant-scoped client reaches the same environment by name.
    let scoped = OrsClient::new(OrsClientOptions {
        variant: Some("interopenv".into()),
        ..OrsClientOptions::new(&base)
    })
    .expect("client");
    let session = scoped.open_session_at("test", 0).await.expect("open at");
    assert!(text(&session.prompt().await.expect("prompt")).starts_with("start 0 target 2"));
    session.close().await.expect("close");
}

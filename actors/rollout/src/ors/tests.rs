//! Client tests against the built-in ORS server (`manta-envs`) and tiny raw-TCP peers
//! for retry and resume behaviour.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use manta_envs::{
    builtin_environments, EnvError, EnvServer, Environment, Episode, RunToolOutput, Secrets,
    ServerHandle, Split,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

fn local() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 0))
}

async fn builtin_server() -> ServerHandle {
    manta_envs::serve(local(), builtin_environments())
        .await
        .expect("server starts")
}

fn client(base: &str, variant: Option<&str>) -> OrsClient {
    OrsClient::new(OrsClientOptions {
        variant: variant.map(str::to_string),
        ..OrsClientOptions::new(base)
    })
    .expect("client")
}

fn text_of(blocks: &[Block]) -> String {
    blocks
        .iter()
        .filter_map(|b| match b {
            Block::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn lists_splits_tasks_and_tools() {
    let server = builtin_server().await;
    let counter = client(&server.base_url(), Some("counter"));
    let splits = counter.splits().await.expect("splits");
    assert_eq!(
        splits,
        vec![
            SplitInfo {
                name: "train".into(),
                kind: "train".into()
            },
            SplitInfo {
                name: "test".into(),
                kind: "test".into()
            }
        ]
    );
    let list = counter.list_tasks("train").await.expect("tasks");
    assert_eq!(
        (list.tasks.len(), list.env_name.as_str()),
        (1000, "counter")
    );
    assert_eq!(counter.num_tasks("test").await.expect("num"), 100);
    let (task, env) = counter.task("train", 7).await.expect("task");
    assert_eq!((task, env), (list.tasks[7].clone(), "counter".to_string()));
    let tools = counter.tools().await.expect("tools");
    assert_eq!(
        tools
            .tools
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["add", "submit"]
    );
    assert!(tools.tools[0].input_schema.is_some() && tools.tools[1].input_schema.is_none());

    // Without a variant the server redirects bare paths to its first environment.
    let bare = client(&server.base_url(), None);
    let list = bare.list_tasks("test").await.expect("bare tasks");
    assert_eq!((list.tasks.len(), list.env_name.as_str()), (100, "digits"));

    match counter.list_tasks("validation").await {
        Err(OrsError::Http {
            status: 400, body, ..
        }) => assert_eq!(body, "Invalid split"),
        other => panic!("expected 400 Invalid split, got {other:?}"),
    }
    let missing = client(&server.base_url(), Some("nope"));
    assert_eq!(
        missing.splits().await.err().and_then(|e| e.status()),
        Some(404)
    );
    assert!(matches!(
        OrsClient::new(OrsClientOptions::new("not a url")),
        Err(OrsError::Config {
            option: "base_url",
            ..
        })
    ));
    server.shutdown().await;
}

#[tokio::test]
async fn digits_episode_through_the_client() {
    let server = builtin_server().await;
    let ors = client(&server.base_url(), Some("digits"));
    let session = ors
        .open_session("digits", &json!({ "target": 4 }))
        .await
        .expect("open");
    assert_eq!(server.live_sessions(), 1);
    let tools = session.tools().await.expect("tools");
    assert!(tools.tools.is_empty());
    let terminal = tools.terminal_tool.expect("terminal tool");
    assert_eq!(
        (terminal.name.as_str(), terminal.arg.as_deref()),
        ("answer", Some("answer"))
    );
    let prompt = session.prompt().await.expect("prompt");
    assert_eq!(
        prompt,
        vec![Block::Text {
            text: "Reply with the digit 4.".into()
        }]
    );

    let result = session
        .call("answer", json!({ "answer": "4" }))
        .await
        .expect("call");
    match result {
        ToolResult::Ok {
            reward,
            finished,
            metadata,
            blocks,
        } => {
            assert_eq!((reward, finished), (Some(1.0), true));
            assert_eq!(metadata, Some(json!({ "target": 4 })));
            assert!(text_of(&blocks).contains("target was 4"));
        }
        other => panic!("expected Ok, got {other:?}"),
    }
    let again = session
        .call("answer", json!({ "answer": "4" }))
        .await
        .expect("call");
    assert!(
        matches!(again, ToolResult::Rejected { reason: Some(ref r), .. } if r == "episode_finished"),
        "{again:?}"
    );
    session.close().await.expect("close");
    assert_eq!(server.live_sessions(), 0);

    // Opening by split/index lets the server look the task up.
    let (task, _) = ors.task("test", 3).await.expect("task");
    let session = ors.open_session_at("test", 3).await.expect("open at");
    let prompt = text_of(&session.prompt().await.expect("prompt"));
    assert_eq!(prompt, format!("Reply with the digit {}.", task["target"]));
    // A session dropped without close is released in the background.
    drop(session);
    for _ in 0..50 {
        if server.live_sessions() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(server.live_sessions(), 0);
    server.shutdown().await;
}

#[tokio::test]
async fn counter_episode_with_step_rewards_and_rejections() {
    let server = builtin_server().await;
    let ors = client(&server.base_url(), Some("counter"));
    let list = ors.list_tasks("test").await.expect("tasks");
    let task = &list.tasks[0];
    let (start, target) = (
        task["start"].as_i64().expect("start"),
        task["target"].as_i64().expect("target"),
    );
    let session = ors.open_session(&list.env_name, task).await.expect("open");

    let bad = session
        .call("add", json!({ "amount": "lots" }))
        .await
        .expect("call");
    assert!(
        matches!(bad, ToolResult::Rejected { reason: Some(ref r), ref error } if r == "input_validation" && error.contains("amount")),
        "{bad:?}"
    );
    let unknown = session.call("divide", json!({})).await.expect("call");
    assert!(
        matches!(unknown, ToolResult::Rejected { reason: Some(ref r), .. } if r == "not_found"),
        "{unknown:?}"
    );

    let mut rewards = Vec::new();
    let mut value = start;
    for amount in [target - start + 3, -3] {
        match session
            .call("add", json!({ "amount": amount }))
            .await
            .expect("add")
        {
            ToolResult::Ok {
                reward,
                finished,
                blocks,
                ..
            } => {
                value += amount;
                assert!(!finished);
                assert_eq!(text_of(&blocks), format!("value is now {value}"));
                rewards.push(reward.expect("step reward"));
            }
            other => panic!("add rejected: {other:?}"),
        }
    }
    // Overshooting by 3 is closer than the start only if |target-start| > 3.
    let first = if (target - start).abs() > 3 { 0.1 } else { 0.0 };
    assert_eq!(rewards, vec![first, 0.1]);
    match session.call("submit", json!({})).await.expect("submit") {
        ToolResult::Ok {
            reward, finished, ..
        } => assert_eq!((reward, finished), (Some(1.0), true)),
        other => panic!("submit rejected: {other:?}"),
    }
    session.close().await.expect("close");
    server.shutdown().await;
}

/// Environment for edge cases: cannot list tasks, echoes secrets in its prompt, and has
/// a `slow` tool, a `boom` tool that panics and a `count` tool.
struct Probe;

struct ProbeEpisode {
    secrets: Secrets,
    calls: u32,
}

impl Environment for Probe {
    fn name(&self) -> &str {
        "probe"
    }
    fn splits(&self) -> Vec<Split> {
        vec![Split::named("train")]
    }
    fn num_tasks(&self, _: &str) -> Result<u64, EnvError> {
        Ok(3)
    }
    fn task(&self, split: &str, index: u64) -> Result<Value, EnvError> {
        if index >= 3 {
            return Err(EnvError::IndexOutOfRange {
                split: split.into(),
                index,
                len: 3,
            });
        }
        Ok(json!({ "i": index }))
    }
    fn tasks(&self, _: &str) -> Result<Vec<Value>, EnvError> {
        Err(EnvError::ListingNotSupported)
    }
    fn tools(&self) -> manta_envs::ToolsListing {
        manta_envs::ToolsListing {
            tools: Vec::new(),
            terminal_tool: None,
        }
    }
    fn new_episode(&self, _: &Value, secrets: &Secrets) -> Result<Box<dyn Episode>, EnvError> {
        Ok(Box::new(ProbeEpisode {
            secrets: secrets.clone(),
            calls: 0,
        }))
    }
}

impl Episode for ProbeEpisode {
    fn prompt(&self) -> Vec<manta_envs::Block> {
        vec![manta_envs::Block::text(json!(self.secrets).to_string())]
    }
    fn call(&mut self, name: &str, _: &Value) -> RunToolOutput {
        self.calls += 1;
        match name {
            "slow" => std::thread::sleep(Duration::from_millis(400)),
            "boom" => panic!("probe tool exploded"),
            _ => {}
        }
        RunToolOutput::Ok(manta_envs::ToolOutput {
            blocks: vec![manta_envs::Block::text(format!("call {}", self.calls))],
            metadata: None,
            reward: None,
            finished: false,
        })
    }
}

async fn probe_server() -> ServerHandle {
    EnvServer::new(vec![Arc::new(Probe)])
        .session_ttl(Duration::from_millis(300), Duration::from_millis(50))
        .serve(local())
        .await
        .expect("probe server")
}

#[tokio::test]
async fn fallback_listing_secrets_tool_failure_and_expiry() {
    let server = probe_server().await;
    let ors = OrsClient::new(OrsClientOptions {
        variant: Some("probe".into()),
        api_key: Some("or-key".into()),
        secrets: BTreeMap::from([("OPENAI_API_KEY".to_string(), "sk-test".to_string())]),
        ping_interval: Duration::from_millis(50),
        ..OrsClientOptions::new(server.base_url())
    })
    .expect("client");

    // /tasks says "not supported": the client reads num_tasks + task(i).
    let list = ors.list_tasks("train").await.expect("fallback listing");
    assert_eq!(
        list.tasks,
        vec![json!({ "i": 0 }), json!({ "i": 1 }), json!({ "i": 2 })]
    );
    assert_eq!(list.env_name, "probe");

    let session = ors
        .open_session("probe", &list.tasks[0])
        .await
        .expect("open");
    let secrets: Value =
        serde_json::from_str(&text_of(&session.prompt().await.expect("prompt"))).expect("json");
    assert_eq!(
        secrets,
        json!({ "OPENAI_API_KEY": "sk-test", "OPENREWARD_API_KEY": "or-key" })
    );
    // Pings (every 50 ms) keep the session past the 300 ms idle limit.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let r = session
        .call("count", json!({}))
        .await
        .expect("call after idle");
    assert!(
        matches!(r, ToolResult::Ok { ref blocks, .. } if text_of(blocks) == "call 1"),
        "{r:?}"
    );

    // A tool that raises ends the session.
    match session.call("boom", json!({})).await {
        Err(OrsError::Sse { message, .. }) => {
            assert!(message.contains("probe tool exploded"), "{message}")
        }
        other => panic!("expected an SSE error, got {other:?}"),
    }
    assert!(matches!(
        session.call("count", json!({})).await,
        Err(OrsError::SessionGone { .. })
    ));
    session.close().await.expect("close");

    // Without pings the server reaps the session; the client reports it gone.
    let quiet = OrsClient::new(OrsClientOptions {
        variant: Some("probe".into()),
        ping_interval: Duration::from_secs(3600),
        ..OrsClientOptions::new(server.base_url())
    })
    .expect("client");
    let session = quiet.open_session("probe", &json!({})).await.expect("open");
    tokio::time::sleep(Duration::from_millis(700)).await;
    match session.prompt().await {
        Err(OrsError::SessionGone { sid, message }) => {
            assert_eq!(sid, session.sid());
            assert!(message.contains("410"), "{message}");
        }
        other => panic!("expected SessionGone, got {other:?}"),
    }
    server.shutdown().await;
}

/// A raw HTTP peer answering each request with the next canned response (then the last).
async fn canned_server(responses: Vec<String>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(local()).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            let resp = responses[n.min(responses.len() - 1)].clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let _ = sock.read(&mut buf).await;
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (format!("http://{addr}"), hits)
}

fn http(status: &str, headers: &str, body: &str) -> String {
    format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n{body}", body.len())
}

#[tokio::test]
async fn retries_transient_statuses_but_not_errors() {
    let fast = RetryPolicy {
        base_delay: Duration::from_millis(5),
        ..RetryPolicy::default()
    };
    let ok = http("200 OK", "", r#"[{"name":"train","type":"train"}]"#);
    let (base, hits) = canned_server(vec![
        http(
            "503 Service Unavailable",
            "X-Backend-State: starting\r\nRetry-After: 0\r\n",
            r#"{"detail":"starting"}"#,
        ),
        http("502 Bad Gateway", "", "bad gateway"),
        http("429 Too Many Requests", "", "{}"),
        ok,
    ])
    .await;
    let ors = OrsClient::new(OrsClientOptions {
        retry: fast.clone(),
        ..OrsClientOptions::new(base)
    })
    .expect("client");
    let splits = ors.splits().await.expect("retried to success");
    assert_eq!(splits[0].name, "train");
    assert_eq!(hits.load(Ordering::SeqCst), 4);

    let (base, hits) = canned_server(vec![http(
        "500 Internal Server Error",
        "",
        r#"{"detail":"KeyError: x"}"#,
    )])
    .await;
    let ors = OrsClient::new(OrsClientOptions {
        retry: fast,
        ..OrsClientOptions::new(base)
    })
    .expect("client");
    match ors.splits().await {
        Err(OrsError::Http {
            status: 500, body, ..
        }) => assert_eq!(body, "KeyError: x"),
        other => panic!("expected HTTP 500, got {other:?}"),
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1, "a 500 must not be retried");
}

/// Forwards to `upstream`, but cuts the first `/call` response right after its `task_id`
/// event, as a dropped connection would.
async fn cutting_proxy(upstream: std::net::SocketAddr) -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind(local()).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let cut = Arc::new(AtomicBool::new(false));
    let cut_flag = cut.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                continue;
            };
            let cut = cut_flag.clone();
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let in_call = Arc::new(Mutex::new(false));
                let seen = in_call.clone();
                let up = tokio::spawn(async move {
                    let mut buf = vec![0u8; 16384];
                    while let Ok(n) = cr.read(&mut buf).await {
                        if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        if String::from_utf8_lossy(&buf[..n]).contains("/call") {
                            *seen.lock().unwrap_or_else(|p| p.into_inner()) = true;
                        }
                    }
                });
                let mut buf = vec![0u8; 16384];
                let mut since_call = String::new();
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    if *in_call.lock().unwrap_or_else(|p| p.into_inner())
                        && !cut.load(Ordering::SeqCst)
                    {
                        since_call.push_str(&String::from_utf8_lossy(&buf[..n]));
                        if since_call.contains("event: task_id") {
                            cut.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                }
                up.abort();
            });
        }
    });
    (format!("http://{addr}"), cut)
}

#[tokio::test]
async fn dropped_call_stream_is_resumed_without_rerunning_the_tool() {
    let server = probe_server().await;
    let (base, cut) = cutting_proxy(server.local_addr()).await;
    let ors = OrsClient::new(OrsClientOptions {
        variant: Some("probe".into()),
        retry: RetryPolicy {
            base_delay: Duration::from_millis(10),
            ..RetryPolicy::default()
        },
        ping_interval: Duration::from_millis(50),
        ..OrsClientOptions::new(base)
    })
    .expect("client");
    let session = ors.open_session("probe", &json!({})).await.expect("open");
    let first = session.call("slow", json!({})).await.expect("resumed call");
    assert!(cut.load(Ordering::SeqCst), "the proxy never cut the stream");
    assert!(
        matches!(first, ToolResult::Ok { ref blocks, .. } if text_of(blocks) == "call 1"),
        "{first:?}"
    );
    let second = session.call("count", json!({})).await.expect("second call");
    assert!(
        matches!(second, ToolResult::Ok { ref blocks, .. } if text_of(blocks) == "call 2"),
        "{second:?}"
    );
    session.close().await.expect("close");
    server.shutdown().await;
}

/// A peer that accepts connections and never answers: every call, the SSE ones
/// included, ends at the request deadline with an error naming the URL, after the
/// configured attempts.
#[tokio::test]
async fn a_silent_server_is_a_named_timeout_on_every_call() {
    let listener = TcpListener::bind(local()).await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(sock);
        }
    });
    let ors = OrsClient::new(OrsClientOptions {
        variant: Some("quiet".into()),
        request_timeout: Duration::from_millis(300),
        retry: RetryPolicy {
            max_attempts: 2,
            base_delay: Duration::from_millis(10),
            ..RetryPolicy::default()
        },
        ..OrsClientOptions::new(&base)
    })
    .expect("client");
    let started = std::time::Instant::now();
    match ors.list_tasks("train").await {
        Err(e @ OrsError::Timeout { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(&format!("{base}/quiet/tasks")) && text.contains("no answer within"),
                "{text}"
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    match ors.open_session("t", &json!({})).await {
        Err(OrsError::Timeout { url, .. }) => assert!(url.ends_with("/create_session"), "{url}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        accepted.load(Ordering::SeqCst) >= 4,
        "both calls retried once"
    );
}

//! Drives the built-in ORS server over real HTTP, checking routes, JSON shapes and SSE
//! framing against what the `openreward` SDK server answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use manta_envs::{
    builtin_environments, Block, EnvError, EnvServer, Environment, Episode, RunToolOutput, Secrets,
    ServerHandle, Split, ToolOutput, ToolSpec, ToolsListing,
};
use reqwest::StatusCode;
use serde_json::{json, Value};

fn local() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 0))
}

async fn start() -> ServerHandle {
    manta_envs::serve(local(), builtin_environments())
        .await
        .expect("server starts")
}

/// Parses a complete SSE body into (event, data) pairs plus the number of comment lines.
fn parse_sse(body: &str) -> (Vec<(String, String)>, usize) {
    let mut events = Vec::new();
    let mut comments = 0;
    for block in body.replace("\r\n", "\n").split("\n\n") {
        let (mut event, mut data) = (None, Vec::new());
        for line in block.lines() {
            if line.starts_with(':') {
                comments += 1;
            } else if let Some(v) = line.strip_prefix("event:") {
                event = Some(v.trim_start().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
            }
        }
        if let Some(e) = event {
            events.push((e, data.join("\n")));
        }
    }
    (events, comments)
}

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    fn new(server: &ServerHandle) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: server.base_url(),
        }
    }

    async fn get(&self, path: &str, sid: Option<&str>) -> (StatusCode, Value) {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(sid) = sid {
            req = req.header("X-Session-ID", sid);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn post(&self, path: &str, sid: Option<&str>, body: Value) -> (StatusCode, Value) {
        let mut req = self.http.post(format!("{}{path}", self.base)).json(&body);
        if let Some(sid) = sid {
            req = req.header("X-Session-ID", sid);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn post_sse(
        &self,
        path: &str,
        sid: Option<&str>,
        body: Value,
    ) -> (Vec<(String, String)>, usize) {
        let mut req = self.http.post(format!("{}{path}", self.base)).json(&body);
        if let Some(sid) = sid {
            req = req.header("X-Session-ID", sid);
        }
        let resp = req.send().await.expect("request");
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        let ctype = resp.headers()["content-type"]
            .to_str()
            .unwrap_or("")
            .to_string();
        assert!(ctype.starts_with("text/event-stream"), "{ctype}");
        parse_sse(&resp.text().await.expect("body"))
    }

    /// create_session + create; returns the sid.
    async fn open(&self, create: Value) -> String {
        let (events, _) = self.post_sse("/create_session", None, json!({})).await;
        assert_eq!(events[0].0, "task_id");
        let sid = events[0].1.clone();
        assert_eq!(events.last().map(|e| e.0.as_str()), Some("end"));
        let (status, body) = self.post("/create", Some(&sid), create).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body, json!({ "sid": sid }));
        sid
    }

    /// A tool call; returns the reassembled result JSON.
    async fn call(&self, env: &str, sid: &str, name: &str, input: Value) -> Value {
        let (events, _) = self
            .post_sse(
                &format!("/{env}/call"),
                Some(sid),
                json!({ "name": name, "input": input }),
            )
            .await;
        assert_eq!(events[0].0, "task_id", "{events:?}");
        reassemble(&events[1..])
    }
}

fn reassemble(events: &[(String, String)]) -> Value {
    let mut text = String::new();
    for (i, (event, data)) in events.iter().enumerate() {
        let last = i + 1 == events.len();
        assert_eq!(event, if last { "end" } else { "chunk" }, "{events:?}");
        text.push_str(data);
    }
    serde_json::from_str(&text).expect("result is JSON")
}

#[tokio::test]
async fn splits_tasks_and_redirects() {
    let server = start().await;
    let c = Client::new(&server);

    let (status, envs) = c.get("/list_environments", None).await;
    assert_eq!(
        (status, envs),
        (StatusCode::OK, json!(["digits", "counter"]))
    );
    let (_, splits) = c.get("/counter/splits", None).await;
    assert_eq!(
        splits,
        json!([{ "name": "train", "type": "train" }, { "name": "test", "type": "test" }])
    );

    let (status, all) = c
        .post("/counter/tasks", None, json!({ "split": "train" }))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(all["env_name"], "counter");
    let tasks = all["tasks"].as_array().expect("tasks array");
    assert_eq!(tasks.len(), 1000);
    let (_, n) = c
        .post("/counter/num_tasks", None, json!({ "split": "test" }))
        .await;
    assert_eq!(n, json!({ "num_tasks": 100 }));
    let (_, one) = c
        .post(
            "/counter/task",
            None,
            json!({ "split": "train", "index": 3 }),
        )
        .await;
    assert_eq!(one, json!({ "task": tasks[3], "env_name": "counter" }));
    let (_, last) = c
        .post(
            "/counter/task",
            None,
            json!({ "split": "train", "index": -1 }),
        )
        .await;
    assert_eq!(last["task"], tasks[999]);
    let (_, range) = c
        .post(
            "/counter/task_range",
            None,
            json!({ "split": "train", "start": 10, "stop": 13 }),
        )
        .await;
    assert_eq!(range["tasks"], json!(tasks[10..13]));

    let (status, err) = c
        .post("/digits/tasks", None, json!({ "split": "nope" }))
        .await;
    assert_eq!(
        (status, err),
        (
            StatusCode::BAD_REQUEST,
            json!({ "detail": "Invalid split" })
        )
    );
    let (status, _) = c
        .post(
            "/digits/task",
            None,
            json!({ "split": "test", "index": 100 }),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = c
        .post(
            "/digits/tasks",
            None,
            json!({ "split": "train", "extra": 1 }),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, _) = c.get("/nosuchenv/tools", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Bare paths redirect (308, method and body kept) to the first environment.
    let no_follow = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let resp = no_follow
        .get(format!("{}/splits?x=1", c.base))
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), StatusCode::PERMANENT_REDIRECT);
    assert_eq!(resp.headers()["location"], "/digits/splits?x=1");
    let (status, bare) = c.post("/tasks", None, json!({ "split": "test" })).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(bare["env_name"], "digits");
    assert_eq!(bare["tasks"].as_array().map(Vec::len), Some(100));
    server.shutdown().await;
}

#[tokio::test]
async fn digits_episode_end_to_end() {
    let server = start().await;
    let c = Client::new(&server);
    let (_, tools) = c.get("/digits/tools", None).await;
    assert_eq!(
        tools,
        json!({ "tools": [], "terminal_tool": { "name": "answer", "arg": "answer", "description": "Your final answer." } })
    );

    let sid = c
        .open(json!({ "env_name": "digits", "task_spec": { "target": 7 } }))
        .await;
    assert_eq!(server.live_sessions(), 1);
    let (status, prompt) = c.get("/digits/prompt", Some(&sid)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        prompt,
        json!([{ "type": "text", "text": "Reply with the digit 7." }])
    );
    let (_, task_tools) = c.get("/digits/task_tools", Some(&sid)).await;
    assert_eq!(task_tools, tools);
    let (status, _) = c.post("/ping", Some(&sid), json!({})).await;
    assert_eq!(status, StatusCode::OK);

    let result = c
        .call("digits", &sid, "answer", json!({ "answer": " 73 " }))
        .await;
    assert_eq!(result["ok"], true);
    assert_eq!(result["output"]["reward"], 0.75);
    assert_eq!(result["output"]["finished"], true);
    assert_eq!(result["output"]["blocks"][0]["type"], "text");

    let again = c
        .call("digits", &sid, "answer", json!({ "answer": "7" }))
        .await;
    assert_eq!(again["ok"], false);
    assert_eq!(again["reason"], "episode_finished");

    let (status, _) = c.post("/delete", Some(&sid), json!({})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = c.post("/delete_session", Some(&sid), json!({})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server.live_sessions(), 0);
    let (status, body) = c.get("/digits/prompt", Some(&sid)).await;
    assert_eq!(
        (status, body),
        (StatusCode::GONE, json!({ "detail": "Session deleted" }))
    );
    server.shutdown().await;
}

#[tokio::test]
async fn counter_episode_with_step_rewards() {
    let server = start().await;
    let c = Client::new(&server);
    let (_, task) = c
        .post(
            "/counter/task",
            None,
            json!({ "split": "train", "index": 5 }),
        )
        .await;
    let (start_v, target) = (
        task["task"]["start"].as_i64().expect("start"),
        task["task"]["target"].as_i64().expect("target"),
    );
    let sid = c
        .open(json!({ "env_name": "counter", "split": "train", "index": 5 }))
        .await;
    let (_, prompt) = c.get("/counter/prompt", Some(&sid)).await;
    let text = prompt[0]["text"].as_str().expect("text");
    assert!(
        text.contains(&format!("starts at {start_v}"))
            && text.contains(&format!("equals {target}")),
        "{text}"
    );
    let (_, tools) = c.get("/counter/task_tools", Some(&sid)).await;
    let names: Vec<&str> = tools["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["add", "submit"]);
    assert_eq!(tools["terminal_tool"], Value::Null);

    let step = (target - start_v).signum();
    // A step away from the target earns nothing; steps towards it earn 0.1 each.
    let away = c
        .call("counter", &sid, "add", json!({ "amount": -step }))
        .await;
    assert_eq!(away["output"]["reward"], 0.0);
    assert_eq!(away["output"]["finished"], false);
    let mut value = start_v - step;
    assert_eq!(
        away["output"]["blocks"][0]["text"],
        format!("value is now {value}")
    );
    while value != target {
        let r = c
            .call("counter", &sid, "add", json!({ "amount": step }))
            .await;
        value += step;
        assert_eq!(r["output"]["reward"], 0.1, "{r}");
        assert_eq!(
            r["output"]["blocks"][0]["text"],
            format!("value is now {value}")
        );
    }
    let overshoot = c
        .call("counter", &sid, "add", json!({ "amount": step }))
        .await;
    assert_eq!(overshoot["output"]["reward"], 0.0);
    c.call("counter", &sid, "add", json!({ "amount": -step }))
        .await;
    let submit = c.call("counter", &sid, "submit", json!({})).await;
    assert_eq!(submit["output"]["reward"], 1.0);
    assert_eq!(submit["output"]["finished"], true);

    // A wrong submission scores 0.
    let sid2 = c
        .open(json!({ "env_name": "counter", "task_spec": { "start": 1, "target": 4 } }))
        .await;
    let wrong = c.call("counter", &sid2, "submit", json!({})).await;
    assert_eq!(
        (
            wrong["output"]["reward"].clone(),
            wrong["output"]["finished"].clone()
        ),
        (json!(0.0), json!(true))
    );
    server.shutdown().await;
}

#[tokio::test]
async fn validation_errors() {
    let server = start().await;
    let c = Client::new(&server);
    let sid = c
        .open(json!({ "env_name": "counter", "task_spec": { "start": 0, "target": 2 } }))
        .await;

    for input in [
        json!({}),
        json!({ "amount": "two" }),
        json!({ "amount": 1.5 }),
    ] {
        let r = c.call("counter", &sid, "add", input.clone()).await;
        assert_eq!(r["ok"], false, "{input}");
        assert_eq!(r["reason"], "input_validation", "{input}");
        assert!(
            r["error"].as_str().is_some_and(|e| e.contains("amount")),
            "{r}"
        );
    }
    let r = c.call("counter", &sid, "multiply", json!({})).await;
    assert_eq!(
        (r["ok"].clone(), r["reason"].clone()),
        (json!(false), json!("not_found"))
    );
    // The rejected calls did not move the counter.
    let r = c.call("counter", &sid, "add", json!({ "amount": 2 })).await;
    assert_eq!(r["output"]["blocks"][0]["text"], "value is now 2");

    let (status, _) = c
        .post(
            "/counter/call",
            Some(&sid),
            json!({ "name": "add", "input": [1] }),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, body) = c
        .post("/counter/call", None, json!({ "name": "add", "input": {} }))
        .await;
    assert_eq!(
        (status, body),
        (
            StatusCode::BAD_REQUEST,
            json!({ "detail": "X-Session-ID header is required" })
        )
    );
    let (status, _) = c
        .post(
            "/counter/call",
            Some("no-such-sid"),
            json!({ "name": "add", "input": {} }),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = c.post("/ping", Some("no-such-sid"), json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, body) = c
        .post(
            "/create",
            Some(&sid),
            json!({ "env_name": "counter", "task_spec": { "start": 0, "target": 2 } }),
        )
        .await;
    assert_eq!(
        (status, body),
        (
            StatusCode::BAD_REQUEST,
            json!({ "detail": "Session already exists" })
        )
    );
    let (status, _) = c
        .post("/create", Some("s2"), json!({ "env_name": "counter" }))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, body) = c
        .post(
            "/create",
            Some("s3"),
            json!({ "env_name": "counter", "task_spec": { "start": "x" } }),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        body["detail"].as_str().is_some_and(|d| d.contains("start")),
        "{body}"
    );
    let (status, _) = c
        .post(
            "/create",
            Some("s4"),
            json!({ "env_name": "nope", "split": "train", "index": 0 }),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = c
        .post(
            "/create",
            Some("s5"),
            json!({ "env_name": "digits", "split": "train", "index": 5000 }),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    server.shutdown().await;
}

/// A test environment: its prompt echoes the secrets it was given, `slow` sleeps,
/// `boom` panics and `big` returns a long text.
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
        Ok(1)
    }
    fn task(&self, _: &str, _: u64) -> Result<Value, EnvError> {
        Ok(json!({}))
    }
    fn tasks(&self, _: &str) -> Result<Vec<Value>, EnvError> {
        Err(EnvError::ListingNotSupported)
    }
    fn tools(&self) -> ToolsListing {
        let spec = |n: &str| ToolSpec {
            name: n.into(),
            description: String::new(),
            input_schema: None,
        };
        ToolsListing {
            tools: vec![spec("slow"), spec("boom"), spec("big")],
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
    fn prompt(&self) -> Vec<Block> {
        vec![Block::text(
            serde_json::to_string(&self.secrets).unwrap_or_default(),
        )]
    }
    fn call(&mut self, name: &str, _: &Value) -> RunToolOutput {
        self.calls += 1;
        match name {
            "slow" => std::thread::sleep(Duration::from_millis(350)),
            "boom" => panic!("probe tool exploded"),
            _ => {}
        }
        RunToolOutput::Ok(ToolOutput {
            blocks: vec![Block::text(format!(
                "call {} {}",
                self.calls,
                "x y ".repeat(200)
            ))],
            metadata: None,
            reward: None,
            finished: false,
        })
    }
}

#[tokio::test]
async fn chunking_resume_keepalive_errors_and_secrets() {
    let server = EnvServer::new(vec![Arc::new(Probe)])
        .chunk_size(100)
        .keep_alive(Duration::from_millis(50))
        .serve(local())
        .await
        .expect("server");
    let c = Client::new(&server);

    let (status, body) = c
        .post("/probe/tasks", None, json!({ "split": "train" }))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["detail"]
        .as_str()
        .is_some_and(|d| d.contains("not supported")));

    // Secrets arrive base64-encoded in X-Secrets on /create.
    let (events, _) = c.post_sse("/create_session", None, json!({})).await;
    let sid = events[0].1.clone();
    use base64::Engine as _;
    let header = base64::engine::general_purpose::STANDARD.encode(
        json!({ "OPENAI_API_KEY": { "value": "sk-1", "allowed_domains": ["api.openai.com"] } })
            .to_string(),
    );
    let resp = c
        .http
        .post(format!("{}/create", c.base))
        .header("X-Session-ID", &sid)
        .header("X-Secrets", header)
        .json(&json!({ "task_spec": {} }))
        .send()
        .await
        .expect("create");
    assert_eq!(resp.status(), StatusCode::OK);
    let (_, prompt) = c.get("/probe/prompt", Some(&sid)).await;
    assert_eq!(prompt[0]["text"], r#"{"OPENAI_API_KEY":"sk-1"}"#);

    // A slow tool: keep-alive comments arrive while waiting; the long result is chunked.
    let (events, comments) = c
        .post_sse(
            "/probe/call",
            Some(&sid),
            json!({ "name": "slow", "input": {} }),
        )
        .await;
    assert!(
        comments >= 2,
        "expected keep-alive comments, got {comments}"
    );
    assert!(
        events.len() > 5,
        "expected several chunks, got {}",
        events.len()
    );
    let task_id = events[0].1.clone();
    let first = reassemble(&events[1..]);
    assert!(first["output"]["blocks"][0]["text"]
        .as_str()
        .is_some_and(|t| t.starts_with("call 1 ")));

    // Resuming by task_id replays the same result without running the tool again.
    let (events, _) = c
        .post_sse(
            "/probe/call",
            Some(&sid),
            json!({ "name": "slow", "input": {}, "task_id": task_id }),
        )
        .await;
    assert_eq!(events[0], ("task_id".to_string(), task_id));
    assert_eq!(reassemble(&events[1..]), first);
    let next = c.call("probe", &sid, "big", json!({})).await;
    assert!(next["output"]["blocks"][0]["text"]
        .as_str()
        .is_some_and(|t| t.starts_with("call 2 ")));
    let (events, _) = c
        .post_sse(
            "/probe/call",
            Some(&sid),
            json!({ "name": "big", "input": {}, "task_id": "nope" }),
        )
        .await;
    assert_eq!(
        events,
        vec![("error".to_string(), "unknown task_id".to_string())]
    );

    // A panicking tool surfaces as an SSE error event carrying its message.
    let (events, _) = c
        .post_sse(
            "/probe/call",
            Some(&sid),
            json!({ "name": "boom", "input": {} }),
        )
        .await;
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[1].0, "error");
    assert!(events[1].1.contains("probe tool exploded"), "{events:?}");
    server.shutdown().await;
}

/// A session idle longer than the TTL is reaped (its sid then answers 410), while one
/// that is pinged lives on well past the TTL. Time only bounds the test: the TTL is long
/// next to the ping period, expiry is awaited as a state (the live-session count), and a
/// deadline far beyond the TTL only stops a hang.
#[tokio::test]
async fn idle_sessions_are_reaped_but_pings_keep_them() {
    const TTL: Duration = Duration::from_secs(3);
    const HANG: Duration = Duration::from_secs(60);
    let server = EnvServer::new(builtin_environments())
        .session_ttl(TTL, Duration::from_millis(50))
        .serve(local())
        .await
        .expect("server");
    let c = Client::new(&server);
    let idle = c
        .open(json!({ "env_name": "digits", "task_spec": { "target": 1 } }))
        .await;
    let pinged = c
        .open(json!({ "env_name": "digits", "task_spec": { "target": 2 } }))
        .await;
    let opened = Instant::now();
    assert_eq!(server.live_sessions(), 2);
    // Ping one session until the reaper has taken the other, and on until the pinged one
    // is 1.5 TTLs old: unpinged, it would have been reaped by then like the idle one.
    let mut reaped = false;
    while !reaped || opened.elapsed() < TTL * 3 / 2 {
        assert!(
            opened.elapsed() < HANG,
            "the idle session was never reaped: {} sessions live after {HANG:?}",
            server.live_sessions()
        );
        let (status, body) = c.post("/ping", Some(&pinged), json!({})).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "the pinged session was lost: {body}"
        );
        let live = server.live_sessions();
        assert!(live >= 1, "the pinged session was reaped too");
        reaped = reaped || live == 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.live_sessions(), 1);
    let (status, body) = c.get("/digits/prompt", Some(&idle)).await;
    assert_eq!(status, StatusCode::GONE, "{body}");
    let (status, body) = c.get("/digits/prompt", Some(&pinged)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.shutdown().await;
}

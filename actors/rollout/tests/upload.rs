//! Trajectory upload: real episodes against Manta's built-in ORS server (scripted
//! policy, real tokenizer) upload their transcripts to a local HTTP endpoint that
//! records every POST to `/v1/rollouts`.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use manta_config::TrainConfig;
use manta_core::SampleStatus;
use manta_engine::{
    Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest, NamedTensors,
};
use manta_rollout::chat::ChatFormat;
use manta_rollout::episode::{run_episode, NO_TOOL_CALL_MESSAGE};
use manta_rollout::ors::{OrsClient, OrsClientOptions};
use manta_rollout::upload::{Message, MessageType, RolloutInfo, UploadConfig, Uploader};
use manta_rollout::{
    EnvironmentHandle, EpisodeContext, EpisodeRequest, GenerationSettings, TaskRef,
};
use manta_tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Only stops a test that would otherwise hang; never reached when things work.
const HANG: Duration = Duration::from_secs(120);

/// Replays scripted assistant turns.
struct ScriptedPolicy {
    tokenizer: Arc<Tokenizer>,
    turns: Mutex<Vec<&'static str>>,
    /// When set, each turn first waits until this count (POSTs that reached an
    /// endpoint) is at least 1.
    after_a_post: Option<Arc<AtomicUsize>>,
}

#[async_trait]
impl Engine for ScriptedPolicy {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        if let Some(posts) = &self.after_a_post {
            let started = Instant::now();
            while posts.load(Ordering::SeqCst) == 0 {
                assert!(
                    started.elapsed() < HANG,
                    "no upload reached the endpoint within {HANG:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let text = self.turns.lock().unwrap().remove(0);
        let ids = self.tokenizer.encode(text).unwrap();
        let stopped = ids
            .last()
            .is_some_and(|t| request.params.stop_token_ids.contains(t));
        Ok(GenerateOutput {
            logprobs: vec![-0.5; ids.len()],
            output_ids: ids,
            finish: if stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
            weight_version: 3,
            ..GenerateOutput::default()
        })
    }
    async fn update_weights(&self, _: NamedTensors, _: u64) -> Result<(), EngineError> {
        Ok(())
    }
    fn weight_version(&self) -> u64 {
        3
    }
}

/// The counter script of `episode_builtin.rs`: a call, a malformed call, no call, a
/// rejected call, the terminal call.
const COUNTER_TURNS: [&str; 5] = [
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": 2}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": }\n</tool_call>",
    "I think I am done.<|im_end|>",
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": \"x\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"submit\", \"arguments\": {}}\n</tool_call>",
];
/// Events one counter episode uploads: the rollout event and 12 messages.
const COUNTER_EVENTS: usize = 13;

type Captured = Arc<Mutex<Vec<(Option<String>, Value)>>>;

/// A local `/v1/rollouts` that records each POST and answers `status`.
async fn capture_endpoint(status: StatusCode) -> (String, Captured) {
    async fn handler(
        State((seen, status)): State<(Captured, StatusCode)>,
        headers: HeaderMap,
        Json(body): Json<Value>,
    ) -> StatusCode {
        let key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        seen.lock().unwrap().push((key, body));
        status
    }
    let seen: Captured = Arc::default();
    let app = Router::new()
        .route("/v1/rollouts", post(handler))
        .with_state((seen.clone(), status));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

/// A local `/v1/rollouts` that holds every POST open until `release` says true, then
/// answers 500.
struct HeldEndpoint {
    url: String,
    /// POSTs that reached the endpoint.
    arrived: Arc<AtomicUsize>,
    /// POSTs answered (only after the release).
    answered: Arc<AtomicUsize>,
    release: tokio::sync::watch::Sender<bool>,
}

async fn held_endpoint() -> HeldEndpoint {
    #[derive(Clone)]
    struct Held {
        arrived: Arc<AtomicUsize>,
        answered: Arc<AtomicUsize>,
        release: tokio::sync::watch::Receiver<bool>,
    }
    async fn handler(State(held): State<Held>) -> StatusCode {
        held.arrived.fetch_add(1, Ordering::SeqCst);
        let mut release = held.release.clone();
        let _ = release.wait_for(|released| *released).await;
        held.answered.fetch_add(1, Ordering::SeqCst);
        StatusCode::INTERNAL_SERVER_ERROR
    }
    let (release, released) = tokio::sync::watch::channel(false);
    let held = Held {
        arrived: Arc::default(),
        answered: Arc::default(),
        release: released,
    };
    let app = Router::new()
        .route("/v1/rollouts", post(handler))
        .with_state(held.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    HeldEndpoint {
        url: format!("http://{addr}"),
        arrived: held.arrived,
        answered: held.answered,
        release,
    }
}

fn model_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3")
}

struct Setup {
    server: manta_envs::ServerHandle,
    ctx: EpisodeContext,
    env: EnvironmentHandle,
}

async fn setup(turns: Vec<&'static str>, uploader: Uploader) -> Setup {
    setup_gated(turns, uploader, None).await
}

/// [`setup`] with a policy whose turns wait for a POST to reach an endpoint first.
async fn setup_gated(
    turns: Vec<&'static str>,
    uploader: Uploader,
    after_a_post: Option<Arc<AtomicUsize>>,
) -> Setup {
    let server = manta_envs::serve(
        "127.0.0.1:0".parse().unwrap(),
        manta_envs::builtin_environments(),
    )
    .await
    .unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir()).unwrap());
    let yaml = "environments:\n  manta/Counter:\n    max_turns: 6\n";
    let train = TrainConfig::from_yaml_str(yaml, Path::new("test.yaml")).unwrap();
    let stop = ["<|im_end|>", "</tool_call>"]
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    let ctx = EpisodeContext {
        engine: Arc::new(ScriptedPolicy {
            tokenizer: tokenizer.clone(),
            turns: Mutex::new(turns),
            after_a_post,
        }),
        chat: ChatFormat::new(tokenizer, train.thinking),
        system_prompt_template: train.system_prompt_template.clone(),
        stop_token_ids: stop,
        upload: Some(uploader),
    };
    let client = OrsClient::new(OrsClientOptions {
        variant: Some("counter".into()),
        ..OrsClientOptions::new(server.base_url())
    })
    .unwrap();
    let (name, config) = train.environments.into_iter().next().unwrap();
    Setup {
        server,
        ctx,
        env: EnvironmentHandle {
            name,
            client,
            config,
        },
    }
}

fn request(sample_id: u64) -> EpisodeRequest {
    EpisodeRequest {
        sample_id,
        group_index: 0,
        index: sample_id as u32,
        task: TaskRef {
            environment: "manta/Counter".into(),
            split: "train".into(),
            task_spec: json!({"start": 1, "target": 3}),
            task_hash: "abc".into(),
            server_env: "counter".into(),
        },
    }
}

const SETTINGS: GenerationSettings = GenerationSettings {
    temperature: 1.0,
    top_p: 1.0,
    top_k: -1,
    max_response_len: 64,
    context_len: 4096,
    partial_rollout: false,
    return_routed_experts: false,
};

fn config(url: &str) -> UploadConfig {
    UploadConfig::new(url, "test-key", "manta-test-run")
}

fn events(seen: &Captured) -> Vec<Value> {
    seen.lock()
        .unwrap()
        .iter()
        .flat_map(|(_, body)| body["events"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn assert_str(e: &Value, key: &str) {
    assert!(e[key].is_string(), "{key} must be a string in {e}");
}

/// Checks every key and type of a message event.
fn assert_message_schema(e: &Value) {
    assert_eq!(e["eventType"], "message", "{e}");
    for key in ["eventId", "rolloutEventId", "type", "content"] {
        assert_str(e, key);
    }
    assert!(e["timestamp"].is_u64() && e["index"].is_u64(), "{e}");
    assert!(
        e["isFinished"].is_boolean() && e["metadata"].is_object(),
        "{e}"
    );
    match e["type"].as_str().unwrap() {
        "tool_call" => {
            assert_str(e, "name");
            assert_str(e, "callId");
            let args: Value = serde_json::from_str(e["content"].as_str().unwrap())
                .expect("tool call content is the arguments JSON");
            assert!(args.is_object(), "{e}");
        }
        "tool_result" => {
            assert_str(e, "callId");
            assert!(e.get("name").is_none(), "{e}");
            assert!(e.get("reward").is_none_or(Value::is_f64), "{e}");
        }
        "system_message" | "user_message" | "assistant_message" | "reasoning" => {
            assert!(e.get("name").is_none() && e.get("callId").is_none(), "{e}");
        }
        other => panic!("unknown message type {other}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn counter_episode_transcript_is_uploaded_in_order() {
    let (url, seen) = capture_endpoint(StatusCode::OK).await;
    let uploader = Uploader::start(config(&url)).unwrap();
    let s = setup(COUNTER_TURNS.to_vec(), uploader.clone()).await;
    let sample = run_episode(&s.ctx, &s.env, &request(5), SETTINGS).await;
    assert_eq!(
        sample.status,
        SampleStatus::Completed,
        "{:?}",
        sample.metadata
    );
    assert!((sample.reward - 1.1).abs() < 1e-9);
    assert!(uploader.flush(Duration::from_secs(10)).await);

    let batches = seen.lock().unwrap().clone();
    assert!(!batches.is_empty());
    for (key, body) in &batches {
        assert_eq!(key.as_deref(), Some("test-key"));
        assert_eq!(
            body.as_object().unwrap().len(),
            1,
            "body is {{\"events\": […]}}"
        );
    }
    let all = events(&seen);
    assert_eq!(all.len(), COUNTER_EVENTS, "{all:#?}");

    let rollout = &all[0];
    assert_eq!(rollout["eventType"], "rollout");
    for key in ["eventId", "runName", "rolloutName", "environment", "split"] {
        assert_str(rollout, key);
    }
    assert!(rollout["timestamp"].is_u64());
    assert_eq!(rollout["runName"], "manta-test-run");
    assert_eq!(rollout["environment"], "manta/Counter");
    assert_eq!(rollout["split"], "train");
    assert_eq!(rollout["task_spec"], json!({"start": 1, "target": 3}));
    assert_eq!(rollout["metadata"]["sample_id"], 5);
    assert_eq!(rollout["metadata"]["task_hash"], "abc");

    let messages = &all[1..];
    for (i, m) in messages.iter().enumerate() {
        assert_message_schema(m);
        assert_eq!(m["index"], i as u64, "indexes are contiguous from 0");
        assert_eq!(m["rolloutEventId"], rollout["eventId"]);
    }
    let kinds: Vec<(&str, &str)> = messages
        .iter()
        .map(|m| {
            (
                m["type"].as_str().unwrap(),
                m.get("name").and_then(Value::as_str).unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("system_message", ""),
            ("user_message", ""),
            ("tool_call", "add"),
            ("tool_result", ""),
            ("assistant_message", ""),
            ("user_message", ""),
            ("assistant_message", ""),
            ("user_message", ""),
            ("tool_call", "add"),
            ("tool_result", ""),
            ("tool_call", "submit"),
            ("tool_result", ""),
        ]
    );
    let content = |i: usize| messages[i]["content"].as_str().unwrap();
    assert!(
        content(0).contains("\"name\": \"add\""),
        "system lists tools"
    );
    assert_eq!(
        serde_json::from_str::<Value>(content(2)).unwrap(),
        json!({"amount": 2})
    );
    assert_eq!(messages[2]["callId"], messages[3]["callId"]);
    assert_eq!(content(3), "value is now 3");
    assert_eq!(messages[3]["reward"], 0.1);
    assert_eq!(messages[3]["isFinished"], false);
    assert!(content(5).starts_with("Error: malformed tool call"));
    assert_eq!(content(6), "I think I am done.");
    assert_eq!(content(7), NO_TOOL_CALL_MESSAGE);
    assert!(
        content(9).starts_with("Error: "),
        "rejected call: {}",
        content(9)
    );
    assert!(messages[9].get("reward").is_none());
    assert_ne!(messages[8]["callId"], messages[10]["callId"]);
    assert_eq!(messages[11]["reward"], 1.0);
    assert_eq!(messages[11]["isFinished"], true);

    let stats = uploader.shutdown(Duration::from_secs(10)).await;
    assert_eq!(
        (stats.uploaded, stats.dropped, stats.failed),
        (COUNTER_EVENTS as u64, 0, 0)
    );
    s.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn many_episodes_are_batched_at_most_128_events() {
    let (url, seen) = capture_endpoint(StatusCode::OK).await;
    // A long age limit, so only the count limit and the final flush cut batches.
    let mut c = config(&url);
    c.max_age = Duration::from_secs(60);
    let uploader = Uploader::start(c).unwrap();
    let episodes = 12;
    let turns = (0..episodes).flat_map(|_| COUNTER_TURNS).collect();
    let s = setup(turns, uploader.clone()).await;
    for i in 0..episodes {
        let sample = run_episode(&s.ctx, &s.env, &request(i), SETTINGS).await;
        assert_eq!(sample.status, SampleStatus::Completed);
    }
    let stats = uploader.shutdown(Duration::from_secs(10)).await;
    let total = episodes as usize * COUNTER_EVENTS;
    assert!(total > 128);
    let sizes: Vec<usize> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(_, b)| b["events"].as_array().unwrap().len())
        .collect();
    assert!(sizes.len() >= 2, "{sizes:?}");
    assert!(sizes.iter().all(|&n| (1..=128).contains(&n)), "{sizes:?}");
    assert_eq!(sizes[0], 128, "a full batch goes out as soon as it fills");
    assert_eq!(sizes.iter().sum::<usize>(), total);
    assert_eq!(stats.uploaded, total as u64);

    // Every message links to a rollout event, and each rollout's indexes are 0..12.
    let all = events(&seen);
    let ids: HashSet<&str> = all.iter().map(|e| e["eventId"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), total, "event ids are unique");
    let mut per_rollout: BTreeMap<&str, Vec<u64>> = all
        .iter()
        .filter(|e| e["eventType"] == "rollout")
        .map(|e| (e["eventId"].as_str().unwrap(), Vec::new()))
        .collect();
    assert_eq!(per_rollout.len(), episodes as usize);
    for m in all.iter().filter(|e| e["eventType"] == "message") {
        assert_message_schema(m);
        per_rollout
            .get_mut(m["rolloutEventId"].as_str().unwrap())
            .expect("message of a known rollout")
            .push(m["index"].as_u64().unwrap());
    }
    for indexes in per_rollout.values() {
        assert_eq!(*indexes, (0..12).collect::<Vec<u64>>());
    }
    s.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_stay_under_one_megabyte() {
    let (url, seen) = capture_endpoint(StatusCode::OK).await;
    let uploader = Uploader::start(config(&url)).unwrap();
    let mut rollout = uploader.start_rollout(RolloutInfo::default());
    let big = "y".repeat(300_000);
    for _ in 0..7 {
        rollout.log(Message::new(MessageType::ToolResult, big.clone()));
    }
    uploader.shutdown(Duration::from_secs(10)).await;
    let bodies = seen.lock().unwrap().clone();
    assert!(bodies.len() >= 3, "{} batches", bodies.len());
    for (_, body) in &bodies {
        let events_bytes: usize = body["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.to_string().len())
            .sum();
        assert!(
            events_bytes <= 1_000_000,
            "{events_bytes} bytes in one batch"
        );
    }
    assert_eq!(events(&seen).len(), 8);
}

/// An upload that hangs neither fails nor holds up the episode: the endpoint holds the
/// first POST open (and later answers 500); the episode runs to its end while that POST
/// is still held, and only then is the endpoint released.
#[tokio::test(flavor = "multi_thread")]
async fn failing_endpoint_never_fails_or_blocks_the_episode() {
    let endpoint = held_endpoint().await;
    let mut c = config(&endpoint.url);
    c.max_retries = 2;
    c.backoff_base = Duration::from_millis(20);
    // Each event is a batch of its own and one POST is in flight at a time: the rollout
    // event's POST goes out at once, and while it is held every later batch waits.
    c.max_batch_events = 1;
    c.max_concurrent_uploads = 1;
    // The held POST must not time out (and be retried) while the episode runs.
    c.request_timeout = HANG;
    let uploader = Uploader::start(c).unwrap();
    // The policy's first turn waits until that POST is held at the endpoint, so the rest
    // of the episode certainly runs while an upload is stuck.
    let s = setup_gated(
        COUNTER_TURNS.to_vec(),
        uploader.clone(),
        Some(endpoint.arrived.clone()),
    )
    .await;
    // On a task of its own, so the deadline holds even if the episode blocks its thread.
    let episode = tokio::spawn(async move {
        let sample = run_episode(&s.ctx, &s.env, &request(1), SETTINGS).await;
        (s, sample)
    });
    let (s, sample) = tokio::time::timeout(HANG, episode)
        .await
        .unwrap_or_else(|_| {
            panic!("the episode was still waiting on the held upload after {HANG:?}")
        })
        .unwrap();
    assert_eq!(
        sample.status,
        SampleStatus::Completed,
        "{:?}",
        sample.metadata
    );
    assert!((sample.reward - 1.1).abs() < 1e-9);
    // The episode is over; its first upload is still held and nothing was sent or lost.
    assert_eq!(endpoint.arrived.load(Ordering::SeqCst), 1);
    assert_eq!(endpoint.answered.load(Ordering::SeqCst), 0);
    let stats = uploader.stats();
    assert_eq!(
        (stats.uploaded, stats.dropped, stats.failed),
        (0, 0, 0),
        "{stats:?}"
    );

    endpoint.release.send(true).unwrap();
    let stats = uploader.shutdown(HANG).await;
    assert_eq!(
        (stats.uploaded, stats.dropped, stats.failed),
        (0, 0, COUNTER_EVENTS as u64),
        "{stats:?}"
    );
    // Each batch (one event) was tried 1 + max_retries times.
    assert_eq!(
        endpoint.arrived.load(Ordering::SeqCst),
        3 * COUNTER_EVENTS,
        "posts"
    );
    s.server.shutdown().await;
}

//! Trajectory upload to OpenReward (`POST {api}/v1/rollouts`), as the `openreward` SDK's
//! rollout logger does it: a rollout event, then one message event per turn piece.
//!
//! Uploading must never slow training: events go into a bounded queue (dropped and
//! counted when it is full), a background task batches them (≤128 events, ≤1 MB, ≤1 s
//! old) and posts them, retrying 429/5xx a few times before dropping the batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, warn};

/// Default platform API when `OPENREWARD_API_URL` is not set.
pub const DEFAULT_API_URL: &str = "https://api.openreward.ai";

/// Setting it to `0`/`false`/`off` turns uploads off even when a run name and key are set.
pub const UPLOAD_SWITCH_ENV: &str = "MANTA_ROLLOUT_UPLOAD";

/// A bad upload setting.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("rollout upload: {option}: {message}")]
    Config {
        option: &'static str,
        message: String,
    },
}

/// Where and how to upload.
#[derive(Debug, Clone)]
pub struct UploadConfig {
    /// Platform API base, e.g. `https://api.openreward.ai`.
    pub api_url: String,
    /// Sent as `x-api-key`.
    pub api_key: String,
    /// `runName` of every rollout (train_config's `openreward_run_name`).
    pub run_name: String,
    /// Events waiting for the background task; more are dropped (and counted).
    pub queue_capacity: usize,
    /// Most events per POST.
    pub max_batch_events: usize,
    /// Most bytes of encoded events per POST.
    pub max_batch_bytes: usize,
    /// Oldest an event may wait before its batch is sent.
    pub max_age: Duration,
    /// Retries of a batch after a 429/5xx or a transport error.
    pub max_retries: u32,
    /// First retry delay; doubles each retry up to `backoff_cap`.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Limit for one POST.
    pub request_timeout: Duration,
    /// Batches in flight at once.
    pub max_concurrent_uploads: usize,
}

impl UploadConfig {
    /// The SDK's batching limits and a retry policy that gives up within seconds.
    pub fn new(
        api_url: impl Into<String>,
        api_key: impl Into<String>,
        run_name: impl Into<String>,
    ) -> Self {
        Self {
            api_url: api_url.into(),
            api_key: api_key.into(),
            run_name: run_name.into(),
            queue_capacity: 100_000,
            max_batch_events: 128,
            max_batch_bytes: 1_000_000,
            max_age: Duration::from_secs(1),
            max_retries: 4,
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(8),
            request_timeout: Duration::from_secs(30),
            max_concurrent_uploads: 4,
        }
    }

    /// Uploads are on when train_config names `openreward_run_name` and
    /// `OPENREWARD_API_KEY` is set (like the cookbook), unless `MANTA_ROLLOUT_UPLOAD`
    /// says off. The API base is `OPENREWARD_API_URL` or [`DEFAULT_API_URL`].
    pub fn from_env(run_name: Option<&str>) -> Option<Self> {
        Self::from_vars(run_name, |k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] with the variables read through `var` (testable).
    pub fn from_vars(run_name: Option<&str>, var: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let switch = var(UPLOAD_SWITCH_ENV).unwrap_or_default();
        if matches!(
            switch.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off" | "no"
        ) {
            return None;
        }
        let run_name = run_name.filter(|r| !r.trim().is_empty())?;
        let key = var("OPENREWARD_API_KEY").filter(|k| !k.trim().is_empty())?;
        let api = var("OPENREWARD_API_URL")
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_API_URL.to_string());
        Some(Self::new(api, key, run_name))
    }
}

/// Counts of events since the uploader started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UploadStats {
    /// Events in batches the API accepted.
    pub uploaded: u64,
    /// Events never sent: the queue was full or the uploader had shut down.
    pub dropped: u64,
    /// Events in batches that failed after all retries.
    pub failed: u64,
    /// Batches the API accepted.
    pub batches: u64,
}

#[derive(Default)]
struct Counters {
    uploaded: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    batches: AtomicU64,
}

enum Command {
    Event(Value),
    /// Send everything queued so far and answer once it is sent (or has failed).
    Flush(oneshot::Sender<()>),
    Shutdown(oneshot::Sender<()>),
}

/// Handle to the background uploader; cheap to clone. Sending never blocks.
#[derive(Clone)]
pub struct Uploader {
    tx: mpsc::Sender<Command>,
    counters: Arc<Counters>,
    run_name: Arc<str>,
    worker: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl std::fmt::Debug for Uploader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uploader")
            .field("run_name", &self.run_name)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Uploader {
    /// Checks the settings and starts the background task (needs a tokio runtime).
    pub fn start(config: UploadConfig) -> Result<Self, UploadError> {
        let base = config.api_url.trim().trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base).map_err(|e| UploadError::Config {
            option: "api_url",
            message: format!("{:?}: {e}", config.api_url),
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(UploadError::Config {
                option: "api_url",
                message: format!("{base:?} must be an http(s) URL"),
            });
        }
        if config.max_batch_events == 0 || config.queue_capacity == 0 {
            return Err(UploadError::Config {
                option: "max_batch_events/queue_capacity",
                message: "must be at least 1".into(),
            });
        }
        let mut key = HeaderValue::from_str(&config.api_key).map_err(|e| UploadError::Config {
            option: "api_key",
            message: format!("not a valid header value: {e}"),
        })?;
        key.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(HeaderName::from_static("x-api-key"), key);
        let http = reqwest::Client::builder()
            .user_agent(concat!("manta-rollout/", env!("CARGO_PKG_VERSION")))
            .default_headers(headers)
            .build()
            .map_err(|e| UploadError::Config {
                option: "http client",
                message: e.to_string(),
            })?;
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let counters = Arc::new(Counters::default());
        let run_name: Arc<str> = Arc::from(config.run_name.as_str());
        let worker = Worker {
            http,
            url: format!("{base}/v1/rollouts"),
            config,
            counters: counters.clone(),
        };
        let handle = tokio::spawn(worker.run(rx));
        Ok(Self {
            tx,
            counters,
            run_name,
            worker: Arc::new(Mutex::new(Some(handle))),
        })
    }

    /// The run every rollout is filed under.
    pub fn run_name(&self) -> &str {
        &self.run_name
    }

    /// Current counters.
    pub fn stats(&self) -> UploadStats {
        UploadStats {
            uploaded: self.counters.uploaded.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            batches: self.counters.batches.load(Ordering::Relaxed),
        }
    }

    /// Queues one event; when the queue is full the event is dropped and counted.
    fn push(&self, event: Value) {
        if let Err(e) = self.tx.try_send(Command::Event(event)) {
            let dropped = self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            if dropped.is_power_of_two() || dropped == 0 {
                let why = match e {
                    mpsc::error::TrySendError::Full(_) => "the upload queue is full",
                    mpsc::error::TrySendError::Closed(_) => "the uploader has shut down",
                };
                warn!(
                    dropped = dropped + 1,
                    "rollout upload: dropping events: {why}"
                );
            }
        }
    }

    /// Starts a rollout: queues its `rollout` event and returns the recorder for its messages.
    pub fn start_rollout(&self, rollout: RolloutInfo) -> RolloutRecorder {
        let event_id = uuid::Uuid::new_v4().to_string();
        let mut event = Map::new();
        event.insert("eventType".into(), json!("rollout"));
        event.insert("eventId".into(), json!(event_id));
        event.insert("timestamp".into(), json!(now_ms()));
        event.insert("runName".into(), json!(&*self.run_name));
        event.insert("rolloutName".into(), json!(rollout.rollout_name));
        event.insert("environment".into(), json!(rollout.environment));
        event.insert("split".into(), json!(rollout.split));
        event.insert("metadata".into(), Value::Object(rollout.metadata));
        event.insert("task_spec".into(), rollout.task_spec);
        self.push(Value::Object(event));
        RolloutRecorder {
            uploader: self.clone(),
            event_id,
            next_index: 0,
        }
    }

    /// Sends everything queued so far and waits until it is sent or has failed, at most
    /// `timeout`. Returns false on timeout or when the uploader has stopped.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let (ack, done) = oneshot::channel();
        let sent = tokio::time::timeout(timeout, async {
            self.tx.send(Command::Flush(ack)).await.is_ok() && done.await.is_ok()
        })
        .await;
        matches!(sent, Ok(true))
    }

    /// Sends what is queued and stops the background task, waiting at most `timeout`;
    /// later events are dropped. Returns the final counters.
    pub async fn shutdown(&self, timeout: Duration) -> UploadStats {
        let deadline = Instant::now() + timeout;
        let (ack, done) = oneshot::channel();
        let stopped = tokio::time::timeout_at(deadline, async {
            self.tx.send(Command::Shutdown(ack)).await.is_ok() && done.await.is_ok()
        })
        .await;
        let handle = self.worker.lock().ok().and_then(|mut h| h.take());
        match (stopped, handle) {
            (Ok(true), Some(handle)) => {
                let _ = tokio::time::timeout_at(deadline, handle).await;
            }
            (Ok(true), None) => {}
            (_, handle) => {
                warn!(
                    ?timeout,
                    "rollout upload: shutdown timed out; unsent events are lost"
                );
                if let Some(handle) = handle {
                    handle.abort();
                }
            }
        }
        self.stats()
    }
}

/// What a rollout event says about the episode.
#[derive(Debug, Clone, Default)]
pub struct RolloutInfo {
    pub rollout_name: String,
    /// `Owner/Name`.
    pub environment: String,
    pub split: String,
    pub metadata: Map<String, Value>,
    pub task_spec: Value,
}

/// The kinds of message the SDK's normalized events have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageType {
    SystemMessage,
    UserMessage,
    AssistantMessage,
    Reasoning,
    ToolCall,
    ToolResult,
}

impl MessageType {
    /// The wire name (`type` of a message event).
    pub fn as_str(self) -> &'static str {
        match self {
            MessageType::SystemMessage => "system_message",
            MessageType::UserMessage => "user_message",
            MessageType::AssistantMessage => "assistant_message",
            MessageType::Reasoning => "reasoning",
            MessageType::ToolCall => "tool_call",
            MessageType::ToolResult => "tool_result",
        }
    }
}

/// One message of a rollout. `name` belongs to tool calls, `call_id` joins a call to
/// its result; absent fields are left out of the event, as the SDK does.
#[derive(Debug, Clone)]
pub struct Message {
    pub kind: MessageType,
    pub content: String,
    pub name: Option<String>,
    pub call_id: Option<String>,
    pub reward: Option<f64>,
    pub is_finished: bool,
    pub metadata: Map<String, Value>,
}

impl Message {
    /// A message with only a type and content.
    pub fn new(kind: MessageType, content: impl Into<String>) -> Self {
        Self {
            kind,
            content: content.into(),
            name: None,
            call_id: None,
            reward: None,
            is_finished: false,
            metadata: Map::new(),
        }
    }
}

/// Records one rollout's messages with consecutive indexes.
#[derive(Debug)]
pub struct RolloutRecorder {
    uploader: Uploader,
    event_id: String,
    next_index: u64,
}

impl RolloutRecorder {
    /// The rollout event's id (`rolloutEventId` of its messages).
    pub fn event_id(&self) -> &str {
        &self.event_id
    }

    /// Queues the next message.
    pub fn log(&mut self, message: Message) {
        let mut event = Map::new();
        event.insert("eventType".into(), json!("message"));
        event.insert("eventId".into(), json!(uuid::Uuid::new_v4().to_string()));
        event.insert("timestamp".into(), json!(now_ms()));
        event.insert("index".into(), json!(self.next_index));
        event.insert("rolloutEventId".into(), json!(self.event_id));
        event.insert("type".into(), json!(message.kind.as_str()));
        // The SDK strips NUL bytes from content.
        event.insert("content".into(), json!(message.content.replace('\0', "")));
        if let Some(name) = message.name {
            event.insert("name".into(), json!(name));
        }
        if let Some(id) = message.call_id {
            event.insert("callId".into(), json!(id));
        }
        if let Some(r) = message.reward.filter(|r| r.is_finite()) {
            event.insert("reward".into(), json!(r));
        }
        event.insert("isFinished".into(), json!(message.is_finished));
        event.insert("metadata".into(), Value::Object(message.metadata));
        self.next_index += 1;
        self.uploader.push(Value::Object(event));
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Worker {
    http: reqwest::Client,
    url: String,
    config: UploadConfig,
    counters: Arc<Counters>,
}

/// Events waiting to be sent, with their encoded size.
#[derive(Default)]
struct Pending {
    events: Vec<Value>,
    bytes: usize,
    since: Option<Instant>,
}

impl Worker {
    async fn run(self, mut rx: mpsc::Receiver<Command>) {
        let worker = Arc::new(self);
        let mut pending = Pending::default();
        let mut in_flight: JoinSet<()> = JoinSet::new();
        loop {
            let deadline = pending.since.map(|s| s + worker.config.max_age);
            let command = tokio::select! {
                c = rx.recv() => c,
                _ = sleep_until_opt(deadline) => {
                    worker.send_batch(&mut pending, &mut in_flight).await;
                    continue;
                }
            };
            match command {
                Some(Command::Event(event)) => {
                    let size = event.to_string().len();
                    if !pending.events.is_empty()
                        && pending.bytes + size > worker.config.max_batch_bytes
                    {
                        worker.send_batch(&mut pending, &mut in_flight).await;
                    }
                    pending.events.push(event);
                    pending.bytes += size;
                    pending.since.get_or_insert_with(Instant::now);
                    if pending.events.len() >= worker.config.max_batch_events
                        || pending.bytes >= worker.config.max_batch_bytes
                    {
                        worker.send_batch(&mut pending, &mut in_flight).await;
                    }
                }
                Some(Command::Flush(ack)) => {
                    worker.send_batch(&mut pending, &mut in_flight).await;
                    while in_flight.join_next().await.is_some() {}
                    let _ = ack.send(());
                }
                Some(Command::Shutdown(ack)) => {
                    // Events already queued behind the shutdown still go out.
                    rx.close();
                    while let Ok(cmd) = rx.try_recv() {
                        if let Command::Event(e) = cmd {
                            let size = e.to_string().len();
                            if !pending.events.is_empty()
                                && (pending.events.len() >= worker.config.max_batch_events
                                    || pending.bytes + size > worker.config.max_batch_bytes)
                            {
                                worker.send_batch(&mut pending, &mut in_flight).await;
                            }
                            pending.events.push(e);
                            pending.bytes += size;
                        }
                    }
                    worker.send_batch(&mut pending, &mut in_flight).await;
                    while in_flight.join_next().await.is_some() {}
                    let _ = ack.send(());
                    return;
                }
                None => {
                    worker.send_batch(&mut pending, &mut in_flight).await;
                    while in_flight.join_next().await.is_some() {}
                    return;
                }
            }
        }
    }

    /// Starts posting what is pending (waiting first if too many posts are in flight).
    async fn send_batch(self: &Arc<Self>, pending: &mut Pending, in_flight: &mut JoinSet<()>) {
        let batch = std::mem::take(pending);
        if batch.events.is_empty() {
            return;
        }
        while in_flight.len() >= self.config.max_concurrent_uploads.max(1) {
            in_flight.join_next().await;
        }
        let me = self.clone();
        in_flight.spawn(async move { me.post(batch.events).await });
    }

    async fn post(&self, events: Vec<Value>) {
        let n = events.len() as u64;
        let body = json!({ "events": events });
        let mut attempt = 0u32;
        loop {
            let result = self
                .http
                .post(&self.url)
                .timeout(self.config.request_timeout)
                .json(&body)
                .send()
                .await;
            let (retryable, error) = match result {
                Ok(resp) if resp.status().is_success() => {
                    self.counters.uploaded.fetch_add(n, Ordering::Relaxed);
                    self.counters.batches.fetch_add(1, Ordering::Relaxed);
                    debug!(events = n, "rollout upload: batch sent");
                    return;
                }
                Ok(resp) => {
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    let text: String = text.chars().take(300).collect();
                    (
                        status.as_u16() == 429 || status.is_server_error(),
                        format!("HTTP {}: {text}", status.as_u16()),
                    )
                }
                Err(e) => (true, e.to_string()),
            };
            if retryable && attempt < self.config.max_retries {
                let delay = self
                    .config
                    .backoff_base
                    .saturating_mul(1u32 << attempt.min(16))
                    .min(self.config.backoff_cap);
                attempt += 1;
                debug!(%error, ?delay, attempt, "rollout upload: retrying");
                tokio::time::sleep(delay).await;
                continue;
            }
            self.counters.failed.fetch_add(n, Ordering::Relaxed);
            warn!(url = %self.url, events = n, %error, "rollout upload: batch dropped");
            return;
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_only_with_run_name_and_key_and_not_switched_off() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(UploadConfig::from_vars(Some("run"), vars(&[])).is_none());
        assert!(UploadConfig::from_vars(None, vars(&[("OPENREWARD_API_KEY", "k")])).is_none());
        let c =
            UploadConfig::from_vars(Some("run"), vars(&[("OPENREWARD_API_KEY", "k")])).expect("on");
        assert_eq!(
            (c.api_url.as_str(), c.api_key.as_str(), c.run_name.as_str()),
            (DEFAULT_API_URL, "k", "run")
        );
        let c = UploadConfig::from_vars(
            Some("run"),
            vars(&[
                ("OPENREWARD_API_KEY", "k"),
                ("OPENREWARD_API_URL", "http://x:1"),
            ]),
        )
        .expect("on");
        assert_eq!(c.api_url, "http://x:1");
        assert!(UploadConfig::from_vars(
            Some("run"),
            vars(&[("OPENREWARD_API_KEY", "k"), (UPLOAD_SWITCH_ENV, "off")])
        )
        .is_none());
    }

    #[tokio::test]
    async fn bad_url_is_a_config_error_naming_it() {
        let err = Uploader::start(UploadConfig::new("ftp://x", "k", "r")).unwrap_err();
        assert!(err.to_string().contains("api_url"), "{err}");
    }

    #[tokio::test]
    async fn full_queue_drops_and_counts_without_blocking() {
        // Nothing listens on port 9: posts fail; a queue of 1 overflows at once.
        let mut c = UploadConfig::new("http://127.0.0.1:9", "k", "r");
        c.queue_capacity = 1;
        c.max_retries = 0;
        let up = Uploader::start(c).unwrap();
        let mut rec = up.start_rollout(RolloutInfo::default());
        for _ in 0..50 {
            rec.log(Message::new(MessageType::UserMessage, "x"));
        }
        let stats = up.shutdown(Duration::from_secs(10)).await;
        assert!(stats.dropped > 0, "{stats:?}");
        assert_eq!(stats.uploaded, 0);
        assert_eq!(stats.dropped + stats.failed, 51, "{stats:?}");
    }
}

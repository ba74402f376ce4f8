//! [`OrsSession`]: one episode's session — prompt, tools, tool calls, keep-alive, close.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use reqwest::Method;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::client::{check_status, send_within, OrsClient, Req};
use super::error::OrsError;
use super::retry::backend_starting;
use super::sse::{read_events, SseEnd};
use super::types::{Block, ToolResult, ToolsListing};

/// Opening sessions lives here, beside the session it returns, so the client module
/// knows nothing of sessions.
impl OrsClient {
    /// Opens a session for `task_spec` of environment `env_name` (the `env_name` that
    /// task listings return). Starts keep-alive pings; close it with [`OrsSession::close`].
    pub async fn open_session(
        &self,
        env_name: &str,
        task_spec: &Value,
    ) -> Result<OrsSession, OrsError> {
        self.open(json!({ "task_spec": task_spec, "env_name": env_name }))
            .await
    }

    /// Opens a session for task `index` of `split`, letting the server look the task up.
    pub async fn open_session_at(&self, split: &str, index: u64) -> Result<OrsSession, OrsError> {
        let mut body = json!({ "split": split, "index": index });
        if let Some(v) = &self.inner.variant {
            body["env_name"] = json!(v);
        }
        self.open(body).await
    }

    async fn open(&self, create: Value) -> Result<OrsSession, OrsError> {
        let sid = self.new_sid().await?;
        let req = Req {
            sid: Some(&sid),
            body: Some(&create),
            secrets: true,
        };
        let url = self.root_url("/create");
        match self.json::<Value>(Method::POST, &url, req).await {
            Ok(_) => {}
            // A retry of a /create that had in fact succeeded.
            Err(OrsError::Http {
                status: 400, body, ..
            }) if body.contains("Session already exists") => {}
            Err(e) => {
                let _ = self
                    .send(
                        Method::POST,
                        &self.root_url("/delete_session"),
                        Req {
                            sid: Some(&sid),
                            ..Req::default()
                        },
                    )
                    .await;
                return Err(e);
            }
        }
        Ok(OrsSession::start(self.clone(), sid))
    }
}

/// Consecutive failed pings after which the session counts as gone (~50 s at 10 s).
const MAX_PING_FAILURES: u32 = 5;

/// Set once the session is known to be dead; later calls fail fast with its reason.
#[derive(Default)]
struct Death(Mutex<Option<String>>);

impl Death {
    fn mark(&self, reason: String) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        d.get_or_insert(reason);
    }
    fn reason(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// A live session on an ORS server. Pings run in the background until [`close`] (or drop).
///
/// [`close`]: OrsSession::close
pub struct OrsSession {
    client: OrsClient,
    sid: String,
    death: Arc<Death>,
    ping: Option<JoinHandle<()>>,
    closed: bool,
}

impl std::fmt::Debug for OrsSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrsSession")
            .field("sid", &self.sid)
            .finish_non_exhaustive()
    }
}

impl OrsSession {
    pub(crate) fn start(client: OrsClient, sid: String) -> Self {
        let death = Arc::new(Death::default());
        let ping = tokio::spawn(ping_loop(client.clone(), sid.clone(), death.clone()));
        Self {
            client,
            sid,
            death,
            ping: Some(ping),
            closed: false,
        }
    }

    /// The session id (`X-Session-ID`).
    pub fn sid(&self) -> &str {
        &self.sid
    }

    fn alive(&self) -> Result<(), OrsError> {
        match self.death.reason() {
            Some(message) => Err(OrsError::SessionGone {
                sid: self.sid.clone(),
                message,
            }),
            None => Ok(()),
        }
    }

    /// Records a session-ending error so later calls fail fast.
    fn note(&self, err: OrsError) -> OrsError {
        match &err {
            OrsError::SessionGone { message, .. } => self.death.mark(message.clone()),
            OrsError::Sse { message, .. } if message != "unknown task_id" => {
                self.death.mark(format!("a tool failed: {message}"))
            }
            _ => {}
        }
        err
    }

    fn req(&self) -> Req<'_> {
        Req {
            sid: Some(&self.sid),
            ..Req::default()
        }
    }

    /// The session's tools (`/task_tools`; servers without it answer 404 → `/tools`).
    pub async fn tools(&self) -> Result<ToolsListing, OrsError> {
        self.alive()?;
        let url = self.client.env_url("/task_tools");
        match self.client.json(Method::GET, &url, self.req()).await {
            Err(OrsError::Http { status: 404, .. }) => {
                let url = self.client.env_url("/tools");
                self.client
                    .json(Method::GET, &url, self.req())
                    .await
                    .map_err(|e| self.note(e))
            }
            other => other.map_err(|e| self.note(e)),
        }
    }

    /// The task prompt.
    pub async fn prompt(&self) -> Result<Vec<Block>, OrsError> {
        self.alive()?;
        let url = self.client.env_url("/prompt");
        self.client
            .json(Method::GET, &url, self.req())
            .await
            .map_err(|e| self.note(e))
    }

    /// Calls tool `name` with `input` (a JSON object). A dropped stream is resumed with the
    /// call's `task_id`; before one arrives only a still-starting backend is retried,
    /// because re-sending could run the tool twice.
    pub async fn call(&self, name: &str, input: Value) -> Result<ToolResult, OrsError> {
        self.alive()?;
        let url = self.client.env_url("/call");
        let inner = &self.client.inner;
        let mut body = json!({ "name": name, "input": input });
        let mut task_id: Option<String> = None;
        let started = Instant::now();
        let mut failures = 0;
        loop {
            if let Some(id) = &task_id {
                body["task_id"] = json!(id);
            }
            let req = Req {
                sid: Some(&self.sid),
                body: Some(&body),
                secrets: false,
            };
            let attempt = async {
                let resp = self
                    .client
                    .request(Method::POST, &url, req)
                    .header("Accept", "text/event-stream");
                let resp = send_within(resp, &url, inner.request_timeout).await?;
                let resp = check_status(resp, &url, Some(&self.sid)).await?;
                read_events(resp, &url, inner.sse_idle_timeout, &mut task_id).await
            }
            .await;
            let err = match attempt {
                Ok(SseEnd::Done(text)) => {
                    return ToolResult::from_json(&text).map_err(|message| OrsError::Decode {
                        url: url.clone(),
                        message,
                    })
                }
                Ok(SseEnd::Closed) => OrsError::Stream {
                    url: url.clone(),
                    message: "stream closed before the `end` event".to_string(),
                },
                Err(e) => e,
            };
            if task_id.is_none() && !backend_starting(&err) {
                return Err(self.note(err));
            }
            failures += 1;
            match inner.retry.next_delay(&err, failures, started.elapsed()) {
                Some(delay) => {
                    tracing::debug!(%url, error = %err, ?task_id, "resuming tool call");
                    tokio::time::sleep(delay).await;
                }
                None => return Err(self.note(err)),
            }
        }
    }

    /// Ends the session: stops pings, then `/delete` and `/delete_session`. Both are tried;
    /// the first failure is returned.
    pub async fn close(mut self) -> Result<(), OrsError> {
        self.closed = true;
        if let Some(ping) = self.ping.take() {
            ping.abort();
        }
        let delete = self
            .client
            .send(Method::POST, &self.client.root_url("/delete"), self.req())
            .await;
        let delete_session = self
            .client
            .send(
                Method::POST,
                &self.client.root_url("/delete_session"),
                self.req(),
            )
            .await;
        delete.and(delete_session).map(|_| ())
    }
}

impl Drop for OrsSession {
    fn drop(&mut self) {
        if let Some(ping) = self.ping.take() {
            ping.abort();
        }
        if self.closed {
            return;
        }
        // Not closed (e.g. the episode was cancelled): release the server side in the
        // background rather than leaving it to the idle reaper.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (client, sid) = (self.client.clone(), self.sid.clone());
            rt.spawn(async move {
                let req = Req {
                    sid: Some(&sid),
                    ..Req::default()
                };
                let _ = client
                    .send(Method::POST, &client.root_url("/delete"), req)
                    .await;
                let _ = client
                    .send(Method::POST, &client.root_url("/delete_session"), req)
                    .await;
            });
        }
    }
}

/// Pings every `ping_interval`; marks the session dead when the server says it is gone or
/// after [`MAX_PING_FAILURES`] failures in a row.
async fn ping_loop(client: OrsClient, sid: String, death: Arc<Death>) {
    let url = client.root_url("/ping");
    let mut failures = 0;
    loop {
        tokio::time::sleep(client.inner.ping_interval).await;
        let req = Req {
            sid: Some(&sid),
            ..Req::default()
        };
        match client.send(Method::POST, &url, req).await {
            Ok(_) => failures = 0,
            Err(OrsError::SessionGone { message, .. }) => {
                death.mark(message);
                return;
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(%sid, error = %e, failures, "ORS ping failed");
                if failures >= MAX_PING_FAILURES {
                    death.mark(format!("{failures} pings failed in a row, last: {e}"));
                    return;
                }
            }
        }
    }
}

//! [`OrsClient`]: environment-level ORS calls (splits, tasks, tools) and opening sessions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::error::OrsError;
use super::retry::RetryPolicy;
use super::secrets::secrets_header;
use super::sse::read_events;
use super::types::{SplitInfo, TaskList, ToolsListing};

/// How to reach an ORS server.
#[derive(Debug, Clone)]
pub struct OrsClientOptions {
    /// Server URL, e.g. `https://sessions.openreward.ai` or the built-in server's URL.
    pub base_url: String,
    /// Sent as `X-API-Key`.
    pub api_key: Option<String>,
    /// `Owner/Name`, sent as `X-Deployment` so the hosted proxy can route.
    pub deployment: Option<String>,
    /// Environment variant: paths become `/{variant}/…`; without it bare paths are used
    /// and the server redirects them to its default environment.
    pub variant: Option<String>,
    /// Secrets for the environment, sent only in `X-Secrets` when a session is opened.
    pub secrets: BTreeMap<String, String>,
    /// Limit for one ordinary request (not for SSE streams, which use `sse_idle_timeout`).
    pub request_timeout: Duration,
    /// Longest silence on an SSE stream before it counts as dropped.
    pub sse_idle_timeout: Duration,
    /// Keep-alive ping interval of sessions.
    pub ping_interval: Duration,
    /// Retry settings for transient failures.
    pub retry: RetryPolicy,
}

impl Default for OrsClientOptions {
    fn default() -> Self {
        Self {
            base_url: String::new(),
            api_key: None,
            deployment: None,
            variant: None,
            secrets: BTreeMap::new(),
            request_timeout: Duration::from_secs(60),
            sse_idle_timeout: Duration::from_secs(30),
            ping_interval: Duration::from_secs(10),
            retry: RetryPolicy::default(),
        }
    }
}

impl OrsClientOptions {
    /// Defaults for everything but the server URL.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            ..Self::default()
        }
    }
}

pub(crate) struct Inner {
    pub http: reqwest::Client,
    pub base_url: String,
    pub variant: Option<String>,
    pub secrets_header: Option<HeaderValue>,
    pub request_timeout: Duration,
    pub sse_idle_timeout: Duration,
    pub ping_interval: Duration,
    pub retry: RetryPolicy,
}

/// An ORS server connection; cheap to clone (shares one HTTP connection pool).
#[derive(Clone)]
pub struct OrsClient {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for OrsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrsClient")
            .field("base_url", &self.inner.base_url)
            .field("variant", &self.inner.variant)
            .finish_non_exhaustive()
    }
}

fn header(option: &'static str, value: &str) -> Result<HeaderValue, OrsError> {
    HeaderValue::from_str(value).map_err(|e| OrsError::Config {
        option,
        message: format!("{value:?} is not a valid header value: {e}"),
    })
}

/// One request of a call: an optional session id and extra header.
#[derive(Default, Clone, Copy)]
pub(crate) struct Req<'a> {
    pub sid: Option<&'a str>,
    pub body: Option<&'a Value>,
    pub secrets: bool,
}

impl OrsClient {
    /// Checks the options and builds the HTTP client (no request is made).
    pub fn new(opts: OrsClientOptions) -> Result<Self, OrsError> {
        let base_url = opts.base_url.trim().trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base_url).map_err(|e| OrsError::Config {
            option: "base_url",
            message: format!("{:?}: {e}", opts.base_url),
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(OrsError::Config {
                option: "base_url",
                message: format!("{base_url:?} must be an http(s) URL"),
            });
        }
        if let Some(v) = &opts.variant {
            if v.is_empty() || v.contains('/') {
                return Err(OrsError::Config {
                    option: "variant",
                    message: format!("{v:?} must be a non-empty path segment"),
                });
            }
        }
        let mut headers = HeaderMap::new();
        if let Some(key) = &opts.api_key {
            let mut v = header("api_key", key)?;
            v.set_sensitive(true);
            headers.insert(HeaderName::from_static("x-api-key"), v);
        }
        if let Some(d) = &opts.deployment {
            headers.insert(
                HeaderName::from_static("x-deployment"),
                header("deployment", d)?,
            );
        }
        let mut secrets = opts.secrets.clone();
        if let Some(key) = &opts.api_key {
            // Like the SDK: environments may call OpenReward services with the caller's key.
            secrets
                .entry("OPENREWARD_API_KEY".to_string())
                .or_insert_with(|| key.clone());
        }
        let secrets_header = match secrets_header(&secrets) {
            Some(h) => {
                let mut v = header("secrets", &h)?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let http = reqwest::Client::builder()
            .user_agent(concat!("manta-ors/", env!("CARGO_PKG_VERSION")))
            .default_headers(headers)
            .build()
            .map_err(|e| OrsError::Config {
                option: "http client",
                message: e.to_string(),
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                base_url,
                variant: opts.variant,
                secrets_header,
                request_timeout: opts.request_timeout,
                sse_idle_timeout: opts.sse_idle_timeout,
                ping_interval: opts.ping_interval,
                retry: opts.retry,
            }),
        })
    }

    /// `{base}/{variant}{suffix}`, or `{base}{suffix}` without a variant.
    pub(crate) fn env_url(&self, suffix: &str) -> String {
        match &self.inner.variant {
            Some(v) => format!("{}/{v}{suffix}", self.inner.base_url),
            None => format!("{}{suffix}", self.inner.base_url),
        }
    }

    pub(crate) fn root_url(&self, path: &str) -> String {
        format!("{}{path}", self.inner.base_url)
    }

    /// Dataset splits of the environment.
    pub async fn splits(&self) -> Result<Vec<SplitInfo>, OrsError> {
        self.json(Method::GET, &self.env_url("/splits"), Req::default())
            .await
    }

    /// All task specs of `split`. Servers that cannot list (400 "not supported") are read
    /// task by task through `num_tasks` + `task`.
    pub async fn list_tasks(&self, split: &str) -> Result<TaskList, OrsError> {
        let body = json!({ "split": split });
        let req = Req {
            body: Some(&body),
            ..Req::default()
        };
        match self.json(Method::POST, &self.env_url("/tasks"), req).await {
            Err(OrsError::Http {
                status: 400, body, ..
            }) if body.contains("not supported") => {
                let n = self.num_tasks(split).await?;
                let fetched: Vec<(Value, String)> = futures::stream::iter(0..n)
                    .map(|i| self.task(split, i))
                    .buffered(16)
                    .try_collect()
                    .await?;
                let env_name = fetched
                    .first()
                    .map(|(_, e)| e.clone())
                    .or_else(|| self.inner.variant.clone())
                    .unwrap_or_default();
                Ok(TaskList {
                    tasks: fetched.into_iter().map(|(t, _)| t).collect(),
                    env_name,
                })
            }
            other => other,
        }
    }

    /// Number of tasks in `split`.
    pub async fn num_tasks(&self, split: &str) -> Result<u64, OrsError> {
        #[derive(serde::Deserialize)]
        struct Answer {
            num_tasks: u64,
        }
        let body = json!({ "split": split });
        let req = Req {
            body: Some(&body),
            ..Req::default()
        };
        let a: Answer = self
            .json(Method::POST, &self.env_url("/num_tasks"), req)
            .await?;
        Ok(a.num_tasks)
    }

    /// Task `index` of `split` and the environment name to open its session with.
    pub async fn task(&self, split: &str, index: u64) -> Result<(Value, String), OrsError> {
        #[derive(serde::Deserialize)]
        struct Answer {
            task: Value,
            env_name: String,
        }
        let body = json!({ "split": split, "index": index });
        let req = Req {
            body: Some(&body),
            ..Req::default()
        };
        let a: Answer = self.json(Method::POST, &self.env_url("/task"), req).await?;
        Ok((a.task, a.env_name))
    }

    /// Tools of the environment (not session specific).
    pub async fn tools(&self) -> Result<ToolsListing, OrsError> {
        self.json(Method::GET, &self.env_url("/tools"), Req::default())
            .await
    }

    /// `POST /create_session`: an SSE answer whose `task_id` event is the new sid.
    pub(super) async fn new_sid(&self) -> Result<String, OrsError> {
        let url = self.root_url("/create_session");
        let started = Instant::now();
        let mut failures = 0;
        loop {
            let mut sid = None;
            let result = async {
                let resp = self
                    .request(
                        Method::POST,
                        &url,
                        Req {
                            secrets: true,
                            body: Some(&json!({})),
                            ..Req::default()
                        },
                    )
                    .header("Accept", "text/event-stream");
                let resp = send_within(resp, &url, self.inner.request_timeout).await?;
                let resp = check_status(resp, &url, None).await?;
                read_events(resp, &url, self.inner.sse_idle_timeout, &mut sid).await
            }
            .await;
            let err = match (result, sid) {
                (Ok(_), Some(sid)) if !sid.is_empty() => return Ok(sid),
                (Ok(_), _) => OrsError::Decode {
                    url: url.clone(),
                    message: "no task_id event with the session id".to_string(),
                },
                (Err(e), _) => e,
            };
            failures += 1;
            match self
                .inner
                .retry
                .next_delay(&err, failures, started.elapsed())
            {
                Some(d) => tokio::time::sleep(d).await,
                None => return Err(err),
            }
        }
    }

    /// A request with the session and secrets headers it needs.
    pub(crate) fn request(
        &self,
        method: Method,
        url: &str,
        req: Req<'_>,
    ) -> reqwest::RequestBuilder {
        let mut b = self.inner.http.request(method, url);
        if let Some(sid) = req.sid {
            b = b.header("X-Session-ID", sid);
        }
        if req.secrets {
            if let Some(s) = &self.inner.secrets_header {
                b = b.header("X-Secrets", s.clone());
            }
        }
        if let Some(body) = req.body {
            b = b.json(body);
        }
        b
    }

    /// Sends with retries and returns the successful response.
    pub(crate) async fn send(
        &self,
        method: Method,
        url: &str,
        req: Req<'_>,
    ) -> Result<reqwest::Response, OrsError> {
        let started = Instant::now();
        let mut failures = 0;
        loop {
            let attempt = send_within(
                self.request(method.clone(), url, req)
                    .timeout(self.inner.request_timeout),
                url,
                self.inner.request_timeout,
            )
            .await;
            let err = match attempt {
                Ok(resp) => match check_status(resp, url, req.sid).await {
                    Ok(resp) => return Ok(resp),
                    Err(e) => e,
                },
                Err(e) => e,
            };
            failures += 1;
            match self
                .inner
                .retry
                .next_delay(&err, failures, started.elapsed())
            {
                Some(d) => {
                    if matches!(err, OrsError::Timeout { .. }) {
                        tracing::warn!(%url, error = %err, attempt = failures, "ORS request timed out; retrying");
                    } else {
                        tracing::debug!(%url, error = %err, delay = ?d, "retrying ORS request");
                    }
                    tokio::time::sleep(d).await
                }
                None => return Err(err),
            }
        }
    }

    /// Sends with retries and decodes the JSON answer.
    pub(crate) async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        url: &str,
        req: Req<'_>,
    ) -> Result<T, OrsError> {
        let resp = self.send(method, url, req).await?;
        let text = resp.text().await.map_err(|source| OrsError::Transport {
            url: url.to_string(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| OrsError::Decode {
            url: url.to_string(),
            message: format!("{e} in {}", truncate(&text, 300)),
        })
    }
}

/// Sends `req`, waiting at most `deadline` for the answer's headers: a server that
/// accepts the connection and never answers is an [`OrsError::Timeout`] naming the URL.
pub(crate) async fn send_within(
    req: reqwest::RequestBuilder,
    url: &str,
    deadline: Duration,
) -> Result<reqwest::Response, OrsError> {
    let timeout = || OrsError::Timeout {
        url: url.to_string(),
        after: deadline,
    };
    match tokio::time::timeout(deadline, req.send()).await {
        Err(_) => Err(timeout()),
        Ok(Err(source)) if source.is_timeout() => Err(timeout()),
        Ok(Err(source)) => Err(OrsError::Transport {
            url: url.to_string(),
            source,
        }),
        Ok(Ok(resp)) => Ok(resp),
    }
}

/// Turns an error status into [`OrsError`]: 410 (and the SDK's 404 "Active environment
/// not found") on a session request become [`OrsError::SessionGone`].
pub(crate) async fn check_status(
    resp: reqwest::Response,
    url: &str,
    sid: Option<&str>,
) -> Result<reqwest::Response, OrsError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap_or_default();
    let detail = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("detail").cloned())
        .map(|d| match d {
            Value::String(s) => s,
            other => other.to_string(),
        })
        .unwrap_or_else(|| truncate(&text, 1000));
    if let Some(sid) = sid {
        if status == StatusCode::GONE
            || (status == StatusCode::NOT_FOUND && detail.contains("Active environment not found"))
        {
            return Err(OrsError::SessionGone {
                sid: sid.to_string(),
                message: format!("{url}: HTTP {}: {detail}", status.as_u16()),
            });
        }
    }
    let retry_after = headers
        .get("Retry-After")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let backend_starting = headers
        .get("X-Backend-State")
        .is_some_and(|v| v.as_bytes() == b"starting");
    Err(OrsError::Http {
        url: url.to_string(),
        status: status.as_u16(),
        body: detail,
        retry_after,
        backend_starting,
    })
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

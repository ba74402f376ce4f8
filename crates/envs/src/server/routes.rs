//! Route handlers. Paths, bodies and status codes follow the SDK server (`server.py`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use futures::stream::{self, Stream};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::calls::Calls;
use super::error::ApiError;
use super::sessions::Sessions;
use super::settings::Settings;
use crate::env::{Environment, Secrets};

/// First path segments served at the root; anything else that is not an environment
/// name is redirected (308) under the first environment, as the SDK server does.
pub(crate) const ROOT_PATHS: &[&str] = &[
    "health",
    "version",
    "ping",
    "list_environments",
    "create",
    "delete",
    "create_session",
    "delete_session",
];

pub(crate) struct AppState {
    envs: Vec<Arc<dyn Environment>>,
    pub sessions: Sessions,
    calls: Arc<Calls>,
    pub settings: Settings,
}

impl AppState {
    pub fn new(envs: Vec<Arc<dyn Environment>>, settings: Settings) -> Self {
        Self {
            envs,
            sessions: Sessions::default(),
            calls: Arc::new(Calls::default()),
            settings,
        }
    }

    fn env(&self, name: &str) -> Result<&Arc<dyn Environment>, ApiError> {
        let name = name.to_lowercase();
        self.envs
            .iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| ApiError::not_found(format!("unknown environment {name:?}")))
    }

    fn sse_keep_alive(&self) -> KeepAlive {
        KeepAlive::new()
            .interval(self.settings.keep_alive)
            .text("ping")
    }
}

type AppResult<T> = Result<T, ApiError>;
type Shared = State<Arc<AppState>>;

pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({ "status": "ok" })) }))
        .route(
            "/version",
            get(|| async {
                Json(json!({ "version": env!("CARGO_PKG_VERSION"), "build_sha": null }))
            }),
        )
        .route("/list_environments", get(list_environments))
        .route("/ping", post(ping))
        .route("/create_session", post(create_session))
        .route("/create", post(create))
        .route("/delete", post(delete))
        .route("/delete_session", post(delete_session))
        .route("/{env_name}/tools", get(tools))
        .route("/{env_name}/splits", get(splits))
        .route("/{env_name}/tasks", post(tasks))
        .route("/{env_name}/num_tasks", post(num_tasks))
        .route("/{env_name}/task", post(task))
        .route("/{env_name}/task_range", post(task_range))
        .route("/{env_name}/task_tools", get(task_tools))
        .route("/{env_name}/prompt", get(prompt))
        .route("/{env_name}/call", post(call))
        .fallback(fallback)
        .with_state(state)
}

/// Parses a JSON body, rejecting unknown fields like the SDK's pydantic models (422).
fn body<T: DeserializeOwned>(bytes: &Bytes) -> AppResult<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::unprocessable(format!("invalid request body: {e}")))
}

fn sid(headers: &HeaderMap) -> AppResult<String> {
    headers
        .get("X-Session-ID")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ApiError::bad_request("X-Session-ID header is required"))
}

/// `X-Secrets`: base64 of `{"KEY": {"value": "...", "allowed_domains": [...]}}`.
fn secrets(headers: &HeaderMap) -> AppResult<Secrets> {
    let Some(raw) = headers.get("X-Secrets") else {
        return Ok(BTreeMap::new());
    };
    let bad = |why: String| ApiError::bad_request(format!("invalid X-Secrets header: {why}"));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(raw.as_bytes())
        .map_err(|e| bad(e.to_string()))?;
    #[derive(Deserialize)]
    struct Entry {
        value: String,
    }
    let map: BTreeMap<String, Entry> =
        serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    Ok(map.into_iter().map(|(k, e)| (k, e.value)).collect())
}

async fn list_environments(State(st): Shared) -> Json<Vec<String>> {
    Json(st.envs.iter().map(|e| e.name().to_string()).collect())
}

async fn ping(State(st): Shared, headers: HeaderMap) -> AppResult<Json<Value>> {
    st.sessions.touch(&sid(&headers)?)?;
    Ok(Json(json!({ "status": "ok" })))
}

/// Issues a new sid as an SSE `task_id` event followed by `end`.
async fn create_session(State(st): Shared) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let sid = uuid::Uuid::new_v4().to_string();
    let events = vec![
        Ok(Event::default().event("task_id").data(sid)),
        Ok(Event::default().event("end").data("")),
    ];
    Sse::new(stream::iter(events)).keep_alive(st.sse_keep_alive())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    env_name: Option<String>,
    task_spec: Option<Value>,
    split: Option<String>,
    index: Option<i64>,
    toolset_name: Option<String>,
}

async fn create(State(st): Shared, headers: HeaderMap, bytes: Bytes) -> AppResult<Json<Value>> {
    let sid = sid(&headers)?;
    let req: CreateBody = body(&bytes)?;
    let env = match &req.env_name {
        Some(name) => st.env(name)?,
        None => &st.envs[0],
    };
    if let Some(toolset) = &req.toolset_name {
        return Err(ApiError::bad_request(format!(
            "unknown toolset {toolset:?}; valid options are []"
        )));
    }
    let task_spec = match (req.task_spec, req.split, req.index) {
        (Some(spec), None, None) if spec.is_object() => spec,
        (Some(spec), None, None) => {
            return Err(ApiError::unprocessable(format!(
                "task_spec must be a JSON object, got {spec}"
            )))
        }
        (None, Some(split), Some(index)) => {
            let index = u64::try_from(index)
                .map_err(|_| ApiError::bad_request(format!("Invalid index {index}")))?;
            env.task(&split, index)?
        }
        _ => {
            return Err(ApiError::unprocessable(
                "Provide either task_spec or both split and index, not both/neither",
            ))
        }
    };
    let episode = env.new_episode(&task_spec, &secrets(&headers)?)?;
    st.sessions.insert(&sid, episode)?;
    tracing::debug!(%sid, env = env.name(), "session created");
    Ok(Json(json!({ "sid": sid })))
}

async fn delete(State(st): Shared, headers: HeaderMap) -> AppResult<Json<Value>> {
    let sid = sid(&headers)?;
    st.sessions.delete(&sid);
    Ok(Json(json!({ "sid": sid })))
}

async fn delete_session(headers: HeaderMap) -> AppResult<Json<Value>> {
    Ok(Json(json!({ "sid": sid(&headers)? })))
}

async fn tools(State(st): Shared, Path(env): Path<String>) -> AppResult<Json<Value>> {
    Ok(Json(json!(st.env(&env)?.tools())))
}

async fn splits(State(st): Shared, Path(env): Path<String>) -> AppResult<Json<Value>> {
    Ok(Json(json!(st.env(&env)?.splits())))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SplitBody {
    split: String,
}

/// Checks the split exists (400 "Invalid split" otherwise, as the SDK server answers).
fn known_split(env: &dyn Environment, split: &str) -> AppResult<()> {
    if env.splits().iter().any(|s| s.name == split) {
        Ok(())
    } else {
        Err(ApiError::bad_request("Invalid split"))
    }
}

async fn tasks(
    State(st): Shared,
    Path(name): Path<String>,
    bytes: Bytes,
) -> AppResult<Json<Value>> {
    let env = st.env(&name)?;
    let req: SplitBody = body(&bytes)?;
    known_split(env.as_ref(), &req.split)?;
    let tasks = env.tasks(&req.split)?;
    Ok(Json(json!({ "tasks": tasks, "env_name": name })))
}

async fn num_tasks(
    State(st): Shared,
    Path(name): Path<String>,
    bytes: Bytes,
) -> AppResult<Json<Value>> {
    let env = st.env(&name)?;
    let req: SplitBody = body(&bytes)?;
    known_split(env.as_ref(), &req.split)?;
    Ok(Json(json!({ "num_tasks": env.num_tasks(&req.split)? })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskBody {
    split: String,
    index: i64,
}

async fn task(State(st): Shared, Path(name): Path<String>, bytes: Bytes) -> AppResult<Json<Value>> {
    let env = st.env(&name)?;
    let req: TaskBody = body(&bytes)?;
    known_split(env.as_ref(), &req.split)?;
    // Negative indices count from the end, like the SDK's Python list indexing.
    let len = env.num_tasks(&req.split)? as i64;
    let index = if req.index < 0 {
        req.index + len
    } else {
        req.index
    };
    if !(0..len).contains(&index) {
        return Err(ApiError::bad_request("Invalid index"));
    }
    let task = env.task(&req.split, index as u64)?;
    Ok(Json(json!({ "task": task, "env_name": name })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RangeBody {
    split: String,
    start: Option<i64>,
    stop: Option<i64>,
}

async fn task_range(
    State(st): Shared,
    Path(name): Path<String>,
    bytes: Bytes,
) -> AppResult<Json<Value>> {
    let env = st.env(&name)?;
    let req: RangeBody = body(&bytes)?;
    known_split(env.as_ref(), &req.split)?;
    let len = env.num_tasks(&req.split)? as i64;
    // Python slice bounds: None = the end, negatives count from the end, clamped.
    let resolve = |v: Option<i64>, default: i64| {
        let v = v.unwrap_or(default);
        (if v < 0 { v + len } else { v }).clamp(0, len)
    };
    let (start, stop) = (resolve(req.start, 0), resolve(req.stop, len));
    let tasks = (start..stop)
        .map(|i| env.task(&req.split, i as u64))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json(json!({ "tasks": tasks, "env_name": name })))
}

async fn task_tools(
    State(st): Shared,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> AppResult<Json<Value>> {
    let env = st.env(&name)?;
    let episode = st.sessions.touch(&sid(&headers)?)?;
    let own = episode.lock().await.tools();
    Ok(Json(json!(own.unwrap_or_else(|| env.tools()))))
}

async fn prompt(State(st): Shared, headers: HeaderMap) -> AppResult<Json<Value>> {
    let episode = st.sessions.touch(&sid(&headers)?)?;
    let blocks = episode.lock().await.prompt();
    Ok(Json(json!(blocks)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CallBody {
    name: String,
    input: Value,
    task_id: Option<String>,
}

/// Runs a tool (or resumes a running/finished call by `task_id`) and answers over SSE.
async fn call(State(st): Shared, headers: HeaderMap, bytes: Bytes) -> AppResult<Response> {
    let episode = st.sessions.touch(&sid(&headers)?)?;
    let req: CallBody = body(&bytes)?;
    if !req.input.is_object() {
        return Err(ApiError::unprocessable(format!(
            "tool input must be a JSON object, got {}",
            req.input
        )));
    }
    let task_id = match req.task_id {
        Some(id) => id,
        None => st
            .calls
            .start(episode, req.name, req.input, st.settings.call_linger),
    };
    let sse = st
        .calls
        .stream(task_id, st.settings.chunk_size, st.settings.keep_alive);
    Ok(sse.into_response())
}

/// Redirects paths outside the known roots to the first environment (308 keeps the
/// method and body); everything else is a 404.
async fn fallback(State(st): Shared, uri: Uri) -> Response {
    let path = uri.path();
    let first = path
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or("")
        .to_lowercase();
    let is_env = st.envs.iter().any(|e| e.name() == first);
    if ROOT_PATHS.contains(&first.as_str()) || is_env {
        return ApiError::new(StatusCode::NOT_FOUND, "Not Found").into_response();
    }
    let mut location = format!("/{}{}", st.envs[0].name(), path);
    if let Some(q) = uri.query() {
        location.push('?');
        location.push_str(q);
    }
    (
        StatusCode::PERMANENT_REDIRECT,
        [(header::LOCATION, location)],
    )
        .into_response()
}

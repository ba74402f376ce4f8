//! The HTTP routes of `driver serve`: SGLang's native API over a [`NativeEngine`].
//!
//! Status codes follow SGLang's `http_server.py`: refused requests are 400 with
//! `{"error": {"message"}}`, `/flush_cache` is 400 while requests run, a failed
//! `/update_weights_from_disk` is 400 with `{"success": false, "message"}`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use manta_engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, NativeEngine, PauseMode, SamplingParams,
};
use manta_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tracing::{info, warn};

use super::wire::{self, AbortBody, BadRequest, ParseContext, PauseBody, UpdateFromDiskBody};

/// How long `/health_generate` waits for its one token before answering 503 (SGLang: 20 s).
const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(20);

/// What every route shares.
pub struct AppState {
    engine: Arc<NativeEngine>,
    tokenizer: Option<Arc<Tokenizer>>,
    /// The directory the weights came from last (changes with `/update_weights_from_disk`).
    model_path: Mutex<PathBuf>,
    tokenizer_path: PathBuf,
    served_model_name: String,
    model_type: Value,
    architectures: Value,
    server_args: Value,
    /// Requests handed to the engine and not answered yet (`/get_load`).
    in_flight: AtomicUsize,
    next_rid: AtomicU64,
    /// Random per process, so rids from two servers behind one router do not collide.
    rid_prefix: String,
}

impl AppState {
    pub fn new(
        engine: Arc<NativeEngine>,
        tokenizer: Option<Arc<Tokenizer>>,
        model_path: PathBuf,
        tokenizer_path: PathBuf,
        served_model_name: String,
        model_config: &Value,
        server_args: Value,
    ) -> Self {
        Self {
            engine,
            tokenizer,
            model_path: Mutex::new(model_path),
            tokenizer_path,
            served_model_name,
            model_type: model_config
                .get("model_type")
                .cloned()
                .unwrap_or(Value::Null),
            architectures: model_config
                .get("architectures")
                .cloned()
                .unwrap_or(Value::Null),
            server_args,
            in_flight: AtomicUsize::new(0),
            next_rid: AtomicU64::new(0),
            rid_prefix: format!("{:016x}", rand::random::<u64>()),
        }
    }

    fn new_rid(&self) -> String {
        let n = self.next_rid.fetch_add(1, Ordering::Relaxed);
        format!("{}{n:016x}", self.rid_prefix)
    }

    fn weight_version(&self) -> String {
        self.engine.weight_version().to_string()
    }

    fn model_path(&self) -> PathBuf {
        self.model_path
            .lock()
            .map(|p| p.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }
}

/// The routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/generate", post(generate).put(generate))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/flush_cache", get(flush_cache).post(flush_cache))
        .route("/pause_generation", post(pause_generation))
        .route("/continue_generation", post(continue_generation))
        .route("/abort_request", post(abort_request))
        .route("/get_weight_version", get(get_weight_version))
        .route("/update_weights_from_disk", post(update_weights_from_disk))
        .route("/get_model_info", get(get_model_info))
        .route("/get_server_info", get(get_server_info))
        .route("/get_load", get(get_load))
        .route("/v1/loads", get(v1_loads))
        .fallback(not_found)
        .with_state(state)
}

/// A refused or failed call: `{"error": {"message", "code"}}` as SGLang's
/// `_create_error_response`.
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }
}

impl From<BadRequest> for ApiError {
    fn from(e: BadRequest) -> Self {
        Self::bad_request(e.0)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::BadRequest(m) => Self::bad_request(m),
            other => Self {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: other.to_string(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            warn!(status = %self.status, "{}", self.message);
        }
        let body = json!({"error": {"message": self.message, "code": self.status.as_u16()}});
        (self.status, Json(body)).into_response()
    }
}

/// Counts a request as in flight and, if its HTTP caller goes away before the answer,
/// aborts it in the engine (as SGLang does on disconnect) instead of finishing it for
/// nobody.
struct InFlight<'a> {
    state: &'a AppState,
    rid: String,
    answered: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.answered {
            let engine = self.state.engine.clone();
            let rid = std::mem::take(&mut self.rid);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = engine.abort(Some(rid)).await;
                });
            }
        }
    }
}

/// Runs one request. It counts as in flight only once the engine has it, so a caller that
/// sees it in `/get_load` can abort it.
async fn run_one(
    state: &AppState,
    request: GenerateRequest,
) -> Result<GenerateOutput, EngineError> {
    let rid = request.rid.clone().unwrap_or_default();
    let mut fut = std::pin::pin!(state.engine.generate(request));
    // The engine's generate hands the request to its thread before its first await.
    if let Poll::Ready(done) = futures::poll!(fut.as_mut()) {
        return done;
    }
    state.in_flight.fetch_add(1, Ordering::SeqCst);
    let mut guard = InFlight {
        state,
        rid,
        answered: false,
    };
    let out = fut.await;
    guard.answered = true;
    out
}

async fn generate(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match generate_inner(&state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let start = Instant::now();
    let info = state.engine.info();
    let ctx = ParseContext {
        tokenizer: state.tokenizer.as_deref(),
        vocab_size: info.vocab_size,
        context_length: info.context_length,
    };
    let parsed = wire::parse_generate(body, &ctx, || state.new_rid())?;
    let outputs = futures::future::join_all(
        parsed
            .items
            .iter()
            .map(|item| run_one(state, item.request.clone())),
    )
    .await;
    let e2e = start.elapsed().as_secs_f64();
    let mut answers = Vec::with_capacity(outputs.len());
    for (item, out) in parsed.items.iter().zip(outputs) {
        let out = out.map_err(|e| {
            if parsed.batch {
                // Say which prompt failed; the others' results are dropped with it.
                let rid = item.request.rid.clone().unwrap_or_default();
                let mut err = ApiError::from(e);
                err.message = format!("request {rid}: {}", err.message);
                err
            } else {
                ApiError::from(e)
            }
        })?;
        answers.push(wire::generate_response(
            item,
            out,
            state.tokenizer.as_deref(),
            e2e,
        ));
    }
    let json = if parsed.batch {
        serde_json::to_vec(&answers)
    } else {
        serde_json::to_vec(&answers[0])
    }
    .map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("cannot encode the answer: {e}"),
    })?;
    if parsed.stream {
        // The engine answers whole requests: the stream is SGLang's last chunk (the
        // full result), then the end marker.
        let mut sse = Vec::with_capacity(json.len() + 32);
        sse.extend_from_slice(b"data: ");
        sse.extend_from_slice(&json);
        sse.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        return Ok(([(header::CONTENT_TYPE, "text/event-stream")], sse).into_response());
    }
    Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response())
}

/// One greedy token from token 0, as SGLang's health check and warm-up.
async fn one_token(state: &AppState, rid: String) -> Result<GenerateOutput, EngineError> {
    run_one(
        state,
        GenerateRequest {
            input_ids: vec![0],
            params: SamplingParams {
                max_new_tokens: 1,
                temperature: 0.0,
                ..SamplingParams::default()
            },
            rid: Some(rid),
            return_routed_experts: false,
        },
    )
    .await
}

/// The warm-up generate before `ready`.
pub async fn warm_up(state: &AppState) -> Result<(), EngineError> {
    one_token(state, format!("WARMUP_{}", state.new_rid())).await?;
    Ok(())
}

/// Aborts every request (shutdown): callers get their partial output at once.
pub async fn abort_everything(state: &AppState) {
    if let Err(e) = state.engine.abort(None).await {
        warn!("abort on shutdown: {e}");
    }
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn health_generate(State(state): State<Arc<AppState>>) -> Response {
    let rid = format!("HEALTH_CHECK_{}", state.new_rid());
    match tokio::time::timeout(HEALTH_CHECK_TIMEOUT, one_token(&state, rid)).await {
        Ok(Ok(_)) => StatusCode::OK.into_response(),
        Ok(Err(e)) => {
            warn!("health check generate failed: {e}");
            (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
        }
        // The request is aborted when its future is dropped (InFlight).
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no token within {} s (the engine may be paused or overloaded)",
                HEALTH_CHECK_TIMEOUT.as_secs()
            ),
        )
            .into_response(),
    }
}

async fn flush_cache(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.flush_cache().await {
        Ok(true) => (StatusCode::OK, "Cache flushed.\n").into_response(),
        Ok(false) => (
            StatusCode::BAD_REQUEST,
            "Cache not flushed: requests are running or waiting; retry when idle.\n",
        )
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn pause_generation(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = async {
        let body: PauseBody = wire::parse_body(&body)?;
        // "retract" (running requests go back to the queue, resumed later) has no exact
        // counterpart: Drain lets running requests finish and holds new ones back, so the
        // call returns once the engine is idle.
        let mode = match body.mode.as_str() {
            "abort" => PauseMode::Abort,
            "in_place" => PauseMode::InPlace,
            "retract" => PauseMode::Drain,
            other => {
                return Err(ApiError::bad_request(format!(
                    "mode: {other:?} is not one of \"abort\", \"retract\", \"in_place\""
                )))
            }
        };
        state.engine.pause(mode).await?;
        info!(mode = %body.mode, "generation paused");
        Ok(Json(
            json!({"message": "Generation paused successfully.", "status": "ok"}),
        ))
    }
    .await;
    result.into_response()
}

async fn continue_generation(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.resume().await {
        Ok(()) => {
            info!("generation continued");
            Json(json!({"message": "Generation continued successfully.", "status": "ok"}))
                .into_response()
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn abort_request(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = async {
        let body: AbortBody = wire::parse_body(&body)?;
        let target = match (body.abort_all, body.rid.filter(|r| !r.is_empty())) {
            (true, _) => None,
            (false, Some(rid)) => Some(rid),
            (false, None) => {
                return Err(ApiError::bad_request(
                    "rid: missing (give a rid, or \"abort_all\": true)",
                ))
            }
        };
        state.engine.abort(target).await?;
        Ok(StatusCode::OK)
    }
    .await;
    result.into_response()
}

async fn get_weight_version(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"weight_version": state.weight_version()}))
}

async fn update_weights_from_disk(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let failed = |message: String| {
        warn!("update_weights_from_disk: {message}");
        (
            StatusCode::BAD_REQUEST,
            Json(json!({"success": false, "message": message, "num_paused_requests": 0})),
        )
            .into_response()
    };
    let body: UpdateFromDiskBody = match wire::parse_body(&body) {
        Ok(b) => b,
        Err(e) => return failed(e.0),
    };
    if let Some(f) = body.load_format.as_deref() {
        if !matches!(f, "auto" | "safetensors") {
            return failed(format!(
                "load_format: {f:?} is not supported (the native engine loads safetensors: \"auto\" or \"safetensors\")"
            ));
        }
    }
    let dir = PathBuf::from(&body.model_path);
    if !dir.is_dir() {
        return failed(format!("model_path: {} is not a directory", dir.display()));
    }
    // SGLang versions are free-form strings; the engine counts, so a version must be a
    // number. Without one the version goes up by one.
    let version = match body.weight_version.as_deref() {
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) => n,
            Err(_) => {
                return failed(format!(
                    "weight_version: {v:?} is not a non-negative integer (the native engine numbers its weight versions)"
                ))
            }
        },
        None => state.engine.weight_version().saturating_add(1),
    };
    if body.abort_all_requests {
        if let Err(e) = state.engine.abort(None).await {
            return failed(format!("cannot abort running requests: {e}"));
        }
    }
    match state
        .engine
        .update_weights_from_disk(dir.clone(), version)
        .await
    {
        Ok(()) => {
            if let Ok(mut p) = state.model_path.lock() {
                *p = dir.clone();
            }
            info!(dir = %dir.display(), version, "weights updated from disk");
            Json(json!({
                "success": true,
                "message": format!(
                    "Succeeded to update model weights from {}. Weight version updated to {version}.",
                    dir.display()
                ),
                "num_paused_requests": 0,
            }))
            .into_response()
        }
        Err(e) => failed(format!("cannot load weights from {}: {e}", dir.display())),
    }
}

async fn get_model_info(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "model_path": state.model_path().display().to_string(),
        "tokenizer_path": state.tokenizer_path.display().to_string(),
        "served_model_name": state.served_model_name,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": state.weight_version(),
        "model_type": state.model_type,
        "architectures": state.architectures,
    }))
}

async fn get_server_info(State(state): State<Arc<AppState>>) -> Json<Value> {
    let mut info = state.server_args.clone();
    let stats = state.engine.stats();
    if let Value::Object(map) = &mut info {
        map.insert(
            "model_path".into(),
            json!(state.model_path().display().to_string()),
        );
        map.insert("weight_version".into(), json!(state.weight_version()));
        map.insert(
            "internal_states".into(),
            json!([{
                "num_reqs": state.in_flight.load(Ordering::SeqCst),
                "steps": stats.steps.load(Ordering::Relaxed),
                "tokens_computed": stats.tokens_computed.load(Ordering::Relaxed),
                "tokens_sampled": stats.tokens_sampled.load(Ordering::Relaxed),
                // Decode steps launched before the previous step's tokens were read.
                "steps_ahead": stats.steps_ahead.load(Ordering::Relaxed),
            }]),
        );
    }
    Json(info)
}

/// SGLang's `/get_load`: one entry per data-parallel rank.
async fn get_load(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!([{"dp_rank": 0, "num_reqs": state.in_flight.load(Ordering::SeqCst)}]))
}

/// SGLang's `/v1/loads` (what slime polls after `abort_request` until idle).
async fn v1_loads(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"loads": [{"dp_rank": 0, "num_reqs": state.in_flight.load(Ordering::SeqCst)}]}))
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route {} on this server (driver serve)", uri.path()),
    }
}

//! The driver's status endpoint: `GET /status` (JSON, what `driver status` prints) and
//! `GET /metrics` (Prometheus' text format), served on `--status-addr` for the whole
//! run. The bound address is written to `<run dir>/status_addr`, so `driver status
//! --run-dir DIR` finds a driver that listens on an ephemeral port.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::status::{self, NodeStatus};

/// How long each worker gets to answer while `/status` is asked.
const NODE_LIMIT: Duration = Duration::from_secs(2);

/// The file beside the run's records that holds the endpoint's address.
pub const ADDR_FILE: &str = "status_addr";

/// The address the endpoint listens on, once started.
static BOUND: Mutex<Option<SocketAddr>> = Mutex::new(None);

/// Starts serving on `addr` (port 0: any free port); returns the bound address.
pub async fn start(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--status-addr {addr}: cannot listen"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/status", get(status_json))
        .route("/metrics", get(metrics));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the status endpoint stopped");
        }
    });
    *BOUND.lock().unwrap_or_else(|e| e.into_inner()) = Some(bound);
    tracing::info!(%bound, "status endpoint (GET /status, GET /metrics)");
    Ok(bound)
}

/// Writes the bound address into `run_dir/status_addr` (nothing when not started).
pub fn write_addr_file(run_dir: &Path) -> anyhow::Result<()> {
    let Some(bound) = *BOUND.lock().unwrap_or_else(|e| e.into_inner()) else {
        return Ok(());
    };
    let path = run_dir.join(ADDR_FILE);
    std::fs::write(&path, format!("{bound}\n"))
        .with_context(|| format!("writing {}", path.display()))
}

/// The run's snapshot with the workers asked just now.
async fn current() -> Option<status::Snapshot> {
    status::snapshot(remote_nodes().await)
}

/// Each worker the run placed actors on: its resources and hosted actors, or why it did
/// not answer.
async fn remote_nodes() -> Vec<NodeStatus> {
    let clients = crate::shutdown::placed_clients();
    let asks = clients.into_iter().map(|client| async move {
        let address = client.addr().to_string();
        let described = client.describe(NODE_LIMIT).await;
        let beat = client.heartbeat(0, NODE_LIMIT).await;
        match (described, beat) {
            (Ok(res), Ok(beat)) => NodeStatus {
                address,
                hostname: res.hostname,
                gpus: res.gpus,
                actors: beat.actors,
                healthy: true,
                error: None,
            },
            (d, b) => NodeStatus {
                address,
                hostname: d.as_ref().map(|r| r.hostname.clone()).unwrap_or_default(),
                gpus: d.as_ref().map(|r| r.gpus.clone()).unwrap_or_default(),
                actors: Vec::new(),
                healthy: false,
                error: d.err().or(b.err()).map(|e| e.to_string()),
            },
        }
    });
    futures::future::join_all(asks).await
}

async fn status_json() -> axum::response::Response {
    match current().await {
        Some(s) => axum::Json(s).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the run has not started yet\n",
        )
            .into_response(),
    }
}

async fn metrics() -> axum::response::Response {
    let body = match current().await {
        Some(s) => status::prometheus(&s),
        None => "# HELP manta_phase 1 for the phase the step is in.\n# TYPE manta_phase gauge\n\
                 manta_phase{phase=\"starting\"} 1\n"
            .to_string(),
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

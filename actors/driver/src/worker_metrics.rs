//! A worker's Prometheus endpoint (`worker --metrics-addr`): what this node offers and
//! hosts, asked of its own control plane (the same heartbeat the driver sends), so the
//! numbers are the ones the driver sees. The driver's endpoint has the run's step and
//! its metrics (crate::status_server).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use manta_runtime::WorkerClient;

use crate::status::escape;

/// Starts serving `GET /metrics` on `addr`, reading the worker at `control` with `token`.
pub async fn start(
    addr: SocketAddr,
    control: SocketAddr,
    token: String,
    gpus: Vec<u32>,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?;
    let bound = listener.local_addr()?;
    let target = match control.ip().is_unspecified() {
        true => SocketAddr::from(([127, 0, 0, 1], control.port())),
        false => control,
    };
    let client =
        WorkerClient::new(&target.to_string(), &token).map_err(|e| anyhow::anyhow!("{e}"))?;
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let (client, gpus) = (client.clone(), gpus.clone());
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    render(&client, &gpus).await,
                )
                    .into_response()
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}

async fn render(client: &WorkerClient, gpus: &[u32]) -> String {
    let beat = client.heartbeat(0, Duration::from_secs(2)).await;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, lines: Vec<(String, f64)>| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (labels, v) in lines {
            out.push_str(&format!("{name}{labels} {v}\n"));
        }
    };
    gauge(
        "manta_worker_up",
        "1 if the worker's control plane answered just now.",
        vec![(String::new(), beat.is_ok() as u8 as f64)],
    );
    gauge(
        "manta_worker_gpus",
        "GPUs this worker offers.",
        vec![(String::new(), gpus.len() as f64)],
    );
    if let Ok(beat) = beat {
        gauge(
            "manta_worker_uptime_seconds",
            "Seconds since the worker started.",
            vec![(String::new(), beat.uptime_ms as f64 / 1000.0)],
        );
        gauge(
            "manta_worker_actors",
            "Actors this worker hosts.",
            vec![(String::new(), beat.actors.len() as f64)],
        );
        gauge(
            "manta_actor_up",
            "1 for each actor this worker hosts.",
            beat.actors
                .iter()
                .map(|a| (format!("{{actor=\"{}\"}}", escape(a)), 1.0))
                .collect(),
        );
    }
    out
}

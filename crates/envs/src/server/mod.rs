//! The ORS HTTP+SSE server: same routes, JSON and SSE events as `openreward.environments.Server`.

mod calls;
mod error;
mod routes;
mod sessions;
mod settings;

use axum::serve::ListenerExt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::env::Environment;
use settings::Settings;

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum EnvServerError {
    #[error("an environment server needs at least one environment")]
    NoEnvironments,
    #[error("environment name {0:?} must be non-empty lower case without '/'")]
    BadName(String),
    #[error("duplicate environment {0:?}")]
    DuplicateName(String),
    #[error("environment {0:?} is also a root path of the server")]
    ReservedName(String),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Builder for an environment server; [`serve`] is the short form with default settings.
pub struct EnvServer {
    envs: Vec<Arc<dyn Environment>>,
    settings: Settings,
}

impl EnvServer {
    /// A server for `envs`; the first one is the default that bare paths redirect to.
    pub fn new(envs: Vec<Arc<dyn Environment>>) -> Self {
        Self {
            envs,
            settings: Settings {
                session_ttl: Duration::from_secs(15 * 60),
                reap_interval: Duration::from_secs(5),
                keep_alive: Duration::from_secs(10),
                chunk_size: 2048,
                call_linger: Duration::from_secs(60),
            },
        }
    }

    /// Idle time after which a session is dropped (default 15 min), and how often to check.
    pub fn session_ttl(mut self, ttl: Duration, check_every: Duration) -> Self {
        self.settings.session_ttl = ttl;
        self.settings.reap_interval = check_every;
        self
    }

    /// Interval of `: ping` comments on SSE streams (default 10 s).
    pub fn keep_alive(mut self, every: Duration) -> Self {
        self.settings.keep_alive = every;
        self
    }

    /// Largest SSE data slice of a call result in bytes (default 2048).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.settings.chunk_size = bytes.max(1);
        self
    }

    /// How long a finished call's result stays available for resuming (default 60 s).
    pub fn call_linger(mut self, linger: Duration) -> Self {
        self.settings.call_linger = linger;
        self
    }

    /// Binds `addr` (port 0 picks a free port), starts serving in the background and
    /// returns a handle that knows the bound address.
    pub async fn serve(self, addr: SocketAddr) -> Result<ServerHandle, EnvServerError> {
        validate(&self.envs)?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| EnvServerError::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| EnvServerError::Bind { addr, source })?;
        let state = Arc::new(routes::AppState::new(self.envs, self.settings.clone()));
        let reaper = tokio::spawn(reap_forever(state.clone()));
        let state_for_handle = state.clone();
        let app = routes::router(state);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            // Small SSE frames and JSON replies must not wait for delayed ACKs (Nagle):
            // without TCP_NODELAY some calls took ~40 ms instead of < 1 ms.
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "could not set TCP_NODELAY");
                }
            });
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::error!(error = %e, "environment server stopped");
            }
        });
        tracing::info!(%local_addr, "environment server listening");
        Ok(ServerHandle {
            local_addr,
            state: state_for_handle,
            stop: Some(stop_tx),
            server: Some(server),
            reaper,
        })
    }
}

/// Serves `envs` on `addr` with default settings (see [`EnvServer`]).
pub async fn serve(
    addr: SocketAddr,
    envs: Vec<Arc<dyn Environment>>,
) -> Result<ServerHandle, EnvServerError> {
    EnvServer::new(envs).serve(addr).await
}

fn validate(envs: &[Arc<dyn Environment>]) -> Result<(), EnvServerError> {
    if envs.is_empty() {
        return Err(EnvServerError::NoEnvironments);
    }
    let mut seen = std::collections::HashSet::new();
    for env in envs {
        let name = env.name();
        if name.is_empty() || name.contains('/') || name.to_lowercase() != name {
            return Err(EnvServerError::BadName(name.to_string()));
        }
        if routes::ROOT_PATHS.contains(&name) {
            return Err(EnvServerError::ReservedName(name.to_string()));
        }
        if !seen.insert(name.to_string()) {
            return Err(EnvServerError::DuplicateName(name.to_string()));
        }
    }
    Ok(())
}

async fn reap_forever(state: Arc<routes::AppState>) {
    let mut tick = tokio::time::interval(state.settings.reap_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let n = state.sessions.reap(state.settings.session_ttl);
        if n > 0 {
            tracing::info!(sessions = n, "reaped idle sessions");
        }
    }
}

/// A running server; dropping it stops the server too.
pub struct ServerHandle {
    local_addr: SocketAddr,
    state: Arc<routes::AppState>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    reaper: JoinHandle<()>,
}

impl ServerHandle {
    /// `http://host:port` of the bound socket (no trailing slash).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Number of live sessions (created and not yet deleted or reaped).
    pub fn live_sessions(&self) -> usize {
        self.state.sessions.len()
    }

    /// Stops accepting connections, lets open requests finish, and waits for the server.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.reaper.abort();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.reaper.abort();
    }
}

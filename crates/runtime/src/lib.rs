//! The cluster runtime: what lets the driver use actors that live in `worker` daemons
//! on other processes or nodes as if they were local.
//!
//! - [`auth`]: the cluster token, checked on every gRPC call (both sides).
//! - [`spawn`]: building rollout and trainer actors from their JSON spawn configs.
//! - [`server`]: the worker daemon's `Worker` and `Rollout` gRPC services.
//! - [`client`]: a typed client for one worker.
//! - [`echo`]: the trivial actor behind the `Echo` RPC.
//! - [`node`]: the node supervisor every hosted actor is linked to.
//! - [`lease`]: a driver's hold on its actors; a worker stops them when it lapses.
//! - [`pool`]: remote rollout actors across nodes, heartbeats, failover and rejoin.
//! - [`remote_trainer`]: a trainer on a worker, its heartbeat and restart.
//! - [`transport`]: the lean HTTP/2 channel under the gRPC clients.
//! - [`weights`]: weights as bounded chunks on the wire (no shared disk).
//! - [`sync_service`]: the worker's `WeightSync` service (pull, push, apply, digests).
//! - [`tls`]: optional TLS (rustls) for the worker and its clients.

pub mod auth;
pub mod client;
pub mod convert;
pub mod echo;
pub mod lease;
pub mod node;
pub mod pool;
pub mod remote_trainer;
pub mod server;
pub mod spawn;
pub mod sync_service;
pub mod tls;
pub mod transport;
pub mod weights;

pub use auth::{load_token, AuthError, BearerToken, CheckToken};
pub use client::WorkerClient;
pub use lease::Lease;
pub use pool::{NodeSpec, PoolOptions, RemotePool};
pub use remote_trainer::{RemoteTrainer, TrainerCallError};
pub use server::{serve, serve_with_tls, WorkerDaemon};
pub use spawn::{
    OpenRewardAccess, RolloutSpawnConfig, ShippedTrainConfig, TrainerSpawnConfig, UploadTarget,
};
pub use tls::{ClientTls, ServerTls, TlsError};

/// What can go wrong talking to or running a worker.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("worker {addr}: {}", tls::status_chain(.status))]
    Rpc { addr: String, status: tonic::Status },
    #[error("worker {addr}: bad address: {message}")]
    Address { addr: String, message: String },
    #[error("worker {addr}: no answer within {ms} ms")]
    Timeout { addr: String, ms: u64 },
    #[error("worker {addr}: {message}")]
    Node { addr: String, message: String },
    #[error("placement cannot be satisfied: {0}")]
    Placement(String),
    #[error("spawning an actor: {0}")]
    Spawn(String),
    #[error(transparent)]
    Wire(#[from] manta_core::wire::WireError),
}

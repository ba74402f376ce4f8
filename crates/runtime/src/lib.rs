//! The cluster runtime: the generic machinery that lets the driver use actors living in
//! `worker` daemons on other processes or nodes. It knows no Manta actor: which actors
//! a worker hosts and the services that call them plug in through [`host::ActorHost`]
//! and [`server::serve_with_services`] (actors/hosting does that for rollouts and
//! trainers).
//!
//! - [`auth`]: the cluster token, checked on every gRPC call (both sides).
//! - [`host`]: what an actor kind plugs into a worker (spawn, typed handle, stop).
//! - [`server`]: the worker daemon: hosted-actor registry and the `Worker` service.
//! - [`client`]: a client for one worker and the channel other services share.
//! - [`echo`]: the trivial actor behind the `Echo` RPC.
//! - [`node`]: the node supervisor every hosted actor is linked to.
//! - [`lease`]: a driver's hold on its actors; a worker stops them when it lapses.
//! - [`tls`]: optional TLS (rustls) for the worker and its clients.

pub mod auth;
pub mod client;
pub mod echo;
pub mod host;
pub mod lease;
pub mod node;
pub mod server;
pub mod tls;

pub use auth::{load_token, AuthError, BearerToken, CheckToken};
pub use client::{AuthedChannel, WorkerClient};
pub use host::{ActorHost, HostedActor, SpawnRequest};
pub use lease::Lease;
pub use server::{serve, serve_with_services, serve_with_tls, spawn_control_plane, WorkerDaemon};
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

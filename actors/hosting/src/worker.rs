//! What a Manta worker daemon hosts: rollout and trainer actors, and the services that
//! call them (`Rollout`, `Trainer`, `WeightSync`) beside the runtime's `Worker`
//! service. The daemon itself (registry, leases, supervision, transport) is
//! manta_runtime's; this module only plugs Manta's actors into it.

use std::sync::Arc;

use manta_proto::cluster::ActorKind;
use manta_proto::rollout::rollout_server::RolloutServer;
use manta_proto::trainer::trainer_server::TrainerServer;
use manta_proto::weight_sync::weight_sync_server::WeightSyncServer;
use manta_runtime::{CheckToken, ServerTls, WorkerDaemon};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;

use crate::rollout::worker::{RolloutHost, RolloutService};
use crate::trainer::client::MAX_TRAINER_MESSAGE;
use crate::trainer::rank_group::RankGroups;
use crate::trainer::worker::{TrainerHost, TrainerService};
use crate::weights::worker::WeightSyncService;
use crate::weights::MAX_WEIGHT_MESSAGE;

/// Registers Manta's actor kinds on `daemon` and returns the builder of the services
/// that call them (for [`manta_runtime::serve_with_services`]).
pub fn install(daemon: &WorkerDaemon) -> impl FnOnce(&CheckToken) -> Routes + Send + 'static {
    daemon.host(ActorKind::Rollout, Arc::new(RolloutHost::default()));
    let groups = RankGroups::default();
    daemon.host(
        ActorKind::Trainer,
        Arc::new(TrainerHost::new(groups.clone())),
    );
    let daemon = daemon.clone();
    move |check: &CheckToken| {
        Routes::new(RolloutServer::with_interceptor(
            RolloutService::new(daemon.clone()),
            check.clone(),
        ))
        .add_service(InterceptedService::new(
            WeightSyncServer::new(WeightSyncService::new(daemon.clone()))
                .max_decoding_message_size(MAX_WEIGHT_MESSAGE)
                .max_encoding_message_size(MAX_WEIGHT_MESSAGE),
            check.clone(),
        ))
        .add_service(InterceptedService::new(
            TrainerServer::new(TrainerService::new(daemon, groups))
                .max_decoding_message_size(MAX_TRAINER_MESSAGE)
                .max_encoding_message_size(MAX_TRAINER_MESSAGE),
            check.clone(),
        ))
    }
}

/// Serves `daemon` as a Manta worker on `listener` until a `Shutdown` call or `stop`
/// resolves.
pub async fn serve(
    daemon: WorkerDaemon,
    listener: tokio::net::TcpListener,
    token: String,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_with_tls(daemon, listener, token, None, stop).await
}

/// [`serve`], over TLS when `tls` is given.
pub async fn serve_with_tls(
    daemon: WorkerDaemon,
    listener: tokio::net::TcpListener,
    token: String,
    tls: Option<ServerTls>,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let services = install(&daemon);
    manta_runtime::serve_with_services(daemon, listener, token, tls, services, stop).await
}

/// Serves `daemon` as a Manta worker from a control-plane thread of its own (see
/// [`manta_runtime::spawn_control_plane`]).
pub fn spawn_control_plane(
    daemon: WorkerDaemon,
    listener: std::net::TcpListener,
    token: String,
    tls: Option<ServerTls>,
) -> std::io::Result<std::thread::JoinHandle<Result<(), String>>> {
    let services = install(&daemon);
    manta_runtime::spawn_control_plane(daemon, listener, token, tls, services)
}

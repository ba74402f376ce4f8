//! The worker daemon: a registry of hosted actors behind the `Worker` gRPC service
//! (describe, spawn, stop, heartbeats, leases, echo), every call checked against the
//! cluster token. Which actors it can host comes from the [`ActorHost`]s registered on
//! it; services that call those actors are added by the caller ([`serve_with_services`]).
//!
//! The `worker` binary serves gRPC from a control-plane thread of its own
//! ([`spawn_control_plane`], a current-thread runtime) while actors run on the main
//! multi-thread runtime: a small call and the echo actor then stay on one thread,
//! with no cross-thread wake-up, and actor work never queues behind them.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::StreamExt;
use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_server::{Worker, WorkerServer};
use manta_proto::common as pb;
use ractor::{call, ActorRef};
use tokio::sync::{Mutex, Notify};
use tonic::service::Routes;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::auth::CheckToken;
use crate::host::{ActorHost, HostedActor, SpawnRequest};
use crate::lease::{Lease, LeaseBook};
use crate::node::NodeMsg;
use crate::tls::ServerTls;

struct State {
    actors: BTreeMap<String, HostedActor>,
    /// Which lease holder placed each actor (actors spawned without a lease are absent).
    owners: BTreeMap<String, u64>,
    leases: LeaseBook,
}

impl State {
    /// Takes actor `name` off the registry and stops it; returns what must run after
    /// it stopped (`None`: no such actor).
    fn remove_and_stop(&mut self, name: &str) -> Option<Option<BoxFuture<'static, ()>>> {
        self.owners.remove(name);
        let hosted = self.actors.remove(name)?;
        hosted.cell.stop(None);
        Some(hosted.on_stop)
    }
}

/// How often the worker looks for expired leases.
const LEASE_CHECK: Duration = Duration::from_millis(100);

/// The daemon's state, shared by every service.
#[derive(Clone)]
pub struct WorkerDaemon {
    gpus: Vec<u32>,
    /// Where hosted actors run.
    actors_runtime: tokio::runtime::Handle,
    started: Instant,
    state: Arc<Mutex<State>>,
    /// The actor kinds this daemon can host, by `ActorKind` value.
    hosts: Arc<RwLock<BTreeMap<i32, Arc<dyn ActorHost>>>>,
    shutdown: Arc<Notify>,
    /// The node supervisor every hosted actor is linked to (started on first spawn).
    node: Arc<tokio::sync::OnceCell<ActorRef<NodeMsg>>>,
}

impl WorkerDaemon {
    /// A daemon offering `gpus`, hosting no actor kind yet ([`WorkerDaemon::host`]).
    /// Call it inside a Tokio runtime: hosted actors run there.
    pub fn new(gpus: Vec<u32>) -> Self {
        Self {
            gpus,
            actors_runtime: tokio::runtime::Handle::current(),
            started: Instant::now(),
            state: Arc::new(Mutex::new(State {
                actors: BTreeMap::new(),
                owners: BTreeMap::new(),
                leases: LeaseBook::default(),
            })),
            hosts: Arc::new(RwLock::new(BTreeMap::new())),
            shutdown: Arc::new(Notify::new()),
            node: Arc::new(tokio::sync::OnceCell::new()),
        }
        .watching_leases()
    }

    /// From now on, `SpawnActor` calls for `kind` go to `host` (replacing any before).
    pub fn host(&self, kind: cpb::ActorKind, host: Arc<dyn ActorHost>) {
        if let Ok(mut hosts) = self.hosts.write() {
            hosts.insert(kind as i32, host);
        }
    }

    /// GPUs this worker offers.
    pub fn gpus(&self) -> &[u32] {
        &self.gpus
    }

    /// The runtime hosted actors run on (multi-threaded).
    pub fn actors_runtime(&self) -> &tokio::runtime::Handle {
        &self.actors_runtime
    }

    /// The handle of hosted actor `name` when it is a `T` (see [`HostedActor::new`]).
    pub async fn hosted<T: Clone + Send + Sync + 'static>(&self, name: &str) -> Option<T> {
        let state = self.state.lock().await;
        state
            .actors
            .get(name)
            .and_then(|h| h.handle.downcast_ref::<T>().cloned())
    }

    /// Every hosted actor whose handle is a `T`, by name.
    pub async fn all_hosted<T: Clone + Send + Sync + 'static>(&self) -> Vec<(String, T)> {
        let state = self.state.lock().await;
        state
            .actors
            .iter()
            .filter_map(|(name, h)| {
                h.handle
                    .downcast_ref::<T>()
                    .map(|t| (name.clone(), t.clone()))
            })
            .collect()
    }

    /// Starts the task that stops the actors of holders whose lease expired (it ends
    /// with the daemon).
    fn watching_leases(self) -> Self {
        let state = Arc::downgrade(&self.state);
        self.actors_runtime.spawn(watch_leases(state));
        self
    }

    /// Links `cell` to the node supervisor, starting it (and the task that takes
    /// exited actors off the registry) on first use.
    async fn supervise(&self, cell: ractor::ActorCell) -> Result<(), Status> {
        let node = self
            .node
            .get_or_try_init(|| async {
                let (node, mut exits) = self
                    .actors_runtime
                    .spawn(crate::node::start_node_actor())
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
                    .map_err(|e| Status::internal(format!("starting the node supervisor: {e}")))?;
                let state = self.state.clone();
                self.actors_runtime.spawn(async move {
                    while let Some(exit) = exits.recv().await {
                        forget_exited(&state, &exit).await;
                    }
                });
                Ok::<_, Status>(node)
            })
            .await?;
        cell.link(node.get_cell());
        Ok(())
    }

    /// Asks [`serve`] to stop (as the `Shutdown` RPC does).
    pub fn request_shutdown(&self) {
        self.shutdown.notify_one();
    }

    /// Stops every actor, then lets every host release what it keeps.
    pub async fn stop_all(&self) {
        let mut state = self.state.lock().await;
        state.owners.clear();
        for (_, h) in std::mem::take(&mut state.actors) {
            h.cell.stop(None);
            if let Some(finish) = h.on_stop {
                finish.await;
            }
        }
        let hosts: Vec<Arc<dyn ActorHost>> = self
            .hosts
            .read()
            .map(|h| h.values().cloned().collect())
            .unwrap_or_default();
        for host in hosts {
            host.shutdown().await;
        }
    }

    /// The host registered for `kind`, or the call's error naming the kinds there are.
    fn host_for(&self, kind: i32) -> Result<Arc<dyn ActorHost>, Status> {
        let hosts = self
            .hosts
            .read()
            .map_err(|_| Status::internal("the actor host registry is poisoned"))?;
        if let Some(host) = hosts.get(&kind) {
            return Ok(host.clone());
        }
        let known: Vec<&str> = hosts
            .keys()
            .filter_map(|&k| cpb::ActorKind::try_from(k).ok())
            .map(|k| k.as_str_name())
            .collect();
        Err(Status::unimplemented(format!(
            "actor kind {kind} cannot be hosted by this worker ({})",
            if known.is_empty() {
                "it hosts no actor kind".to_string()
            } else {
                known.join(" or ")
            }
        )))
    }
}

#[tonic::async_trait]
impl Worker for WorkerDaemon {
    async fn heartbeat(
        &self,
        request: Request<cpb::HeartbeatRequest>,
    ) -> Result<Response<cpb::HeartbeatReply>, Status> {
        let request = request.into_inner();
        let actors = {
            let mut state = self.state.lock().await;
            if let Some(lease) = Lease::from_pb(request.lease.as_ref()) {
                state.leases.renew(lease);
            }
            state.actors.keys().cloned().collect()
        };
        Ok(Response::new(cpb::HeartbeatReply {
            sequence: request.sequence,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            actors,
        }))
    }

    async fn describe(
        &self,
        _request: Request<pb::Empty>,
    ) -> Result<Response<cpb::NodeResources>, Status> {
        Ok(Response::new(cpb::NodeResources {
            hostname: std::env::var("HOSTNAME").unwrap_or_default(),
            gpus: self.gpus.clone(),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
        }))
    }

    async fn check_model(
        &self,
        request: Request<cpb::CheckModelRequest>,
    ) -> Result<Response<cpb::CheckModelReply>, Status> {
        let dir = std::path::PathBuf::from(request.into_inner().directory);
        let exists = dir.is_dir();
        let missing = ["config.json", "tokenizer.json"]
            .into_iter()
            .filter(|f| !dir.join(f).is_file())
            .map(str::to_string)
            .collect();
        Ok(Response::new(cpb::CheckModelReply { exists, missing }))
    }

    async fn spawn_actor(
        &self,
        request: Request<cpb::SpawnActorRequest>,
    ) -> Result<Response<cpb::SpawnActorReply>, Status> {
        let req = request.into_inner();
        let host = self.host_for(req.kind)?;
        if self.state.lock().await.actors.contains_key(&req.name) {
            return Err(Status::already_exists(format!(
                "an actor named {:?} already runs here",
                req.name
            )));
        }
        // A spawn renews its lease and keeps it from expiring while it runs (a holder
        // loading a model is alive).
        let lease = Lease::from_pb(req.lease.as_ref());
        if let Some(lease) = lease {
            self.state.lock().await.leases.spawning(lease, true);
        }
        let spawn = SpawnRequest {
            name: req.name.clone(),
            gpus: req.gpus,
            config_json: req.config_json,
            offered_gpus: self.gpus.clone(),
        };
        let spawned = self
            .actors_runtime
            .spawn(async move { host.spawn(spawn).await })
            .await
            .map_err(|e| Status::internal(e.to_string()))
            .and_then(|r| r);
        if let Some(lease) = lease {
            self.state.lock().await.leases.spawning(lease, false);
        }
        let hosted = spawned?;
        self.supervise(hosted.cell.clone()).await?;
        let mut state = self.state.lock().await;
        state.actors.insert(req.name.clone(), hosted);
        if let Some(lease) = lease {
            state.owners.insert(req.name.clone(), lease.holder);
        }
        Ok(Response::new(cpb::SpawnActorReply { name: req.name }))
    }

    async fn stop_actor(
        &self,
        request: Request<cpb::StopActorRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let name = request.into_inner().name;
        let stopped = self.state.lock().await.remove_and_stop(&name);
        match stopped {
            Some(finish) => {
                info!(actor = %name, "actor stopped");
                if let Some(finish) = finish {
                    finish.await;
                }
                Ok(Response::new(pb::Empty {}))
            }
            None => Err(Status::not_found(format!(
                "no actor named {name:?} on this worker"
            ))),
        }
    }

    async fn shutdown(&self, _request: Request<pb::Empty>) -> Result<Response<pb::Empty>, Status> {
        info!("shutdown requested");
        self.shutdown.notify_one();
        Ok(Response::new(pb::Empty {}))
    }

    async fn echo(
        &self,
        request: Request<cpb::EchoRequest>,
    ) -> Result<Response<cpb::EchoReply>, Status> {
        let req = request.into_inner();
        let actor = crate::echo::echo_actor()
            .await
            .map_err(|e| Status::internal(format!("starting the echo actor: {e}")))?;
        let payload = call!(actor, crate::echo::EchoMsg::Echo, req.payload)
            .map_err(|e| Status::internal(format!("echo actor: {e}")))?;
        Ok(Response::new(cpb::EchoReply {
            sequence: req.sequence,
            payload,
        }))
    }

    async fn ingest_samples(
        &self,
        request: Request<tonic::Streaming<pb::Sample>>,
    ) -> Result<Response<cpb::IngestReply>, Status> {
        let mut stream = request.into_inner();
        let mut reply = cpb::IngestReply::default();
        while let Some(sample) = stream.message().await? {
            reply.samples += 1;
            reply.tokens += sample.tokens.len() as u64;
            reply.array_bytes += 4
                * (sample.tokens.len() + sample.loss_mask.len() + sample.rollout_log_probs.len())
                    as u64;
        }
        Ok(Response::new(reply))
    }
}

/// Takes an actor that ended off the registry, unless it was already removed (asked to
/// stop) or its name now belongs to a newer actor.
async fn forget_exited(state: &Mutex<State>, exit: &crate::node::ActorExit) {
    let mut state = state.lock().await;
    let hosted = state
        .actors
        .get(&exit.name)
        .is_some_and(|h| h.cell.get_id() == exit.id);
    if !hosted {
        return;
    }
    if let Some(Some(finish)) = state.remove_and_stop(&exit.name) {
        tokio::spawn(finish);
    }
    warn!(
        actor = %exit.name,
        how = %exit.how,
        "a hosted actor ended on its own; removed from this node (the driver re-creates it)"
    );
}

/// Every [`LEASE_CHECK`], stops the actors of holders whose lease expired; ends when
/// the daemon is gone.
async fn watch_leases(state: Weak<Mutex<State>>) {
    let mut tick = tokio::time::interval(LEASE_CHECK);
    loop {
        tick.tick().await;
        let Some(state) = state.upgrade() else {
            return;
        };
        let mut finishing = Vec::new();
        {
            let mut state = state.lock().await;
            for lease in state.leases.take_expired(Instant::now()) {
                let names: Vec<String> = state
                    .owners
                    .iter()
                    .filter(|(_, &holder)| holder == lease.holder)
                    .map(|(name, _)| name.clone())
                    .collect();
                if names.is_empty() {
                    continue;
                }
                for name in &names {
                    finishing.extend(state.remove_and_stop(name).flatten());
                }
                warn!(
                    holder = %format!("{:016x}", lease.holder),
                    actors = ?names,
                    "the driver that placed these actors sent no heartbeat for {:?} (lease_timeout_ms): stopping them",
                    lease.timeout
                );
            }
        }
        for finish in finishing {
            finish.await;
        }
    }
}

/// Serves the `Worker` service alone on `listener` until a `Shutdown` call or `stop`
/// resolves.
pub async fn serve(
    daemon: WorkerDaemon,
    listener: tokio::net::TcpListener,
    token: String,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_with_tls(daemon, listener, token, None, stop).await
}

/// [`serve`], over TLS when `tls` is given (plaintext connections then fail their handshake).
pub async fn serve_with_tls(
    daemon: WorkerDaemon,
    listener: tokio::net::TcpListener,
    token: String,
    tls: Option<ServerTls>,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_with_services(daemon, listener, token, tls, |_| Routes::default(), stop).await
}

/// [`serve_with_tls`], plus the services `services` builds (given the token check
/// they must put in front of each), e.g. those that call the hosted actors.
pub async fn serve_with_services(
    daemon: WorkerDaemon,
    listener: tokio::net::TcpListener,
    token: String,
    tls: Option<ServerTls>,
    services: impl FnOnce(&CheckToken) -> Routes,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let check = CheckToken::new(token);
    let shutdown = daemon.shutdown.clone();
    // Small gRPC frames must not wait for delayed ACKs (Nagle): without TCP_NODELAY
    // a call round trip took ~43 ms instead of ~0.1 ms. tonic's own nodelay option
    // does not apply to a listener passed in.
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.and_then(|tcp| {
            tcp.set_nodelay(true)?;
            Ok(tcp)
        })
    });
    let routes = services(&check).add_service(WorkerServer::with_interceptor(
        daemon.clone(),
        check.clone(),
    ));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls.config())?;
    }
    let result = builder
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, async move {
            tokio::select! {
                _ = shutdown.notified() => {}
                _ = stop => {}
            }
        })
        .await;
    if let Err(e) = &result {
        warn!(error = %e, "worker server stopped with an error");
    }
    daemon.stop_all().await;
    result
}

/// Serves `daemon` (and what `services` builds, see [`serve_with_services`]) from a
/// thread of its own running a current-thread runtime (see the module docs), until a
/// `Shutdown` call or [`WorkerDaemon::request_shutdown`].
pub fn spawn_control_plane(
    daemon: WorkerDaemon,
    listener: std::net::TcpListener,
    token: String,
    tls: Option<ServerTls>,
    services: impl FnOnce(&CheckToken) -> Routes + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<Result<(), String>>> {
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("manta-control-plane".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("starting the control-plane runtime: {e}"))?;
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .map_err(|e| format!("listening: {e}"))?;
                serve_with_services(
                    daemon,
                    listener,
                    token,
                    tls,
                    services,
                    std::future::pending(),
                )
                .await
                .map_err(|e| crate::tls::error_chain(&e))
            })
        })
}

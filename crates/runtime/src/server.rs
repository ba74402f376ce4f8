//! The worker daemon: hosts rollout actors and serves the `Worker` and `Rollout`
//! gRPC services, every call checked against the cluster token.
//!
//! The `worker` binary serves gRPC from a control-plane thread of its own
//! ([`spawn_control_plane`], a current-thread runtime) while actors run on the main
//! multi-thread runtime: a small call and the echo actor then stay on one thread,
//! with no cross-thread wake-up, and episode work never queues behind them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use manta_config::TrainConfig;
use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_server::{Worker, WorkerServer};
use manta_proto::common as pb;
use manta_proto::rollout as rpb;
use manta_proto::rollout::rollout_server::{Rollout, RolloutServer};
use manta_proto::trainer as tpb;
use manta_proto::trainer::trainer_server::{Trainer, TrainerServer};
use manta_proto::weight_sync::weight_sync_server::WeightSyncServer;
use manta_rollout::{GenerationSettings, RolloutMsg, Uploader};
use manta_trainer::{TrainBatch, TrainerMsg};
use ractor::{call, ActorRef};
use tokio::sync::{Mutex, Notify};
use tonic::{Request, Response, Status};
use tracing::{info, warn, Instrument};

use crate::auth::CheckToken;
use crate::convert::request_from_pb;
use crate::lease::{Lease, LeaseBook};
use crate::node::NodeMsg;
use crate::spawn::{spawn_rollout, spawn_trainer, RolloutSpawnConfig, TrainerSpawnConfig};
use crate::tls::ServerTls;

pub(crate) struct Hosted {
    pub(crate) actor: ActorRef<RolloutMsg>,
    max_concurrent: usize,
    /// The actor's trajectory uploader, flushed when it stops.
    upload: Option<Uploader>,
}

pub(crate) struct State {
    pub(crate) actors: BTreeMap<String, Hosted>,
    trainers: BTreeMap<String, ActorRef<TrainerMsg>>,
    env_server: Option<manta_envs::ServerHandle>,
    /// Which lease holder placed each actor (actors spawned without a lease are absent).
    owners: BTreeMap<String, u64>,
    leases: LeaseBook,
    /// Weights pushed for `ApplyWeights`, by version (CPU tensors; the newest two).
    pub(crate) staged: BTreeMap<u64, manta_trainer::NamedTensors>,
}

impl State {
    /// Takes actor `name` (rollout or trainer) off the registry and stops it; returns
    /// its uploader, if any, for the caller to flush.
    fn remove_and_stop(&mut self, name: &str) -> Option<Option<Uploader>> {
        self.owners.remove(name);
        if let Some(t) = self.trainers.remove(name) {
            t.stop(None);
            return Some(None);
        }
        let hosted = self.actors.remove(name)?;
        hosted.actor.stop(None);
        Some(hosted.upload)
    }
}

/// How often the worker looks for expired leases.
const LEASE_CHECK: Duration = Duration::from_millis(100);
/// How long stopping an actor waits for its last trajectories to upload.
const UPLOAD_FLUSH: Duration = Duration::from_secs(5);

/// The daemon's state, shared by both services.
#[derive(Clone)]
pub struct WorkerDaemon {
    gpus: Vec<u32>,
    /// Where hosted actors (and the built-in environment server) run.
    actors_runtime: tokio::runtime::Handle,
    started: Instant,
    pub(crate) state: Arc<Mutex<State>>,
    shutdown: Arc<Notify>,
    /// The node supervisor every hosted actor is linked to (started on first spawn).
    node: Arc<tokio::sync::OnceCell<ActorRef<NodeMsg>>>,
}

impl WorkerDaemon {
    /// A daemon offering `gpus`. Call it inside a Tokio runtime: hosted actors run there.
    pub fn new(gpus: Vec<u32>) -> Self {
        Self {
            gpus,
            actors_runtime: tokio::runtime::Handle::current(),
            started: Instant::now(),
            state: Arc::new(Mutex::new(State {
                actors: BTreeMap::new(),
                trainers: BTreeMap::new(),
                env_server: None,
                owners: BTreeMap::new(),
                leases: LeaseBook::default(),
                staged: BTreeMap::new(),
            })),
            shutdown: Arc::new(Notify::new()),
            node: Arc::new(tokio::sync::OnceCell::new()),
        }
        .watching_leases()
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

    async fn actor(&self, name: &str) -> Result<(ActorRef<RolloutMsg>, usize), Status> {
        let state = self.state.lock().await;
        state
            .actors
            .get(name)
            .map(|h| (h.actor.clone(), h.max_concurrent))
            .ok_or_else(|| Status::not_found(format!("no actor named {name:?} on this worker")))
    }

    pub(crate) async fn trainer(&self, name: &str) -> Result<ActorRef<TrainerMsg>, Status> {
        let state = self.state.lock().await;
        state
            .trainers
            .get(name)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no trainer named {name:?} on this worker")))
    }

    /// Asks [`serve`] to stop (as the `Shutdown` RPC does).
    pub fn request_shutdown(&self) {
        self.shutdown.notify_one();
    }

    /// Stops every actor and the built-in environment server.
    pub async fn stop_all(&self) {
        let mut state = self.state.lock().await;
        state.owners.clear();
        for (_, h) in std::mem::take(&mut state.actors) {
            h.actor.stop(None);
            if let Some(upload) = h.upload {
                finish_upload(upload).await;
            }
        }
        for (_, t) in std::mem::take(&mut state.trainers) {
            t.stop(None);
        }
        if let Some(server) = state.env_server.take() {
            server.shutdown().await;
        }
    }
}

impl WorkerDaemon {
    /// A spawn with a lease renews it and keeps it from expiring while it runs.
    async fn spawn_starts(&self, req: &cpb::SpawnActorRequest) -> Option<Lease> {
        let lease = Lease::from_pb(req.lease.as_ref())?;
        self.state.lock().await.leases.spawning(lease, true);
        Some(lease)
    }

    async fn spawn_ends<T>(
        &self,
        lease: Option<Lease>,
        result: Result<T, Status>,
    ) -> Result<T, Status> {
        if let Some(lease) = lease {
            self.state.lock().await.leases.spawning(lease, false);
        }
        result
    }

    async fn spawn_trainer_actor(
        &self,
        req: cpb::SpawnActorRequest,
    ) -> Result<Response<cpb::SpawnActorReply>, Status> {
        let cfg =
            TrainerSpawnConfig::from_json(&req.config_json).map_err(Status::invalid_argument)?;
        if let Some(g) = req.gpus.iter().find(|g| !self.gpus.contains(g)) {
            return Err(Status::failed_precondition(format!(
                "trainer {:?} asks for GPU {g}, but this worker offers {:?}",
                req.name, self.gpus
            )));
        }
        let options = cfg
            .into_options(&req.gpus)
            .map_err(Status::failed_precondition)?;
        if self.state.lock().await.trainers.contains_key(&req.name) {
            return Err(Status::already_exists(format!(
                "a trainer named {:?} already runs here",
                req.name
            )));
        }
        let name = req.name.clone();
        let lease = self.spawn_starts(&req).await;
        let spawned = self
            .actors_runtime
            .spawn(async move { spawn_trainer(&name, options).await })
            .await
            .map_err(|e| Status::internal(e.to_string()))
            .and_then(|r| r.map_err(|e| Status::internal(format!("{e:#}"))));
        let actor = self.spawn_ends(lease, spawned).await?;
        self.supervise(actor.get_cell()).await?;
        info!(actor = %req.name, gpus = ?req.gpus, "trainer spawned");
        let mut state = self.state.lock().await;
        state.trainers.insert(req.name.clone(), actor);
        if let Some(lease) = lease {
            state.owners.insert(req.name.clone(), lease.holder);
        }
        Ok(Response::new(cpb::SpawnActorReply { name: req.name }))
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
            state
                .actors
                .keys()
                .chain(state.trainers.keys())
                .cloned()
                .collect()
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
        if req.kind == cpb::ActorKind::Trainer as i32 {
            return self.spawn_trainer_actor(req).await;
        }
        if req.kind != cpb::ActorKind::Rollout as i32 {
            return Err(Status::unimplemented(format!(
                "actor kind {} cannot be hosted by this worker (ACTOR_KIND_ROLLOUT or ACTOR_KIND_TRAINER)",
                req.kind
            )));
        }
        let cfg =
            RolloutSpawnConfig::from_json(&req.config_json).map_err(Status::invalid_argument)?;
        let train: TrainConfig = cfg
            .train_config
            .parse()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let mut state = self.state.lock().await;
        if state.actors.contains_key(&req.name) {
            return Err(Status::already_exists(format!(
                "an actor named {:?} already runs here",
                req.name
            )));
        }
        if RolloutSpawnConfig::needs_builtin(&train) && state.env_server.is_none() {
            let addr = SocketAddr::from(([127, 0, 0, 1], 0));
            let server = self
                .actors_runtime
                .spawn(manta_envs::serve(addr, manta_envs::builtin_environments()))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(|e| {
                    Status::internal(format!("starting the built-in environment server: {e}"))
                })?;
            info!(url = %server.base_url(), "built-in environment server started");
            state.env_server = Some(server);
        }
        let builtin_url = state.env_server.as_ref().map(|s| s.base_url());
        let lease = Lease::from_pb(req.lease.as_ref());
        if let Some(lease) = lease {
            state.leases.spawning(lease, true);
        }
        let name = req.name.clone();
        let spawn_cfg = cfg.clone();
        let spawned =
            self.actors_runtime
                .spawn(async move {
                    spawn_rollout(&name, &spawn_cfg, &train, builtin_url.as_deref()).await
                })
                .await
                .map_err(|e| Status::internal(e.to_string()))
                .and_then(|r| r.map_err(|e| Status::internal(format!("{e:#}"))));
        if let Some(lease) = lease {
            state.leases.spawning(lease, false);
            state.owners.insert(req.name.clone(), lease.holder);
        }
        let (actor, upload) = spawned?;
        self.supervise(actor.get_cell()).await?;
        info!(actor = %req.name, "rollout actor spawned");
        state.actors.insert(
            req.name.clone(),
            Hosted {
                actor,
                max_concurrent: cfg.max_concurrent_episodes.max(1),
                upload,
            },
        );
        Ok(Response::new(cpb::SpawnActorReply { name: req.name }))
    }

    async fn stop_actor(
        &self,
        request: Request<cpb::StopActorRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let name = request.into_inner().name;
        let stopped = self.state.lock().await.remove_and_stop(&name);
        match stopped {
            Some(upload) => {
                info!(actor = %name, "actor stopped");
                if let Some(upload) = upload {
                    finish_upload(upload).await;
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

type SampleStream = Pin<Box<dyn Stream<Item = Result<pb::Sample, Status>> + Send>>;

#[tonic::async_trait]
impl Rollout for WorkerDaemon {
    type RunEpisodesStream = SampleStream;

    async fn run_episodes(
        &self,
        request: Request<rpb::RunEpisodesRequest>,
    ) -> Result<Response<SampleStream>, Status> {
        let span = tracing::info_span!("run_episodes");
        manta_telemetry::set_parent_from_metadata(&span, request.metadata());
        let req = request.into_inner();
        let (actor, concurrency) = self.actor(&req.actor).await?;
        let settings = GenerationSettings {
            temperature: req.temperature as f64,
            max_response_len: req.max_response_len as usize,
            context_len: req.context_len as usize,
            partial_rollout: req.partial_rollout,
        };
        let episodes = req
            .episodes
            .into_iter()
            .map(request_from_pb)
            .collect::<Result<Vec<_>, String>>()
            .map_err(Status::invalid_argument)?;
        // One episode per actor call, so each sample streams back as soon as it ends.
        let stream = futures::stream::iter(episodes)
            .map(move |episode| {
                let actor = actor.clone();
                let span = span.clone();
                async move {
                    let id = episode.sample_id;
                    let mut samples =
                        call!(actor, RolloutMsg::RunEpisodes, vec![episode], settings).map_err(
                            |e| Status::internal(format!("sample {id}: rollout actor: {e}")),
                        )?;
                    let sample = samples.pop().ok_or_else(|| {
                        Status::internal(format!("sample {id}: the rollout actor returned nothing"))
                    })?;
                    Ok(pb::Sample::from(&sample))
                }
                .instrument(span)
            })
            .buffer_unordered(concurrency);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn weight_version(
        &self,
        _request: Request<pb::Empty>,
    ) -> Result<Response<rpb::WeightVersionReply>, Status> {
        let actors: Vec<ActorRef<RolloutMsg>> = {
            let state = self.state.lock().await;
            state.actors.values().map(|h| h.actor.clone()).collect()
        };
        let mut version = 0;
        for actor in actors {
            version = version.max(call!(actor, RolloutMsg::WeightVersion).unwrap_or(0));
        }
        Ok(Response::new(rpb::WeightVersionReply { version }))
    }
}

/// Takes an actor that ended off the registry, unless it was already removed (asked to
/// stop) or its name now belongs to a newer actor.
async fn forget_exited(state: &Mutex<State>, exit: &crate::node::ActorExit) {
    let mut state = state.lock().await;
    let rollout = state
        .actors
        .get(&exit.name)
        .is_some_and(|h| h.actor.get_id() == exit.id);
    let trainer = state
        .trainers
        .get(&exit.name)
        .is_some_and(|t| t.get_id() == exit.id);
    if rollout || trainer {
        if let Some(Some(upload)) = state.remove_and_stop(&exit.name) {
            tokio::spawn(finish_upload(upload));
        }
    }
    if rollout || trainer {
        warn!(
            actor = %exit.name,
            how = %exit.how,
            "a hosted actor ended on its own; removed from this node (the driver re-creates it)"
        );
    }
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
        let mut uploads = Vec::new();
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
                    uploads.extend(state.remove_and_stop(name).flatten());
                }
                warn!(
                    holder = %format!("{:016x}", lease.holder),
                    actors = ?names,
                    "the driver that placed these actors sent no heartbeat for {:?} (lease_timeout_ms): stopping them",
                    lease.timeout
                );
            }
        }
        for upload in uploads {
            finish_upload(upload).await;
        }
    }
}

/// Sends a stopped actor's last trajectories (at most [`UPLOAD_FLUSH`]) and logs the counts.
async fn finish_upload(upload: Uploader) {
    let stats = upload.shutdown(UPLOAD_FLUSH).await;
    info!(
        uploaded = stats.uploaded,
        dropped = stats.dropped,
        failed = stats.failed,
        "trajectory upload finished"
    );
}

fn trainer_call<T>(
    name: &str,
    result: Result<T, ractor::RactorErr<TrainerMsg>>,
) -> Result<T, Status> {
    result.map_err(|e| Status::unavailable(format!("trainer {name} did not answer: {e}")))
}

#[tonic::async_trait]
impl Trainer for WorkerDaemon {
    async fn train_step(
        &self,
        request: Request<tpb::TrainStepRequest>,
    ) -> Result<Response<tpb::TrainStepReply>, Status> {
        let req = request.into_inner();
        let trainer = self.trainer(&req.actor).await?;
        if req.advantages.len() != req.samples.len() {
            return Err(Status::invalid_argument(format!(
                "{} advantages for {} samples",
                req.advantages.len(),
                req.samples.len()
            )));
        }
        let samples = req
            .samples
            .into_iter()
            .map(manta_core::Sample::try_from)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let batch = TrainBatch {
            samples,
            advantages: req.advantages.iter().map(|&a| a as f64).collect(),
            global_samples: req.global_batch_samples as usize,
        };
        let metrics = trainer_call(&req.actor, call!(trainer, TrainerMsg::TrainStep, batch))?
            .map_err(|e| Status::internal(format!("training step {} failed: {e}", req.step)))?;
        Ok(Response::new(tpb::TrainStepReply {
            metrics: metrics.into_iter().collect(),
        }))
    }

    async fn save_checkpoint(
        &self,
        request: Request<tpb::SaveCheckpointRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = request.into_inner();
        let trainer = self.trainer(&req.actor).await?;
        let dir = std::path::PathBuf::from(&req.directory);
        trainer_call(
            &req.actor,
            call!(trainer, TrainerMsg::SaveCheckpoint, dir, req.step),
        )?
        .map_err(|e| Status::internal(format!("saving {}: {e}", req.directory)))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn load_checkpoint(
        &self,
        request: Request<tpb::LoadCheckpointRequest>,
    ) -> Result<Response<tpb::LoadCheckpointReply>, Status> {
        let req = request.into_inner();
        let trainer = self.trainer(&req.actor).await?;
        let dir = std::path::PathBuf::from(&req.directory);
        let step = trainer_call(&req.actor, call!(trainer, TrainerMsg::LoadCheckpoint, dir))?
            .map_err(|e| Status::failed_precondition(format!("loading {}: {e}", req.directory)))?;
        Ok(Response::new(tpb::LoadCheckpointReply { step }))
    }
}

/// Serves both services on `listener` until a `Shutdown` call or `stop` resolves.
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
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls.config())?;
    }
    let result = builder
        .add_service(WorkerServer::with_interceptor(
            daemon.clone(),
            check.clone(),
        ))
        .add_service(RolloutServer::with_interceptor(
            daemon.clone(),
            check.clone(),
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            WeightSyncServer::new(daemon.clone())
                .max_decoding_message_size(crate::weights::MAX_WEIGHT_MESSAGE)
                .max_encoding_message_size(crate::weights::MAX_WEIGHT_MESSAGE),
            check.clone(),
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            TrainerServer::new(daemon.clone())
                .max_decoding_message_size(crate::client::MAX_TRAINER_MESSAGE)
                .max_encoding_message_size(crate::client::MAX_TRAINER_MESSAGE),
            check,
        ))
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

/// Serves `daemon` from a thread of its own running a current-thread runtime (see the
/// module docs), until a `Shutdown` call or [`WorkerDaemon::request_shutdown`].
pub fn spawn_control_plane(
    daemon: WorkerDaemon,
    listener: std::net::TcpListener,
    token: String,
    tls: Option<ServerTls>,
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
                serve_with_tls(daemon, listener, token, tls, std::future::pending())
                    .await
                    .map_err(|e| crate::tls::error_chain(&e))
            })
        })
}

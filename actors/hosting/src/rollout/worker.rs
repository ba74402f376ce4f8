//! Rollout actors on a worker: the [`RolloutHost`] that builds them from their spawn
//! config (with the built-in environment server when train_config asks for it), and
//! the `Rollout` gRPC service that runs their episodes, streaming each sample back as
//! it ends.

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use manta_config::TrainConfig;
use manta_proto::common as pb;
use manta_proto::rollout as rpb;
use manta_proto::rollout::rollout_server::Rollout;
use manta_rollout::{GenerationSettings, RolloutMsg, Uploader};
use manta_runtime::{ActorHost, HostedActor, SpawnRequest, WorkerDaemon};
use ractor::{call, ActorRef};
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};
use tracing::{info, Instrument};

use super::convert::request_from_pb;
use super::spawn::{spawn_rollout, RolloutSpawnConfig};

/// How long stopping an actor waits for its last trajectories to upload.
const UPLOAD_FLUSH: Duration = Duration::from_secs(5);

/// A hosted rollout actor as the worker's services call it.
#[derive(Clone)]
pub struct HostedRollout {
    pub actor: ActorRef<RolloutMsg>,
    /// Episodes of one `RunEpisodes` call in flight at once.
    pub max_concurrent: usize,
}

/// Builds rollout actors (`ACTOR_KIND_ROLLOUT`) and keeps the built-in environment
/// server they share.
#[derive(Default)]
pub struct RolloutHost {
    env_server: Mutex<Option<manta_envs::ServerHandle>>,
}

#[tonic::async_trait]
impl ActorHost for RolloutHost {
    async fn spawn(&self, req: SpawnRequest) -> Result<HostedActor, Status> {
        let cfg =
            RolloutSpawnConfig::from_json(&req.config_json).map_err(Status::invalid_argument)?;
        let train: TrainConfig = cfg
            .train_config
            .parse()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let builtin_url = {
            let mut env_server = self.env_server.lock().await;
            if RolloutSpawnConfig::needs_builtin(&train) && env_server.is_none() {
                let addr = SocketAddr::from(([127, 0, 0, 1], 0));
                let server = manta_envs::serve(addr, manta_envs::builtin_environments())
                    .await
                    .map_err(|e| {
                        Status::internal(format!("starting the built-in environment server: {e}"))
                    })?;
                info!(url = %server.base_url(), "built-in environment server started");
                *env_server = Some(server);
            }
            env_server.as_ref().map(|s| s.base_url())
        };
        let (actor, upload) = spawn_rollout(&req.name, &cfg, &train, builtin_url.as_deref())
            .await
            .map_err(|e| Status::internal(format!("{e:#}")))?;
        info!(actor = %req.name, "rollout actor spawned");
        let hosted = HostedRollout {
            actor: actor.clone(),
            max_concurrent: cfg.max_concurrent_episodes.max(1),
        };
        let hosted = HostedActor::new(actor.get_cell(), hosted);
        Ok(match upload {
            Some(upload) => hosted.on_stop(finish_upload(upload)),
            None => hosted,
        })
    }

    async fn shutdown(&self) {
        if let Some(server) = self.env_server.lock().await.take() {
            server.shutdown().await;
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

/// The `Rollout` service over a daemon's hosted rollout actors.
#[derive(Clone)]
pub struct RolloutService {
    daemon: WorkerDaemon,
}

impl RolloutService {
    pub fn new(daemon: WorkerDaemon) -> Self {
        Self { daemon }
    }

    async fn actor(&self, name: &str) -> Result<HostedRollout, Status> {
        self.daemon
            .hosted::<HostedRollout>(name)
            .await
            .ok_or_else(|| Status::not_found(format!("no actor named {name:?} on this worker")))
    }
}

type SampleStream = Pin<Box<dyn Stream<Item = Result<pb::Sample, Status>> + Send>>;

#[tonic::async_trait]
impl Rollout for RolloutService {
    type RunEpisodesStream = SampleStream;

    async fn run_episodes(
        &self,
        request: Request<rpb::RunEpisodesRequest>,
    ) -> Result<Response<SampleStream>, Status> {
        let span = tracing::info_span!("run_episodes");
        manta_telemetry::set_parent_from_metadata(&span, request.metadata());
        let req = request.into_inner();
        let HostedRollout {
            actor,
            max_concurrent: concurrency,
        } = self.actor(&req.actor).await?;
        let settings = GenerationSettings {
            temperature: req.temperature as f64,
            top_p: req.top_p.unwrap_or(1.0),
            top_k: req.top_k.unwrap_or(-1),
            max_response_len: req.max_response_len as usize,
            context_len: req.context_len as usize,
            partial_rollout: req.partial_rollout,
            return_routed_experts: req.return_routed_experts,
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
        let actors = self.daemon.all_hosted::<HostedRollout>().await;
        let mut version = 0;
        for (_, hosted) in actors {
            version = version.max(call!(hosted.actor, RolloutMsg::WeightVersion).unwrap_or(0));
        }
        Ok(Response::new(rpb::WeightVersionReply { version }))
    }
}

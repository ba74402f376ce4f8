//! The driver's side of rollout actors on a worker: spawning them and running their
//! episodes, over the worker's channel.

use std::future::Future;
use std::time::Duration;

use manta_proto::cluster as cpb;
use manta_proto::common as pb;
use manta_proto::rollout as rpb;
use manta_proto::rollout::rollout_client::RolloutClient as RolloutRpc;
use manta_rollout::{EpisodeRequest, GenerationSettings};
use manta_runtime::{RuntimeError, WorkerClient};

use super::convert::request_to_pb;
use super::spawn::RolloutSpawnConfig;

/// How long a rollout spawn may take (model and engine load).
const SPAWN_LIMIT: Duration = Duration::from_secs(120);

/// Rollout calls on a worker (implemented for [`WorkerClient`]).
pub trait RolloutCalls {
    /// Starts a rollout actor named `name` on the worker.
    fn spawn_rollout(
        &self,
        name: &str,
        cfg: &RolloutSpawnConfig,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Starts episodes on actor `actor`; samples stream back as they finish.
    fn run_episodes(
        &self,
        actor: &str,
        episodes: &[EpisodeRequest],
        settings: GenerationSettings,
    ) -> impl Future<Output = Result<tonic::Streaming<pb::Sample>, RuntimeError>> + Send;
}

impl RolloutCalls for WorkerClient {
    async fn spawn_rollout(
        &self,
        name: &str,
        cfg: &RolloutSpawnConfig,
    ) -> Result<(), RuntimeError> {
        let config_json =
            serde_json::to_string(cfg).map_err(|e| RuntimeError::Spawn(e.to_string()))?;
        self.spawn_actor(cpb::ActorKind::Rollout, name, &[], config_json, SPAWN_LIMIT)
            .await
    }

    async fn run_episodes(
        &self,
        actor: &str,
        episodes: &[EpisodeRequest],
        settings: GenerationSettings,
    ) -> Result<tonic::Streaming<pb::Sample>, RuntimeError> {
        let mut c = RolloutRpc::new(self.channel());
        let request = rpb::RunEpisodesRequest {
            episodes: episodes.iter().map(request_to_pb).collect(),
            temperature: settings.temperature as f32,
            max_response_len: settings.max_response_len as u32,
            actor: actor.to_string(),
            context_len: settings.context_len as u32,
            partial_rollout: settings.partial_rollout,
            top_p: Some(settings.top_p),
            top_k: Some(settings.top_k),
            return_routed_experts: settings.return_routed_experts,
        };
        let mut request = tonic::Request::new(request);
        manta_telemetry::inject_into_metadata(&tracing::Span::current(), request.metadata_mut());
        self.timed(Duration::from_secs(30), c.run_episodes(request))
            .await
    }
}

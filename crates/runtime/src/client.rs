//! A typed client for one worker daemon; every call carries the cluster token and
//! every error names the worker's address.

use std::sync::Arc;
use std::time::Duration;

use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_client::WorkerClient as WorkerRpc;
use manta_proto::common as pb;
use manta_proto::rollout as rpb;
use manta_proto::rollout::rollout_client::RolloutClient as RolloutRpc;
use manta_proto::trainer as tpb;
use manta_proto::trainer::trainer_client::TrainerClient as TrainerRpc;
use manta_proto::weight_sync as wpb;
use manta_proto::weight_sync::weight_sync_client::WeightSyncClient as WeightSyncRpc;
use manta_rollout::{EpisodeRequest, GenerationSettings};
use tonic::codegen::InterceptedService;
use tonic::transport::Endpoint;

use crate::auth::BearerToken;
use crate::convert::request_to_pb;
use crate::lease::Lease;
use crate::spawn::{RolloutSpawnConfig, TrainerSpawnConfig};
use crate::tls::{error_chain, status_chain, ClientTls};
use crate::transport::{ClusterChannel, H2Channel};
use crate::weights::{Assembler, WeightSet, MAX_WEIGHT_MESSAGE};
use crate::RuntimeError;

type Authed = InterceptedService<ClusterChannel, BearerToken>;

/// How long to wait for a worker's TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One worker, reached over gRPC. Cheap to clone; the channel reconnects by itself
/// when a worker restarts on the same address.
#[derive(Clone)]
pub struct WorkerClient {
    addr: String,
    tls: bool,
    worker: WorkerRpc<Authed>,
    rollout: RolloutRpc<Authed>,
    trainer: TrainerRpc<Authed>,
    weight_sync: WeightSyncRpc<Authed>,
    /// Sent with heartbeats and spawns: actors spawned through this client live while
    /// its heartbeats keep coming.
    lease: Option<Lease>,
}

/// Largest message to or from a trainer (a rank's share of a batch).
pub const MAX_TRAINER_MESSAGE: usize = 1 << 30;

impl WorkerClient {
    /// A lazily connecting plaintext client for `addr` (`host:port`).
    pub fn new(addr: &str, token: &str) -> Result<Self, RuntimeError> {
        Self::connect(addr, token, None)
    }

    /// A lazily connecting client for `addr`; over TLS (https, trusting `tls`'s CA)
    /// when `tls` is given.
    pub fn connect(addr: &str, token: &str, tls: Option<&ClientTls>) -> Result<Self, RuntimeError> {
        let address = |message: String| RuntimeError::Address {
            addr: addr.to_string(),
            message,
        };
        let channel = match tls {
            None => ClusterChannel::Lean(
                H2Channel::lazy(addr, CONNECT_TIMEOUT).map_err(|e| address(e.to_string()))?,
            ),
            Some(tls) => ClusterChannel::Tonic(
                Endpoint::from_shared(format!("https://{addr}"))
                    .map_err(|e| address(e.to_string()))?
                    .connect_timeout(CONNECT_TIMEOUT)
                    .tcp_nodelay(true)
                    .tls_config(tls.config())
                    .map_err(|e| address(format!("TLS setup: {}", error_chain(&e))))?
                    .connect_lazy(),
            ),
        };
        let auth = BearerToken::new(token)?;
        Ok(Self {
            addr: addr.to_string(),
            tls: tls.is_some(),
            worker: WorkerRpc::with_interceptor(channel.clone(), auth.clone()),
            rollout: RolloutRpc::with_interceptor(channel.clone(), auth.clone()),
            weight_sync: WeightSyncRpc::with_interceptor(channel.clone(), auth.clone())
                .max_encoding_message_size(MAX_WEIGHT_MESSAGE)
                .max_decoding_message_size(MAX_WEIGHT_MESSAGE),
            trainer: TrainerRpc::with_interceptor(channel, auth)
                .max_encoding_message_size(MAX_TRAINER_MESSAGE)
                .max_decoding_message_size(MAX_TRAINER_MESSAGE),
            lease: None,
        })
    }

    /// This client with `lease`: the actors it spawns are stopped by the worker when
    /// its heartbeats stop for the lease's timeout.
    pub fn with_lease(mut self, lease: Lease) -> Self {
        self.lease = Some(lease);
        self
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn rpc(&self, status: tonic::Status) -> RuntimeError {
        let status = match tls_mismatch_hint(self.tls, &status) {
            Some(hint) => {
                tonic::Status::new(status.code(), format!("{} ({hint})", status_chain(&status)))
            }
            None => status,
        };
        RuntimeError::Rpc {
            addr: self.addr.clone(),
            status,
        }
    }

    async fn timed<T>(
        &self,
        limit: Duration,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, RuntimeError> {
        match tokio::time::timeout(limit, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(self.rpc(status)),
            Err(_) => Err(RuntimeError::Timeout {
                addr: self.addr.clone(),
                ms: limit.as_millis() as u64,
            }),
        }
    }

    pub async fn describe(&self, limit: Duration) -> Result<cpb::NodeResources, RuntimeError> {
        let mut c = self.worker.clone();
        self.timed(limit, c.describe(pb::Empty {})).await
    }

    /// Checks that `directory` is a model directory on the worker: an error naming the
    /// worker, the directory and what is missing of `required` (e.g. config.json).
    pub async fn check_model(
        &self,
        directory: &std::path::Path,
        required: &[&str],
        limit: Duration,
    ) -> Result<(), RuntimeError> {
        let mut c = self.worker.clone();
        let reply = self
            .timed(
                limit,
                c.check_model(cpb::CheckModelRequest {
                    directory: directory.to_string_lossy().into_owned(),
                }),
            )
            .await?;
        let problem = if !reply.exists {
            "does not exist on this node".to_string()
        } else {
            let missing: Vec<&str> = required
                .iter()
                .copied()
                .filter(|f| reply.missing.iter().any(|m| m == f))
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            format!("has no {} on this node", missing.join(" or "))
        };
        Err(RuntimeError::Placement(format!(
            "node {}: the model directory {} {problem} (the model path must exist on every \
             worker node; set it with `model` under [train] in cluster.toml or --model)",
            self.addr,
            directory.display()
        )))
    }

    /// A round trip through the worker's echo actor (its actor system, not just the server).
    pub async fn echo(&self, sequence: u64, limit: Duration) -> Result<u64, RuntimeError> {
        let mut c = self.worker.clone();
        let reply = self
            .timed(
                limit,
                c.echo(cpb::EchoRequest {
                    sequence,
                    payload: Vec::new(),
                }),
            )
            .await?;
        Ok(reply.sequence)
    }

    pub async fn heartbeat(
        &self,
        sequence: u64,
        limit: Duration,
    ) -> Result<cpb::HeartbeatReply, RuntimeError> {
        let mut c = self.worker.clone();
        let request = cpb::HeartbeatRequest {
            sequence,
            lease: self.lease.map(Lease::to_pb),
        };
        self.timed(limit, c.heartbeat(request)).await
    }

    /// Starts a rollout actor named `name` on the worker.
    pub async fn spawn_rollout(
        &self,
        name: &str,
        cfg: &RolloutSpawnConfig,
    ) -> Result<(), RuntimeError> {
        let config_json =
            serde_json::to_string(cfg).map_err(|e| RuntimeError::Spawn(e.to_string()))?;
        let mut c = self.worker.clone();
        self.timed(
            Duration::from_secs(120),
            c.spawn_actor(cpb::SpawnActorRequest {
                kind: cpb::ActorKind::Rollout as i32,
                name: name.to_string(),
                gpus: Vec::new(),
                config_json,
                lease: self.lease.map(Lease::to_pb),
            }),
        )
        .await?;
        Ok(())
    }

    /// Starts a trainer actor named `name` on the worker, on `gpus` (none: CPU).
    pub async fn spawn_trainer(
        &self,
        name: &str,
        cfg: &TrainerSpawnConfig,
        gpus: &[u32],
        limit: Duration,
    ) -> Result<(), RuntimeError> {
        let config_json =
            serde_json::to_string(cfg).map_err(|e| RuntimeError::Spawn(e.to_string()))?;
        let mut c = self.worker.clone();
        self.timed(
            limit,
            c.spawn_actor(cpb::SpawnActorRequest {
                kind: cpb::ActorKind::Trainer as i32,
                name: name.to_string(),
                gpus: gpus.to_vec(),
                config_json,
                lease: self.lease.map(Lease::to_pb),
            }),
        )
        .await?;
        Ok(())
    }

    /// One GRPO step on trainer `actor` (no time limit: a step takes what it takes;
    /// a lost worker breaks the connection).
    pub async fn train_step(
        &self,
        actor: &str,
        step: u64,
        batch: &manta_trainer::TrainBatch,
    ) -> Result<std::collections::BTreeMap<String, f64>, RuntimeError> {
        let mut c = self.trainer.clone();
        let request = tpb::TrainStepRequest {
            step,
            samples: batch.samples.iter().map(pb::Sample::from).collect(),
            advantages: batch.advantages.iter().map(|&a| a as f32).collect(),
            global_batch_samples: batch.global_samples as u32,
            actor: actor.to_string(),
        };
        let reply = c
            .train_step(request)
            .await
            .map_err(|s| self.rpc(s))?
            .into_inner();
        Ok(reply.metrics.into_iter().collect())
    }

    pub async fn save_checkpoint(
        &self,
        actor: &str,
        directory: &str,
        step: u64,
    ) -> Result<(), RuntimeError> {
        let mut c = self.trainer.clone();
        c.save_checkpoint(tpb::SaveCheckpointRequest {
            directory: directory.to_string(),
            step,
            actor: actor.to_string(),
        })
        .await
        .map_err(|s| self.rpc(s))?;
        Ok(())
    }

    /// Restores trainer `actor` from a checkpoint; returns the checkpoint's step.
    pub async fn load_checkpoint(&self, actor: &str, directory: &str) -> Result<u64, RuntimeError> {
        let mut c = self.trainer.clone();
        let reply = c
            .load_checkpoint(tpb::LoadCheckpointRequest {
                directory: directory.to_string(),
                actor: actor.to_string(),
            })
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(reply.into_inner().step)
    }

    /// Streams trainer `actor`'s current weights off the worker.
    pub async fn pull_weights(&self, actor: &str) -> Result<WeightSet, RuntimeError> {
        let mut c = self.weight_sync.clone();
        let mut stream = c
            .pull_weights(wpb::PullWeightsRequest {
                actor: actor.to_string(),
            })
            .await
            .map_err(|s| self.rpc(s))?
            .into_inner();
        let mut asm = Assembler::new();
        while let Some(chunk) = stream.message().await.map_err(|s| self.rpc(s))? {
            asm.push(chunk).map_err(|e| self.weights_error(e))?;
        }
        let (_, set) = asm.finish().map_err(|e| self.weights_error(e))?;
        Ok(set)
    }

    /// Sends `set` as `version` in chunks of `chunk_bytes`; the worker stages it.
    pub async fn push_weights(
        &self,
        set: Arc<WeightSet>,
        version: u64,
        chunk_bytes: usize,
    ) -> Result<wpb::PushWeightsReply, RuntimeError> {
        let mut c = self.weight_sync.clone();
        let chunks = futures::stream::iter(set.chunks(version, chunk_bytes));
        let reply = c.push_weights(chunks).await.map_err(|s| self.rpc(s))?;
        Ok(reply.into_inner())
    }

    /// Applies the staged `version` to every engine on the worker (pause, copy, bump,
    /// resume).
    pub async fn apply_weights(
        &self,
        version: u64,
        pause: wpb::PauseMode,
    ) -> Result<wpb::ApplyWeightsReply, RuntimeError> {
        let mut c = self.weight_sync.clone();
        let reply = c
            .apply_weights(wpb::ApplyWeightsRequest {
                version,
                pause: pause as i32,
            })
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(reply.into_inner())
    }

    /// What each rollout engine on the worker holds, tensor by tensor.
    pub async fn engine_digests(&self) -> Result<Vec<wpb::EngineDigest>, RuntimeError> {
        let mut c = self.weight_sync.clone();
        let reply = c
            .engine_digests(wpb::EngineDigestsRequest {})
            .await
            .map_err(|s| self.rpc(s))?;
        Ok(reply.into_inner().engines)
    }

    fn weights_error(&self, e: crate::weights::WeightsError) -> RuntimeError {
        RuntimeError::Node {
            addr: self.addr.clone(),
            message: e.to_string(),
        }
    }

    pub async fn stop_actor(&self, name: &str) -> Result<(), RuntimeError> {
        let mut c = self.worker.clone();
        self.timed(
            Duration::from_secs(10),
            c.stop_actor(cpb::StopActorRequest {
                name: name.to_string(),
            }),
        )
        .await?;
        Ok(())
    }

    pub async fn shutdown(&self) -> Result<(), RuntimeError> {
        let mut c = self.worker.clone();
        self.timed(Duration::from_secs(10), c.shutdown(pb::Empty {}))
            .await?;
        Ok(())
    }

    /// Starts episodes on actor `actor`; samples stream back as they finish.
    pub async fn run_episodes(
        &self,
        actor: &str,
        episodes: &[EpisodeRequest],
        settings: GenerationSettings,
    ) -> Result<tonic::Streaming<pb::Sample>, RuntimeError> {
        let mut c = self.rollout.clone();
        let request = rpb::RunEpisodesRequest {
            episodes: episodes.iter().map(request_to_pb).collect(),
            temperature: settings.temperature as f32,
            max_response_len: settings.max_response_len as u32,
            actor: actor.to_string(),
            context_len: settings.context_len as u32,
            partial_rollout: settings.partial_rollout,
        };
        let mut request = tonic::Request::new(request);
        manta_telemetry::inject_into_metadata(&tracing::Span::current(), request.metadata_mut());
        self.timed(Duration::from_secs(30), c.run_episodes(request))
            .await
    }

    /// Maps a streaming error to one that names this worker.
    pub fn stream_error(&self, status: tonic::Status) -> RuntimeError {
        self.rpc(status)
    }
}

/// A hint for a connection that broke in a way typical of one side speaking TLS and the
/// other not (a refused TCP connection or a timeout gets none).
fn tls_mismatch_hint(client_tls: bool, status: &tonic::Status) -> Option<&'static str> {
    std::error::Error::source(status)?;
    let chain = status_chain(status);
    if chain.contains("tcp connect error") || chain.contains("timed out") {
        return None;
    }
    if client_tls {
        chain.contains("corrupt message").then_some(
            "the worker may be serving plaintext: start it with --tls-cert/--tls-key, \
             or remove cluster.tls_ca",
        )
    } else {
        Some(
            "if the worker serves TLS (--tls-cert/--tls-key), set cluster.tls_ca in \
             cluster.toml to its CA certificate",
        )
    }
}

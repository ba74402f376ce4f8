//! A typed client for one worker daemon; every call carries the cluster token and
//! every error names the worker's address.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_client::WorkerClient as WorkerRpc;
use manta_proto::common as pb;
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::auth::BearerToken;
use crate::lease::Lease;
use crate::tls::{error_chain, status_chain, ClientTls};
use crate::RuntimeError;

/// The authenticated channel to one worker: every gRPC client of the worker's services
/// (the generic `Worker` one here, those of hosted actors elsewhere) is built on it.
/// tonic's own `Channel`: a hand-written HTTP/2 transport saved ~5 µs of a ~120 µs
/// control call (BENCHMARKS.md), nothing a training step can see.
pub type AuthedChannel = InterceptedService<Channel, BearerToken>;

/// How long to wait for a worker's TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One worker, reached over gRPC. Cheap to clone; the channel reconnects by itself
/// when a worker restarts on the same address. Calls to hosted actors' services go
/// over the same channel ([`WorkerClient::channel`]).
#[derive(Clone)]
pub struct WorkerClient {
    addr: String,
    tls: bool,
    /// Whether this worker has answered a call through this client (or a clone): then
    /// a broken connection is the worker going away, never a TLS mismatch.
    answered: Arc<AtomicBool>,
    channel: AuthedChannel,
    worker: WorkerRpc<AuthedChannel>,
    /// Sent with heartbeats and spawns: actors spawned through this client live while
    /// its heartbeats keep coming.
    lease: Option<Lease>,
}

/// How long the next heartbeat may take to answer: the time left before the node would
/// be declared dead (`dead_after` since its last answer, `last_answer`), and at least one
/// `interval`. A worker that answers slowly (a loaded host, a long collective) is alive;
/// only `dead_after` without any answer marks it dead, whether its calls fail fast or hang.
pub fn heartbeat_limit(last_answer: Instant, interval: Duration, dead_after: Duration) -> Duration {
    dead_after
        .saturating_sub(last_answer.elapsed())
        .max(interval)
}

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
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| address(e.to_string()))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let endpoint = match tls {
            None => endpoint,
            Some(tls) => endpoint
                .tls_config(tls.config())
                .map_err(|e| address(format!("TLS setup: {}", error_chain(&e))))?,
        };
        // Opened on first use and re-opened after it breaks (a worker restarted on the
        // same address).
        let channel = endpoint.connect_lazy();
        let channel = InterceptedService::new(channel, BearerToken::new(token)?);
        Ok(Self {
            addr: addr.to_string(),
            tls: tls.is_some(),
            answered: Arc::new(AtomicBool::new(false)),
            worker: WorkerRpc::new(channel.clone()),
            channel,
            lease: None,
        })
    }

    /// The authenticated channel, for clients of other services on this worker
    /// (e.g. `RolloutClient::new(worker.channel())`).
    pub fn channel(&self) -> AuthedChannel {
        self.channel.clone()
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

    /// A call's error status as an error naming this worker (with a hint when it looks
    /// like a TLS mismatch: the worker never answered and the connection broke).
    pub fn rpc_error(&self, status: tonic::Status) -> RuntimeError {
        let hint = if self.answered.load(Ordering::Relaxed) {
            None
        } else {
            tls_mismatch_hint(self.tls, &status)
        };
        let status = match hint {
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

    /// Awaits a unary call for at most `limit`; errors name this worker.
    pub async fn timed<T>(
        &self,
        limit: Duration,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, RuntimeError> {
        match tokio::time::timeout(limit, fut).await {
            Ok(Ok(r)) => {
                self.answered.store(true, Ordering::Relaxed);
                Ok(r.into_inner())
            }
            Ok(Err(status)) => Err(self.rpc_error(status)),
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

    /// One heartbeat (renewing this client's lease), given `limit` to answer; see
    /// [`heartbeat_limit`] for how long a liveness loop should wait.
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

    /// Starts an actor of `kind` named `name` on the worker, on `gpus` (none: CPU),
    /// from `config_json` (the kind's own format), under this client's lease.
    pub async fn spawn_actor(
        &self,
        kind: cpb::ActorKind,
        name: &str,
        gpus: &[u32],
        config_json: String,
        limit: Duration,
    ) -> Result<(), RuntimeError> {
        let mut c = self.worker.clone();
        self.timed(
            limit,
            c.spawn_actor(cpb::SpawnActorRequest {
                kind: kind as i32,
                name: name.to_string(),
                gpus: gpus.to_vec(),
                config_json,
                lease: self.lease.map(Lease::to_pb),
            }),
        )
        .await?;
        Ok(())
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

    /// Maps a streaming error to one that names this worker.
    pub fn stream_error(&self, status: tonic::Status) -> RuntimeError {
        self.rpc_error(status)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_may_take_the_time_left_before_the_node_is_dead() {
        let (interval, dead_after) = (Duration::from_millis(100), Duration::from_secs(60));
        let fresh = heartbeat_limit(Instant::now(), interval, dead_after);
        assert!(
            fresh > Duration::from_secs(59) && fresh <= dead_after,
            "{fresh:?}"
        );
        let answered = Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        let short = Duration::from_millis(20);
        assert_eq!(heartbeat_limit(answered, interval, short), interval);
    }
}

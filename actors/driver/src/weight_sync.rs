//! Weight sync as the step loop sees it: one call, [`WeightSync::sync`], the same in
//! local and remote mode. Placement picks the mechanism per trainer/engine pair
//! (`manta_weight_sync::route`): engines in the driver copy the trainer's tensors
//! in-process; engines on workers receive the weights as bounded gRPC chunks (no
//! shared disk), staged before the engines pause. Mechanisms this build cannot run yet
//! (CUDA IPC in the loop, NCCL) are named in the log and the weights go over gRPC.
//!
//! Every sync follows the version protocol: engines pause (running requests finish, or
//! abort with their partial output), copy, take the new version, resume.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use manta_cluster::rollout::pool::PauseMode as WirePause;
use manta_cluster::weights;
use manta_cluster::RemotePool;
use manta_proto::weight_sync::{EngineDigest, TensorDigest};
use manta_rollout::engine::PauseMode;
use manta_rollout::RolloutMsg;
use manta_telemetry::StepMetrics;
use manta_weight_sync::route::{self, Endpoint};
use manta_weight_sync::{SyncOptions, WeightSyncMsg};
use ractor::{call, ActorRef};
use tracing::{info, warn};

use crate::trainer_handle::TrainerHandle;

/// `MANTA_VERIFY_WEIGHT_SYNC=1`: after every sync, read each engine's weights back,
/// compare them with the trainer's bit for bit (the run fails on a difference), and
/// append the digests to `runs/<run>/weight_sync.jsonl`; a node that rejoins is checked
/// the same way after its sync.
pub const VERIFY_ENV: &str = "MANTA_VERIFY_WEIGHT_SYNC";

/// The engines weights go to.
pub enum Targets {
    /// Engines in the driver process, fed by the in-process weight-sync actor.
    InProcess {
        actor: ActorRef<WeightSyncMsg>,
        engines: Vec<ActorRef<RolloutMsg>>,
    },
    /// Engines on worker daemons, fed over gRPC.
    Workers(Arc<RemotePool>),
    /// No engine (`--load-debug-rollout-data`).
    None,
}

/// What one sync did.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncOutcome {
    pub version: u64,
    /// From the request to the last engine's ack (`perf/update_weights_time`).
    pub seconds: f64,
    /// Longest time an engine was paused (`perf/pause_to_resume_time`).
    pub pause_to_resume_s: f64,
    pub engines: usize,
}

impl SyncOutcome {
    /// Adds `perf/update_weights_time`, `perf/pause_to_resume_time` and `weights/version`.
    pub fn record(&self, m: &mut StepMetrics) {
        m.insert("perf/update_weights_time".into(), self.seconds);
        m.insert("perf/pause_to_resume_time".into(), self.pause_to_resume_s);
        m.insert("weights/version".into(), self.version as f64);
    }
}

/// Moves the trainer's weights into every engine.
pub struct WeightSync {
    trainer: TrainerHandle,
    targets: Targets,
    pause: PauseMode,
    /// Where verification records go (see [`VERIFY_ENV`]).
    verify: Option<PathBuf>,
}

impl WeightSync {
    /// A sync from `trainer` (living at `trainer_at`) to `targets` (engines at
    /// `engines_at`, by name); logs the mechanism placement picks for each pair.
    pub fn new(
        trainer: TrainerHandle,
        trainer_at: &Endpoint,
        targets: Targets,
        engines_at: &[(String, Endpoint)],
    ) -> Self {
        for (name, at) in engines_at {
            let wanted = route::choose(trainer_at, at);
            match route::resolve(trainer_at, at) {
                (used, None) => info!(engine = %name, mechanism = %used, "weight sync route"),
                (used, Some(why)) => warn!(
                    engine = %name,
                    wanted = %wanted,
                    used = %used,
                    "weight sync route: {why}; using {used}"
                ),
            }
        }
        Self {
            trainer,
            targets,
            pause: PauseMode::Drain,
            verify: None,
        }
    }

    /// No engine to feed (debug rollout data).
    pub fn none(trainer: TrainerHandle) -> Self {
        Self::new(trainer, &Endpoint::in_driver(None), Targets::None, &[])
    }

    /// Verifies every sync and appends the digests to `path` when [`VERIFY_ENV`] is set.
    pub fn verifying_from_env(mut self, path: PathBuf) -> Self {
        if std::env::var(VERIFY_ENV).is_ok_and(|v| v == "1" || v == "true") {
            if let Targets::Workers(pool) = &self.targets {
                pool.verify_rejoins();
            }
            self.verify = Some(path);
        }
        self
    }

    /// Running requests end now (kept as partial output) instead of finishing.
    pub fn abort_on_pause(mut self) -> Self {
        self.pause = PauseMode::Abort;
        self
    }

    /// Puts the trainer's current weights into every engine as `version` (an older
    /// version is allowed: a rewind to a checkpoint).
    pub async fn sync(&self, version: u64) -> anyhow::Result<SyncOutcome> {
        let started = Instant::now();
        let (pause_to_resume_s, engines, expected) = match &self.targets {
            Targets::None => (0.0, 0, None),
            Targets::InProcess { actor, engines } => {
                let opts = SyncOptions {
                    pause: self.pause,
                    allow_rewind: true,
                };
                let report = call!(actor, WeightSyncMsg::SyncWith, version, opts)
                    .context("the weight-sync actor did not answer")?
                    .context("in-process weight sync")?;
                (report.pause_to_resume_s, engines.len(), None)
            }
            Targets::Workers(pool) => {
                let set = Arc::new(
                    self.trainer
                        .weight_set()
                        .await
                        .context("reading the trainer's weights")?,
                );
                let chunk = weights::chunk_bytes()?;
                let pause = match self.pause {
                    PauseMode::Abort => WirePause::Abort,
                    _ => WirePause::Drain,
                };
                let synced = pool
                    .publish_weights(set.clone(), version, chunk, pause)
                    .await
                    .with_context(|| format!("sending weights version {version} to the workers"))?;
                let expected = self.verify.is_some().then(|| set.digests());
                (synced.pause_to_resume_s, synced.engines, expected)
            }
        };
        let outcome = SyncOutcome {
            version,
            seconds: started.elapsed().as_secs_f64(),
            pause_to_resume_s,
            engines,
        };
        if let Some(path) = &self.verify {
            self.verify(path, version, expected).await?;
        }
        Ok(outcome)
    }

    /// Compares every engine's weights with the trainer's, bit for bit, and records them.
    async fn verify(
        &self,
        path: &std::path::Path,
        version: u64,
        expected: Option<Vec<TensorDigest>>,
    ) -> anyhow::Result<()> {
        let expected = match expected {
            Some(e) => e,
            None => {
                let set = self.trainer.weight_set().await?;
                set.digests()
            }
        };
        let mut found: Vec<(String, EngineDigest)> = Vec::new();
        match &self.targets {
            Targets::None => return Ok(()),
            Targets::InProcess { engines, .. } => {
                for (i, engine) in engines.iter().enumerate() {
                    let tensors = call!(engine, RolloutMsg::ReadWeights)
                        .context("a rollout actor did not answer")?
                        .context("reading an engine's weights")?;
                    let v = call!(engine, RolloutMsg::WeightVersion)
                        .context("a rollout actor did not answer")?;
                    let digests =
                        tokio::task::spawn_blocking(move || weights::digest_tensors(&tensors))
                            .await??;
                    found.push((
                        "driver".into(),
                        EngineDigest {
                            actor: format!("rollout-{i}"),
                            version: v,
                            tensors: digests,
                        },
                    ));
                }
            }
            Targets::Workers(pool) => {
                for (node, digests) in pool.engine_digests().await {
                    for d in digests? {
                        found.push((node.clone(), d));
                    }
                }
            }
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        for (node, engine) in &found {
            let line = serde_json::json!({
                "version": version,
                "node": node,
                "actor": engine.actor,
                "engine_version": engine.version,
                "tensors": engine
                    .tensors
                    .iter()
                    .map(|t| (t.name.clone(), serde_json::Value::from(t.sha256.clone())))
                    .collect::<serde_json::Map<_, _>>(),
            });
            writeln!(file, "{line}").with_context(|| format!("writing {}", path.display()))?;
        }
        for (node, engine) in &found {
            if engine.version != version {
                anyhow::bail!(
                    "engine {} on {node} reports weights version {} after syncing {version}",
                    engine.actor,
                    engine.version
                );
            }
            if let Some(t) = first_difference(&expected, &engine.tensors) {
                anyhow::bail!(
                    "engine {} on {node}: tensor {t} differs from the trainer's after syncing version {version}",
                    engine.actor
                );
            }
        }
        info!(
            version,
            engines = found.len(),
            "weight sync verified bit for bit"
        );
        Ok(())
    }
}

/// The first tensor (by name) whose bytes, dtype or shape differ, or that one side lacks.
fn first_difference(expected: &[TensorDigest], got: &[TensorDigest]) -> Option<String> {
    let by_name = |ds: &[TensorDigest]| {
        ds.iter()
            .map(|d| (d.name.clone(), d.clone()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (a, b) = (by_name(expected), by_name(got));
    a.keys()
        .chain(b.keys())
        .find(|k| a.get(*k) != b.get(*k))
        .cloned()
}

/// Where the trainer lives, for [`route::choose`]: on its worker, or in the driver
/// (on the first of `gpus`, the CPU when none).
pub fn trainer_endpoint(trainer: &TrainerHandle, gpus: &[u32]) -> Endpoint {
    match trainer.remote() {
        Some(r) => Endpoint::on_worker(r.addr(), gpus.first().copied()),
        None => Endpoint::in_driver(gpus.first().copied()),
    }
}

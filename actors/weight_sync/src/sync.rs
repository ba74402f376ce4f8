//! Weight sync as the step loop sees it: one call, [`WeightSync::sync`], the same in
//! local and remote mode. Placement picks the mechanism per trainer/engine pair
//! ([`crate::route`]): engines in the driver take the trainer's tensors in-process (a
//! copy, or one NCCL broadcast group when they sit on GPUs of their own); engines on
//! workers receive the weights as bounded gRPC chunks (no shared disk), staged before
//! the engines pause. Mechanisms this build cannot run yet (CUDA IPC between workers,
//! NCCL to workers) are named in the log and the weights go over gRPC.
//!
//! Every sync follows the version protocol: engines pause (running requests finish, or
//! abort with their partial output), copy, take the new version, resume.
//!
//! Where the engines are is an [`EngineTargets`]: engines in this process
//! ([`crate::targets::in_process`]) or on worker daemons ([`crate::targets::workers`]);
//! [`WeightSync`] has one code path over either.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use manta_engine::PauseMode;
use manta_hosting::weights::WeightSet;
use manta_hosting::TrainerCallError;
use manta_proto::weight_sync::{EngineDigest, TensorDigest};
use manta_telemetry::StepMetrics;
use tracing::{info, warn};

use crate::route::{self, Endpoint};

/// The trainer as weight sync sees it, in this process or on a worker.
#[async_trait::async_trait]
pub trait TrainerWeights: Send + Sync {
    /// Every weight with its bytes and digests (gRPC publication, verification).
    async fn weight_set(&self) -> Result<WeightSet, TrainerCallError>;
    /// The weights as tensors where the trainer is, for a broadcast rooted in this
    /// process (`None`: the trainer is elsewhere).
    async fn tensors(&self) -> Result<Option<manta_engine::NamedTensors>, TrainerCallError> {
        Ok(None)
    }
    /// The weights a group of parameters at a time, where the trainer holds them only
    /// in shards (ZeRO-3 ranks in this process gather one decoder layer per group, and the
    /// next only once the receiver has marked this one copied), so no device ever holds
    /// the whole model for a sync. `None`: read [`TrainerWeights::tensors`] instead.
    async fn weight_parts(&self) -> Result<Option<TrainerParts>, TrainerCallError> {
        Ok(None)
    }
    /// The worker hosting the trainer (`None`: this process).
    fn worker_addr(&self) -> Option<&str>;
}

/// A trainer's weights in parts ([`TrainerWeights::weight_parts`]): the groups, in order,
/// and the trainer's own outcome once the last is sent.
pub struct TrainerParts {
    /// Every part's tensors by name, shape and kind, in the order they come (known
    /// before the first: a broadcast names every round up front).
    pub layout: Vec<Vec<manta_engine::WeightShape>>,
    pub parts: manta_engine::WeightParts,
    pub finished: tokio::task::JoinHandle<Result<(), TrainerCallError>>,
}

impl TrainerParts {
    /// The trainer's outcome, once every part was taken (or the receiver dropped them).
    pub async fn finish(self) -> Result<(), TrainerCallError> {
        drop(self.parts);
        self.finished.await.map_err(|e| TrainerCallError::Failed {
            addr: "this process".into(),
            message: format!("the task reading the trainer's weights: {e}"),
        })?
    }
}

/// `MANTA_VERIFY_WEIGHT_SYNC=1`: after every sync, read each engine's weights back,
/// compare them with the trainer's bit for bit (the run fails on a difference), and
/// append the digests to `runs/<run>/weight_sync.jsonl`; a node that rejoins is checked
/// the same way after its sync.
pub const VERIFY_ENV: &str = manta_knobs::VERIFY_WEIGHT_SYNC;

/// The engines weights go to, wherever they live.
#[async_trait::async_trait]
pub trait EngineTargets: Send + Sync {
    /// Puts `trainer`'s current weights into every engine as `version`, each engine
    /// pausing as `pause` says. `want_digests`: return the digests of what was sent, when
    /// the weights passed through here as bytes (verification then reads them no
    /// second time).
    async fn publish(
        &self,
        trainer: &dyn TrainerWeights,
        version: u64,
        pause: PauseMode,
        want_digests: bool,
    ) -> anyhow::Result<Published>;

    /// What every engine holds now, by where it lives (verification).
    async fn engine_digests(&self) -> anyhow::Result<Vec<(String, EngineDigest)>>;

    /// Verification is on: engines that rejoin later are checked too (where they can).
    fn verify_rejoins(&self) {}

    /// Gives every engine that holds an older version than the last sync (it restarted
    /// and lost weights no file holds) the trainer's current weights; names them. Engines
    /// on workers are re-fed when their node rejoins, so the default finds none.
    async fn refresh_lagging(&self) -> anyhow::Result<Vec<String>> {
        Ok(Vec::new())
    }
}

/// What one publication did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Published {
    /// Longest time an engine was paused.
    pub pause_to_resume_s: f64,
    /// Engines that took the version.
    pub engines: usize,
    /// The sent weights' digests, when asked for and at hand.
    pub sent: Option<Vec<TensorDigest>>,
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
    trainer: Arc<dyn TrainerWeights>,
    /// `None`: no engine to feed (`--load-debug-rollout-data`).
    targets: Option<Arc<dyn EngineTargets>>,
    pause: PauseMode,
    /// Where verification records go (see [`VERIFY_ENV`]).
    verify: Option<PathBuf>,
}

impl WeightSync {
    /// A sync from `trainer` (living at `trainer_at`) to `targets` (engines at
    /// `engines_at`, by name); logs the mechanism placement picks for each pair.
    pub fn new(
        trainer: Arc<dyn TrainerWeights>,
        trainer_at: &Endpoint,
        targets: impl EngineTargets + 'static,
        engines_at: &[(String, Endpoint)],
    ) -> Self {
        Self::with_targets(trainer, trainer_at, Some(Arc::new(targets)), engines_at)
    }

    /// A sync from `trainer` to engines on workers (at `engines_at`) through the one
    /// weight-update group `group` describes; logs each pair's mechanism, rank 0 and why.
    pub fn over_worker_group(
        trainer: Arc<dyn TrainerWeights>,
        group: &route::WorkerGroupRoute,
        targets: impl EngineTargets + 'static,
        engines_at: &[(String, Endpoint)],
    ) -> Self {
        for (name, at) in engines_at {
            info!(
                engine = %name,
                node = %at.process,
                mechanism = group.mechanism(),
                rank0 = %group.rank0(),
                why = group.why(),
                "weight sync route: {} from {} (rank 0) into engine {name} on {}, as {} asks",
                group.mechanism(),
                group.rank0(),
                at.process,
                group.why()
            );
        }
        Self::with_targets(trainer, &group.rank0, Some(Arc::new(targets)), &[])
    }

    fn with_targets(
        trainer: Arc<dyn TrainerWeights>,
        trainer_at: &Endpoint,
        targets: Option<Arc<dyn EngineTargets>>,
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
    pub fn none(trainer: Arc<dyn TrainerWeights>) -> Self {
        Self::with_targets(trainer, &Endpoint::in_driver(None), None, &[])
    }

    /// Verifies every sync and appends the digests to `path` when [`VERIFY_ENV`] is set.
    pub fn verifying_from_env(mut self, path: PathBuf) -> Self {
        if manta_knobs::verify_weight_sync() {
            if let Some(targets) = &self.targets {
                targets.verify_rejoins();
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
        let published = match &self.targets {
            None => Published::default(),
            Some(targets) => {
                targets
                    .publish(
                        self.trainer.as_ref(),
                        version,
                        self.pause,
                        self.verify.is_some(),
                    )
                    .await?
            }
        };
        let outcome = SyncOutcome {
            version,
            seconds: started.elapsed().as_secs_f64(),
            pause_to_resume_s: published.pause_to_resume_s,
            engines: published.engines,
        };
        if let Some(path) = &self.verify {
            self.verify(path, version, published.sent).await?;
        }
        Ok(outcome)
    }

    /// Re-sends the last synced weights to engines that lost them (see
    /// [`EngineTargets::refresh_lagging`]); names the engines it fed. Call it between
    /// training steps only: the trainer's weights must be the last version synced.
    pub async fn refresh_lagging(&self) -> anyhow::Result<Vec<String>> {
        match &self.targets {
            None => Ok(Vec::new()),
            Some(targets) => targets.refresh_lagging().await,
        }
    }

    /// Compares every engine's weights with the trainer's, bit for bit, and records them.
    async fn verify(
        &self,
        path: &std::path::Path,
        version: u64,
        expected: Option<Vec<TensorDigest>>,
    ) -> anyhow::Result<()> {
        let Some(targets) = &self.targets else {
            return Ok(());
        };
        let expected = match expected {
            Some(e) => e,
            None => {
                let set = self.trainer.weight_set().await?;
                set.digests()
            }
        };
        let found = targets.engine_digests().await?;
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
pub fn trainer_endpoint(trainer: &dyn TrainerWeights, gpus: &[u32]) -> Endpoint {
    match trainer.worker_addr() {
        Some(addr) => Endpoint::on_worker(addr, gpus.first().copied()),
        None => Endpoint::in_driver(gpus.first().copied()),
    }
}

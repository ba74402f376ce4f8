//! `cluster.toml`: where the actors run.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{read, ConfigError};
use crate::settings::TrainOverrides;
use crate::trainer_ranks::TrainerRankPlace;

/// Where the driver places actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClusterMode {
    /// One in-process worker inside the driver: no daemons, no GPU needed.
    #[default]
    Local,
    /// Worker daemons listed under `[[nodes]]`.
    Remote,
}

/// Which inference engine rollout actors drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Manta's tch engine, sharing the trainer's model code.
    #[default]
    Native,
    /// An SGLang server launched as a child process.
    Sglang,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterSection {
    #[serde(default)]
    mode: ClusterMode,
    /// train_config.yaml to use when `--config` is not given, relative to cluster.toml.
    train_config: Option<PathBuf>,
    /// Remote mode: how often the driver heartbeats each worker.
    #[serde(default = "default_heartbeat_ms")]
    heartbeat_interval_ms: u64,
    /// Remote mode: a worker silent this long is dead and its episodes move elsewhere.
    #[serde(default = "default_dead_after_ms")]
    dead_after_ms: u64,
    /// Remote mode: how long spawning one actor on a worker may take (model load).
    #[serde(default = "default_spawn_timeout_s")]
    spawn_timeout_s: u64,
    /// Remote mode: a worker that hears no heartbeat from the driver for this long stops
    /// the actors it placed there (a driver killed without Ctrl-C leaves nothing behind).
    #[serde(default = "default_lease_timeout_ms")]
    lease_timeout_ms: u64,
    /// Remote mode: reach the workers over TLS, trusting this CA (PEM; relative to cluster.toml).
    tls_ca: Option<PathBuf>,
    /// Remote mode: the name the workers' certificates must carry (default: each node's host).
    tls_domain: Option<String>,
    /// Remote mode: how weights reach the engines on workers.
    #[serde(default)]
    worker_weights: WorkerWeights,
    /// Remote mode: the address workers reach the driver at, for the weight-update
    /// group's store (`worker_weights` "nccl" or "store").
    #[serde(default = "default_driver_address")]
    driver_address: String,
}

/// `cluster.worker_weights`: how the trainer's weights reach engines on workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum WorkerWeights {
    /// Bounded chunks over Manta's gRPC (any placement; no shared disk).
    #[default]
    Grpc,
    /// One NCCL broadcast group, rank 0 the trainer in the driver on its GPU, every
    /// engine on a worker GPU a member.
    Nccl,
    /// The same group protocol through the driver's TCPStore, for engines without GPUs
    /// (small models, tests).
    Store,
}

fn default_driver_address() -> String {
    "127.0.0.1".into()
}

fn default_heartbeat_ms() -> u64 {
    1000
}
fn default_dead_after_ms() -> u64 {
    3000
}
fn default_spawn_timeout_s() -> u64 {
    120
}
fn default_lease_timeout_ms() -> u64 {
    10_000
}
fn default_restart_timeout_s() -> u64 {
    120
}

/// What the driver does when the trainer's worker is lost mid-run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TrainerFailurePolicy {
    /// Wait for the node to come back, re-create the trainer from the last checkpoint
    /// (or the initial weights) and go on from the step after it.
    #[default]
    Restart,
    /// Stop the run with a message saying how to resume.
    Stop,
}

/// `[trainer]`: where the trainer runs and what happens when it is lost.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TrainerSection {
    /// Remote mode: index into `[[nodes]]` of the worker hosting the trainer; absent,
    /// the driver process hosts it.
    pub node: Option<usize>,
    /// GPUs of that node the trainer uses (empty: CPU); in local mode, GPUs of this
    /// machine, one data-parallel rank on each (NCCL). A remote trainer computes on the
    /// first.
    #[serde(default)]
    pub gpus: Vec<u32>,
    /// Local mode: data-parallel trainer ranks (ZeRO-2). On the CPU (no `gpus`), this many
    /// ranks as threads of the driver; with `gpus`, it may only repeat their count.
    /// Absent: one rank, or one per listed GPU.
    #[serde(default)]
    pub data_parallel_ranks: Option<usize>,
    /// Remote mode: data-parallel ranks on workers, rank r at the r-th entry
    /// (crate::trainer_ranks); instead of `node`, `gpus` and `data_parallel_ranks`.
    #[serde(default)]
    pub ranks: Vec<TrainerRankPlace>,
    /// Megatron/slime's `--bf16`: bf16 weights and compute with fp32 master weights and
    /// fp32 AdamW state. Absent: bf16 when the trainer runs on a GPU, fp32 on the CPU.
    #[serde(default)]
    pub bf16: Option<bool>,
    #[serde(default)]
    pub on_failure: TrainerFailurePolicy,
    /// How long `on_failure = "restart"` waits for the trainer's node to answer again.
    #[serde(default = "default_restart_timeout_s")]
    pub restart_timeout_s: u64,
}

impl TrainerSection {
    /// Data-parallel ranks of a local-mode trainer: one per listed GPU, else
    /// `data_parallel_ranks` (1 when absent). Validated with the file.
    pub fn data_parallel_world(&self) -> usize {
        if self.gpus.is_empty() {
            self.data_parallel_ranks.unwrap_or(1)
        } else {
            self.gpus.len()
        }
    }
}

impl Default for TrainerSection {
    fn default() -> Self {
        Self {
            node: None,
            gpus: Vec::new(),
            bf16: None,
            data_parallel_ranks: None,
            ranks: Vec::new(),
            on_failure: TrainerFailurePolicy::Restart,
            restart_timeout_s: default_restart_timeout_s(),
        }
    }
}

/// `[[nodes]]`: a worker daemon the driver uses in remote mode.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// `host:port` the worker listens on.
    pub address: String,
    /// GPUs the node must offer (empty for CPU-only local-model mode).
    #[serde(default)]
    pub gpus: Vec<u32>,
}

/// `[rollout]`: engines and episode concurrency.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    #[serde(default)]
    pub engine: EngineKind,
    /// Number of rollout actors (engines) in local mode; per node in remote mode.
    #[serde(default = "one")]
    pub engines: usize,
    /// Episodes in flight per rollout actor.
    #[serde(default = "default_concurrency")]
    pub max_concurrent_episodes: usize,
    /// Largest batch the native engine decodes at once.
    #[serde(default = "default_engine_batch")]
    pub max_batch_size: usize,
    /// Remote mode: indices into `[[nodes]]` that host rollout engines (default: all).
    pub nodes: Option<Vec<usize>>,
    /// GPUs each engine uses (0: CPU; SGLang's tensor parallel size otherwise).
    #[serde(default)]
    pub gpus_per_engine: usize,
    /// Engines share the trainer's GPUs on its node instead of using others.
    #[serde(default)]
    pub colocate: bool,
    /// `engine = "sglang"`: the program and leading arguments of the server, before the
    /// flags Manta adds (`--model-path`, `--port`, ...) [`python3 -m sglang.launch_server`].
    /// `driver serve` is the stand-in where SGLang cannot run.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// SGLang's `--mem-fraction-static` (left to the server when absent); in local mode
    /// also the native engine's share of its GPU (default 0.85, 0.3 when colocated).
    #[serde(default)]
    pub mem_fraction_static: Option<f64>,
    /// More flags appended to the server's command line as given.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// How long a launched server may take to answer `/health_generate`.
    #[serde(default = "default_engine_health_timeout_s")]
    pub health_timeout_s: u64,
    /// Period of the health check of a running server.
    #[serde(default = "default_engine_health_interval_ms")]
    pub health_interval_ms: u64,
    /// Restarts allowed per engine before its rollout actor gives up.
    #[serde(default = "default_engine_max_restarts")]
    pub max_restarts: u32,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            mode: ClusterMode::Local,
            train_config: None,
            heartbeat_interval_ms: default_heartbeat_ms(),
            dead_after_ms: default_dead_after_ms(),
            spawn_timeout_s: default_spawn_timeout_s(),
            lease_timeout_ms: default_lease_timeout_ms(),
            tls_ca: None,
            tls_domain: None,
            worker_weights: WorkerWeights::Grpc,
            driver_address: default_driver_address(),
        }
    }
}

fn one() -> usize {
    1
}
fn default_concurrency() -> usize {
    64
}
fn default_engine_batch() -> usize {
    64
}
fn default_engine_health_timeout_s() -> u64 {
    600
}
fn default_engine_health_interval_ms() -> u64 {
    5000
}
fn default_engine_max_restarts() -> u32 {
    5
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            engine: EngineKind::Native,
            engines: 1,
            max_concurrent_episodes: default_concurrency(),
            max_batch_size: default_engine_batch(),
            nodes: None,
            gpus_per_engine: 0,
            colocate: false,
            command: None,
            mem_fraction_static: None,
            extra_args: Vec::new(),
            health_timeout_s: default_engine_health_timeout_s(),
            health_interval_ms: default_engine_health_interval_ms(),
            max_restarts: default_engine_max_restarts(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    cluster: ClusterSection,
    #[serde(default)]
    rollout: RolloutSection,
    #[serde(default)]
    trainer: TrainerSection,
    #[serde(default)]
    train: TrainOverrides,
    #[serde(default)]
    nodes: Vec<NodeConfig>,
}

/// Remote mode over TLS: the CA the workers' certificates chain to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTls {
    /// `cluster.tls_ca`, resolved against the cluster file's folder; checked to exist
    /// and hold a PEM certificate when the file is loaded.
    pub ca: PathBuf,
    /// `cluster.tls_domain`: overrides the name checked in each worker's certificate.
    pub domain: Option<String>,
}

/// The parsed `cluster.toml`.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The file it was read from (for messages and relative paths).
    pub path: PathBuf,
    pub mode: ClusterMode,
    /// Absolute (resolved) path of the default train_config.yaml, if named.
    pub train_config: Option<PathBuf>,
    pub rollout: RolloutSection,
    pub trainer: TrainerSection,
    /// Defaults for the training flags (`[train]`), below the command line.
    pub train: TrainOverrides,
    /// Worker daemons (remote mode only).
    pub nodes: Vec<NodeConfig>,
    pub heartbeat_interval_ms: u64,
    pub dead_after_ms: u64,
    pub spawn_timeout_s: u64,
    /// Remote mode: workers stop a silent driver's actors after this long.
    pub lease_timeout_ms: u64,
    /// Remote mode: TLS to the workers (`cluster.tls_ca`); `None` is plaintext.
    pub tls: Option<ClusterTls>,
    /// Remote mode: how weights reach the workers' engines (`cluster.worker_weights`).
    pub worker_weights: WorkerWeights,
    /// Remote mode: where workers reach the driver's weight-update store.
    pub driver_address: String,
}

impl ClusterConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = read(path)?;
        Self::from_toml_str(&text, path)
    }

    /// Parses `text` as if read from `path` (used for messages and relative paths).
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let raw: RawCluster = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        validate_remote(&raw, path)?;
        validate_placement(&raw, path)?;
        validate_data_parallel(&raw, path)?;
        crate::trainer_ranks::validate(&raw.trainer, raw.cluster.mode, &raw.nodes, path)?;
        if let Some(command) = &raw.rollout.command {
            if command.first().is_none_or(|p| p.is_empty()) {
                return Err(ConfigError::invalid(
                    path,
                    "rollout.command",
                    format!("{command:?}"),
                    "must name a program (e.g. [\"python3\", \"-m\", \"sglang.launch_server\"])",
                ));
            }
        }
        if let Some(f) = raw.rollout.mem_fraction_static {
            if !(f > 0.0 && f <= 1.0) {
                return Err(ConfigError::invalid(
                    path,
                    "rollout.mem_fraction_static",
                    f,
                    "must be in (0, 1]",
                ));
            }
        }
        for (key, value) in [
            ("rollout.engines", raw.rollout.engines),
            (
                "rollout.max_concurrent_episodes",
                raw.rollout.max_concurrent_episodes,
            ),
            ("rollout.max_batch_size", raw.rollout.max_batch_size),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(path, key, value, "must be at least 1"));
            }
        }
        raw.train.validate(path, "train.")?;
        let base = path.parent().unwrap_or(Path::new("."));
        let tls = cluster_tls(&raw, path, base)?;
        validate_worker_weights(&raw, path)?;
        Ok(ClusterConfig {
            path: path.to_path_buf(),
            mode: raw.cluster.mode,
            train_config: raw.cluster.train_config.map(|p| base.join(p)),
            rollout: raw.rollout,
            trainer: raw.trainer,
            train: raw.train,
            nodes: raw.nodes,
            heartbeat_interval_ms: raw.cluster.heartbeat_interval_ms,
            dead_after_ms: raw.cluster.dead_after_ms,
            spawn_timeout_s: raw.cluster.spawn_timeout_s,
            lease_timeout_ms: raw.cluster.lease_timeout_ms,
            tls,
            worker_weights: raw.cluster.worker_weights,
            driver_address: raw.cluster.driver_address,
        })
    }
}

/// `cluster.worker_weights`: a broadcast group needs remote mode. Its rank 0 is the
/// trainer: in the driver (its store at `driver_address`), or on `trainer.node`'s worker.
/// NCCL needs the trainer on a GPU (its first) and no engine on that GPU (one rank per
/// GPU); the store backend moves CPU tensors, so a trainer on a worker has no GPUs.
fn validate_worker_weights(raw: &RawCluster, path: &Path) -> Result<(), ConfigError> {
    let c = &raw.cluster;
    let key = "cluster.worker_weights";
    let shown = match c.worker_weights {
        WorkerWeights::Grpc => return Ok(()),
        WorkerWeights::Nccl => "\"nccl\"",
        WorkerWeights::Store => "\"store\"",
    };
    if c.mode != ClusterMode::Remote {
        return Err(ConfigError::invalid(
            path,
            key,
            shown,
            "weights go to workers only with cluster.mode = \"remote\"",
        ));
    }
    if let Some(node) = raw.trainer.root_node() {
        if c.worker_weights == WorkerWeights::Store && !raw.trainer.root_gpus().is_empty() {
            return Err(ConfigError::invalid(
                path,
                key,
                shown,
                format!(
                    "the store backend moves CPU tensors, but the trainer (rank 0) is on GPU {:?} of node {node}: use \"nccl\"",
                    raw.trainer.root_gpus()
                ),
            ));
        }
        let engines_here = raw.rollout.nodes.as_ref().is_none_or(|n| n.contains(&node));
        if c.worker_weights == WorkerWeights::Nccl && raw.rollout.colocate && engines_here {
            return Err(ConfigError::invalid(
                path,
                key,
                shown,
                format!(
                    "NCCL takes one rank per GPU, but rollout.colocate = true puts engines on the trainer's GPUs of node {node}: leave colocate off, or use \"grpc\""
                ),
            ));
        }
    }
    if c.worker_weights == WorkerWeights::Nccl && raw.trainer.root_gpus().is_empty() {
        return Err(ConfigError::invalid(
            path,
            key,
            shown,
            "NCCL broadcasts from the trainer's GPU: set trainer.gpus (or each of trainer.ranks' gpu), or use \"store\" on CPUs",
        ));
    }
    if c.driver_address.trim().is_empty() || c.driver_address.contains(char::is_whitespace) {
        return Err(ConfigError::invalid(
            path,
            "cluster.driver_address",
            format!("{:?}", c.driver_address),
            "must be a host name or address the workers reach the driver at",
        ));
    }
    Ok(())
}

/// `cluster.tls_ca` / `cluster.tls_domain`: remote mode only; the CA file must exist and
/// hold a PEM certificate now, not at the first connection.
fn cluster_tls(
    raw: &RawCluster,
    path: &Path,
    base: &Path,
) -> Result<Option<ClusterTls>, ConfigError> {
    let c = &raw.cluster;
    let Some(ca) = &c.tls_ca else {
        if let Some(domain) = &c.tls_domain {
            return Err(ConfigError::invalid(
                path,
                "cluster.tls_domain",
                format!("{domain:?}"),
                "only used together with cluster.tls_ca",
            ));
        }
        return Ok(None);
    };
    let shown = format!("{:?}", ca.display().to_string());
    if c.mode != ClusterMode::Remote {
        return Err(ConfigError::invalid(
            path,
            "cluster.tls_ca",
            shown,
            "TLS to worker daemons is only used with cluster.mode = \"remote\"",
        ));
    }
    let resolved = base.join(ca);
    let text = std::fs::read_to_string(&resolved).map_err(|e| {
        ConfigError::invalid(
            path,
            "cluster.tls_ca",
            &shown,
            format!("cannot read {}: {e}", resolved.display()),
        )
    })?;
    if !text.contains("-----BEGIN CERTIFICATE-----") {
        return Err(ConfigError::invalid(
            path,
            "cluster.tls_ca",
            shown,
            format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                resolved.display()
            ),
        ));
    }
    if let Some(domain) = &c.tls_domain {
        if domain.is_empty() || domain.chars().any(|ch| ch.is_whitespace() || ch == '/') {
            return Err(ConfigError::invalid(
                path,
                "cluster.tls_domain",
                format!("{domain:?}"),
                "must be a host name (or IP address) the workers' certificates carry",
            ));
        }
    }
    Ok(Some(ClusterTls {
        ca: resolved,
        domain: c.tls_domain.clone(),
    }))
}

impl ClusterConfig {
    /// Indices of the nodes hosting rollout engines (remote mode).
    pub fn rollout_nodes(&self) -> Vec<usize> {
        match &self.rollout.nodes {
            Some(nodes) => nodes.clone(),
            None => (0..self.nodes.len()).collect(),
        }
    }

    /// Local mode: GPUs of this machine for rollout engine `engine` (empty on CPU):
    /// `rollout.gpus_per_engine` of them, counting from GPU 0 and skipping the trainer's
    /// unless engines are colocated with it.
    pub fn local_engine_gpus(&self, engine: usize) -> Vec<u32> {
        let per = self.rollout.gpus_per_engine;
        let taken = |g: &u32| !self.rollout.colocate && self.trainer.gpus.contains(g);
        (0u32..)
            .filter(|g| !taken(g))
            .skip(engine * per)
            .take(per)
            .collect()
    }

    /// GPUs of node `node` for its rollout engine `engine` (empty on CPU): the node's
    /// GPUs in order, skipping the trainer's (or its ranks') unless engines are
    /// colocated with it.
    pub fn engine_gpus(&self, node: usize, engine: usize) -> Vec<u32> {
        let per = self.rollout.gpus_per_engine;
        let trainer_here = if self.rollout.colocate {
            Vec::new()
        } else {
            self.trainer.gpus_on(node)
        };
        let free: Vec<u32> = self.nodes[node]
            .gpus
            .iter()
            .copied()
            .filter(|g| !trainer_here.contains(g))
            .collect();
        free.into_iter().skip(engine * per).take(per).collect()
    }
}

/// `trainer.data_parallel_ranks`: at least 1, the GPU count when `trainer.gpus` lists
/// GPUs, and local mode only (remote mode lists its ranks in `trainer.ranks`).
fn validate_data_parallel(raw: &RawCluster, path: &Path) -> Result<(), ConfigError> {
    let t = &raw.trainer;
    let Some(ranks) = t.data_parallel_ranks else {
        return Ok(());
    };
    const KEY: &str = "trainer.data_parallel_ranks";
    if ranks == 0 {
        return Err(ConfigError::invalid(path, KEY, ranks, "must be at least 1"));
    }
    if !t.gpus.is_empty() && ranks != t.gpus.len() {
        return Err(ConfigError::invalid(
            path,
            KEY,
            ranks,
            format!(
                "trainer.gpus = {:?} runs one rank per GPU ({}); leave data_parallel_ranks out \
                 or set it to {}",
                t.gpus,
                t.gpus.len(),
                t.gpus.len()
            ),
        ));
    }
    if raw.cluster.mode == ClusterMode::Remote && ranks > 1 {
        return Err(ConfigError::invalid(
            path,
            KEY,
            ranks,
            "this key places ranks in the driver (local mode); in remote mode list them with \
             trainer.ranks = [{ node = 0 }, { node = 1 }] (and `gpu` for GPU ranks)",
        ));
    }
    Ok(())
}

/// Roles must fit the nodes: the trainer's node and GPUs exist, rollout nodes exist,
/// and each node has GPUs for its engines (plus the trainer's, unless colocated).
fn validate_placement(raw: &RawCluster, path: &Path) -> Result<(), ConfigError> {
    let t = &raw.trainer;
    let r = &raw.rollout;
    if raw.cluster.mode == ClusterMode::Local {
        for (key, set) in [
            ("trainer.node", t.node.is_some()),
            ("rollout.nodes", r.nodes.is_some()),
        ] {
            if set {
                return Err(ConfigError::invalid(
                    path,
                    key,
                    "set",
                    "node placement is only used with cluster.mode = \"remote\"",
                ));
            }
        }
        return Ok(());
    }
    let n = raw.nodes.len();
    if let Some(node) = t.node {
        if node >= n {
            return Err(ConfigError::invalid(
                path,
                "trainer.node",
                node,
                format!(
                    "there are {n} [[nodes]] (indices 0..{})",
                    n.saturating_sub(1)
                ),
            ));
        }
        let offered = &raw.nodes[node].gpus;
        if let Some(g) = t.gpus.iter().find(|g| !offered.contains(g)) {
            return Err(ConfigError::invalid(
                path,
                "trainer.gpus",
                format!("{:?}", t.gpus),
                format!("GPU {g} is not among nodes[{node}].gpus {offered:?}"),
            ));
        }
    } else if !t.gpus.is_empty() && raw.cluster.worker_weights != WorkerWeights::Nccl {
        return Err(ConfigError::invalid(
            path,
            "trainer.gpus",
            format!("{:?}", t.gpus),
            "the trainer runs in the driver (no trainer.node); the driver's GPUs are used only as the root of cluster.worker_weights = \"nccl\"",
        ));
    }
    if t.restart_timeout_s == 0 {
        return Err(ConfigError::invalid(
            path,
            "trainer.restart_timeout_s",
            0,
            "must be at least 1",
        ));
    }
    let rollout_nodes: Vec<usize> = match &r.nodes {
        Some(list) => {
            if list.is_empty() {
                return Err(ConfigError::invalid(
                    path,
                    "rollout.nodes",
                    "[]",
                    "name at least one node",
                ));
            }
            if let Some(bad) = list.iter().find(|&&i| i >= n) {
                return Err(ConfigError::invalid(
                    path,
                    "rollout.nodes",
                    format!("{list:?}"),
                    format!("node {bad} does not exist: there are {n} [[nodes]]"),
                ));
            }
            list.clone()
        }
        None => (0..n).collect(),
    };
    for (i, node) in raw.nodes.iter().enumerate() {
        let trainer = if r.colocate { 0 } else { t.gpus_on(i).len() };
        let engines = if rollout_nodes.contains(&i) {
            r.engines * r.gpus_per_engine
        } else {
            0
        };
        if trainer + engines > node.gpus.len() {
            return Err(ConfigError::invalid(
                path,
                format!("nodes[{i}].gpus"),
                format!("{:?}", node.gpus),
                format!(
                    "placement cannot be satisfied: the node needs {} GPUs ({trainer} for the trainer, \
                     {} engines x rollout.gpus_per_engine {})",
                    trainer + engines,
                    if rollout_nodes.contains(&i) { r.engines } else { 0 },
                    r.gpus_per_engine
                ),
            ));
        }
    }
    Ok(())
}

/// Remote mode needs nodes with `host:port` addresses, and heartbeats faster than the
/// dead-node timeout; local mode must not list nodes.
fn validate_remote(raw: &RawCluster, path: &Path) -> Result<(), ConfigError> {
    let c = &raw.cluster;
    match c.mode {
        ClusterMode::Local => {
            if !raw.nodes.is_empty() {
                return Err(ConfigError::invalid(
                    path,
                    "nodes",
                    format!("{} entries", raw.nodes.len()),
                    "[[nodes]] are only used with cluster.mode = \"remote\"",
                ));
            }
        }
        ClusterMode::Remote => {
            if raw.nodes.is_empty() {
                return Err(ConfigError::invalid(
                    path,
                    "nodes",
                    "[]",
                    "remote mode needs at least one [[nodes]] entry with an address",
                ));
            }
            let mut seen = std::collections::BTreeSet::new();
            for (i, n) in raw.nodes.iter().enumerate() {
                let key = format!("nodes[{i}].address");
                let ok = n
                    .address
                    .rsplit_once(':')
                    .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
                if !ok {
                    return Err(ConfigError::invalid(
                        path,
                        key,
                        format!("{:?}", n.address),
                        "must be host:port",
                    ));
                }
                if !seen.insert(n.address.clone()) {
                    return Err(ConfigError::invalid(
                        path,
                        key,
                        format!("{:?}", n.address),
                        "is listed twice",
                    ));
                }
            }
        }
    }
    if c.heartbeat_interval_ms == 0 {
        return Err(ConfigError::invalid(
            path,
            "cluster.heartbeat_interval_ms",
            0,
            "must be at least 1",
        ));
    }
    if c.dead_after_ms <= c.heartbeat_interval_ms {
        return Err(ConfigError::invalid(
            path,
            "cluster.dead_after_ms",
            c.dead_after_ms,
            format!(
                "must be longer than cluster.heartbeat_interval_ms ({})",
                c.heartbeat_interval_ms
            ),
        ));
    }
    if c.lease_timeout_ms < c.dead_after_ms {
        return Err(ConfigError::invalid(
            path,
            "cluster.lease_timeout_ms",
            c.lease_timeout_ms,
            format!(
                "must be at least cluster.dead_after_ms ({}): workers must not drop the \
                 actors of a driver that still counts them live",
                c.dead_after_ms
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

//! Remote mode: the trainer stays in the driver; rollout actors live on the `worker`
//! daemons cluster.toml lists. Placement is checked before anything starts.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use manta_config::{ClusterConfig, TrainConfig, TrainSettings};
use manta_runtime::pool::NodeSpec;
use manta_runtime::{load_token, ClientTls, PoolOptions, RemotePool, RolloutSpawnConfig};
use tracing::info;

use crate::driver_actor::RunSummary;
use crate::local;
use crate::run::{default_run_name, run_with_worker};
use crate::step::Rollouts;

fn absolute(path: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    std::fs::canonicalize(path).with_context(|| format!("resolving {}", path.display()))
}

/// Runs a training job with rollouts on worker daemons.
pub async fn train_remote(
    cluster: ClusterConfig,
    train: TrainConfig,
    mut settings: TrainSettings,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<RunSummary> {
    let token = load_token().context("remote mode needs the cluster token")?;
    let run_name = settings.run_name.clone().unwrap_or_else(default_run_name);
    settings.run_name = Some(run_name.clone());
    let weights_dir = absolute(&settings.runs_dir)
        .or_else(|_| {
            std::fs::create_dir_all(&settings.runs_dir)?;
            absolute(&settings.runs_dir)
        })?
        .join(&run_name)
        .join("weights");
    let nodes: Vec<NodeSpec> = cluster
        .nodes
        .iter()
        .map(|n| NodeSpec {
            address: n.address.clone(),
            gpus: n.gpus.clone(),
        })
        .collect();
    let spawn = RolloutSpawnConfig {
        model_dir: absolute(&settings.model)?,
        seed: settings.seed,
        train_config: absolute(&train.path)?,
        max_concurrent_episodes: cluster.rollout.max_concurrent_episodes,
        max_batch_size: cluster.rollout.max_batch_size,
    };
    let opts = PoolOptions {
        heartbeat_interval: Duration::from_millis(cluster.heartbeat_interval_ms),
        dead_after: Duration::from_millis(cluster.dead_after_ms),
        no_live_node_timeout: Duration::from_secs(60),
    };
    info!(
        nodes = nodes.len(),
        engines_per_node = cluster.rollout.engines,
        "placing rollout actors on worker nodes"
    );
    let tls = cluster
        .tls
        .as_ref()
        .map(|t| ClientTls::from_file("cluster.tls_ca", &t.ca, t.domain.clone()))
        .transpose()
        .with_context(|| format!("cluster {}", cluster.path.display()))?;
    let pool = RemotePool::start_with_tls(
        &nodes,
        &token,
        tls.as_ref(),
        spawn,
        cluster.rollout.engines,
        opts,
    )
    .await
    .with_context(|| format!("cluster {}", cluster.path.display()))?;
    let pool = Arc::new(pool);
    // The trainer, weight sync (with no local engines) and task listing stay here.
    let mut local_cluster = cluster.clone();
    local_cluster.rollout.engines = 0;
    let worker = local::start(&local_cluster, &train, &settings).await?;
    let rollouts = Rollouts::Remote {
        pool: pool.clone(),
        weights_dir,
    };
    let result = run_with_worker(&worker, rollouts, &train, &settings, stop).await;
    worker.shutdown().await;
    if let Ok(pool) = Arc::try_unwrap(pool) {
        pool.shutdown().await;
    }
    result
}

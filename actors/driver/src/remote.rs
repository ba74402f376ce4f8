//! Remote mode: rollout actors live on the `worker` daemons cluster.toml lists, and the
//! trainer on one of them (`[trainer] node = N`), as data-parallel ranks on several
//! (`[trainer] ranks`, crate::remote_ranks), or in the driver. Every node is
//! checked (reachable, token accepted, GPUs present, model directory there) before
//! anything starts. Every placer holds a lease its heartbeats renew, so workers stop
//! the actors of a driver that died without saying so.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use manta_config::{ClusterConfig, TrainConfig, TrainSettings, WorkerWeights};
use manta_cuda::weight_group::Backend;
use manta_hosting::rollout::pool::{GroupRoot, RootAt};
use manta_hosting::{
    NodeSpec, OpenRewardAccess, PoolOptions, RemotePool, RemoteTrainer, RolloutSpawnConfig,
    ShippedTrainConfig, TrainerSpawnConfig,
};
use manta_runtime::{load_token, ClientTls, Lease, WorkerClient};
use tracing::info;

use crate::local;
use crate::placement::TrainerRecovery;
use crate::placement::{Placed, Teardown};
use crate::remote_ranks::{node_host, Reach};
use crate::rollouts::Rollouts;
use crate::run_dir::default_run_name;
use crate::step::StepActors;
use crate::trainer_handle::TrainerHandle;
use manta_weight_sync::route::{Endpoint, WorkerGroupRoute};
use manta_weight_sync::targets::WorkerEngines;
use manta_weight_sync::{trainer_endpoint, WeightSync};

/// The trainer actor's name on its worker.
const TRAINER_NAME: &str = "trainer-0";

fn absolute(path: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    std::fs::canonicalize(path).with_context(|| format!("resolving {}", path.display()))
}

/// Remote mode (crate::placement): rollouts, and the trainer when `[trainer] node` says
/// so, on worker daemons; task listing here. Makes `settings`' paths absolute.
pub async fn place(
    cluster: &ClusterConfig,
    train: &TrainConfig,
    settings: &mut TrainSettings,
) -> anyhow::Result<Placed> {
    local::check_true_on_policy(&cluster.rollout, settings, true)?;
    let token = load_token().context("remote mode needs the cluster token")?;
    let run_name = settings.run_name.clone().unwrap_or_else(default_run_name);
    settings.run_name = Some(run_name.clone());
    // Workers read and write these paths: make them absolute (shared disk or one machine).
    settings.model = absolute(&settings.model)?;
    if let Some(save) = &settings.save {
        std::fs::create_dir_all(save).with_context(|| format!("creating {}", save.display()))?;
        settings.save = Some(absolute(save)?);
    }
    if let Some(load) = &settings.load {
        settings.load = Some(absolute(load).context("--load")?);
    }
    let rollout_nodes: Vec<NodeSpec> = cluster
        .rollout_nodes()
        .into_iter()
        .map(|i| NodeSpec {
            address: cluster.nodes[i].address.clone(),
            gpus: cluster.nodes[i].gpus.clone(),
        })
        .collect();
    // Workers get the config's text and OpenReward access from here: they need no
    // copy of the run's files and nothing in their environment but the model.
    let spawn = RolloutSpawnConfig {
        model_dir: settings.model.clone(),
        seed: settings.seed,
        train_config: ShippedTrainConfig::read(&train.path)
            .with_context(|| format!("reading {}", train.path.display()))?,
        max_concurrent_episodes: cluster.rollout.max_concurrent_episodes,
        max_batch_size: cluster.rollout.max_batch_size,
        openreward: OpenRewardAccess::from_env(train),
        sglang: sglang_spawn(cluster, settings),
        engine_gpus: engine_gpus(cluster),
        mem_fraction_static: cluster.rollout.mem_fraction_static,
    };
    let opts = PoolOptions {
        heartbeat_interval: Duration::from_millis(cluster.heartbeat_interval_ms),
        dead_after: Duration::from_millis(cluster.dead_after_ms),
        no_live_node_timeout: Duration::from_secs(60),
        lease_timeout: Duration::from_millis(cluster.lease_timeout_ms),
    };
    let tls = cluster
        .tls
        .as_ref()
        .map(|t| ClientTls::from_file("cluster.tls_ca", &t.ca, t.domain.clone()))
        .transpose()
        .with_context(|| format!("cluster {}", cluster.path.display()))?;
    let in_cluster = |e: manta_runtime::RuntimeError| {
        anyhow::Error::new(e).context(format!("cluster {}", cluster.path.display()))
    };
    let reach = Reach {
        token: &token,
        tls: tls.as_ref(),
        lease_timeout: opts.lease_timeout,
        heartbeat_interval: opts.heartbeat_interval,
        dead_after: opts.dead_after,
    };
    // The trainer's node is checked before anything is spawned anywhere.
    let trainer_client = match cluster.trainer.node {
        Some(i) => {
            let client = WorkerClient::connect(&cluster.nodes[i].address, &token, tls.as_ref())
                .map_err(in_cluster)?
                .with_lease(Lease::new(opts.lease_timeout));
            RemoteTrainer::check(&client, &cluster.trainer.gpus, &settings.model)
                .await
                .map_err(in_cluster)?;
            Some(client)
        }
        None => None,
    };
    info!(
        nodes = rollout_nodes.len(),
        engines_per_node = cluster.rollout.engines,
        trainer = %cluster.trainer.root_node().map_or("driver".to_string(), |i| cluster.nodes[i].address.clone()),
        trainer_ranks = cluster.trainer.ranks.len().max(1),
        "placing actors on worker nodes"
    );
    let pool = RemotePool::start_with_tls(
        &rollout_nodes,
        &token,
        tls.as_ref(),
        spawn,
        cluster.rollout.engines,
        opts,
    )
    .await
    .map_err(in_cluster)?;
    for (client, actors) in pool.placed() {
        crate::shutdown::register(client, actors);
    }
    let pool = Arc::new(pool);
    let weak = Arc::downgrade(&pool);
    crate::shutdown::before_stop(move || {
        if let Some(pool) = weak.upgrade() {
            pool.stop_heartbeats();
        }
    });
    // Task listing (and the trainer, unless a worker hosts it) stays here.
    let mut local_cluster = cluster.clone();
    local_cluster.rollout.engines = 0;
    let trainer_here = trainer_client.is_none() && cluster.trainer.ranks.is_empty();
    let worker = local::start(&local_cluster, train, settings, trainer_here).await?;
    let mut on_worker = None;
    let options = manta_trainer::TrainerOptions {
        bf16: cluster.trainer.bf16,
        ..local::trainer_options(settings, tch::Device::Cpu)
    };
    let trainer = match (trainer_client, &worker.trainer) {
        (None, _) if !cluster.trainer.ranks.is_empty() => {
            let placed = crate::remote_ranks::place(cluster, settings, &options, &reach).await?;
            on_worker = Some(placed.rank0);
            placed.handle
        }
        (Some(client), _) => {
            let remote = RemoteTrainer::start(
                client,
                TRAINER_NAME,
                TrainerSpawnConfig::from_options(&options),
                cluster.trainer.gpus.clone(),
                Duration::from_secs(cluster.spawn_timeout_s),
                opts.heartbeat_interval,
                opts.dead_after,
            )
            .await
            .map_err(in_cluster)?;
            let (client, name) = remote.placed();
            crate::shutdown::register(client, vec![name]);
            let remote = Arc::new(remote);
            on_worker = Some(remote.clone());
            TrainerHandle::remote(remote)
        }
        (None, Some(local)) => local.clone(),
        (None, None) => anyhow::bail!("no trainer was started"),
    };
    // Engines on workers get the weights over gRPC, or by one broadcast from the trainer
    // (cluster.worker_weights): no disk is shared with them.
    let trainer_at = trainer_endpoint(&trainer, &cluster.trainer.root_gpus());
    let engines_at: Vec<(String, Endpoint)> = cluster
        .rollout_nodes()
        .into_iter()
        .enumerate()
        .flat_map(|(i, node)| {
            (0..cluster.rollout.engines).map(move |k| {
                let gpu = cluster.engine_gpus(node, k).first().copied();
                (
                    format!("rollout-{i}-{k}"),
                    Endpoint::on_worker(&cluster.nodes[node].address, gpu),
                )
            })
        })
        .collect();
    let targets = WorkerEngines::new(pool.clone());
    let trainer_weights = Arc::new(trainer.clone());
    let weights = match worker_group_root(cluster, on_worker) {
        Some(root) => {
            info!(
                backend = ?root.backend,
                rank0 = %root.describe(),
                "weights to workers: one broadcast group for every engine (cluster.worker_weights)"
            );
            let group = WorkerGroupRoute {
                rank0: trainer_at,
                nccl: root.backend == Backend::Nccl,
            };
            WeightSync::over_worker_group(
                trainer_weights,
                &group,
                targets.broadcasting(root),
                &engines_at,
            )
        }
        None => WeightSync::new(trainer_weights, &trainer_at, targets, &engines_at),
    }
    .verifying_from_env(crate::run_dir::verify_log(settings));
    let actors = StepActors {
        trainer: trainer.clone(),
        rollouts: Rollouts::remote(pool.clone()),
        weights,
        rollout_only: settings.debug_rollout_only,
    };
    Ok(Placed {
        actors,
        env_clients: worker.env_clients.clone(),
        recovery: TrainerRecovery {
            policy: cluster.trainer.on_failure,
            restart_timeout: Duration::from_secs(cluster.trainer.restart_timeout_s),
        },
        teardown: Teardown::default().then(trainer).then(worker).then(pool),
    })
}

/// `--load-debug-rollout-data` with `[trainer] ranks`: the saved groups feed the ranks
/// on their workers (no engine, no rollout node), so ranks on workers train on exactly
/// the batches local ranks would.
pub async fn place_saved_ranks(
    cluster: &ClusterConfig,
    settings: &mut TrainSettings,
    template: String,
) -> anyhow::Result<Placed> {
    if let Some(filter) = &settings.sampling.dynamic_sampling_filter {
        anyhow::bail!(
            "--load-debug-rollout-data trains on the saved groups as they are: drop \
             --dynamic-sampling-filter-path ({filter})"
        );
    }
    let token = load_token().context("remote mode needs the cluster token")?;
    settings.model = absolute(&settings.model)?;
    let tls = cluster
        .tls
        .as_ref()
        .map(|t| ClientTls::from_file("cluster.tls_ca", &t.ca, t.domain.clone()))
        .transpose()
        .with_context(|| format!("cluster {}", cluster.path.display()))?;
    let reach = Reach {
        token: &token,
        tls: tls.as_ref(),
        lease_timeout: Duration::from_millis(cluster.lease_timeout_ms),
        heartbeat_interval: Duration::from_millis(cluster.heartbeat_interval_ms),
        dead_after: Duration::from_millis(cluster.dead_after_ms),
    };
    let options = manta_trainer::TrainerOptions {
        bf16: cluster.trainer.bf16,
        ..local::trainer_options(settings, tch::Device::Cpu)
    };
    let placed = crate::remote_ranks::place(cluster, settings, &options, &reach).await?;
    let handle = placed.handle;
    Ok(Placed {
        actors: StepActors {
            trainer: handle.clone(),
            rollouts: Rollouts::saved(template, settings.rollout_batch_size, settings.n_samples),
            weights: WeightSync::none(Arc::new(handle.clone())),
            rollout_only: false,
        },
        env_clients: Default::default(),
        recovery: TrainerRecovery {
            policy: cluster.trainer.on_failure,
            restart_timeout: Duration::from_secs(cluster.trainer.restart_timeout_s),
        },
        teardown: Teardown::default().then(handle),
    })
}

/// What workers need to launch SGLang engines (`None` for the native engine): the
/// `[rollout]` keys (each actor's GPUs travel in `RolloutSpawnConfig::engine_gpus`).
fn sglang_spawn(
    cluster: &manta_config::ClusterConfig,
    settings: &manta_config::TrainSettings,
) -> Option<manta_hosting::SglangSpawn> {
    let r = &cluster.rollout;
    if r.engine != manta_config::EngineKind::Sglang {
        return None;
    }
    Some(manta_hosting::SglangSpawn {
        command: r.command.clone(),
        mem_fraction_static: r.mem_fraction_static,
        extra_args: r.extra_args.clone(),
        health_timeout_s: r.health_timeout_s,
        health_interval_ms: r.health_interval_ms,
        max_restarts: r.max_restarts,
        run_name: settings.run_name.clone().unwrap_or_default(),
    })
}

/// Each rollout actor's GPUs by name (`rollout-<i>-<k>`: engine k of the i-th rollout
/// node), from placement; empty lists (CPU nodes) are left out.
fn engine_gpus(cluster: &ClusterConfig) -> std::collections::BTreeMap<String, Vec<u32>> {
    let mut gpus = std::collections::BTreeMap::new();
    for (i, node) in cluster.rollout_nodes().into_iter().enumerate() {
        for k in 0..cluster.rollout.engines {
            let of_engine = cluster.engine_gpus(node, k);
            if !of_engine.is_empty() {
                gpus.insert(format!("rollout-{i}-{k}"), of_engine);
            }
        }
    }
    gpus
}

/// Rank 0 of the broadcast to the workers' engines, when `cluster.worker_weights` asks
/// for one (validated: NCCL has the trainer's GPUs). The trainer's worker when it hosts
/// the trainer (`on_worker`; with `[trainer] ranks`, rank 0's worker, whose weights
/// every rank shares under ZeRO-2): its store at its node's host from cluster.toml, the
/// port chosen there (only that node knows which are free); else this process, its
/// store at `cluster.driver_address`, NCCL from the trainer's first GPU.
fn worker_group_root(
    cluster: &ClusterConfig,
    on_worker: Option<Arc<RemoteTrainer>>,
) -> Option<GroupRoot> {
    let backend = match cluster.worker_weights {
        WorkerWeights::Grpc => return None,
        WorkerWeights::Nccl => Backend::Nccl,
        WorkerWeights::Store => Backend::Store,
    };
    let at = match (on_worker, cluster.trainer.root_node()) {
        (Some(trainer), Some(node)) => RootAt::Trainer {
            trainer,
            master_address: node_host(&cluster.nodes[node].address),
        },
        _ => RootAt::Here {
            master_address: cluster.driver_address.clone(),
            device: cluster.trainer.gpus.first().copied().unwrap_or(0) as usize,
        },
    };
    Some(GroupRoot {
        backend,
        timeout: Duration::from_secs(120),
        at,
    })
}

#[cfg(test)]
mod tests {
    use super::{engine_gpus, node_host};

    #[test]
    fn native_engines_on_workers_get_the_gpus_placement_gives_them() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let two_workers = manta_config::ClusterConfig::from_file(
            &root.join("configs/gpu2-workers-trainer-nccl.toml"),
        )
        .expect("configs/gpu2-workers-trainer-nccl.toml");
        // Worker B (node 1) is the only rollout node: its engine takes its GPU 1.
        assert_eq!(
            engine_gpus(&two_workers),
            [("rollout-0-0".to_string(), vec![1])].into()
        );
        // CPU nodes (no `gpus`): nothing is shipped, the engines run on the CPU.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cluster.toml");
        std::fs::write(
            &path,
            format!(
                "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\n\n\
                 [rollout]\nengines = 2\n\n\
                 [[nodes]]\naddress = \"127.0.0.1:7101\"\n",
                root.join("train_config.yaml").display()
            ),
        )
        .expect("writing the config");
        let cpu = manta_config::ClusterConfig::from_file(&path).expect("a CPU remote config");
        assert!(engine_gpus(&cpu).is_empty());
    }

    #[test]
    fn a_node_host_is_its_address_without_the_port() {
        assert_eq!(node_host("10.0.0.2:7100"), "10.0.0.2");
        assert_eq!(node_host("gpu-a.example:7100"), "gpu-a.example");
        assert_eq!(node_host("[::1]:7100"), "::1");
    }
}

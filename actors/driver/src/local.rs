//! Local mode: the driver hosts one in-process worker — a trainer, rollout actors with
//! native engines, a weight-sync actor — plus Manta's built-in environment server when
//! train_config.yaml asks for it (`url: builtin`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use manta_config::EngineKind;
use manta_config::{ClusterConfig, TrainConfig, TrainSettings};
use manta_engine::{
    Engine, NativeEngine, NativeEngineOptions, NcclTarget, SglangEngine, SglangOptions,
};
use manta_hosting::rollout::spawn::start_rollout_actor;
use manta_hosting::OpenRewardAccess;
use manta_rollout::ors::OrsClient;
use manta_rollout::{RolloutMsg, Uploader};
use manta_tokenizer::Tokenizer;
use manta_trainer::batch::MicroBatchLayout;
use manta_trainer::loss::ClipRange;
use manta_trainer::loss::LossOptions;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::schedule::{DecayStyle, LrSchedule};
use manta_trainer::{
    AlgoOptions, RankGroupKind, Recompute, RecomputeMethod, TrainerActor, TrainerOptions,
};
use manta_weight_sync::route::{self, Endpoint, Mechanism};
use manta_weight_sync::{BroadcastRoot, WeightSyncActor, WeightSyncArgs, WeightSyncMsg};
use ractor::{Actor, ActorRef};
use tch::Device;
use tracing::info;

use crate::placement::{Placed, Stoppable, Teardown, TrainerRecovery};
use crate::rollouts::Rollouts;
use crate::step::StepActors;
use crate::trainer_handle::data_parallel::{spawn_ranks, RankDevices};
use crate::trainer_handle::TrainerHandle;
use manta_weight_sync::targets::InProcessEngines;
use manta_weight_sync::WeightSync;

/// The native engine's share of GPU memory (weights + KV cache) when it shares the
/// trainer's GPU and `rollout.mem_fraction_static` is not set.
const COLOCATED_MEM_FRACTION: f64 = 0.3;

pub use manta_hosting::rollout::spawn::{stop_token_ids, BUILTIN_URL, DEFAULT_SESSION_URL};

/// Handles to everything local mode started.
pub struct LocalWorker {
    /// The in-process trainer: one actor or a data-parallel rank group (absent when a
    /// worker daemon hosts it).
    pub trainer: Option<TrainerHandle>,
    pub rollouts: Vec<ActorRef<RolloutMsg>>,
    pub weight_sync: Option<ActorRef<WeightSyncMsg>>,
    /// Where the trainer and each engine (by name) live, for the weight-sync routes.
    pub trainer_at: Endpoint,
    pub engines_at: Vec<(String, Endpoint)>,
    /// One client per environment, for listing tasks.
    pub env_clients: BTreeMap<String, OrsClient>,
    env_server: Option<manta_envs::ServerHandle>,
    /// Trajectory upload to OpenReward, when configured.
    upload: Option<Uploader>,
}

/// How long shutdown waits for the last trajectories to upload.
const UPLOAD_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

#[async_trait::async_trait]
impl Stoppable for LocalWorker {
    async fn stop(self: Box<Self>) {
        self.shutdown().await;
    }
}

impl LocalWorker {
    /// Stops actors and the environment server.
    pub async fn shutdown(self) {
        for r in &self.rollouts {
            r.stop(None);
        }
        if let Some(w) = &self.weight_sync {
            w.stop(None);
        }
        if let Some(t) = &self.trainer {
            t.shutdown().await;
        }
        if let Some(upload) = self.upload {
            let stats = upload.shutdown(UPLOAD_FLUSH_TIMEOUT).await;
            info!(
                uploaded = stats.uploaded,
                dropped = stats.dropped,
                failed = stats.failed,
                "trajectory upload finished"
            );
        }
        if let Some(server) = self.env_server {
            server.shutdown().await;
        }
    }
}

/// Starts Manta's built-in environment server when an environment says `url: builtin`.
pub(crate) async fn start_builtin_server(
    train: &TrainConfig,
) -> anyhow::Result<Option<manta_envs::ServerHandle>> {
    let needs_builtin = train
        .environments
        .values()
        .any(|e| e.url.as_deref() == Some(BUILTIN_URL));
    if !needs_builtin {
        return Ok(None);
    }
    let server = manta_envs::serve("127.0.0.1:0".parse()?, manta_envs::builtin_environments())
        .await
        .context("starting the built-in environment server")?;
    info!(url = %server.base_url(), "built-in environment server started");
    Ok(Some(server))
}

/// The trajectory uploader, when train_config names `openreward_run_name` and
/// `OPENREWARD_API_KEY` is set (the same rule rollout actors on workers follow).
fn start_uploader(train: &TrainConfig) -> anyhow::Result<Option<Uploader>> {
    OpenRewardAccess::from_env(train).start_uploader()
}

/// Resolves each environment's server URL and builds one ORS client for it; the flag
/// says whether it is the built-in server.
pub(crate) fn environment_clients(
    train: &TrainConfig,
    builtin_url: Option<&str>,
) -> anyhow::Result<BTreeMap<String, (OrsClient, bool)>> {
    Ok(manta_hosting::rollout::spawn::environment_clients(
        train,
        builtin_url,
        &OpenRewardAccess::from_env(train),
    )?
    .into_iter()
    .map(|(name, client)| {
        let builtin = train.environments[&name].url.as_deref() == Some(BUILTIN_URL);
        (name, (client, builtin))
    })
    .collect())
}

/// The trainer's options from the resolved settings.
pub fn trainer_options(settings: &TrainSettings, device: Device) -> TrainerOptions {
    TrainerOptions {
        model_dir: settings.model.clone(),
        seed: settings.seed,
        device,
        adam: AdamWConfig {
            lr: settings.lr,
            beta1: settings.adam_beta1,
            beta2: settings.adam_beta2,
            eps: settings.adam_eps,
            weight_decay: settings.weight_decay,
        },
        clip: ClipRange {
            eps_clip: settings.eps_clip,
            eps_clip_high: settings.eps_clip_high,
        },
        clip_grad: settings.clip_grad,
        temperature: settings.temperature,
        max_tokens_per_gpu: settings.max_tokens_per_gpu,
        layout: MicroBatchLayout::Packed,
        bf16: None,
        use_rollout_logprobs: settings.algo.use_rollout_logprobs,
        logprob_chunk: 1024,
        recompute: settings.recompute.as_ref().map(|r| Recompute {
            // Validated with the settings (uniform or block).
            method: r.method.parse().unwrap_or(RecomputeMethod::Uniform),
            num_layers: r.num_layers,
        }),
        algo: algo_options(settings),
    }
}

/// True on-policy mode needs every engine to compute as the trainer does, which only the
/// native engine in this process can (`remote`: engines placed on workers, which run on
/// the CPU or SGLang). Refused by name otherwise, instead of a run whose log-probs differ.
pub fn check_true_on_policy(
    rollout: &manta_config::RolloutSection,
    settings: &TrainSettings,
    remote: bool,
) -> anyhow::Result<()> {
    if !settings.algo.true_on_policy_mode || rollout.engines == 0 {
        return Ok(());
    }
    if remote {
        anyhow::bail!(
            "--true-on-policy-mode: the rollout engines would run on workers (on the CPU, or \
             SGLang), which cannot compute as the trainer does; run it in local mode"
        );
    }
    if matches!(rollout.engine, EngineKind::Sglang) {
        anyhow::bail!(
            "--true-on-policy-mode needs rollout.engine = \"native\": SGLang engines compute \
             attention with their own kernels"
        );
    }
    Ok(())
}

/// slime's loss and schedule flags for the trainer.
pub fn algo_options(settings: &TrainSettings) -> AlgoOptions {
    let a = &settings.algo;
    let steps = a.num_steps_per_rollout.max(1);
    let style = a.lr_decay_style;
    let lr_schedule =
        (style != DecayStyle::Constant || a.lr_warmup_iters > 0).then(|| LrSchedule {
            max_lr: settings.lr,
            min_lr: a.min_lr,
            warmup_steps: a.lr_warmup_iters,
            decay_steps: (settings.num_rollout * steps) as u64,
            style,
        });
    AlgoOptions {
        loss: LossOptions {
            estimator: a.advantage_estimator,
            eps_clip_c: a.eps_clip_c,
            use_kl_loss: a.use_kl_loss,
            kl_loss_coef: a.kl_loss_coef,
            kl_loss_type: a.kl_loss_type,
            use_unbiased_kl: a.use_unbiased_kl,
            entropy_coef: a.entropy_coef,
            use_tis: a.use_tis,
            tis_clip: a.tis_clip,
            tis_clip_low: a.tis_clip_low,
            tis_mode: a.tis_mode,
            use_opsm: a.use_opsm,
            opsm_delta: a.opsm_delta,
            calculate_per_token_loss: a.calculate_per_token_loss,
        },
        lr_schedule,
        num_steps_per_rollout: steps,
        ref_load: a.ref_load.clone(),
        true_on_policy: a.true_on_policy_mode,
        moe_aux_loss_coeff: a.moe_aux_loss_coeff,
        use_rollout_routing_replay: a.use_rollout_routing_replay,
        grad_reduce_in_bf16: settings.grad_reduce_in_bf16,
    }
}

/// Starts the local worker's actors; the trainer (and weight sync) only when
/// `host_trainer` (remote mode may place the trainer on a worker instead).
pub async fn start(
    cluster: &ClusterConfig,
    train: &TrainConfig,
    settings: &TrainSettings,
    host_trainer: bool,
) -> anyhow::Result<LocalWorker> {
    check_true_on_policy(&cluster.rollout, settings, false)?;
    let model_dir = settings.model.as_path();
    check_model_dir(model_dir)?;
    let env_server = start_builtin_server(train).await?;
    let upload = start_uploader(train)?;
    let builtin_url = env_server.as_ref().map(|s| s.base_url());
    let tokenizer = Arc::new(
        Tokenizer::from_dir(model_dir)
            .with_context(|| format!("loading the tokenizer from {}", model_dir.display()))?,
    );
    let cuda_devices = if tch::Cuda::is_available() {
        tch::Cuda::device_count()
    } else {
        0
    };
    let trainer = if host_trainer {
        let device = local_device(
            &cluster.path,
            "trainer.gpus",
            &cluster.trainer.gpus,
            cuda_devices,
        )?;
        let options = TrainerOptions {
            bf16: cluster.trainer.bf16,
            ..trainer_options(settings, device)
        };
        let devices = if cluster.trainer.gpus.is_empty() {
            RankDevices::Cpu(cluster.trainer.data_parallel_world())
        } else {
            RankDevices::Gpus(cluster.trainer.gpus.clone())
        };
        Some(start_trainer(options, &devices, settings).await?)
    } else {
        None
    };
    let mut rollouts = Vec::new();
    let mut engines_at = Vec::new();
    let trainer_at = Endpoint::in_driver(cluster.trainer.gpus.first().copied());
    let env_clients = environment_clients(train, builtin_url.as_deref())?;
    for i in 0..cluster.rollout.engines {
        let gpus = cluster.local_engine_gpus(i);
        let engine_at = match cluster.rollout.engine {
            EngineKind::Native => Endpoint::in_driver(gpus.first().copied()),
            // The server is a process of its own.
            EngineKind::Sglang => Endpoint::sglang_server(i, gpus.first().copied()),
        };
        let engine: Arc<dyn Engine> = match cluster.rollout.engine {
            EngineKind::Native => {
                let device = local_device(
                    &cluster.path,
                    "rollout.gpus_per_engine",
                    &gpus,
                    cuda_devices,
                )?;
                let defaults = NativeEngineOptions::new(model_dir, device);
                NativeEngine::start(NativeEngineOptions {
                    seed: settings.seed,
                    max_running_requests: cluster.rollout.max_batch_size,
                    mem_fraction_static: engine_mem_fraction(
                        &cluster.rollout,
                        defaults.mem_fraction_static,
                    ),
                    true_on_policy: settings.algo.true_on_policy_mode,
                    enable_return_routed_experts: settings.algo.use_rollout_routing_replay,
                    ..defaults
                })
                .context("starting the native engine")?
            }
            EngineKind::Sglang => {
                let run = settings.run_name.clone().unwrap_or_default();
                let logs = settings.runs_dir.join(run).join("engines");
                let mut opts = SglangOptions::new(
                    &sglang_server(&cluster.rollout),
                    &format!("engine-{i}"),
                    model_dir,
                    &gpus,
                    settings.seed,
                    logs.join(format!("{i}.log")),
                );
                if settings.algo.use_rollout_routing_replay {
                    opts.launch
                        .argv
                        .push("--enable-return-routed-experts".into());
                }
                let progress =
                    manta_telemetry::Progress::start(format!("starting SGLang engine {i}"));
                let engine = SglangEngine::launch(opts).await.with_context(|| {
                    format!("starting SGLang engine {i} (rollout.engine = \"sglang\")")
                })?;
                drop(progress);
                if let Some(device) = trainer_at.gpu.filter(|_| trainer.is_some()) {
                    feed_sglang(&engine, i, device, &engine_at).await?;
                }
                engine
            }
        };
        engines_at.push((format!("rollout-{i}"), engine_at));
        let clients = environment_clients(train, builtin_url.as_deref())?
            .into_iter()
            .map(|(name, (client, _))| (name, client))
            .collect();
        let rollout = start_rollout_actor(
            &format!("rollout-{i}"),
            engine,
            &tokenizer,
            train,
            clients,
            upload.clone(),
            cluster.rollout.max_concurrent_episodes,
        )
        .await?;
        rollouts.push(rollout);
    }
    let weight_sync = match &trainer {
        Some(handle) => Some(
            Actor::spawn(
                Some("weight-sync".into()),
                WeightSyncActor,
                WeightSyncArgs {
                    // Through the handle: rank 0's weights (ZeRO-2), or gathered with
                    // every rank taking part (ZeRO-3).
                    trainer: Arc::new(handle.clone()),
                    engines: rollouts.clone(),
                    broadcast_from: route::in_process_broadcast(
                        &trainer_at,
                        &engines_at
                            .iter()
                            .map(|(_, at)| at.clone())
                            .collect::<Vec<_>>(),
                    )
                    .map(|gpu| BroadcastRoot::Cuda(gpu as usize)),
                },
            )
            .await
            .context("starting weight sync")?
            .0,
        ),
        None => None,
    };
    Ok(LocalWorker {
        trainer,
        rollouts,
        weight_sync,
        trainer_at,
        engines_at,
        env_clients: env_clients.into_iter().map(|(k, (c, _))| (k, c)).collect(),
        env_server,
        upload,
    })
}

/// Wires the weight-sync route placement picks for an SGLang engine (its server is its
/// own process on `gpus`; the trainer is in this one on `trainer_gpu`): NCCL broadcast
/// (`/update_weights_from_distributed`) when they are on different GPUs, else the
/// safetensors file and `/update_weights_from_disk`.
async fn feed_sglang(
    engine: &SglangEngine,
    index: usize,
    trainer_gpu: u32,
    engine_at: &Endpoint,
) -> anyhow::Result<()> {
    let trainer_at = Endpoint::in_driver(Some(trainer_gpu));
    if route::choose(&trainer_at, engine_at) != Mechanism::Nccl {
        info!(
            engine = index,
            "weight sync route: SGLang engine fed through /update_weights_from_disk"
        );
        return Ok(());
    }
    engine
        .feed_over_nccl(NcclTarget {
            device: trainer_gpu as usize,
            master_address: "127.0.0.1".into(),
        })
        .await
        .with_context(|| {
            format!(
                "SGLang engine {index} on GPU {:?}: joining the NCCL weight-update group with the trainer on GPU {trainer_gpu}",
                engine_at.gpu
            )
        })?;
    info!(
        engine = index,
        trainer_gpu, "weight sync route: NCCL broadcast (/update_weights_from_distributed)"
    );
    Ok(())
}

/// Starts the in-process trainer: one actor when `devices` has one rank (`options.device`
/// is its device), else a rank group, one actor per rank: data parallel at
/// `settings.zero_stage` (2 or 3; 3 needs two ranks or more), or one context-parallel
/// group when `settings.context_parallel_size` > 1 (then it must be the rank count).
pub async fn start_trainer(
    options: TrainerOptions,
    devices: &RankDevices,
    settings: &TrainSettings,
) -> anyhow::Result<TrainerHandle> {
    let cp = settings.context_parallel_size;
    let kind = match (settings.zero_stage, cp) {
        (2, 0 | 1) => RankGroupKind::Zero2,
        (3, 0 | 1) => RankGroupKind::Zero3,
        (2, _) => RankGroupKind::ContextParallel,
        (3, _) => anyhow::bail!(
            "--context-parallel-size {cp} with --zero-stage 3: context-parallel ranks \
             replicate the weights; use --zero-stage 2"
        ),
        (other, _) => anyhow::bail!("--zero-stage {other}: must be 2 or 3"),
    };
    if kind == RankGroupKind::ContextParallel && devices.world() != cp {
        anyhow::bail!(
            "--context-parallel-size {cp}: the trainer has {} ranks; context parallelism \
             needs exactly {cp} (data parallel × context parallel is not built)",
            devices.world()
        );
    }
    if devices.world() <= 1 {
        if kind == RankGroupKind::Zero3 {
            anyhow::bail!(
                "--zero-stage 3 shards the parameters over the data-parallel ranks and needs \
                 at least two; this run has one trainer"
            );
        }
        let (trainer, _) = Actor::spawn(Some("trainer".into()), TrainerActor, options)
            .await
            .context("starting the trainer")?;
        return Ok(TrainerHandle::local(trainer));
    }
    let steps = options.algo.num_steps_per_rollout;
    let ranks = spawn_ranks(options, devices, kind).await?;
    Ok(TrainerHandle::local_ranks(ranks, steps, kind))
}

/// The device for GPUs `gpus` named by key `key` of the cluster file `file` in local
/// mode: the CPU when none are named, else the first of them, which this process must
/// see through CUDA (`cuda_devices` of them).
pub fn local_device(
    file: &Path,
    key: &str,
    gpus: &[u32],
    cuda_devices: i64,
) -> anyhow::Result<Device> {
    let file = file.display();
    let Some(&first) = gpus.first() else {
        return Ok(Device::Cpu);
    };
    if cuda_devices == 0 {
        anyhow::bail!(
            "{file}: {key} asks for GPUs {gpus:?}, but CUDA is not available to libtorch in \
             this process (no GPU, or a CPU-only libtorch); remove the GPUs to run on the CPU"
        );
    }
    if let Some(bad) = gpus.iter().find(|&&g| i64::from(g) >= cuda_devices) {
        anyhow::bail!(
            "{file}: {key} asks for GPU {bad}, but this process sees {cuda_devices} CUDA \
             device(s) (0..{})",
            cuda_devices - 1
        );
    }
    Ok(Device::Cuda(first as usize))
}

fn check_model_dir(dir: &Path) -> anyhow::Result<()> {
    for file in ["config.json", "tokenizer.json"] {
        if !dir.join(file).is_file() {
            anyhow::bail!(
                "model directory {} has no {file} (pass --model DIR with a Hugging Face model directory)",
                dir.display()
            );
        }
    }
    Ok(())
}

/// The native engine's share of its GPU: `rollout.mem_fraction_static` when set; a
/// colocated engine otherwise leaves most of the GPU to the trainer it shares.
/// The SGLang server settings of cluster.toml's `[rollout]`.
pub fn sglang_server(rollout: &manta_config::RolloutSection) -> manta_engine::SglangServer {
    manta_engine::SglangServer {
        command: rollout.command.clone(),
        max_running_requests: rollout.max_batch_size,
        mem_fraction_static: rollout.mem_fraction_static,
        extra_args: rollout.extra_args.clone(),
        health_timeout_s: rollout.health_timeout_s,
        health_interval_ms: rollout.health_interval_ms,
        max_restarts: rollout.max_restarts,
    }
}

fn engine_mem_fraction(rollout: &manta_config::RolloutSection, default: f64) -> f64 {
    rollout.mem_fraction_static.unwrap_or(if rollout.colocate {
        COLOCATED_MEM_FRACTION
    } else {
        default
    })
}

/// Local mode: the trainer, the engines and the environments in this process
/// (crate::placement).
pub async fn place(
    cluster: &ClusterConfig,
    train: &TrainConfig,
    settings: &TrainSettings,
) -> anyhow::Result<Placed> {
    let worker = start(cluster, train, settings, true).await?;
    let (trainer, weight_sync) = match (&worker.trainer, &worker.weight_sync) {
        (Some(t), Some(w)) => (t.clone(), w.clone()),
        _ => anyhow::bail!("local mode started without a trainer"),
    };
    let weights = WeightSync::new(
        Arc::new(trainer.clone()),
        &worker.trainer_at,
        InProcessEngines::new(weight_sync, worker.rollouts.clone()),
        &worker.engines_at,
    )
    .verifying_from_env(crate::run_dir::verify_log(settings));
    Ok(Placed {
        actors: StepActors {
            trainer,
            rollouts: Rollouts::local(worker.rollouts.clone(), cluster.rollout.colocate),
            weights,
            rollout_only: settings.debug_rollout_only,
        },
        env_clients: worker.env_clients.clone(),
        recovery: TrainerRecovery::default(),
        teardown: Teardown::default().then(worker),
    })
}

/// `--load-debug-rollout-data`: only the trainer runs, as `devices` says (`[trainer]
/// gpus`: one rank per GPU, NCCL between them, `bf16` as `[trainer] bf16`; else CPU
/// ranks on threads in fp32); each step trains on the saved samples of that rollout,
/// read back in place of engines (crate::rollouts::saved).
pub async fn place_saved(
    template: String,
    settings: &TrainSettings,
    devices: RankDevices,
    bf16: Option<bool>,
    cluster_file: &Path,
) -> anyhow::Result<Placed> {
    // Saved group k of a rollout is group k of its step: a filter that drops groups
    // would shift every later step onto the wrong file's groups.
    if let Some(filter) = &settings.sampling.dynamic_sampling_filter {
        anyhow::bail!(
            "--load-debug-rollout-data trains on the saved groups as they are: drop \
             --dynamic-sampling-filter-path ({filter})"
        );
    }
    // GPU ranks (`[trainer] gpus`) train on their GPUs, so saved rollouts reproduce a
    // GPU run's steps (bench/run_workers.sh trainer-dp2 compares ranks on workers with
    // them); CPU ranks on threads.
    let device = match &devices {
        RankDevices::Cpu(_) => Device::Cpu,
        RankDevices::Gpus(gpus) => {
            let cuda = if tch::Cuda::is_available() {
                tch::Cuda::device_count()
            } else {
                0
            };
            local_device(cluster_file, "trainer.gpus", gpus, cuda)?
        }
    };
    let options = TrainerOptions {
        bf16,
        ..trainer_options(settings, device)
    };
    let handle = start_trainer(options, &devices, settings).await?;
    Ok(Placed {
        actors: StepActors {
            trainer: handle.clone(),
            rollouts: Rollouts::saved(template, settings.rollout_batch_size, settings.n_samples),
            weights: WeightSync::none(Arc::new(handle.clone())),
            rollout_only: false,
        },
        env_clients: BTreeMap::new(),
        recovery: TrainerRecovery::default(),
        teardown: Teardown::default().then(handle),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn true_on_policy_mode_is_refused_where_engines_cannot_follow_the_trainer() {
        let mut rollout = manta_config::RolloutSection {
            engines: 1,
            ..Default::default()
        };
        let mut settings = manta_config::TrainOverrides::default().resolve();
        assert!(
            check_true_on_policy(&rollout, &settings, true).is_ok(),
            "mode off"
        );
        settings.algo.true_on_policy_mode = true;
        assert!(check_true_on_policy(&rollout, &settings, false).is_ok());
        let err = check_true_on_policy(&rollout, &settings, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--true-on-policy-mode") && err.contains("workers"),
            "{err}"
        );
        rollout.engine = EngineKind::Sglang;
        let err = check_true_on_policy(&rollout, &settings, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rollout.engine") && err.contains("SGLang"),
            "{err}"
        );
    }

    #[test]
    fn a_colocated_engine_takes_a_small_share_unless_told() {
        let mut rollout = manta_config::RolloutSection::default();
        assert_eq!(engine_mem_fraction(&rollout, 0.85), 0.85);
        rollout.colocate = true;
        assert_eq!(engine_mem_fraction(&rollout, 0.85), COLOCATED_MEM_FRACTION);
        rollout.mem_fraction_static = Some(0.5);
        assert_eq!(engine_mem_fraction(&rollout, 0.85), 0.5);
    }

    #[test]
    fn gpus_need_cuda_and_errors_name_the_key() {
        let file = Path::new("conf/my-cluster.toml");
        assert_eq!(
            local_device(file, "trainer.gpus", &[], 0).unwrap(),
            Device::Cpu
        );
        let err = local_device(file, "trainer.gpus", &[0], 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("conf/my-cluster.toml: trainer.gpus")
                && err.contains("CUDA is not available"),
            "{err}"
        );
        let err = local_device(file, "rollout.gpus_per_engine", &[3], 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rollout.gpus_per_engine") && err.contains("GPU 3"),
            "{err}"
        );
        assert_eq!(
            local_device(file, "trainer.gpus", &[1, 2], 4).unwrap(),
            Device::Cuda(1)
        );
    }
}

//! Setting up and running a training job: configuration layers, the local worker,
//! tasks, resume, then the DriverActor's loop.

use std::path::{Path, PathBuf};

use anyhow::Context;
use manta_config::{ClusterConfig, ClusterMode, TrainConfig, TrainOverrides, TrainSettings};
use manta_rollout::ors::OrsClient;
use manta_rollout::TaskRef;
use manta_telemetry::{MetricsWriter, WandbOptions, WandbSink};
use ractor::{call, Actor};
use tracing::{info, warn};

use crate::cli::TrainArgs;
use crate::driver_actor::{latest_checkpoint, DriverActor, DriverMsg, RunPlan, RunSummary};
use crate::eval::EvalSet;
use crate::failure_budget::StepChecks;
use crate::guard_flags::Guards;
use crate::placement::{Placed, TrainerRecovery};
use crate::run_lock::DirLock;
use crate::settings_report::SettingLayers;
use crate::step::StepActors;
use crate::tasks::{cookbook_cap, read_tasks_jsonl, task_hash, CookbookSelection, TaskSampler};
use crate::trainer_handle::data_parallel::RankDevices;

/// Configuration after all layers are applied.
pub struct ResolvedConfig {
    pub cluster: ClusterConfig,
    pub train: TrainConfig,
    pub settings: TrainSettings,
    /// The layers the settings came from, for the resolved-settings listing.
    pub layers: SettingLayers,
    /// `--eval-prompt-data`'s sets, read (empty without `--eval-interval`).
    pub eval_sets: Vec<EvalSet>,
}

/// Reads cluster.toml and train_config.yaml and applies the flags on top.
pub fn resolve_config(args: &TrainArgs) -> anyhow::Result<ResolvedConfig> {
    let mut cluster = ClusterConfig::from_file(&args.cluster)?;
    if args.bf16 {
        // `--bf16` means what `[trainer] bf16 = true` means, and wins over it.
        cluster.trainer.bf16 = Some(true);
    }
    let flags = args.overrides();
    flags.validate(Path::new("command line"), "--")?;
    let file = match &args.train_settings {
        Some(path) => Some((path.clone(), TrainOverrides::from_file(path)?)),
        None => None,
    };
    let layers = SettingLayers {
        flags: flags.clone(),
        spellings: args.spellings.clone(),
        file: file.clone(),
        cluster: (args.cluster.clone(), cluster.train.clone()),
    };
    let below_flags = match file {
        Some((_, values)) => values.over(cluster.train.clone())?,
        None => cluster.train.clone(),
    };
    let merged = flags.over(below_flags)?;
    merged.validate_merged()?;
    // The built-in default is the repository's tiny model, a path: only a model someone
    // named may be a hub name to look up in the Hugging Face cache.
    let model_named = merged.model.is_some();
    let mut settings = merged.resolve();
    if args.use_wandb && settings.wandb_project.is_none() {
        anyhow::bail!(
            "--use-wandb logs to Weights & Biases and needs --wandb-project NAME \
             (or [train] wandb_project in {})",
            args.cluster.display()
        );
    }
    if model_named {
        settings.model = crate::hf_cache::resolve_model(&settings.model)?;
    }
    check_zero_stage(&cluster, &settings, &args.cluster)?;
    check_context_parallel(&cluster, &settings, &args.cluster)?;
    check_grad_reduce_in_bf16(&cluster, &settings, &args.cluster)?;
    if cluster.rollout.colocate && settings.sampling.max_weight_staleness > 0 {
        // As slime: overlapping rollouts with training needs the engines off the
        // trainer's GPUs.
        anyhow::bail!(
            "max_weight_staleness = {}: asynchronous mode needs engines on their own GPUs, \
             but {} sets rollout.colocate = true",
            settings.sampling.max_weight_staleness,
            args.cluster.display()
        );
    }
    let config_path = args
        .config
        .clone()
        .or_else(|| cluster.train_config.clone())
        .with_context(|| {
            format!(
            "no train_config.yaml: pass --config FILE or set `train_config` under [cluster] in {}",
            args.cluster.display()
        )
        })?;
    let train = TrainConfig::from_file(&config_path)?;
    let eval_sets = match settings.eval.interval {
        Some(_) if settings.load_debug_rollout_data.is_some() => anyhow::bail!(
            "--eval-interval evaluates on the engines, and --load-debug-rollout-data runs \
             none: drop one of them"
        ),
        Some(_) => crate::eval::load_sets(&settings.eval, &train)?,
        None => {
            if !settings.eval.datasets.is_empty() {
                warn!(
                    "--eval-prompt-data without --eval-interval: nothing is evaluated \
                     (as in slime); add --eval-interval N"
                );
            }
            Vec::new()
        }
    };
    Ok(ResolvedConfig {
        cluster,
        train,
        settings,
        layers,
        eval_sets,
    })
}

/// `--zero-stage 3` shards the parameters over the data-parallel ranks: refused where
/// there is one trainer (remote mode places one; local mode needs two ranks), before
/// anything starts.
fn check_zero_stage(
    cluster: &ClusterConfig,
    settings: &TrainSettings,
    cluster_path: &Path,
) -> anyhow::Result<()> {
    if settings.zero_stage != 3 {
        return Ok(());
    }
    let ranks = match cluster.mode {
        ClusterMode::Local => cluster.trainer.data_parallel_world(),
        ClusterMode::Remote => anyhow::bail!(
            "--zero-stage 3 (or [train] zero_stage = 3) shards the parameters over \
             data-parallel trainer ranks, but {} sets remote mode, whose trainer ranks \
             ([trainer] ranks) are ZeRO-2 only: use local mode's [trainer] gpus or \
             data_parallel_ranks, or --zero-stage 2",
            cluster_path.display()
        ),
    };
    if ranks < 2 {
        anyhow::bail!(
            "--zero-stage 3 (or [train] zero_stage = 3) shards the parameters over the \
             data-parallel trainer ranks and needs at least two, but {} has {ranks} \
             ([trainer] gpus = [..] with two or more GPUs, or data_parallel_ranks = N)",
            cluster_path.display()
        );
    }
    Ok(())
}

/// `--context-parallel-size N` (N > 1) runs local mode's whole rank group as one
/// context-parallel group (data parallel × CP is not built), so the rank count must be
/// N; refused before anything starts where the trainer cannot run it.
fn check_context_parallel(
    cluster: &ClusterConfig,
    settings: &TrainSettings,
    cluster_path: &Path,
) -> anyhow::Result<()> {
    let size = settings.context_parallel_size;
    if size <= 1 {
        return Ok(());
    }
    let flag = format!("--context-parallel-size {size} (or [train] context_parallel_size)");
    if cluster.mode == ClusterMode::Remote {
        anyhow::bail!(
            "{flag}: {} sets remote mode, whose trainer ranks ([trainer] ranks) are data \
             parallel only: use local mode's [trainer] gpus or data_parallel_ranks",
            cluster_path.display()
        );
    }
    let ranks = cluster.trainer.data_parallel_world();
    if ranks != size {
        anyhow::bail!(
            "{flag}: the trainer's world size is data parallel × context parallel and only \
             data parallel = 1 is built, so the local rank count must be {size}, but {} has \
             {ranks} ([trainer] gpus = [..] with {size} GPUs, or data_parallel_ranks = {size})",
            cluster_path.display()
        );
    }
    if settings.zero_stage == 3 {
        anyhow::bail!(
            "{flag} with --zero-stage 3: context-parallel ranks replicate the weights \
             (ZeRO-2 over the group); use --zero-stage 2"
        );
    }
    if settings.algo.true_on_policy_mode {
        anyhow::bail!(
            "{flag} with --true-on-policy-mode: its batch-invariant attention is not built \
             for context parallelism"
        );
    }
    Ok(())
}

/// `--grad-reduce-in-bf16` reduces bf16 gradients over data-parallel ranks: refused,
/// before anything starts, for one trainer and for fp32 weights (`[trainer] bf16 =
/// false`, or CPU ranks without `bf16 = true`), rather than ignored.
fn check_grad_reduce_in_bf16(
    cluster: &ClusterConfig,
    settings: &TrainSettings,
    cluster_path: &Path,
) -> anyhow::Result<()> {
    if !settings.grad_reduce_in_bf16 {
        return Ok(());
    }
    let t = &cluster.trainer;
    // Without `bf16`, the trainer's weights are bf16 on GPUs and fp32 on the CPU.
    let (ranks, on_gpus) = match cluster.mode {
        ClusterMode::Local => (t.data_parallel_world(), !t.gpus.is_empty()),
        ClusterMode::Remote => (
            t.ranks.len(),
            !t.ranks.is_empty() && t.ranks.iter().all(|r| r.gpu.is_some()),
        ),
    };
    let flag = "--grad-reduce-in-bf16 (or [train] grad_reduce_in_bf16 = true)";
    let file = cluster_path.display();
    if ranks < 2 {
        anyhow::bail!(
            "{flag} reduces the gradients over data-parallel trainer ranks, but {file} has \
             one trainer (local mode: [trainer] gpus with two or more GPUs, or \
             data_parallel_ranks = N; remote mode: [trainer] ranks); drop the flag"
        );
    }
    if !t.bf16.unwrap_or(on_gpus) {
        anyhow::bail!(
            "{flag} reduces bf16 gradients, but the trainer's weights are fp32 ({file}: \
             [trainer] bf16 = false, or ranks on the CPU without bf16 = true): pass --bf16 \
             or drop the flag"
        );
    }
    Ok(())
}

/// Lists every configured split of every environment from its server and picks tasks
/// as the cookbook's prepare_tasks.py does with its default seed (42) and no
/// `--max-tasks`.
async fn list_tasks(
    env_clients: &std::collections::BTreeMap<String, OrsClient>,
    train: &TrainConfig,
) -> anyhow::Result<Vec<TaskRef>> {
    let mut tasks = Vec::new();
    let mut selection = CookbookSelection::new(crate::tasks::TASK_SEED);
    for (name, env) in &train.environments {
        let client = &env_clients[name];
        for split in &env.splits {
            let listed = client
                .list_tasks(split)
                .await
                .with_context(|| format!("listing tasks of {name} split {split}"))?;
            let server_env = listed.env_name.clone();
            let refs: Vec<TaskRef> = listed
                .tasks
                .into_iter()
                .map(|spec| TaskRef {
                    environment: name.clone(),
                    split: split.clone(),
                    task_hash: task_hash(&spec),
                    task_spec: spec,
                    server_env: server_env.clone(),
                })
                .collect();
            info!(environment = %name, split = %split, tasks = refs.len(), "tasks listed");
            tasks.extend(selection.split(refs, cookbook_cap(env.num_samples, None)));
        }
    }
    selection.finish(&mut tasks);
    Ok(tasks)
}

/// Runs a whole training job, local or remote (cluster.toml `[cluster] mode`). `stop` is
/// polled between steps (and, with `--on-stop abandon-step`, during rollouts).
pub async fn train(
    args: &TrainArgs,
    stop: crate::signals::StopRequest,
) -> anyhow::Result<RunSummary> {
    let ResolvedConfig {
        cluster,
        train,
        mut settings,
        layers,
        eval_sets,
    } = resolve_config(args)?;
    if let Some(dir) = settings.load.clone() {
        if crate::load_dir::checkpoint_to_resume(&dir)?.is_none() {
            // Miles: a --load directory without a checkpoint yet means a fresh start.
            println!(
                "--load {}: no checkpoint there yet; starting fresh",
                dir.display()
            );
            info!(load = %dir.display(), "no checkpoint to resume; starting fresh");
            settings.load = None;
        }
    }
    let guards = args.guards.resolve()?;
    // `--load DIR` alone continues the run directory DIR's checkpoints belong to.
    let recorded = match settings.load.as_deref() {
        Some(load) => crate::save_dir::read_record(load)?,
        None => None,
    };
    if args.settings.run_name.is_none() && args.settings.runs_dir.is_none() {
        if let Some(rec) = &recorded {
            if let (Some(parent), Some(name)) = (
                rec.run_dir.parent(),
                rec.run_dir.file_name().and_then(|n| n.to_str()),
            ) {
                settings.runs_dir = parent.to_path_buf();
                settings.run_name = Some(name.to_string());
            }
        }
    }
    // Settled before anything writes under runs/<run> (remote mode's weights included),
    // and held (locked) by this process until the run ends.
    let requested = settings
        .run_name
        .clone()
        .unwrap_or_else(crate::run_dir::default_run_name);
    let (run, _run_lock) =
        crate::run_dir::choose_locked(&settings.runs_dir, &requested, settings.load.as_deref())?;
    if run.name != requested {
        println!(
            "{} holds an earlier run; this run writes to {}",
            settings.runs_dir.join(&requested).display(),
            run.path.display()
        );
    } else if run.continues {
        println!("resuming into {}", run.path.display());
    }
    let run_path = run.path.clone();
    // The run's log and status endpoint from here on, before the long start-up work.
    std::fs::create_dir_all(&run.path)
        .with_context(|| format!("creating {}", run.path.display()))?;
    let log = run.path.join("driver.log");
    manta_telemetry::run_log::open(&log).with_context(|| format!("opening {}", log.display()))?;
    crate::status_server::start(args.status_addr).await?;
    crate::status_server::write_addr_file(&run.path)?;
    settings.run_name = Some(run.name);
    let (_save_lock, run_id) = prepare_save_dir(&settings, &run_path, recorded.as_ref())?;
    if args.save_hf && (settings.save.is_none() || settings.debug_rollout_only) {
        anyhow::bail!(
            "--save-hf exports the run's final checkpoint: it needs --save DIR (and training: \
             --debug-rollout-only writes no checkpoint)"
        );
    }
    if let (Some(n), None) = (args.settings.save_interval, settings.save.as_ref()) {
        // Asked for checkpoints but gave them nowhere to go: say so before the run, not
        // after a lost trainer restarts from its initial weights.
        warn!(
            "--save-interval {n} without --save DIR writes no checkpoint: a lost trainer \
             restarts from its initial weights and re-runs the steps since"
        );
    }
    info!(
        model = %settings.model.display(),
        steps = settings.num_rollout,
        prompts = settings.rollout_batch_size,
        n_samples = settings.n_samples,
        lr = settings.lr,
        mode = ?cluster.mode,
        "starting training"
    );
    crate::status::describe_cluster(
        match cluster.mode {
            ClusterMode::Local => "local",
            ClusterMode::Remote => "remote",
        },
        (cluster.mode == ClusterMode::Local).then(|| local_node(&cluster)),
    );
    let placed = {
        let _progress = manta_telemetry::Progress::start("placing actors and loading the model");
        place(&cluster, &train, &mut settings).await?
    };
    let result = run_with_actors(
        &placed.env_clients,
        placed.actors,
        &train,
        &settings,
        placed.recovery,
        stop,
        RunRecords {
            run_id,
            guards,
            layers,
            eval_sets,
        },
    )
    .await;
    placed.teardown.run().await;
    let summary = result?;
    if let Some(save) = settings.save.as_ref().filter(|_| args.save_hf) {
        save_hf(save, &settings.model).await?;
    }
    Ok(summary)
}

/// Local mode's one node for `driver status`: this host, the trainer's GPUs, and the
/// actors local placement names (trainer ranks, `rollout-<i>`).
fn local_node(cluster: &ClusterConfig) -> crate::status::NodeStatus {
    let gpus = cluster.trainer.gpus.clone();
    let ranks = cluster.trainer.data_parallel_world();
    let mut actors: Vec<String> = if ranks > 1 {
        (0..ranks).map(|r| format!("trainer-{r}")).collect()
    } else {
        vec!["trainer".into()]
    };
    actors.extend((0..cluster.rollout.engines.max(1)).map(|i| format!("rollout-{i}")));
    crate::status::NodeStatus {
        address: "local".into(),
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default(),
        gpus,
        actors,
        healthy: true,
        error: None,
    }
}

/// `--save-hf`: the latest checkpoint under `save` as a Hugging Face model directory in
/// `save/hf`, with the tokenizer of the run's model directory. After the teardown, so the
/// trainer's memory is free; the checkpoint is read back from disk, as `driver export`
/// reads it.
async fn save_hf(save: &Path, model: &Path) -> anyhow::Result<()> {
    let checkpoint =
        latest_checkpoint(save).context("--save-hf: the run saved no checkpoint to export")?;
    let opts = manta_trainer::export::ExportOptions {
        dtype: Default::default(),
        tokenizer_from: Some(model.to_path_buf()),
    };
    let exported = crate::export::export(checkpoint, save.join("hf"), opts)
        .await
        .context("--save-hf (the checkpoint stays; `driver export` can write it again)")?;
    println!("{}", crate::export::summary(&exported));
    Ok(())
}

/// Starts the actors `cluster` places for this run (crate::placement). Remote mode makes
/// the paths in `settings` absolute (workers read and write them).
async fn place(
    cluster: &ClusterConfig,
    train: &TrainConfig,
    settings: &mut TrainSettings,
) -> anyhow::Result<Placed> {
    // Debug data needs no engine or environment, local or remote: the trainer runs here.
    if let Some(template) = settings.load_debug_rollout_data.clone() {
        // Ranks on workers (`[trainer] ranks`) train there; else the trainer runs here,
        // with local mode's data-parallel ranks.
        let devices = match cluster.mode {
            ClusterMode::Remote if !cluster.trainer.ranks.is_empty() => {
                return crate::remote::place_saved_ranks(cluster, settings, template).await;
            }
            ClusterMode::Local if !cluster.trainer.gpus.is_empty() => {
                RankDevices::Gpus(cluster.trainer.gpus.clone())
            }
            ClusterMode::Local => RankDevices::Cpu(cluster.trainer.data_parallel_world()),
            ClusterMode::Remote => RankDevices::Cpu(1),
        };
        return crate::local::place_saved(
            template,
            settings,
            devices,
            cluster.trainer.bf16,
            &cluster.path,
        )
        .await;
    }
    match cluster.mode {
        ClusterMode::Local => crate::local::place(cluster, train, settings).await,
        ClusterMode::Remote => crate::remote::place(cluster, train, settings).await,
    }
}

/// What a run records and checks beside its settings.
pub(crate) struct RunRecords {
    /// Recorded in every checkpoint's manifest (crate::save_dir).
    pub run_id: String,
    pub guards: Guards,
    /// Where the settings came from (written to the run directory).
    pub layers: SettingLayers,
    /// What `--eval-interval` evaluates.
    pub eval_sets: Vec<EvalSet>,
}

pub(crate) async fn run_with_actors(
    env_clients: &std::collections::BTreeMap<String, OrsClient>,
    actors: StepActors,
    train: &TrainConfig,
    settings: &TrainSettings,
    recovery: TrainerRecovery,
    stop: crate::signals::StopRequest,
    records: RunRecords,
) -> anyhow::Result<RunSummary> {
    let RunRecords {
        run_id,
        guards,
        layers,
        eval_sets,
    } = records;
    // Partial rollouts: a weight update ends running generate calls at once (their
    // episodes resume with the new weights) instead of waiting for them to finish.
    let actors = if settings.sampling.partial_rollout {
        StepActors {
            weights: actors.weights.abort_on_pause(),
            ..actors
        }
    } else {
        actors
    };
    let tasks = match &settings.task_data {
        // Debug data replaces the tasks: one placeholder keeps the step loop's shape.
        _ if settings.load_debug_rollout_data.is_some() => vec![debug_task(train)],
        Some(path) => read_tasks_jsonl(path)?,
        None => list_tasks(env_clients, train).await?,
    };
    if let Some(t) = tasks
        .iter()
        .find(|t| !train.environments.contains_key(&t.environment))
    {
        anyhow::bail!(
            "task {} names environment {}, which {} does not configure",
            t.task_hash,
            t.environment,
            train.path.display()
        );
    }
    if tasks.is_empty() {
        anyhow::bail!("no tasks to train on");
    }
    let mut first_step = 1;
    if let Some(dir) = &settings.load {
        let checkpoint = latest_checkpoint(dir)?;
        verify_checkpoint(&checkpoint).await?;
        let _progress = manta_telemetry::Progress::start(format!(
            "loading checkpoint {}",
            checkpoint.display()
        ));
        let step = actors
            .trainer
            .load_checkpoint(&checkpoint)
            .await
            .with_context(|| format!("loading checkpoint {}", checkpoint.display()))?;
        actors
            .weights
            .sync(step)
            .await
            .context("syncing resumed weights to the engines")?;
        info!(checkpoint = %checkpoint.display(), step, "resumed");
        first_step = step + 1;
    }
    let run_name = settings
        .run_name
        .clone()
        .unwrap_or_else(crate::run_dir::default_run_name);
    let run_dir: PathBuf = settings.runs_dir.join(&run_name);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    // A resumed run continuing its directory trains the steps after the checkpoint again.
    crate::run_dir::rewind(&run_dir, first_step - 1)?;
    std::fs::write(
        run_dir.join("settings.json"),
        serde_json::to_string_pretty(settings)?,
    )
    .with_context(|| format!("writing {}/settings.json", run_dir.display()))?;
    layers.report(&run_dir, settings)?;
    let metrics = MetricsWriter::open(&run_dir.join("metrics.jsonl"))
        .with_context(|| format!("opening {}/metrics.jsonl", run_dir.display()))?;
    info!(run = %run_dir.display(), tasks = tasks.len(), "run directory ready");
    if settings.debug_rollout_only {
        info!("--debug-rollout-only: each step runs its rollouts and trains nothing; the engines keep their first weights");
    }
    let wandb = settings.wandb_project.as_ref().and_then(|project| {
        let opts = WandbOptions {
            project: project.clone(),
            run_name: settings
                .wandb_run
                .clone()
                .unwrap_or_else(|| run_name.clone()),
            python: None,
        };
        let config = serde_json::to_value(settings).unwrap_or_default();
        WandbSink::start(&opts, &config)
    });
    let eval = (settings.eval.interval.is_some() && !eval_sets.is_empty()).then(|| {
        for (name, tasks) in eval_sets.iter().map(|s| (&s.name, s.tasks.len())) {
            info!(set = %name, tasks, "evaluation set");
        }
        crate::eval::Evaluator::new(actors.rollouts.clone(), settings.eval.clone(), eval_sets)
    });
    let queue = crate::sampling::GroupQueue::new(
        actors.rollouts.clone(),
        TaskSampler::new(tasks, settings.seed),
        settings,
        first_step,
    );
    let plan = RunPlan {
        actors,
        recovery,
        queue,
        rollout_batch_size: settings.rollout_batch_size,
        n_samples: settings.n_samples,
        advantages: crate::step::AdvantageSpec::from_settings(&settings.algo)?,
        save_debug: settings.save_debug_rollout_data.clone(),
        first_step,
        weight_version: first_step - 1,
        last_step: settings.num_rollout as u64,
        save: settings.save.clone(),
        save_interval: settings.save_interval,
        metrics,
        wandb,
        run_dir,
        stop_requested: stop,
        run_id,
        guards,
        checks: StepChecks {
            max_failed_episode_ratio: guards.max_failed_episode_ratio,
            context_len: settings.context_len,
        },
        eval,
    };
    crate::status::start_run(&plan.run_dir, first_step, plan.last_step);
    let (driver, handle) = Actor::spawn(Some("driver".into()), DriverActor, plan)
        .await
        .context("starting the driver actor")?;
    let summary = call!(driver, DriverMsg::Run).context("the driver actor stopped unexpectedly")?;
    driver.stop(None);
    let _ = handle.await;
    summary.map_err(|e| anyhow::anyhow!(e))
}

/// Locks `--save` (refusing a directory another run holds, or one that cannot be
/// written: the lock file is the probe), removes the `.tmp` directories failed saves
/// left, and records the run directory and run id there. Returns the lock and the run
/// id: the recorded one when resuming from this directory's run, else a new one.
fn prepare_save_dir(
    settings: &TrainSettings,
    run_dir: &Path,
    recorded: Option<&crate::save_dir::SaveRecord>,
) -> anyhow::Result<(Option<DirLock>, String)> {
    let run_name = settings.run_name.clone().unwrap_or_default();
    let run_id = recorded
        .map(|r| r.run_id.clone())
        .unwrap_or_else(|| crate::save_dir::new_run_id(&run_name));
    let Some(save) = settings.save.as_deref() else {
        return Ok((None, run_id));
    };
    if settings.debug_rollout_only {
        return Ok((None, run_id));
    }
    let lock = DirLock::acquire(save, "--save directory")?;
    if let (Some(need), Some(free)) = (
        crate::save_dir::checkpoint_estimate(&settings.model),
        crate::save_dir::free_bytes(save),
    ) {
        if free < need {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            warn!(
                "--save {}: {:.1} GiB free, and one checkpoint of {} takes about {:.1} GiB: \
                 the first save may fail",
                save.display(),
                gib(free),
                settings.model.display(),
                gib(need)
            );
        }
    }
    for tmp in crate::save_dir::remove_failed_saves(save)? {
        info!(dir = %tmp.display(), "removed a failed save's temporary directory");
    }
    let absolute = std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
    crate::save_dir::write_record(
        save,
        &crate::save_dir::SaveRecord {
            run_dir: absolute,
            run_id: run_id.clone(),
        },
    )?;
    Ok((Some(lock), run_id))
}

/// `--load`: the checkpoint must match its manifest (crate::checkpoint_manifest).
async fn verify_checkpoint(checkpoint: &Path) -> anyhow::Result<()> {
    let dir = checkpoint.to_path_buf();
    let verified = tokio::task::spawn_blocking(move || crate::checkpoint_manifest::verify(&dir))
        .await
        .context("verifying the checkpoint")?
        .with_context(|| format!("--load: checkpoint {} is damaged", checkpoint.display()))?;
    match verified {
        Some(m) => {
            info!(checkpoint = %checkpoint.display(), step = m.step, run = %m.run_id, files = m.files.len(), "checkpoint verified")
        }
        None => {
            warn!(checkpoint = %checkpoint.display(), "checkpoint has no manifest.json (saved by an older version): its files are not verified")
        }
    }
    Ok(())
}

/// The task every step "samples" when training from debug rollout data.
fn debug_task(train: &TrainConfig) -> manta_rollout::TaskRef {
    let environment = train
        .environments
        .keys()
        .next()
        .cloned()
        .unwrap_or_default();
    manta_rollout::TaskRef {
        environment: environment.clone(),
        split: "debug".into(),
        task_spec: serde_json::Value::Null,
        task_hash: "debug-rollout-data".into(),
        server_env: environment,
    }
}

#[cfg(test)]
mod tests;

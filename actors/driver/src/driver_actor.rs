//! `DriverActor`: owns the training loop. Each step is a `Step` message it sends
//! itself, so a stop request is seen between steps and the mailbox stays the single
//! place where the run advances.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use manta_config::TrainerFailurePolicy;
use manta_hosting::TrainerCallError;
use manta_telemetry::{MetricsWriter, TensorBoardWriter, WandbSink};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tracing::field::Empty;
use tracing::{error, info, info_span, warn, Instrument};

use crate::failure_budget::{FailureBudget, StepChecks, StepFailure};
use crate::guard_flags::Guards;
use crate::placement::TrainerRecovery;
use crate::sampling::GroupQueue;
use crate::step::{run_step, StepActors};
use crate::trainer_handle::TrainerHandle;

/// Trainer restarts in a row (no step completed in between) before the run gives up.
const MAX_TRAINER_RESTARTS: u32 = 3;

/// The curves PNG is redrawn after a step when it is older than this (and after step 1).
const PLOT_EVERY: Duration = Duration::from_secs(30);

/// How long the end of a run waits for the W&B sidecar to upload its last steps.
const WANDB_FINISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// How a run ended.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub steps_done: u64,
    pub last_step: u64,
    pub interrupted: bool,
    /// Sample ids trained on, in step order.
    pub trained_ids: Vec<u64>,
    pub final_weight_version: u64,
}

pub enum DriverMsg {
    /// Start the loop; the reply comes when the run ends.
    Run(RpcReplyPort<Result<RunSummary, String>>),
    /// Internal: run the next step.
    Step,
}

/// Everything the loop needs.
pub struct RunPlan {
    pub actors: StepActors,
    /// What to do when a remote trainer is lost.
    pub recovery: TrainerRecovery,
    /// The weight version the engines hold at the start (the resumed step, or 0).
    pub weight_version: u64,
    /// Where each step's groups come from (over-sampling, dynamic sampling, async mode).
    pub queue: GroupQueue,
    pub rollout_batch_size: usize,
    pub n_samples: usize,
    pub advantages: crate::step::AdvantageSpec,
    /// `--save-debug-rollout-data` template.
    pub save_debug: Option<String>,
    /// First step to run (1 on a fresh run; checkpoint step + 1 on resume).
    pub first_step: u64,
    pub last_step: u64,
    pub save: Option<PathBuf>,
    pub save_interval: usize,
    pub metrics: MetricsWriter,
    /// Weights & Biases, when `--wandb-project` is set and its sidecar started.
    pub wandb: Option<WandbSink>,
    pub run_dir: PathBuf,
    /// Set by SIGINT or SIGTERM: finish (or abandon) the current step, save, stop.
    pub stop_requested: crate::signals::StopRequest,
    /// Recorded in every checkpoint's manifest (crate::save_dir).
    pub run_id: String,
    /// The failure budget and `--keep-last`.
    pub guards: Guards,
    /// What makes a step a failed one (crate::failure_budget).
    pub checks: StepChecks,
    /// Evaluation during training (`--eval-interval`); `None` evaluates nothing.
    pub eval: Option<crate::eval::Evaluator>,
}

pub struct DriverState {
    plan: RunPlan,
    tensorboard: Option<TensorBoardWriter>,
    next_step: u64,
    steps_done: u64,
    /// Sample ids trained on, per step.
    trained: Vec<(u64, Vec<u64>)>,
    weight_version: u64,
    /// Trainer restarts since the last completed step.
    restarts: u32,
    /// Failed steps in a row.
    budget: FailureBudget,
    reply: Option<RpcReplyPort<Result<RunSummary, String>>>,
    started: Instant,
    /// When the curves PNG was last drawn.
    plotted: Option<Instant>,
}

pub struct DriverActor;

impl Actor for DriverActor {
    type Msg = DriverMsg;
    type State = DriverState;
    type Arguments = RunPlan;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        plan: RunPlan,
    ) -> Result<DriverState, ActorProcessingErr> {
        // TensorBoard files are a convenience: a failure to create one is logged, not fatal.
        let tensorboard = match TensorBoardWriter::create(&plan.run_dir) {
            Ok(w) => Some(w),
            Err(e) => {
                warn!(dir = %plan.run_dir.display(), error = %e, "no TensorBoard event file");
                None
            }
        };
        Ok(DriverState {
            tensorboard,
            next_step: plan.first_step,
            weight_version: plan.weight_version,
            budget: FailureBudget::new(&plan.guards),
            plan,
            steps_done: 0,
            trained: Vec::new(),
            restarts: 0,
            reply: None,
            started: Instant::now(),
            plotted: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: DriverMsg,
        state: &mut DriverState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            DriverMsg::Run(reply) => {
                state.started = Instant::now();
                // slime evaluates the initial weights once, on a fresh run only.
                if state.plan.first_step == 1 {
                    if let Err(e) = evaluate_if_due(state, 0).await {
                        let _ = reply.send(Err(format!("{e:#}")));
                        return Ok(());
                    }
                }
                state.reply = Some(reply);
                myself.send_message(DriverMsg::Step)?;
            }
            DriverMsg::Step => {
                let interrupted = state.plan.stop_requested.is_requested();
                if interrupted || state.next_step > state.plan.last_step {
                    let result = finish(state, interrupted)
                        .await
                        .map_err(|e| format!("{e:#}"));
                    if let Some(reply) = state.reply.take() {
                        let _ = reply.send(result);
                    }
                    return Ok(());
                }
                let step = state.next_step;
                let outcome = match one_step(state).await {
                    Ok(StepEnd::Abandoned) => {
                        // Abandoned on request: the next message finishes the run.
                        Ok(())
                    }
                    Ok(StepEnd::Trained) => {
                        state.restarts = 0;
                        state.budget.succeeded();
                        Ok(())
                    }
                    Ok(StepEnd::Failed(failure)) => step_failed(state, step, &failure).await,
                    Err(e) => match e.downcast_ref::<TrainerCallError>() {
                        Some(TrainerCallError::Lost { .. }) => {
                            trainer_lost(state, step, &format!("{e:#}")).await
                        }
                        _ => Err(format!("step {step}: {e:#}")),
                    },
                };
                match outcome {
                    Ok(()) => myself.send_message(DriverMsg::Step)?,
                    Err(message) => {
                        if let Some(reply) = state.reply.take() {
                            let _ = reply.send(Err(message));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Step `step` trained nothing: wait and try it again, or end the run once the failure
/// budget is spent (at once when retrying cannot help).
async fn step_failed(
    state: &mut DriverState,
    step: u64,
    failure: &StepFailure,
) -> Result<(), String> {
    let backoff = state.budget.failed(step, failure)?;
    let budget = state.plan.guards.max_failed_steps;
    println!(
        "retrying step {step}/{} in {}s: it failed and trained nothing: {} ({} of {budget} \
         failed steps in a row allowed)",
        state.plan.last_step,
        backoff.as_secs(),
        failure.cause,
        state.budget.in_a_row(),
    );
    warn!(step, cause = %failure.cause, "step failed; nothing trained");
    tokio::time::sleep(backoff).await;
    Ok(())
}

/// How a step ended.
enum StepEnd {
    Trained,
    /// A stop request abandoned it during its rollouts (`--on-stop abandon-step`): nothing
    /// of it is recorded and the trainer is untouched.
    Abandoned,
    /// It failed and trained nothing (it is not recorded).
    Failed(StepFailure),
}

/// Runs the next step.
async fn one_step(state: &mut DriverState) -> anyhow::Result<StepEnd> {
    let plan = &mut state.plan;
    let step = state.next_step;
    let version = state.weight_version;
    // Each step is the root of its own trace; episodes (local or on workers) hang off it.
    // Integers as i64: OpenTelemetry has no unsigned attribute type.
    let span = info_span!(
        parent: None,
        "step",
        step = step as i64,
        samples = (plan.rollout_batch_size * plan.n_samples) as i64,
        reward = Empty,
        loss = Empty
    );
    crate::status::step_started(step);
    let running = run_step(
        &plan.actors,
        step,
        &mut plan.queue,
        version,
        plan.n_samples,
        plan.advantages,
        plan.save_debug.as_deref(),
        plan.checks,
    )
    .instrument(span.clone());
    let stop = plan.stop_requested.clone();
    let outcome = tokio::select! {
        outcome = running => outcome?,
        () = stop.abandon_while_collecting() => {
            crate::status::set_phase(crate::status::Phase::Stopping);
            warn!(step, "step {step} abandoned during its rollouts (--on-stop abandon-step)");
            return Ok(StepEnd::Abandoned);
        }
    };
    if let Some(failure) = outcome.failed {
        return Ok(StepEnd::Failed(failure));
    }
    let m = &outcome.metrics;
    if let Some(reward) = m.get("rollout/raw_reward") {
        span.record("reward", reward);
    }
    if let Some(loss) = m.get("train/loss") {
        span.record("loss", loss);
    }
    plan.metrics
        .write_step(step, m)
        .with_context(|| format!("writing {}", plan.metrics.path().display()))?;
    if let Some(Err(e)) = state.tensorboard.as_mut().map(|tb| tb.write_step(step, m)) {
        warn!(error = %e, "TensorBoard write failed; disabling it");
        state.tensorboard = None;
    }
    if let Some(wandb) = &plan.wandb {
        wandb.log(step, m);
    }
    let trained = !plan.actors.rollout_only;
    let version_after = if trained { step } else { state.weight_version };
    let (elapsed, eta) = crate::status::step_finished(step, version_after, m);
    let line = format!(
        "{}  elapsed {}  eta {}",
        progress_line(step, plan.last_step, m),
        crate::status::human_duration(elapsed),
        eta.map(crate::status::human_duration)
            .unwrap_or_else(|| "-".into())
    );
    println!("{line}");
    manta_telemetry::run_log::line(&line);
    if m.get("rollout/failed_count").copied().unwrap_or(0.0) > 0.0 {
        warn!(
            step,
            failed = m["rollout/failed_count"],
            "some episodes failed and were left out of training"
        );
    }
    append_trained_ids(&plan.run_dir, step, &outcome.trained_ids)?;
    state.trained.push((step, outcome.trained_ids));
    if trained {
        state.weight_version = step;
    }
    state.steps_done += 1;
    state.next_step += 1;
    if let Some(dir) = plan.save.as_ref().filter(|_| trained) {
        if plan.save_interval > 0
            && step.is_multiple_of(plan.save_interval as u64)
            && step < plan.last_step
        {
            save_checkpoint(
                &plan.actors.trainer,
                dir,
                step,
                &plan.run_id,
                plan.guards.keep_last,
            )
            .await?;
        }
    }
    evaluate_if_due(state, step).await?;
    let plan = &mut state.plan;
    if state.plotted.is_none_or(|t| t.elapsed() >= PLOT_EVERY) {
        state.plotted = Some(Instant::now());
        let png = plan.run_dir.join("curves.png");
        if let Err(e) = manta_telemetry::plot_curves(plan.metrics.path(), &png) {
            warn!(error = %e, "curves not redrawn");
        }
    }
    crate::status::set_phase(crate::status::Phase::Idle);
    Ok(StepEnd::Trained)
}

/// Evaluates after `step` (0: before the first) when `--eval-interval` says so, and
/// records the `eval/` metrics under that step wherever the step's own metrics go.
async fn evaluate_if_due(state: &mut DriverState, step: u64) -> anyhow::Result<()> {
    let plan = &mut state.plan;
    let Some(evaluator) = plan.eval.as_mut().filter(|e| e.due(step)) else {
        return Ok(());
    };
    let phase = crate::status::phase();
    crate::status::set_phase(crate::status::Phase::Eval);
    let span = info_span!(parent: None, "eval", step = step as i64);
    let m = evaluator
        .evaluate(step)
        .instrument(span)
        .await
        .with_context(|| format!("evaluation after step {step}"))?;
    plan.metrics
        .write_step(step, &m)
        .with_context(|| format!("writing {}", plan.metrics.path().display()))?;
    if let Some(Err(e)) = state.tensorboard.as_mut().map(|tb| tb.write_step(step, &m)) {
        warn!(error = %e, "TensorBoard write failed; disabling it");
        state.tensorboard = None;
    }
    if let Some(wandb) = &plan.wandb {
        wandb.log(step, &m);
    }
    let line = evaluator.summary(step, &m);
    println!("{line}");
    manta_telemetry::run_log::line(&line);
    crate::status::set_phase(phase);
    Ok(())
}

/// One line per step: where its time went and how fast tokens moved. `rollout` is the
/// time the step waited for its groups (in asynchronous mode they were mostly
/// generated during the previous step), `tok/s` counts generated tokens over the
/// groups' generation time and trained tokens over the training time.
pub fn progress_line(step: u64, last_step: u64, m: &manta_telemetry::StepMetrics) -> String {
    let get = |key: &str| m.get(key).copied().unwrap_or(f64::NAN);
    format!(
        "step {step:>5}/{last_step}  reward {:.3}  loss {:+.4}  time {:.2}s \
         (rollout {:.2}s, train {:.2}s, sync {:.2}s)  tok/s rollout {:.0} train {:.0}",
        get("rollout/raw_reward"),
        get("train/loss"),
        get("perf/step_time"),
        get("perf/rollout_time"),
        get("perf/train_time"),
        get("perf/update_weights_time"),
        get("perf/rollout_tokens_per_sec"),
        get("perf/tokens_per_gpu_per_sec"),
    )
}

async fn finish(state: &mut DriverState, interrupted: bool) -> anyhow::Result<RunSummary> {
    crate::status::set_phase(crate::status::Phase::Stopping);
    if let Some(wandb) = state.plan.wandb.take() {
        // Blocking wait for the sidecar's upload, off the runtime's worker threads.
        let _ = tokio::task::spawn_blocking(move || wandb.finish(WANDB_FINISH_TIMEOUT)).await;
    }
    let plan = &state.plan;
    let last_done = state.next_step - 1;
    // --debug-rollout-only trains nothing: no checkpoint to write.
    if let Some(dir) = plan.save.as_ref().filter(|_| !plan.actors.rollout_only) {
        if state.steps_done > 0 {
            save_checkpoint(
                &plan.actors.trainer,
                dir,
                last_done,
                &plan.run_id,
                plan.guards.keep_last,
            )
            .await?;
        }
    }
    if interrupted {
        warn!(
            step = last_done,
            "stopped on request after step {last_done}"
        );
    }
    let png = plan.run_dir.join("curves.png");
    match manta_telemetry::plot_curves(plan.metrics.path(), &png) {
        Ok(_) => info!(plot = %png.display(), "wrote the training curves"),
        Err(e) => warn!(error = %e, "no plot written"),
    }
    let version = state.weight_version;
    info!(
        steps = state.steps_done,
        seconds = state.started.elapsed().as_secs_f64(),
        metrics = %plan.metrics.path().display(),
        "run finished"
    );
    Ok(RunSummary {
        run_dir: plan.run_dir.clone(),
        steps_done: state.steps_done,
        last_step: last_done,
        interrupted,
        trained_ids: state
            .trained
            .iter()
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect(),
        final_weight_version: version,
    })
}

/// A remote trainer was lost during `step`: stop with a message saying how to resume,
/// or re-create it from the last checkpoint and go on from there, as configured.
async fn trainer_lost(state: &mut DriverState, step: u64, cause: &str) -> Result<(), String> {
    let latest = state
        .plan
        .save
        .as_ref()
        .filter(|dir| dir.join("latest").is_file())
        .and_then(|dir| latest_checkpoint(dir).ok());
    let resume = match (&state.plan.save, &latest) {
        (Some(dir), Some(ckpt)) => format!(
            "resume with --load {} (latest checkpoint {})",
            dir.display(),
            ckpt.display()
        ),
        _ => "no checkpoint was saved yet (--save DIR --save-interval N keeps one)".into(),
    };
    match state.plan.recovery.policy {
        TrainerFailurePolicy::Stop => {
            error!(step, "{cause}");
            Err(format!(
                "step {step}: {cause}\ncluster.toml [trainer] on_failure = \"stop\": the run stops here; {resume}"
            ))
        }
        TrainerFailurePolicy::Restart if state.restarts >= MAX_TRAINER_RESTARTS => Err(format!(
            "step {step}: {cause}\nthe trainer was lost {} times in a row without finishing a step; \
             stopping; {resume}",
            state.restarts + 1
        )),
        TrainerFailurePolicy::Restart => {
            state.restarts += 1;
            let from = latest
                .as_ref()
                .and_then(|c| c.file_name())
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("step_"))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            // One line that says what was lost and where the run picks up again.
            warn!(
                step,
                restored_step = from,
                "{cause}; restarting the trainer from {}; the run resumes at step {}",
                latest
                    .as_ref()
                    .map(|c| format!("checkpoint {}", c.display()))
                    .unwrap_or_else(|| "its initial weights (no checkpoint yet)".into()),
                from + 1
            );
            restart_trainer(state, latest.as_deref())
                .await
                .map_err(|e| format!("step {step}: {cause}\nrestarting the trainer failed: {e:#}; {resume}"))
        }
    }
}

/// Re-creates the remote trainer, restores `checkpoint` (or keeps the initial weights),
/// syncs the engines, and rewinds the loop to the step after the restored one.
async fn restart_trainer(
    state: &mut DriverState,
    checkpoint: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let plan = &mut state.plan;
    plan.actors
        .trainer
        .restart(plan.recovery.restart_timeout)
        .await?;
    let from = match checkpoint {
        Some(ckpt) => plan
            .actors
            .trainer
            .load_checkpoint(ckpt)
            .await
            .with_context(|| format!("loading {}", ckpt.display()))?,
        None => 0,
    };
    plan.actors.weights.sync(from).await?;
    // Steps after the restored one will be trained again: forget them, so every
    // record (trained ids, metrics, TensorBoard) holds each step once.
    state.trained.retain(|(s, _)| *s <= from);
    truncate_trained_ids(&plan.run_dir, from)?;
    plan.metrics
        .discard_after(from)
        .with_context(|| format!("rewinding {}", plan.metrics.path().display()))?;
    if let Some(Err(e)) = state.tensorboard.as_mut().map(|tb| tb.discard_after(from)) {
        warn!(error = %e, "rewinding the TensorBoard event file failed; disabling it");
        state.tensorboard = None;
    }
    plan.queue.rewind(from);
    crate::status::rewound(from);
    state.next_step = from + 1;
    state.weight_version = from;
    info!(
        next_step = state.next_step,
        "trainer restarted; steps after {from} run again (their earlier records are dropped)"
    );
    Ok(())
}

/// Keeps only the records of steps up to `last` in `run_dir/trained_ids.jsonl`.
fn truncate_trained_ids(run_dir: &std::path::Path, last: u64) -> anyhow::Result<()> {
    let path = run_dir.join("trained_ids.jsonl");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= last)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    let tmp = run_dir.join("trained_ids.jsonl.tmp");
    std::fs::write(&tmp, kept).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

/// Appends `{"step": N, "ids": [...]}` to `run_dir/trained_ids.jsonl`, so sample
/// accounting (no id lost, none repeated) can be checked after a run.
fn append_trained_ids(run_dir: &std::path::Path, step: u64, ids: &[u64]) -> anyhow::Result<()> {
    use std::io::Write;
    let path = run_dir.join("trained_ids.jsonl");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(file, "{}", serde_json::json!({"step": step, "ids": ids}))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Saves `dir/step_NNNNNN`, records its files' checksums in its manifest, and then
/// points `dir/latest` at it (written atomically), so `--load dir` always finds a
/// complete checkpoint; then `--keep-last` deletes the oldest beyond `keep_last`. A
/// failed save's `step_NNNNNN.tmp` is removed.
pub async fn save_checkpoint(
    trainer: &TrainerHandle,
    dir: &std::path::Path,
    step: u64,
    run_id: &str,
    keep_last: Option<usize>,
) -> anyhow::Result<()> {
    let name = format!("step_{step:06}");
    let target = dir.join(&name);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let phase = crate::status::phase();
    crate::status::set_phase(crate::status::Phase::Checkpoint);
    let progress =
        manta_telemetry::Progress::start(format!("saving checkpoint {}", target.display()));
    if let Err(e) = trainer.save_checkpoint(&target, step).await {
        crate::status::set_phase(phase);
        let tmp = target.with_extension("tmp");
        if tmp.is_dir() {
            if let Err(rm) = std::fs::remove_dir_all(&tmp) {
                warn!(dir = %tmp.display(), error = %rm, "could not remove the failed save");
            }
        }
        return Err(e).with_context(|| format!("saving checkpoint {}", target.display()));
    }
    drop(progress);
    // Where ranks keep their parts on their workers' disks, this directory holds the
    // driver's record of them only; it is what the manifest covers then.
    if target.is_dir() {
        let (target, run_id) = (target.clone(), run_id.to_string());
        tokio::task::spawn_blocking(move || {
            crate::checkpoint_manifest::write(&target, step, &run_id)
        })
        .await
        .context("checksumming the checkpoint")?
        .context("writing the checkpoint's manifest")?;
    }
    let tmp = dir.join("latest.tmp");
    std::fs::write(&tmp, &name).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join("latest"))
        .with_context(|| format!("updating {}/latest", dir.display()))?;
    info!(checkpoint = %target.display(), "checkpoint saved");
    if let Some(keep) = keep_last {
        for old in crate::save_dir::keep_last(dir, keep, &target)? {
            info!(checkpoint = %old.display(), "--keep-last {keep}: deleted");
        }
    }
    crate::status::set_phase(phase);
    Ok(())
}

/// The checkpoint `dir/latest` points at.
pub fn latest_checkpoint(dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let latest = dir.join("latest");
    let name = std::fs::read_to_string(&latest).with_context(|| {
        format!(
            "--load {}: no `latest` file (is this a Manta checkpoint directory?)",
            dir.display()
        )
    })?;
    let path = dir.join(name.trim());
    if !path.is_dir() {
        anyhow::bail!(
            "--load {}: `latest` names {}, which does not exist",
            dir.display(),
            path.display()
        );
    }
    Ok(path)
}

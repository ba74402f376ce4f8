//! What a running driver is doing, in one place: the step and its phase, episodes in
//! flight, the engines' weight version, the last step's metrics and the ETA. The run
//! loop writes it as it goes; `driver status` and the Prometheus endpoint
//! (crate::status_server) read it. One run per process, so it is process-wide.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Where the step in flight is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Placing actors, loading the model, resuming.
    Starting = 0,
    /// Collecting the step's episodes.
    Rollout = 1,
    /// The optimizer step.
    Train = 2,
    /// Moving the new weights into the engines.
    WeightSync = 3,
    /// Writing a checkpoint.
    Checkpoint = 4,
    /// Between steps.
    Idle = 5,
    /// Stopping: final checkpoint, actors shutting down.
    Stopping = 6,
    /// Evaluating (`--eval-interval`): nothing trains meanwhile.
    Eval = 7,
}

impl Phase {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Rollout,
            2 => Self::Train,
            3 => Self::WeightSync,
            4 => Self::Checkpoint,
            5 => Self::Idle,
            6 => Self::Stopping,
            7 => Self::Eval,
            _ => Self::Starting,
        }
    }

    /// The name `driver status` and the metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Rollout => "rollout",
            Self::Train => "train",
            Self::WeightSync => "weight_sync",
            Self::Checkpoint => "checkpoint",
            Self::Idle => "idle",
            Self::Stopping => "stopping",
            Self::Eval => "eval",
        }
    }
}

static PHASE: AtomicU8 = AtomicU8::new(Phase::Starting as u8);
static IN_FLIGHT: AtomicI64 = AtomicI64::new(0);
static RUN: Mutex<Option<RunState>> = Mutex::new(None);

/// The run's progress, as the loop last wrote it.
struct RunState {
    run_dir: String,
    mode: String,
    first_step: u64,
    last_step: u64,
    /// The step in flight (or the next one, between steps).
    step: u64,
    steps_done: u64,
    weight_version: u64,
    started: Instant,
    started_unix: f64,
    last_metrics: BTreeMap<String, f64>,
    local_node: Option<NodeStatus>,
}

/// One node of the cluster as `driver status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeStatus {
    pub address: String,
    pub hostname: String,
    pub gpus: Vec<u32>,
    /// The actors it hosts.
    pub actors: Vec<String>,
    /// Whether it answered its heartbeat just now.
    pub healthy: bool,
    /// The error of a node that did not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// An engine and the weight version it holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EngineStatus {
    pub name: String,
    pub weight_version: u64,
}

/// Everything `driver status` prints; also the JSON of `GET /status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Snapshot {
    pub run_dir: String,
    pub mode: String,
    pub phase: Phase,
    pub step: u64,
    pub last_step: u64,
    pub steps_done: u64,
    pub episodes_in_flight: i64,
    pub elapsed_s: f64,
    /// Seconds to the last step at the mean pace so far (none before the first step).
    pub eta_s: Option<f64>,
    pub started_unix: f64,
    pub nodes: Vec<NodeStatus>,
    pub engines: Vec<EngineStatus>,
    /// The last finished step's metrics (slime's names).
    pub last_step_metrics: BTreeMap<String, f64>,
}

/// The cluster as placed: its mode and, in local mode, the one in-process node.
static CLUSTER: Mutex<Option<(String, Option<NodeStatus>)>> = Mutex::new(None);

/// Records the cluster's mode (`local`, `remote`) and local mode's in-process node.
pub fn describe_cluster(mode: &str, local_node: Option<NodeStatus>) {
    *CLUSTER.lock().unwrap_or_else(|e| e.into_inner()) = Some((mode.to_string(), local_node));
}

/// Records the run's shape as its loop starts: `first_step..=last_step` to run.
pub fn start_run(run_dir: &std::path::Path, first_step: u64, last_step: u64) {
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let (mode, local_node) = CLUSTER
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_else(|| ("local".into(), None));
    *RUN.lock().unwrap_or_else(|e| e.into_inner()) = Some(RunState {
        run_dir: run_dir.display().to_string(),
        mode,
        first_step,
        last_step,
        step: first_step,
        steps_done: 0,
        weight_version: first_step.saturating_sub(1),
        started: Instant::now(),
        started_unix,
        last_metrics: BTreeMap::new(),
        local_node,
    });
    set_phase(Phase::Idle);
}

/// The step in flight moves to `phase`.
pub fn set_phase(phase: Phase) {
    PHASE.store(phase as u8, Ordering::SeqCst);
}

/// The phase of the step in flight.
pub fn phase() -> Phase {
    Phase::from_u8(PHASE.load(Ordering::SeqCst))
}

/// `step` starts.
pub fn step_started(step: u64) {
    if let Some(run) = RUN.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        run.step = step;
    }
    set_phase(Phase::Rollout);
}

/// `step` finished with `metrics`; the engines hold `weight_version`. Returns the
/// elapsed time and the ETA for the step line.
pub fn step_finished(
    step: u64,
    weight_version: u64,
    metrics: &BTreeMap<String, f64>,
) -> (f64, Option<f64>) {
    let mut slot = RUN.lock().unwrap_or_else(|e| e.into_inner());
    let Some(run) = slot.as_mut() else {
        return (0.0, None);
    };
    run.steps_done += 1;
    run.step = step + 1;
    run.weight_version = weight_version;
    run.last_metrics = metrics.clone();
    let elapsed = run.started.elapsed().as_secs_f64();
    (elapsed, eta(run, elapsed))
}

/// Seconds to the last step at the mean pace of the steps done so far.
fn eta(run: &RunState, elapsed: f64) -> Option<f64> {
    if run.steps_done == 0 {
        return None;
    }
    let left = (run.last_step + 1).saturating_sub(run.first_step + run.steps_done);
    Some(elapsed / run.steps_done as f64 * left as f64)
}

/// The loop rewound to the step after `step` (a lost trainer restored a checkpoint).
pub fn rewound(step: u64) {
    if let Some(run) = RUN.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        run.step = step + 1;
        run.weight_version = step;
    }
}

/// `n` episodes were sent out (negative: `n` came back).
pub fn episodes_in_flight(n: i64) {
    IN_FLIGHT.fetch_add(n, Ordering::SeqCst);
}

/// The run's state now, with `nodes` (remote mode: asked of the workers just now).
pub fn snapshot(nodes: Vec<NodeStatus>) -> Option<Snapshot> {
    let slot = RUN.lock().unwrap_or_else(|e| e.into_inner());
    let run = slot.as_ref()?;
    let elapsed = run.started.elapsed().as_secs_f64();
    let mut all = Vec::new();
    all.extend(run.local_node.clone());
    all.extend(nodes);
    Some(Snapshot {
        run_dir: run.run_dir.clone(),
        mode: run.mode.clone(),
        phase: phase(),
        step: run.step,
        last_step: run.last_step,
        steps_done: run.steps_done,
        episodes_in_flight: IN_FLIGHT.load(Ordering::SeqCst).max(0),
        elapsed_s: elapsed,
        eta_s: eta(run, elapsed),
        started_unix: run.started_unix,
        // Rollout actors own the engines; one on a node that did not answer is left out.
        engines: all
            .iter()
            .filter(|n| n.healthy)
            .flat_map(|n| n.actors.iter())
            .filter(|a| a.starts_with("rollout-"))
            .map(|name| EngineStatus {
                name: name.clone(),
                weight_version: run.weight_version,
            })
            .collect(),
        nodes: all,
        last_step_metrics: run.last_metrics.clone(),
    })
}

/// `1h02m`, `3m05s`, `12s`: durations for the step line and `driver status`.
pub fn human_duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, min, sec) => format!("{min}m{sec:02}s"),
        (h, min, _) => format!("{h}h{min:02}m"),
    }
}

/// The snapshot as `driver status` prints it.
pub fn render(s: &Snapshot) -> String {
    let mut out = String::new();
    let eta = s
        .eta_s
        .map(human_duration)
        .unwrap_or_else(|| "unknown".into());
    out.push_str(&format!(
        "run {} ({} mode)\nstep {}/{}  phase {}  steps done {}  episodes in flight {}\nelapsed {}  eta {}\n",
        s.run_dir,
        s.mode,
        s.step.min(s.last_step),
        s.last_step,
        s.phase.name(),
        s.steps_done,
        s.episodes_in_flight,
        human_duration(s.elapsed_s),
        eta
    ));
    out.push_str("nodes:\n");
    for n in &s.nodes {
        let health = if n.healthy {
            "healthy"
        } else {
            "NOT ANSWERING"
        };
        let gpus = if n.gpus.is_empty() {
            "no GPU".to_string()
        } else {
            format!(
                "GPUs {}",
                n.gpus
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        out.push_str(&format!(
            "  {} ({})  {health}  {gpus}  actors: {}\n",
            n.address,
            n.hostname,
            if n.actors.is_empty() {
                "none".to_string()
            } else {
                n.actors.join(", ")
            }
        ));
        if let Some(e) = &n.error {
            out.push_str(&format!("    {e}\n"));
        }
    }
    out.push_str("engines:\n");
    for e in &s.engines {
        out.push_str(&format!(
            "  {}  weight version {}\n",
            e.name, e.weight_version
        ));
    }
    for key in ["rollout/raw_reward", "train/loss", "perf/step_time"] {
        if let Some(v) = s.last_step_metrics.get(key) {
            out.push_str(&format!("last step {key} {v:.4}\n"));
        }
    }
    out
}

/// The snapshot in Prometheus' text exposition format (version 0.0.4): gauges named
/// `manta_*`, the last step's metrics as `manta_step_metric{name="train/loss"}`.
pub fn prometheus(s: &Snapshot) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, samples: &[(String, f64)]| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (labels, v) in samples {
            out.push_str(&format!("{name}{labels} {}\n", prom_value(*v)));
        }
    };
    let one = |v: f64| vec![(String::new(), v)];
    gauge("manta_step", "The step in flight.", &one(s.step as f64));
    gauge(
        "manta_last_step",
        "The run's last step.",
        &one(s.last_step as f64),
    );
    gauge(
        "manta_steps_done",
        "Steps finished by this process.",
        &one(s.steps_done as f64),
    );
    let phases: Vec<(String, f64)> = [
        Phase::Starting,
        Phase::Rollout,
        Phase::Train,
        Phase::WeightSync,
        Phase::Checkpoint,
        Phase::Idle,
        Phase::Stopping,
    ]
    .iter()
    .map(|p| {
        (
            format!("{{phase=\"{}\"}}", p.name()),
            (*p == s.phase) as u8 as f64,
        )
    })
    .collect();
    gauge("manta_phase", "1 for the phase the step is in.", &phases);
    gauge(
        "manta_episodes_in_flight",
        "Episodes sent to rollout actors and not back yet.",
        &one(s.episodes_in_flight as f64),
    );
    gauge(
        "manta_elapsed_seconds",
        "Seconds since the run's first step.",
        &one(s.elapsed_s),
    );
    gauge(
        "manta_eta_seconds",
        "Seconds to the last step at the pace so far (NaN before the first step).",
        &one(s.eta_s.unwrap_or(f64::NAN)),
    );
    let node = |n: &NodeStatus| format!("node=\"{}\"", escape(&n.address));
    gauge(
        "manta_node_up",
        "1 if the node answered its heartbeat just now.",
        &s.nodes
            .iter()
            .map(|n| (format!("{{{}}}", node(n)), n.healthy as u8 as f64))
            .collect::<Vec<_>>(),
    );
    gauge(
        "manta_node_gpus",
        "GPUs the node offers.",
        &s.nodes
            .iter()
            .map(|n| (format!("{{{}}}", node(n)), n.gpus.len() as f64))
            .collect::<Vec<_>>(),
    );
    gauge(
        "manta_actor_up",
        "1 for each actor a node hosts.",
        &s.nodes
            .iter()
            .flat_map(|n| {
                n.actors
                    .iter()
                    .map(move |a| (format!("{{{},actor=\"{}\"}}", node(n), escape(a)), 1.0))
            })
            .collect::<Vec<_>>(),
    );
    gauge(
        "manta_engine_weight_version",
        "The weight version each engine holds.",
        &s.engines
            .iter()
            .map(|e| {
                (
                    format!("{{engine=\"{}\"}}", escape(&e.name)),
                    e.weight_version as f64,
                )
            })
            .collect::<Vec<_>>(),
    );
    gauge(
        "manta_step_metric",
        "The last finished step's metrics, by slime's names.",
        &s.last_step_metrics
            .iter()
            .map(|(k, v)| (format!("{{name=\"{}\"}}", escape(k)), *v))
            .collect::<Vec<_>>(),
    );
    out
}

/// A label value escaped as the exposition format asks (backslash, quote, newline).
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A sample value: Prometheus spells the special floats `NaN`, `+Inf`, `-Inf`.
pub fn prom_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Snapshot {
        Snapshot {
            run_dir: "runs/r".into(),
            mode: "remote".into(),
            phase: Phase::Train,
            step: 3,
            last_step: 10,
            steps_done: 2,
            episodes_in_flight: 4,
            elapsed_s: 20.0,
            eta_s: Some(80.0),
            started_unix: 0.0,
            nodes: vec![NodeStatus {
                address: "10.0.0.1:7100".into(),
                hostname: "gpu1".into(),
                gpus: vec![0, 1],
                actors: vec!["rollout-0-0".into(), "trainer-0".into()],
                healthy: true,
                error: None,
            }],
            engines: vec![EngineStatus {
                name: "rollout-0-0".into(),
                weight_version: 2,
            }],
            last_step_metrics: [("train/loss".to_string(), 0.5)].into(),
        }
    }

    /// Each sample line is `name{labels} value` with the values the snapshot holds, and
    /// every metric has its TYPE line.
    #[test]
    fn prometheus_text_holds_the_snapshot() {
        let text = prometheus(&sample());
        for line in [
            "manta_step 3",
            "manta_phase{phase=\"train\"} 1",
            "manta_phase{phase=\"rollout\"} 0",
            "manta_episodes_in_flight 4",
            "manta_node_up{node=\"10.0.0.1:7100\"} 1",
            "manta_node_gpus{node=\"10.0.0.1:7100\"} 2",
            "manta_actor_up{node=\"10.0.0.1:7100\",actor=\"trainer-0\"} 1",
            "manta_engine_weight_version{engine=\"rollout-0-0\"} 2",
            "manta_step_metric{name=\"train/loss\"} 0.5",
            "manta_eta_seconds 80",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            assert!(text.contains(&format!("# TYPE {name} gauge")), "{l}");
        }
    }

    #[test]
    fn labels_and_special_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(prom_value(f64::NAN), "NaN");
        assert_eq!(prom_value(f64::NEG_INFINITY), "-Inf");
        assert_eq!(prom_value(2.5), "2.5");
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human_duration(12.4), "12s");
        assert_eq!(human_duration(185.0), "3m05s");
        assert_eq!(human_duration(3720.0), "1h02m");
    }
}

//! Weights & Biases logging, as the cookbook's users have it, through the real `wandb`
//! package: a Python sidecar (python/wandb_sidecar.py, embedded) fed one JSON line per
//! step on stdin. W&B is a convenience: it never stops or slows training. A missing
//! Python or `wandb` is a warning naming what is missing; a full pipe drops lines
//! (counted); a sidecar that dies is logged and the run goes on without it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStderr, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Mutex;
use std::time::Duration;

use tracing::{info, warn};

use crate::metrics::StepMetrics;

const SIDECAR: &str = include_str!("../python/wandb_sidecar.py");

/// The interpreter used when `MANTA_PYTHON` is not set.
pub const DEFAULT_PYTHON: &str = "python3";

/// Environment variable naming the Python that runs the sidecar.
pub const PYTHON_ENV: &str = "MANTA_PYTHON";

/// Lines queued for the sidecar before new ones are dropped.
const QUEUE: usize = 4096;

/// Where to log.
#[derive(Debug, Clone)]
pub struct WandbOptions {
    pub project: String,
    pub run_name: String,
    /// The interpreter; `None` reads `MANTA_PYTHON`, else [`DEFAULT_PYTHON`].
    pub python: Option<String>,
}

/// A running sidecar. Dropping it closes its input, which ends the W&B run.
pub struct WandbSink {
    lines: Option<SyncSender<String>>,
    dropped: AtomicU64,
    /// Signalled when the sidecar has exited (in a Mutex so the sink is `Sync`).
    exited: Mutex<Receiver<()>>,
}

impl WandbSink {
    /// Starts the sidecar and sends it `config` (the run's settings). Returns `None`,
    /// after a warning saying what is missing, when the interpreter cannot start.
    pub fn start(opts: &WandbOptions, config: &serde_json::Value) -> Option<Self> {
        let python = opts
            .python
            .clone()
            .or_else(|| std::env::var(PYTHON_ENV).ok().filter(|p| !p.is_empty()))
            .unwrap_or_else(|| DEFAULT_PYTHON.to_string());
        let spawned = Command::new(&python)
            .args(["-c", SIDECAR, &opts.project, &opts.run_name])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                warn!(
                    "W&B logging is off: cannot start the Python `{python}` (set {PYTHON_ENV} \
                     to a Python with the `wandb` package): {e}"
                );
                return None;
            }
        };
        let (Some(stdin), Some(stderr)) = (child.stdin.take(), child.stderr.take()) else {
            warn!("W&B logging is off: the sidecar's pipes were not opened");
            let _ = child.kill();
            return None;
        };
        let (tx, rx) = mpsc::sync_channel::<String>(QUEUE);
        let (exit_tx, exited) = mpsc::channel();
        let first = serde_json::json!({ "config": config }).to_string();
        // The queue is empty: the first line always fits.
        let _ = tx.try_send(first);
        std::thread::Builder::new()
            .name("wandb-writer".into())
            .spawn(move || write_lines(stdin, rx))
            .ok()?;
        std::thread::Builder::new()
            .name("wandb-watch".into())
            .spawn(move || {
                watch(child, stderr);
                let _ = exit_tx.send(());
            })
            .ok()?;
        info!(project = %opts.project, run = %opts.run_name, python = %python, "W&B sidecar started");
        Some(Self {
            lines: Some(tx),
            dropped: AtomicU64::new(0),
            exited: Mutex::new(exited),
        })
    }

    /// Queues one step's metrics; never blocks. Non-finite values are left out.
    pub fn log(&self, step: u64, metrics: &StepMetrics) {
        let Some(tx) = &self.lines else { return };
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            if let Some(n) = serde_json::Number::from_f64(*v) {
                obj.insert(k.clone(), serde_json::Value::Number(n));
            }
        }
        match tx.try_send(serde_json::Value::Object(obj).to_string()) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(
                        step,
                        "W&B sidecar is falling behind; dropping steps (counted at the end)"
                    );
                }
            }
            // The writer stopped: the sidecar's exit was already logged.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Ends the W&B run: closes the sidecar's input and waits up to `timeout` for it to
    /// finish uploading. Blocking: call it from a blocking thread.
    pub fn finish(mut self, timeout: Duration) {
        self.lines = None;
        let dropped = self.dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            warn!(dropped, "steps not sent to W&B (the sidecar fell behind)");
        }
        let exited = self
            .exited
            .get_mut()
            .map(|rx| rx.recv_timeout(timeout).is_ok())
            .unwrap_or(false);
        if !exited {
            warn!(
                "the W&B sidecar is still finishing after {}s; leaving it to finish on its own \
                 (`wandb sync` uploads what it missed)",
                timeout.as_secs()
            );
        }
    }
}

/// Feeds queued lines to the sidecar until the queue closes or the pipe breaks.
fn write_lines(stdin: ChildStdin, rx: Receiver<String>) {
    let mut stdin = std::io::BufWriter::new(stdin);
    for line in rx {
        if writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .is_err()
        {
            // The sidecar is gone; `watch` reports how it ended.
            return;
        }
    }
}

/// Relays the sidecar's stderr to the log and reports how it ended.
fn watch(mut child: Child, stderr: ChildStderr) {
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        if line.starts_with("manta-wandb:") {
            warn!(target: "manta::wandb", "{line}");
        } else if !line.trim().is_empty() {
            info!(target: "manta::wandb", "{line}");
        }
    }
    match child.wait() {
        Ok(status) if status.success() => info!("W&B sidecar finished"),
        Ok(status) => warn!("the W&B sidecar exited ({status}); metrics are no longer sent to W&B"),
        Err(e) => warn!("waiting for the W&B sidecar failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_python_turns_wandb_off_instead_of_failing() {
        let opts = WandbOptions {
            project: "p".into(),
            run_name: "r".into(),
            python: Some("/nonexistent/python-for-manta-test".into()),
        };
        assert!(WandbSink::start(&opts, &serde_json::json!({})).is_none());
    }

    /// Only stops a test that would otherwise hang; never reached when things work.
    const HANG: Duration = Duration::from_secs(120);

    /// Runs `f` on a thread of its own and returns its result; fails the test if `f` has
    /// not returned within [`HANG`].
    fn returns<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(HANG)
            .unwrap_or_else(|_| panic!("{what} had not returned after {HANG:?}"))
    }

    /// A stand-in for the sidecar's Python (started as `PATH -c SCRIPT project run`): a
    /// shell script running `body`.
    fn fake_python(dir: &std::path::Path, body: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("python");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    #[test]
    fn a_sidecar_that_dies_does_not_block_logging() {
        // `true` exits at once: every later line meets a closed pipe or a closed queue.
        let opts = WandbOptions {
            project: "p".into(),
            run_name: "r".into(),
            python: Some("true".into()),
        };
        let sink = WandbSink::start(&opts, &serde_json::json!({})).expect("`true` starts");
        let mut m = StepMetrics::new();
        m.insert("rollout/raw_reward".into(), 0.5);
        let sink = returns("logging to a dead sidecar", move || {
            for step in 1..=(2 * QUEUE as u64) {
                sink.log(step, &m);
            }
            sink
        });
        // The sidecar's exit was seen: finish returns at once, not after its timeout.
        returns("finish after the sidecar died", move || {
            sink.finish(Duration::from_secs(3600))
        });
    }

    #[test]
    fn a_sidecar_that_does_not_read_never_blocks_logging() {
        // Alive but reading nothing until released: the pipe fills, then the queue, and
        // every later step must be dropped (and counted) instead of waited for. (It also
        // stops waiting when the test's folder is gone, so a failed test leaves no process.)
        let dir = tempfile::tempdir().unwrap();
        let release = dir.path().join("release");
        let python = fake_python(
            dir.path(),
            &format!(
                "while [ ! -e '{r}' ] && [ -d '{d}' ]; do sleep 0.05; done\nexec cat >/dev/null",
                r = release.display(),
                d = dir.path().display()
            ),
        );
        let opts = WandbOptions {
            project: "p".into(),
            run_name: "r".into(),
            python: Some(python),
        };
        let sink = WandbSink::start(&opts, &serde_json::json!({})).expect("the script starts");
        let mut m = StepMetrics::new();
        // About 1 KB a line: the pipe and the writer's buffer hold a few hundred at most.
        m.insert("x".repeat(1000), 0.5);
        let steps = 2 * QUEUE as u64;
        let sink = returns("logging to a sidecar that does not read", move || {
            for step in 1..=steps {
                sink.log(step, &m);
            }
            sink
        });
        // At most the queue and what the pipe took got through; the rest was dropped.
        let dropped = sink.dropped.load(Ordering::Relaxed);
        assert!(
            dropped >= steps - QUEUE as u64 - 1000 && dropped < steps,
            "{dropped} of {steps} steps dropped"
        );
        // Released, the sidecar reads everything, ends on EOF, and finish sees it.
        std::fs::write(&release, "").unwrap();
        returns("finish after the sidecar was released", move || {
            sink.finish(Duration::from_secs(3600))
        });
    }
}

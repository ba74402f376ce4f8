//! How the driver stops on SIGINT (Ctrl-C) and SIGTERM (`scancel`, `kill`, a pod
//! deletion): both are one request. The first ends the run after the step in flight, or
//! abandons that step if its rollouts are still running (`--on-stop`); either way the
//! last finished step is checkpointed and every actor stopped, and the driver exits 0.
//! The second exits at once with status 130.
//!
//! The immediate exit is `_exit(2)` after flushing the logs, not `std::process::exit`:
//! the latter runs libtorch's static destructors while the engine and trainer threads
//! are still inside torch calls, which then fail libtorch's internal assertions.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

/// What the first stop request does with the step in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStop {
    /// Run the step to its end (rollouts, training, weight sync), then stop.
    #[default]
    FinishStep,
    /// Drop the step if it is still collecting rollouts (its episodes are lost and run
    /// again on resume); a step already training is finished.
    AbandonStep,
}

/// A stop request shared by the signal handler and the run loop.
#[derive(Clone, Default)]
pub struct StopRequest {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    requested: AtomicBool,
    abandon: AtomicBool,
}

impl StopRequest {
    /// A request that `on_stop` decides how to honour.
    pub fn new(on_stop: OnStop) -> Self {
        let request = Self::default();
        request
            .inner
            .abandon
            .store(on_stop == OnStop::AbandonStep, Ordering::SeqCst);
        request
    }

    /// Asks the run to stop; returns whether it had been asked already.
    pub fn request(&self) -> bool {
        self.inner.requested.swap(true, Ordering::SeqCst)
    }

    /// Whether a stop was asked for.
    pub fn is_requested(&self) -> bool {
        self.inner.requested.load(Ordering::SeqCst)
    }

    /// Whether a step still collecting rollouts should be dropped now.
    pub fn abandons_rollouts(&self) -> bool {
        self.is_requested() && self.inner.abandon.load(Ordering::SeqCst)
    }

    /// Resolves once the step in flight should be dropped: a stop was asked for with
    /// `--on-stop abandon-step` while the step is collecting its rollouts.
    pub async fn abandon_while_collecting(&self) {
        loop {
            if self.abandons_rollouts() && crate::status::phase() == crate::status::Phase::Rollout {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Signal names for messages.
fn name(kind: SignalKind) -> &'static str {
    if kind == SignalKind::terminate() {
        "SIGTERM"
    } else {
        "Ctrl-C"
    }
}

/// Watches SIGINT and SIGTERM for the run: the first sets `stop`, the second stops the
/// actors on the workers (2 s at most) and exits with status 130.
pub fn watch(stop: StopRequest) -> std::io::Result<()> {
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        loop {
            let kind = tokio::select! {
                Some(()) = int.recv() => SignalKind::interrupt(),
                Some(()) = term.recv() => SignalKind::terminate(),
                else => return,
            };
            if stop.request() {
                eprintln!(
                    "second {}: stopping actors on the workers and exiting now",
                    name(kind)
                );
                let stopped = crate::shutdown::force_stop(Duration::from_secs(2)).await;
                eprintln!("stopped {stopped} remote actors");
                exit_now(130);
            }
            let what = if stop.inner.abandon.load(Ordering::SeqCst) {
                "stopping: a step still in its rollouts is dropped, one training finishes"
            } else {
                "stopping after the current step"
            };
            eprintln!("{}: {what} (press again to exit now)", name(kind));
            tracing::warn!("{}: {what}", name(kind));
        }
    });
    Ok(())
}

/// Flushes the logs and ends the process without running destructors or `atexit`
/// handlers (see the module's doc).
pub fn exit_now(code: i32) -> ! {
    manta_telemetry::run_log::flush();
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit takes no pointers and never returns; nothing after it runs.
    unsafe { libc::_exit(code) }
}

/// A worker's stop on SIGINT or SIGTERM: resolves with the signal's name.
pub async fn worker_stop_signal() -> std::io::Result<&'static str> {
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    Ok(tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    })
}

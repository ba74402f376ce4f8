//! Progress of long work that has no steps to count (loading a model, saving or loading
//! a checkpoint, an export, an SGLang server's start-up): a spinner with the elapsed time
//! on a terminal, an info line every [`LOG_EVERY`] otherwise (Slurm logs, CI), and one
//! line with the time taken when it ends.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a non-terminal log says the work is still going.
pub const LOG_EVERY: Duration = Duration::from_secs(15);

/// Shows that `label`'s work is going until dropped.
pub struct Progress {
    label: String,
    started: Instant,
    bar: Option<ProgressBar>,
    done: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
}

impl Progress {
    /// Starts showing `label` (a spinner when stderr is a terminal, periodic lines
    /// otherwise).
    pub fn start(label: impl Into<String>) -> Self {
        let label = label.into();
        let started = Instant::now();
        let done = Arc::new(AtomicBool::new(false));
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} {elapsed}") {
                bar.set_style(style);
            }
            bar.set_message(label.clone());
            bar.enable_steady_tick(Duration::from_millis(120));
            return Self {
                label,
                started,
                bar: Some(bar),
                done,
                ticker: None,
            };
        }
        tracing::info!("{label}…");
        let (flag, name) = (done.clone(), label.clone());
        let ticker = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                let mut next = started + LOG_EVERY;
                while !flag.load(Ordering::SeqCst) {
                    let now = Instant::now();
                    if now >= next {
                        tracing::info!("{name}… {:.0}s so far", started.elapsed().as_secs_f64());
                        next += LOG_EVERY;
                    }
                    std::thread::park_timeout(next.saturating_duration_since(now));
                }
            })
            .ok();
        Self {
            label,
            started,
            bar: None,
            done,
            ticker,
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.ticker.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        tracing::info!(
            "{}: {:.1}s",
            self.label,
            self.started.elapsed().as_secs_f64()
        );
    }
}

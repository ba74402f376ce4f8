//! What a run leaves behind for people: console logs, OpenTelemetry spans, `metrics.jsonl`,
//! TensorBoard event files, Weights & Biases (through a Python sidecar), and a PNG plot.

pub mod logging;
pub mod metrics;
pub mod plot;
pub mod progress;
pub mod run_log;
pub mod tensorboard;
pub mod trace_context;
pub mod wandb;

pub use logging::{init_logging, shutdown_tracing, TracingGuard, OTLP_ENDPOINT_ENV};
pub use metrics::{read_metrics, MetricsWriter, StepMetrics};
pub use plot::{plot_curves, PlotError, PlottedSeries, PLOTTED_METRICS};
pub use progress::Progress;
pub use tensorboard::{read_event_steps, TensorBoardWriter};
pub use trace_context::{
    inject_into_metadata, inject_trace_context, set_parent_from, set_parent_from_metadata,
    span_with_remote_parent,
};
pub use wandb::{WandbOptions, WandbSink};

/// Replaces `path` with `contents` atomically: written beside it as `<name>.tmp`,
/// then renamed over it, so a crash leaves either the old file or the new one.
pub(crate) fn replace_file(path: &std::path::Path, contents: &[u8]) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, contents)?;
    std::fs::rename(&tmp, path)
}

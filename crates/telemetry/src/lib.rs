//! What a run leaves behind for people: console logs, OpenTelemetry spans, `metrics.jsonl`,
//! TensorBoard event files, Weights & Biases (through a Python sidecar), and a PNG plot.

pub mod logging;
pub mod metrics;
pub mod plot;
pub mod tensorboard;
pub mod trace_context;
pub mod wandb;

pub use logging::{init_logging, shutdown_tracing, TracingGuard, OTLP_ENDPOINT_ENV};
pub use metrics::{read_metrics, MetricsWriter, StepMetrics};
pub use plot::{plot_curves, PlotError, PlottedSeries, PLOTTED_METRICS};
pub use tensorboard::TensorBoardWriter;
pub use trace_context::{
    inject_into_metadata, inject_trace_context, set_parent_from, set_parent_from_metadata,
    span_with_remote_parent,
};
pub use wandb::{WandbOptions, WandbSink};

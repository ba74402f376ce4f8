//! Console logging via `tracing`, plus OpenTelemetry span export over OTLP/gRPC when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, so a run's steps and episodes can be followed
//! across processes in any OTLP backend (Jaeger, Tempo, an OpenTelemetry collector).

use std::sync::Mutex;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The environment variable that turns span export on (the OpenTelemetry standard one).
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// How long [`shutdown_tracing`] waits for the last spans to reach the collector.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The installed tracer provider, kept so [`shutdown_tracing`] can flush it.
static PROVIDER: Mutex<Option<SdkTracerProvider>> = Mutex::new(None);

/// Flushes exported spans when dropped; hold it for the life of `main`.
#[must_use = "dropping the guard shuts span export down"]
pub struct TracingGuard {
    _private: (),
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        shutdown_tracing();
    }
}

/// Logs to stderr (`RUST_LOG` overrides the default level, `info`) and to the run log
/// once one is opened ([`crate::run_log`]), and, when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set, exports Manta's spans (`manta*` targets, info
/// and above, whatever `RUST_LOG` says) over OTLP/gRPC with `service.name` =
/// `service_name` (e.g. `manta-driver`, `manta-worker`). Call it inside a multi-thread
/// Tokio runtime: the gRPC exporter runs its connection there. Safe to call twice (the
/// second call installs nothing).
pub fn init_logging(service_name: &str) -> TracingGuard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_filter(filter);
    // The run directory's driver.log: info and above whatever RUST_LOG says, no colours.
    let run_log = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(false)
        .with_writer(crate::run_log::RunLogWriter)
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    let endpoint = std::env::var(OTLP_ENDPOINT_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let (otel, otel_error) = match endpoint {
        None => (None, None),
        Some(endpoint) => match tracer_provider(service_name) {
            Ok(provider) => {
                let tracer = provider.tracer("manta");
                let mut slot = PROVIDER.lock().unwrap_or_else(|e| e.into_inner());
                let layer = tracing_opentelemetry::layer()
                    .with_tracer(tracer)
                    .with_filter(Targets::new().with_target("manta", Level::INFO));
                // A second init keeps the first provider (its layer is the installed one).
                if slot.is_none() {
                    *slot = Some(provider);
                }
                (Some(layer), None)
            }
            Err(e) => (None, Some(format!("{OTLP_ENDPOINT_ENV}={endpoint}: {e}"))),
        },
    };
    let installed = tracing_subscriber::registry()
        .with(fmt)
        .with(run_log)
        .with(otel)
        .try_init()
        .is_ok();
    if installed && otel_error.is_none() && PROVIDER.lock().is_ok_and(|p| p.is_some()) {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    }
    if let Some(e) = otel_error {
        tracing::warn!(error = %e, "span export disabled");
    }
    TracingGuard { _private: () }
}

/// Why span export could not start.
#[derive(Debug, thiserror::Error)]
enum ExportSetupError {
    #[error("the OTLP gRPC exporter needs a Tokio runtime; call init_logging inside one")]
    NoRuntime,
    #[error("building the OTLP gRPC exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

fn tracer_provider(service_name: &str) -> Result<SdkTracerProvider, ExportSetupError> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(ExportSetupError::NoRuntime);
    }
    // Endpoint, headers and timeout come from the standard OTEL_EXPORTER_OTLP_* variables.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let resource = Resource::builder()
        .with_service_name(service_name.to_string())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Exports the spans still buffered and stops span export; call it before the process
/// exits (a no-op when export is off or already shut down). It blocks for at most a few
/// seconds, and needs the Tokio runtime the exporter was built in to be running on
/// another thread (any multi-thread runtime worker, or `main`'s `block_on` thread).
pub fn shutdown_tracing() {
    let provider = PROVIDER.lock().unwrap_or_else(|e| e.into_inner()).take();
    let Some(provider) = provider else { return };
    // On its own thread, so a runtime worker calling us never blocks inside the runtime.
    let done = std::thread::spawn(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT)).join();
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("warning: flushing OpenTelemetry spans failed: {e}"),
        Err(_) => eprintln!("warning: flushing OpenTelemetry spans panicked"),
    }
}

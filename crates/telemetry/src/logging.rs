//! Console logging via `tracing`.

use tracing_subscriber::EnvFilter;

/// Logs to stderr; `RUST_LOG` overrides the default level (`info`). Safe to call twice.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
}

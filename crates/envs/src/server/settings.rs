//! The server's timing and chunking settings, shared by the builder and the routes.

use std::time::Duration;

/// Server settings; the defaults match the SDK server.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub session_ttl: Duration,
    pub reap_interval: Duration,
    pub keep_alive: Duration,
    pub chunk_size: usize,
    pub call_linger: Duration,
}

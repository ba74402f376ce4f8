//! Errors of the ORS client; each names the URL involved.

use std::time::Duration;

/// What went wrong talking to an ORS server.
#[derive(Debug, thiserror::Error)]
pub enum OrsError {
    /// Bad client options (e.g. an unparsable base URL or header value).
    #[error("invalid ORS client option {option}: {message}")]
    Config {
        option: &'static str,
        message: String,
    },
    /// A non-success HTTP status; `body` is the server's `detail` when it sent one.
    #[error("{url}: HTTP {status}: {body}")]
    Http {
        url: String,
        status: u16,
        body: String,
        /// `Retry-After` (seconds form) of the answer.
        retry_after: Option<Duration>,
        /// `X-Backend-State: starting`: the environment is still booting, nothing ran.
        backend_starting: bool,
    },
    /// The session no longer exists on the server (410, an unknown sid, failed pings,
    /// or a tool that raised).
    #[error("ORS session {sid} is gone: {message}")]
    SessionGone { sid: String, message: String },
    /// The server sent an SSE `error` event (a tool raised; the session is dead).
    #[error("{url}: server reported an error: {message}")]
    Sse { url: String, message: String },
    /// An answer that does not match the protocol.
    #[error("{url}: cannot decode answer: {message}")]
    Decode { url: String, message: String },
    /// Connection, TLS or timeout failure.
    #[error("{url}: request failed: {source}")]
    Transport {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server did not answer within the request deadline
    /// (`MANTA_ENV_REQUEST_TIMEOUT_S`): a silent or hung environment server.
    #[error("{url}: no answer within {} s (the deadline of one request, MANTA_ENV_REQUEST_TIMEOUT_S)", after.as_secs())]
    Timeout { url: String, after: Duration },
    /// An SSE stream that stopped early or went quiet past the heartbeat timeout.
    #[error("{url}: event stream interrupted: {message}")]
    Stream { url: String, message: String },
}

impl OrsError {
    /// The HTTP status, when the server answered with one.
    pub fn status(&self) -> Option<u16> {
        match self {
            OrsError::Http { status, .. } => Some(*status),
            _ => None,
        }
    }
}

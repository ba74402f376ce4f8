//! Reading the ORS SSE answers (`task_id`, `chunk`*, `end` | `error`; `:` comments ignored).

use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::StreamExt;

use super::error::OrsError;

/// How an SSE answer ended.
#[derive(Debug)]
pub(crate) enum SseEnd {
    /// `end` arrived: the concatenated `chunk`/`end` data.
    Done(String),
    /// The stream closed without `end` (normal for `/create_session`).
    Closed,
}

/// Why the byte stream under the SSE parser stopped.
#[derive(Debug, thiserror::Error)]
enum ByteStreamError {
    #[error("no data for {0:?}")]
    Idle(Duration),
    #[error(transparent)]
    Transport(#[from] reqwest::Error),
}

/// The response body with a limit on each gap between byte chunks. The limit sits below
/// the SSE parser on purpose: the parser swallows `: ping` comments, and those must count
/// as activity.
fn idle_limited(
    resp: reqwest::Response,
    idle: Duration,
) -> impl futures::Stream<Item = Result<bytes::Bytes, ByteStreamError>> {
    let bytes = Box::pin(resp.bytes_stream());
    futures::stream::unfold(Some(bytes), move |state| async move {
        let mut bytes = state?;
        match tokio::time::timeout(idle, bytes.next()).await {
            Err(_) => Some((Err(ByteStreamError::Idle(idle)), None)),
            Ok(None) => None,
            Ok(Some(Ok(chunk))) => Some((Ok(chunk), Some(bytes))),
            Ok(Some(Err(e))) => Some((Err(e.into()), None)),
        }
    })
}

/// Consumes `resp` as SSE. `task_id` is set as soon as its event arrives, so a caller can
/// resume even when this returns an error. Each gap between bytes may last `idle` at most
/// (servers send `: ping` comments every 10 s).
pub(crate) async fn read_events(
    resp: reqwest::Response,
    url: &str,
    idle: Duration,
    task_id: &mut Option<String>,
) -> Result<SseEnd, OrsError> {
    let mut events = Box::pin(idle_limited(resp, idle).eventsource());
    let mut data = String::new();
    loop {
        let next = events.next().await;
        let event = match next {
            None => return Ok(SseEnd::Closed),
            Some(Ok(event)) => event,
            Some(Err(e)) => {
                return Err(OrsError::Stream {
                    url: url.to_string(),
                    message: e.to_string(),
                })
            }
        };
        match event.event.as_str() {
            "task_id" => *task_id = Some(event.data.trim().to_string()),
            "chunk" => data.push_str(&event.data),
            "end" => {
                data.push_str(&event.data);
                return Ok(SseEnd::Done(data));
            }
            "error" => {
                return Err(OrsError::Sse {
                    url: url.to_string(),
                    message: if event.data.is_empty() {
                        "unknown SSE error".to_string()
                    } else {
                        event.data
                    },
                })
            }
            other => tracing::debug!(event = other, url, "ignoring unknown SSE event"),
        }
    }
}

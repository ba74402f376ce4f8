//! Tool calls as resumable background tasks streamed over SSE.
//!
//! A call runs once; its answer is kept for a linger period so a client whose stream
//! dropped can re-POST with the `task_id` it was given and receive the same result.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{self, Stream, StreamExt};
use serde_json::Value;
use tokio::sync::watch;

use super::sessions::SharedEpisode;

/// A finished call: the result JSON, or the message of a tool that panicked.
type Outcome = Result<Arc<str>, String>;

/// Running and recently finished calls by task id.
#[derive(Default)]
pub(crate) struct Calls {
    tasks: Mutex<HashMap<String, watch::Receiver<Option<Outcome>>>>,
}

impl Calls {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, watch::Receiver<Option<Outcome>>>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts `name(input)` on the episode and returns its task id.
    pub fn start(
        self: &Arc<Self>,
        episode: SharedEpisode,
        name: String,
        input: Value,
        linger: Duration,
    ) -> String {
        let task_id = uuid::Uuid::new_v4().simple().to_string();
        let (tx, rx) = watch::channel(None);
        self.lock().insert(task_id.clone(), rx);
        let calls = Arc::clone(self);
        let id = task_id.clone();
        tokio::spawn(async move {
            let mut guard = episode.lock_owned().await;
            let joined = tokio::task::spawn_blocking(move || {
                let out = guard.call(&name, &input);
                serde_json::to_string(&out.to_json())
            })
            .await;
            let outcome: Outcome = match joined {
                Ok(Ok(json)) => Ok(Arc::from(json)),
                Ok(Err(e)) => Err(format!("tool result is not serialisable: {e}")),
                Err(e) => Err(panic_message(e)),
            };
            let _ = tx.send(Some(outcome));
            tokio::time::sleep(linger).await;
            calls.lock().remove(&id);
        });
        task_id
    }

    /// The SSE answer for a task: `task_id`, then the result in `chunk`s ending with `end`,
    /// or an `error` event; an unknown id yields only `error: unknown task_id`.
    pub fn stream(
        &self,
        task_id: String,
        chunk_size: usize,
        keep_alive: Duration,
    ) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        let rx = self.lock().get(&task_id).cloned();
        let events = match rx {
            None => stream::iter(vec![Event::default()
                .event("error")
                .data("unknown task_id")])
            .left_stream(),
            Some(mut rx) => {
                let head =
                    stream::once(async move { Event::default().event("task_id").data(task_id) });
                let tail = stream::once(async move {
                    let outcome = match rx.wait_for(Option::is_some).await {
                        Ok(done) => done.clone().unwrap_or_else(|| Err("call vanished".into())),
                        Err(_) => Err("tool call was cancelled".to_string()),
                    };
                    result_events(outcome, chunk_size)
                })
                .flat_map(stream::iter);
                head.chain(tail).right_stream()
            }
        };
        Sse::new(events.map(Ok)).keep_alive(KeepAlive::new().interval(keep_alive).text("ping"))
    }
}

fn result_events(outcome: Outcome, chunk_size: usize) -> Vec<Event> {
    match outcome {
        Err(message) => vec![Event::default().event("error").data(message)],
        Ok(json) => {
            let slices = split_chunks(&json, chunk_size);
            let last = slices.len().saturating_sub(1);
            slices
                .into_iter()
                .enumerate()
                .map(|(i, s)| {
                    Event::default()
                        .event(if i == last { "end" } else { "chunk" })
                        .data(s)
                })
                .collect()
        }
    }
}

/// Splits `text` into slices of at most `size` bytes on char boundaries. A slice never
/// starts with whitespace, because the SDK's SSE parser strips leading whitespace of data.
pub(crate) fn split_chunks(text: &str, size: usize) -> Vec<&str> {
    let size = size.max(1);
    let starts_clean =
        |s: &str, i: usize| s.is_char_boundary(i) && !s[i..].starts_with(char::is_whitespace);
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > size {
        // Prefer the last clean cut within `size`; if the whole window is whitespace,
        // let this slice run on to the next non-whitespace character.
        let cut = (1..=size)
            .rev()
            .find(|&i| starts_clean(rest, i))
            .or_else(|| (size..rest.len()).find(|&i| starts_clean(rest, i)))
            .unwrap_or(rest.len());
        let (head, tail) = rest.split_at(cut);
        out.push(head);
        rest = tail;
    }
    if !rest.is_empty() || out.is_empty() {
        out.push(rest);
    }
    out
}

fn panic_message(err: tokio::task::JoinError) -> String {
    match err.try_into_panic() {
        Ok(payload) => {
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "tool panicked".to_string());
            format!("tool failed: {text}")
        }
        Err(e) => format!("tool was cancelled: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::split_chunks;

    #[test]
    fn chunks_reassemble_and_avoid_leading_whitespace() {
        let text = format!("{{\"t\":\"{}\"}}", "ab cdé fg ".repeat(500));
        let parts = split_chunks(&text, 64);
        assert!(parts.len() > 10);
        assert_eq!(parts.concat(), text);
        for p in &parts {
            assert!(p.len() <= 64);
            assert!(!p.starts_with(char::is_whitespace), "slice {p:?}");
        }
        assert_eq!(split_chunks("{}", 2048), vec!["{}"]);
        let spaces = format!("{{\"t\":\"{}x\"}}", " ".repeat(100));
        let parts = split_chunks(&spaces, 16);
        assert_eq!(parts.concat(), spaces);
        assert!(parts.iter().all(|p| !p.starts_with(' ')));
    }
}

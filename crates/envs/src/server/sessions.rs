//! Live sessions keyed by sid, with last-seen times for the idle reaper.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use super::error::ApiError;
use crate::env::Episode;

/// One session's episode; a tokio mutex because tool calls hold it across an await.
pub(crate) type SharedEpisode = Arc<tokio::sync::Mutex<Box<dyn Episode>>>;

struct Entry {
    episode: SharedEpisode,
    last_seen: Instant,
}

/// Why a sid is no longer live; kept for a while so clients get 410 rather than 404.
#[derive(Debug, Clone, Copy)]
enum Gone {
    Deleted,
    Expired,
}

/// Sessions plus tombstones of recently ended ones.
#[derive(Default)]
pub(crate) struct Sessions {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    live: HashMap<String, Entry>,
    gone: HashMap<String, (Gone, Instant)>,
}

/// How long an ended sid answers 410 before it is forgotten (then 404).
const TOMBSTONE_TTL: Duration = Duration::from_secs(3600);

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the maps inconsistent, so recover.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a session; 400 if the sid is already live.
    pub fn insert(&self, sid: &str, episode: Box<dyn Episode>) -> Result<(), ApiError> {
        let mut inner = self.lock();
        if inner.live.contains_key(sid) {
            return Err(ApiError::bad_request("Session already exists"));
        }
        inner.gone.remove(sid);
        inner.live.insert(
            sid.to_string(),
            Entry {
                episode: Arc::new(tokio::sync::Mutex::new(episode)),
                last_seen: Instant::now(),
            },
        );
        Ok(())
    }

    /// The session's episode, marking it seen; 404 for an unknown sid, 410 for an ended one.
    pub fn touch(&self, sid: &str) -> Result<SharedEpisode, ApiError> {
        let mut inner = self.lock();
        if let Some(entry) = inner.live.get_mut(sid) {
            entry.last_seen = Instant::now();
            return Ok(entry.episode.clone());
        }
        Err(match inner.gone.get(sid) {
            Some((Gone::Deleted, _)) => ApiError::new(StatusCode::GONE, "Session deleted"),
            Some((Gone::Expired, _)) => {
                ApiError::new(StatusCode::GONE, "Session expired after being idle")
            }
            None => ApiError::not_found("Active environment not found"),
        })
    }

    /// Ends a session if it is live.
    pub fn delete(&self, sid: &str) {
        let mut inner = self.lock();
        if inner.live.remove(sid).is_some() {
            inner
                .gone
                .insert(sid.to_string(), (Gone::Deleted, Instant::now()));
        }
    }

    /// Drops sessions idle longer than `ttl` and old tombstones; returns how many were dropped.
    pub fn reap(&self, ttl: Duration) -> usize {
        let now = Instant::now();
        let mut inner = self.lock();
        let stale: Vec<String> = inner
            .live
            .iter()
            .filter(|(_, e)| now.duration_since(e.last_seen) > ttl)
            .map(|(sid, _)| sid.clone())
            .collect();
        for sid in &stale {
            inner.live.remove(sid);
            inner.gone.insert(sid.clone(), (Gone::Expired, now));
        }
        inner
            .gone
            .retain(|_, (_, at)| now.duration_since(*at) <= TOMBSTONE_TTL);
        stale.len()
    }

    /// Number of live sessions.
    pub fn len(&self) -> usize {
        self.lock().live.len()
    }
}

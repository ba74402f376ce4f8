//! The second Ctrl-C: the driver exits at once, but first tells every worker to stop
//! the actors it placed there (briefly: a worker that does not answer is left behind).
//! Remote mode registers what it placed; the first Ctrl-C's clean stop needs none of
//! this (the run ends its step and shuts its actors down in order).

use std::sync::Mutex;
use std::time::Duration;

use manta_runtime::WorkerClient;
use tracing::warn;

static PLACED: Mutex<Vec<(WorkerClient, Vec<String>)>> = Mutex::new(Vec::new());
/// Run first: whatever would re-spawn actors (the pool's heartbeats) must stop.
static BEFORE: Mutex<Vec<Box<dyn Fn() + Send>>> = Mutex::new(Vec::new());

/// Registers something to run before the actors are stopped.
pub fn before_stop(hook: impl Fn() + Send + 'static) {
    if let Ok(mut hooks) = BEFORE.lock() {
        hooks.push(Box::new(hook));
    }
}

/// Records actors placed on a worker, to be stopped by [`force_stop`].
pub fn register(client: WorkerClient, actors: Vec<String>) {
    if let Ok(mut placed) = PLACED.lock() {
        placed.push((client, actors));
    }
}

/// One client per worker that hosts registered actors (for `driver status`).
pub fn placed_clients() -> Vec<WorkerClient> {
    let placed = PLACED.lock().map(|p| p.clone()).unwrap_or_default();
    let mut clients: Vec<WorkerClient> = Vec::new();
    for (client, _) in placed {
        if clients.iter().all(|c| c.addr() != client.addr()) {
            clients.push(client);
        }
    }
    clients
}

/// Stops every registered actor, all workers at once, waiting at most `limit`.
/// Returns how many stop calls succeeded.
pub async fn force_stop(limit: Duration) -> usize {
    if let Ok(hooks) = BEFORE.lock() {
        for hook in hooks.iter() {
            hook();
        }
    }
    let placed = PLACED.lock().map(|p| p.clone()).unwrap_or_default();
    let calls = placed.iter().flat_map(|(client, actors)| {
        actors.iter().map(move |a| async move {
            match client.stop_actor(a).await {
                Ok(()) => true,
                Err(e) => {
                    warn!(node = client.addr(), actor = %a, error = %e, "could not stop actor");
                    false
                }
            }
        })
    });
    match tokio::time::timeout(limit, futures::future::join_all(calls)).await {
        Ok(done) => done.into_iter().filter(|ok| *ok).count(),
        Err(_) => 0,
    }
}

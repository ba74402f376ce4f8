//! Heartbeats: a node is declared dead after missed answers, and on its return its missing
//! actors are spawned again and it is given the current weights before it goes live.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use manta_runtime::{RuntimeError, WorkerClient};
use tracing::{info, warn};

use super::broadcast::rejoin_broadcast;
use super::state::{Node, Published, Shared};
use crate::rollout::client::RolloutCalls;
use crate::weights::WeightSyncCalls;

/// Heartbeats `client` (renewing its lease) until aborted; answers are not checked.
pub(super) async fn renew_lease(client: WorkerClient, interval: Duration) {
    let mut sequence = 0;
    loop {
        tokio::time::sleep(interval).await;
        sequence += 1;
        let _ = client.heartbeat(sequence, interval).await;
    }
}

/// How often a node waiting for broadcast weights asks for a rejoin broadcast again.
const REJOIN_RETRY: Duration = Duration::from_secs(1);

/// Heartbeats one node; marks it dead after `dead_after` without an answer, and on
/// its return re-spawns missing actors and reloads the current weights.
pub(super) async fn heartbeat_loop(shared: Arc<Shared>, index: usize) {
    let node = &shared.nodes[index];
    let addr = node.client.addr().to_string();
    let mut ticker = tokio::time::interval(shared.opts.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_ok = Instant::now();
    let mut last_try = Instant::now();
    let mut sequence = 0;
    loop {
        ticker.tick().await;
        sequence += 1;
        match node
            .client
            .heartbeat(
                sequence,
                manta_runtime::client::heartbeat_limit(
                    last_ok,
                    shared.opts.heartbeat_interval,
                    shared.opts.dead_after,
                ),
            )
            .await
        {
            Ok(reply) => {
                last_ok = Instant::now();
                let missing: Vec<&String> = node
                    .actors
                    .iter()
                    .filter(|a| !reply.actors.contains(a))
                    .collect();
                let was_live = *node.live.borrow();
                let awaiting = node.awaiting_weights.load(Ordering::SeqCst);
                let none_live = !shared.nodes.iter().any(|n| *n.live.borrow());
                if missing.is_empty() && awaiting && none_live && last_try.elapsed() >= REJOIN_RETRY
                {
                    // The rejoin broadcast was not possible then (a step was changing
                    // the weights); a sync may not come while no node is live.
                    last_try = Instant::now();
                    let _publishing = shared.publish.lock().await;
                    if node.awaiting_weights.load(Ordering::SeqCst) {
                        rejoin_broadcast(&shared).await;
                    }
                    continue;
                }
                if missing.is_empty() && (was_live || awaiting) {
                    continue;
                }
                node.live.send_replace(false);
                match rejoin(&shared, node, &missing).await {
                    Ok(()) => info!(node = %addr, "node rejoined"),
                    Err(e) => warn!(node = %addr, error = %e, "node answered but could not rejoin"),
                }
            }
            Err(e) => {
                if *node.live.borrow() && last_ok.elapsed() >= shared.opts.dead_after {
                    node.live.send_replace(false);
                    warn!(node = %addr, error = %e, "node dead: no heartbeat for {:?}", shared.opts.dead_after);
                }
            }
        }
    }
}

/// Every engine on `node` holds `p`'s version and bytes.
async fn verify_node(node: &Node, p: &Published) -> Result<(), RuntimeError> {
    let sorted = |mut d: Vec<manta_proto::weight_sync::TensorDigest>| {
        d.sort_by(|a, b| a.name.cmp(&b.name));
        d
    };
    let want = sorted(p.set.digests());
    let engines = node.client.engine_digests().await?;
    for e in &engines {
        let got = sorted(e.tensors.clone());
        if e.version != p.version || got != want {
            return Err(RuntimeError::Node {
                addr: node.client.addr().to_string(),
                message: format!(
                    "engine {} holds version {} after the rejoin sync of version {}{}",
                    e.actor,
                    e.version,
                    p.version,
                    if got != want {
                        ", with different weights"
                    } else {
                        ""
                    }
                ),
            });
        }
    }
    info!(
        node = node.client.addr(),
        version = p.version,
        engines = engines.len(),
        "rejoined node verified bit for bit"
    );
    Ok(())
}

/// Re-creates a returning node's missing actors, gives its engines the current weights
/// (a restarted engine starts from the model directory's weights) and marks it live.
async fn rejoin(shared: &Shared, node: &Node, missing: &[&String]) -> Result<(), RuntimeError> {
    for name in missing {
        node.client.spawn_rollout(name, &shared.spawn).await?;
    }
    // Publishing waits for this: the node goes live holding the newest version.
    let _publishing = shared.publish.lock().await;
    if shared.broadcasting.load(Ordering::SeqCst) {
        // Its actors are new: the next broadcast makes a group with them in it.
        node.incarnation.fetch_add(1, Ordering::SeqCst);
        node.awaiting_weights.store(true, Ordering::SeqCst);
        info!(
            node = node.client.addr(),
            "rejoined node waits for the next weight broadcast before it goes live"
        );
        rejoin_broadcast(shared).await;
        return Ok(());
    }
    let current = shared.weights.lock().ok().and_then(|w| w.clone());
    if let Some(p) = current {
        node.client
            .push_weights(p.set.clone(), p.version, p.chunk_bytes)
            .await?;
        let reply = node.client.apply_weights(p.version, p.pause).await?;
        info!(
            node = node.client.addr(),
            version = p.version,
            engines = reply.engines,
            "rejoined node synced to the current weights"
        );
        if shared.verify_rejoins.load(Ordering::Relaxed) {
            verify_node(node, &p).await?;
        }
    }
    node.live.send_replace(true);
    Ok(())
}

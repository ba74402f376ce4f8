//! Weights to the nodes by one broadcast over a weight-update group: the group made again
//! when its members change, members' receives aborted when rank 0 fails, and the rejoin
//! broadcast that feeds a returning node when no other node is live.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::join_all;
use manta_proto::weight_sync as wpb;
use manta_runtime::RuntimeError;
use manta_trainer::NamedTensors;
use tracing::{debug, info, warn};

use super::state::{node_failed, refused, Node, PoolGroup, PoolSync, Shared};
use crate::rollout::rank0::{wire_backend, GroupRoot, Rank0, RootAt};
use crate::weights::WeightSyncCalls;
use manta_proto::weight_sync::PauseMode;

/// [`RemotePool::publish_broadcast`]'s work, under the publish lock the caller holds.
pub(super) async fn broadcast_locked(
    shared: &Shared,
    root: &GroupRoot,
    tensors: Option<NamedTensors>,
    version: u64,
    pause: PauseMode,
    want_digests: bool,
) -> Result<(PoolSync, Option<Vec<wpb::TensorDigest>>), RuntimeError> {
    let nodes = &shared.nodes;
    let members: Vec<usize> = (0..nodes.len())
        .filter(|&i| *nodes[i].live.borrow() || nodes[i].awaiting_weights.load(Ordering::SeqCst))
        .collect();
    if members.is_empty() {
        return Err(RuntimeError::Placement(format!(
            "no live node to take weights version {version}"
        )));
    }
    let key: Vec<(usize, u64)> = members
        .iter()
        .map(|&i| (i, nodes[i].incarnation.load(Ordering::SeqCst)))
        .collect();
    // A re-created trainer lost the group it rooted: make a new one at once rather
    // than broadcast into the old one until its timeout.
    let root_incarnation = match &root.at {
        RootAt::Trainer { trainer, .. } => trainer.incarnation(),
        RootAt::Here { .. } => 0,
    };
    let mut slot = shared.group.lock().await;
    let rank0 = match slot.take() {
        Some(g) if g.members == key && g.root_incarnation == root_incarnation => g.rank0,
        stale => {
            // Its members changed: abort it, so dropping it waits on nobody.
            if let Some(old) = stale {
                old.rank0.abort().await;
            }
            let world = 1 + members
                .iter()
                .map(|&i| nodes[i].actors.len())
                .sum::<usize>();
            let rank0 = Rank0::make(root, world).await?;
            info!(
                group = %rank0.group_name(),
                ranks = world,
                backend = ?root.backend,
                nodes = members.len(),
                rank0 = %root.describe(),
                "weight-update group made for the workers' engines"
            );
            rank0
        }
    };
    let (master_address, master_port) = rank0.store();
    let backend = wire_backend(rank0.backend());
    let names = rank0.names(tensors.as_ref());
    let (group_name, world_size) = (rank0.group_name().to_string(), rank0.world_size());
    let timeout_s = rank0.timeout().as_secs().max(1) as u32;
    let mut next_rank = 1u32;
    let requests: Vec<wpb::ReceiveBroadcastRequest> = members
        .iter()
        .map(|&i| {
            let actors = nodes[i].actors.clone();
            let ranks = (0..actors.len() as u32).map(|k| next_rank + k).collect();
            next_rank += actors.len() as u32;
            wpb::ReceiveBroadcastRequest {
                version,
                pause: pause as i32,
                backend: backend as i32,
                master_address: master_address.clone(),
                master_port: u32::from(master_port),
                group_name: group_name.clone(),
                world_size: world_size as u32,
                actors,
                ranks,
                names: names.clone(),
                timeout_s,
            }
        })
        .collect();
    let aborter = rank0.aborter();
    // Which side failed first: rank 0 aborted for a member that failed (every member has
    // answered then), or the members aborted for rank 0.
    let members_failed = AtomicBool::new(false);
    let rank0_failed = AtomicBool::new(false);
    let receiving = async {
        let replies = join_all(
            members
                .iter()
                .zip(requests)
                .map(|(&i, req)| nodes[i].client.receive_broadcast(req)),
        )
        .await;
        // A member that gave up leaves rank 0 waiting for it: end the wait.
        if replies.iter().any(Result::is_err) {
            members_failed.store(true, Ordering::SeqCst);
            aborter.abort().await;
        }
        replies
    };
    let sending = async {
        let (rank0, sent) = rank0.broadcast(tensors, want_digests).await;
        // The members would wait for rank 0 until the group's timeout (on NCCL, c10d's
        // watchdog may then take their whole worker down): end their receive now.
        let on_its_own = !members_failed.load(Ordering::SeqCst);
        if let (Err(cause), true) = (&sent, on_its_own) {
            rank0_failed.store(true, Ordering::SeqCst);
            warn!(group = %group_name, rank0 = %root.describe(), cause = %cause, "rank 0's broadcast failed: aborting the members' receive");
            abort_members(nodes, &members, &group_name).await;
        }
        (rank0, sent)
    };
    let (replies, (rank0, sent)) = tokio::join!(receiving, sending);
    let failed_anywhere = sent.is_err() || replies.iter().any(Result::is_err);
    let rank0 = match rank0 {
        // Dropped below: an aborted group is freed without waiting on its peers.
        Some(r) if failed_anywhere => {
            r.abort().await;
            None
        }
        kept => kept,
    };
    let mut sync = PoolSync {
        nodes: 0,
        engines: 0,
        pause_to_resume_s: 0.0,
    };
    let mut failed = false;
    for (&i, reply) in members.iter().zip(replies) {
        match reply {
            Ok(reply) => {
                sync.nodes += 1;
                sync.engines += reply.engines as usize;
                sync.pause_to_resume_s = sync.pause_to_resume_s.max(reply.pause_to_resume_s);
            }
            // Its receive was aborted because rank 0 failed: rank 0's error is the one.
            Err(e) if rank0_failed.load(Ordering::SeqCst) && refused(&e) => {
                failed = true;
                debug!(node = nodes[i].client.addr(), version, error = %e, "member's receive ended after rank 0 failed");
            }
            Err(e) => {
                failed = true;
                node_failed(&nodes[i], e, version)?;
            }
        }
    }
    let digests = match sent {
        Ok(d) if !failed => d,
        sent => {
            // The group is aborted or broken: the next broadcast makes a new one.
            return Err(RuntimeError::Placement(format!(
                "weights version {version} did not reach every node by broadcast{}",
                sent.err()
                    .map(|e| format!(" (rank 0, {}: {e})", root.describe()))
                    .unwrap_or_default()
            )));
        }
    };
    for &i in &members {
        if nodes[i].awaiting_weights.swap(false, Ordering::SeqCst) {
            nodes[i].live.send_replace(true);
            info!(
                node = nodes[i].client.addr(),
                version, "rejoined node live with the broadcast weights"
            );
        }
    }
    *slot = rank0.map(|rank0| PoolGroup {
        rank0,
        members: key,
        root_incarnation,
    });
    Ok((sync, digests))
}

/// How long the driver waits for a member's worker to answer `AbortBroadcast`.
const ABORT_MEMBER_LIMIT: Duration = Duration::from_secs(10);

/// Has every member node abort its engines' receive in `group` at once; a worker that
/// does not answer is left to the group's timeout (its failures are only logged).
async fn abort_members(nodes: &[Node], members: &[usize], group: &str) {
    let calls = members.iter().map(|&i| async move {
        let client = &nodes[i].client;
        match tokio::time::timeout(ABORT_MEMBER_LIMIT, client.abort_broadcast(group)).await {
            Ok(Ok(aborted)) => {
                debug!(node = client.addr(), group, aborted, "member's receive aborted")
            }
            Ok(Err(e)) => {
                debug!(node = client.addr(), group, error = %e, "aborting a member's receive failed")
            }
            Err(_) => debug!(
                node = client.addr(),
                group,
                "aborting a member's receive: no answer within {ABORT_MEMBER_LIMIT:?}"
            ),
        }
    });
    join_all(calls).await;
}

/// Gives a rejoined node the current weights by a broadcast from the trainer's worker at
/// once, when it is the only node that could go live (else the step waiting for rollouts
/// would wait for it forever) and the trainer's weights are still the version last
/// broadcast. Called under the publish lock; `false`: not possible now.
pub(super) async fn rejoin_broadcast(shared: &Shared) -> bool {
    if shared.nodes.iter().any(|n| *n.live.borrow()) {
        return false;
    }
    let Some(last) = shared.last_root.lock().ok().and_then(|l| l.clone()) else {
        return false;
    };
    let RootAt::Trainer { trainer, .. } = &last.root.at else {
        return false;
    };
    // No step or checkpoint load may change the weights while they go out.
    let Some(generation) = trainer.hold_weights() else {
        return false;
    };
    if *generation != last.generation {
        return false;
    }
    match broadcast_locked(shared, &last.root, None, last.version, last.pause, false).await {
        Ok((sync, _)) => {
            info!(
                version = last.version,
                engines = sync.engines,
                "rejoined node fed by a broadcast from the trainer's worker (no other node live)"
            );
            true
        }
        Err(e) => {
            warn!(version = last.version, error = %e, "rejoin broadcast failed; the node waits for the next sync");
            false
        }
    }
}

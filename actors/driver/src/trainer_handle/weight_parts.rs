//! ZeRO-3 ranks' weights for weight sync, a shard group at a time: every rank of the
//! group visits its weights at once (each group's all-gather is a collective), rank 0's
//! visitor hands each gathered group on and waits until the receiver has copied and
//! dropped it before the next gather, the other ranks' visitors drop theirs. So the sync
//! holds one decoder layer beyond the ranks' shards, never the whole model on a GPU.

use manta_engine::WeightPart;
use manta_hosting::weights::{tensor_bytes, WeightSet};
use manta_hosting::TrainerCallError;
use manta_trainer::WeightVisitor;
use manta_weight_sync::TrainerParts;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Rank 0's visitor: each group goes to `parts` and the next is gathered once the
/// receiver answers. A receiver that is gone (or drops a group unanswered) ends the
/// forwarding, never the visit: the other ranks wait in the remaining gathers, so this
/// rank takes part in them too and drops the groups.
pub(super) fn forwarding(parts: mpsc::Sender<WeightPart>) -> WeightVisitor {
    let mut open = Some(parts);
    Box::new(move |group| {
        if let Some(tx) = &open {
            let (part, copied) = WeightPart::new(group);
            let delivered = tx.blocking_send(part).is_ok() && copied.blocking_recv().is_ok();
            if !delivered {
                open = None;
            }
        }
        Ok(())
    })
}

/// The other ranks' visitor: they gather with rank 0 and keep nothing.
pub(super) fn discarding() -> WeightVisitor {
    Box::new(|_group| Ok(()))
}

/// The parts `rx` receives (laid out as `layout`), with the ranks' visits (`visits`)
/// as the outcome.
pub(super) fn group(
    layout: manta_trainer::WeightGroupShapes,
    rx: mpsc::Receiver<WeightPart>,
    visits: Vec<JoinHandle<Result<(), TrainerCallError>>>,
) -> TrainerParts {
    let finished = tokio::spawn(async move {
        let mut first = None;
        for (rank, visit) in futures::future::join_all(visits)
            .await
            .into_iter()
            .enumerate()
        {
            let outcome = visit.unwrap_or_else(|e| {
                Err(TrainerCallError::Failed {
                    addr: "the driver process".into(),
                    message: format!("trainer rank {rank} visiting its weights: {e}"),
                })
            });
            if let Err(e) = outcome {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    });
    TrainerParts {
        layout,
        parts: rx,
        finished,
    }
}

/// Every part as bytes on the host (a part's device memory is answered free as soon as
/// it is copied), sorted by name as the whole-model read sorts them.
pub(super) async fn weight_set(mut parts: TrainerParts) -> Result<WeightSet, TrainerCallError> {
    let failed = |message: String| TrainerCallError::Failed {
        addr: "the driver process".into(),
        message,
    };
    let mut tensors = Vec::new();
    while let Some(part) = parts.parts.recv().await {
        let (group, copied) = part.into_parts();
        let bytes = tokio::task::spawn_blocking(move || {
            group
                .iter()
                .map(|(name, t)| tensor_bytes(name, t))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| failed(e.to_string()))?;
        copied.done();
        tensors.extend(bytes.map_err(|e| failed(e.to_string()))?);
    }
    parts.finish().await?;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(WeightSet { tensors })
}

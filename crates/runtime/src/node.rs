//! The node supervisor: every actor a worker hosts is linked to one `NodeActor`, which
//! hears when any of them stops or fails. An actor that ends without being asked to is
//! taken off the node's registry, so the next heartbeat no longer lists it and the
//! driver re-creates it (rollout actors: respawned with the current weights; the
//! trainer: restarted from its checkpoint, or the run stops, as configured).

use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::mpsc;

/// The supervisor takes no messages of its own; it only receives supervision events.
pub enum NodeMsg {}

/// An actor that ended: its id and how.
#[derive(Debug, Clone)]
pub struct ActorExit {
    pub id: ActorId,
    pub name: String,
    pub how: String,
}

pub struct NodeActor;

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = mpsc::UnboundedSender<ActorExit>;
    type Arguments = mpsc::UnboundedSender<ActorExit>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        exits: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(exits)
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        exits: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // A child's failure must not take the supervisor (and every sibling) down with
        // it: report it and carry on.
        let exit = |cell: &ActorCell, how: String| ActorExit {
            id: cell.get_id(),
            name: cell.get_name().unwrap_or_else(|| cell.get_id().to_string()),
            how,
        };
        let report = match &event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => Some(exit(
                cell,
                match reason {
                    Some(r) => format!("stopped ({r})"),
                    None => "stopped".into(),
                },
            )),
            SupervisionEvent::ActorFailed(cell, error) => {
                Some(exit(cell, format!("failed: {error}")))
            }
            _ => None,
        };
        if let Some(report) = report {
            let _ = exits.send(report);
        }
        Ok(())
    }
}

/// Starts a supervisor; exits of linked actors arrive on the returned receiver.
pub async fn start_node_actor(
) -> Result<(ActorRef<NodeMsg>, mpsc::UnboundedReceiver<ActorExit>), ractor::SpawnErr> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (actor, _) = Actor::spawn(None, NodeActor, tx).await?;
    Ok((actor, rx))
}

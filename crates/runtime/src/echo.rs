//! A trivial actor that answers with what it was sent: the worker's `Echo` RPC goes
//! through its mailbox, so a round trip measures gRPC plus the actor system, not just
//! the server.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::OnceCell;

/// The one message: reply with the same bytes.
pub enum EchoMsg {
    Echo(Vec<u8>, RpcReplyPort<Vec<u8>>),
}

/// Replies to every [`EchoMsg::Echo`] with its payload.
pub struct EchoActor;

impl Actor for EchoActor {
    type Msg = EchoMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        _args: (),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let EchoMsg::Echo(payload, reply) = msg;
        // The caller may have given up (timeout); nothing to do then.
        let _ = reply.send(payload);
        Ok(())
    }
}

static ECHO: OnceCell<ActorRef<EchoMsg>> = OnceCell::const_new();

/// The process's echo actor, started on first use.
pub async fn echo_actor() -> Result<ActorRef<EchoMsg>, ractor::SpawnErr> {
    ECHO.get_or_try_init(|| async {
        let (actor, _) = Actor::spawn(None, EchoActor, ()).await?;
        Ok(actor)
    })
    .await
    .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn echoes_payload_and_reuses_one_actor() {
        let a = echo_actor().await.unwrap();
        let b = echo_actor().await.unwrap();
        assert_eq!(a.get_id(), b.get_id());
        let out = ractor::call!(a, EchoMsg::Echo, vec![1, 2, 3]).unwrap();
        assert_eq!(out, vec![1, 2, 3]);
    }
}

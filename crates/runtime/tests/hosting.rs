//! The generic worker daemon hosting an actor kind it knows nothing about (a toy
//! counter actor plugged in through `ActorHost`), over real gRPC: spawn, typed handle,
//! stop with its finishing work, refusals that name the problem, a lapsed lease, an
//! actor that dies on its own, and the host's shutdown.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use manta_proto::cluster::ActorKind;
use manta_runtime::{
    serve, ActorHost, HostedActor, Lease, RuntimeError, SpawnRequest, WorkerClient, WorkerDaemon,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::oneshot;
use tonic::{Code, Status};

const TOKEN: &str = "hosting-test-token";
const LIMIT: Duration = Duration::from_secs(5);

enum ToyMsg {
    Get(RpcReplyPort<u32>),
}

/// Answers with the number it was started with.
struct Toy;

impl Actor for Toy {
    type Msg = ToyMsg;
    type State = u32;
    type Arguments = u32;

    async fn pre_start(&self, _: ActorRef<ToyMsg>, n: u32) -> Result<u32, ActorProcessingErr> {
        Ok(n)
    }

    async fn handle(
        &self,
        _: ActorRef<ToyMsg>,
        msg: ToyMsg,
        n: &mut u32,
    ) -> Result<(), ActorProcessingErr> {
        let ToyMsg::Get(reply) = msg;
        let _ = reply.send(*n);
        Ok(())
    }
}

/// Hosts `Toy` actors: the config is the number; counts finished stops and shutdowns.
#[derive(Default)]
struct ToyHost {
    finished: Arc<AtomicUsize>,
    shut_down: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl ActorHost for ToyHost {
    async fn spawn(&self, req: SpawnRequest) -> Result<HostedActor, Status> {
        let n: u32 = req.config_json.trim().parse().map_err(|_| {
            Status::invalid_argument(format!("toy config {:?} is not a number", req.config_json))
        })?;
        let (actor, _) = Actor::spawn(Some(req.name.clone()), Toy, n)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let finished = self.finished.clone();
        Ok(
            HostedActor::new(actor.get_cell(), actor).on_stop(async move {
                finished.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    async fn shutdown(&self) {
        self.shut_down.store(true, Ordering::SeqCst);
    }
}

fn code(e: RuntimeError) -> (Code, String) {
    match e {
        RuntimeError::Rpc { status, .. } => (status.code(), status.message().to_string()),
        other => panic!("not a call error: {other}"),
    }
}

async fn hosted_names(client: &WorkerClient) -> Vec<String> {
    client.heartbeat(0, LIMIT).await.unwrap().actors
}

/// Waits (bounded) until `cond` holds for the worker's list of actors.
async fn wait_for_names(client: &WorkerClient, cond: impl Fn(&[String]) -> bool) {
    let started = Instant::now();
    loop {
        let names = hosted_names(client).await;
        if cond(&names) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the worker still hosts {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugged_in_actor_kind_is_hosted_stopped_and_supervised() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let daemon = WorkerDaemon::new(vec![]);
    let host = Arc::new(ToyHost::default());
    let (finished, shut_down) = (host.finished.clone(), host.shut_down.clone());
    daemon.host(ActorKind::Rollout, host);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(daemon.clone(), listener, TOKEN.into(), async {
        let _ = stop_rx.await;
    }));
    let client = WorkerClient::new(&addr, TOKEN).unwrap();
    let spawn = |name: &'static str, config: &'static str| {
        let client = client.clone();
        async move {
            client
                .spawn_actor(ActorKind::Rollout, name, &[], config.into(), LIMIT)
                .await
        }
    };

    // A kind nobody registered is refused, naming the kinds there are.
    let (c, message) = code(
        client
            .spawn_actor(ActorKind::Trainer, "t", &[], "1".into(), LIMIT)
            .await
            .unwrap_err(),
    );
    assert_eq!(c, Code::Unimplemented);
    assert!(message.contains("ACTOR_KIND_ROLLOUT"), "{message}");
    // The host's own refusal reaches the caller as it said it.
    let (c, message) = code(spawn("hosting-bad", "forty").await.unwrap_err());
    assert_eq!(c, Code::InvalidArgument);
    assert!(message.contains("\"forty\" is not a number"), "{message}");

    // Spawned: listed, reachable through its typed handle (and only as that type).
    spawn("hosting-a", "41").await.unwrap();
    assert_eq!(hosted_names(&client).await, vec!["hosting-a".to_string()]);
    let actor = daemon
        .hosted::<ActorRef<ToyMsg>>("hosting-a")
        .await
        .expect("typed handle");
    assert_eq!(ractor::call!(actor, ToyMsg::Get).unwrap(), 41);
    assert!(daemon.hosted::<String>("hosting-a").await.is_none());
    assert_eq!(daemon.all_hosted::<ActorRef<ToyMsg>>().await.len(), 1);
    let (c, _) = code(spawn("hosting-a", "1").await.unwrap_err());
    assert_eq!(c, Code::AlreadyExists);

    // Stopped by the driver: its finishing work ran before the call returned.
    client.stop_actor("hosting-a").await.unwrap();
    assert_eq!(finished.load(Ordering::SeqCst), 1);
    assert!(hosted_names(&client).await.is_empty());
    let (c, _) = code(client.stop_actor("hosting-a").await.unwrap_err());
    assert_eq!(c, Code::NotFound);

    // A placer whose heartbeats stop loses its actors when its lease lapses.
    let leased = client
        .clone()
        .with_lease(Lease::new(Duration::from_millis(300)));
    leased
        .spawn_actor(ActorKind::Rollout, "hosting-leased", &[], "2".into(), LIMIT)
        .await
        .unwrap();
    wait_for_names(&client, |n| n.is_empty()).await;
    assert_eq!(finished.load(Ordering::SeqCst), 2);

    // An actor that dies on its own is taken off the node by the supervisor.
    spawn("hosting-dies", "3").await.unwrap();
    ractor::registry::where_is("hosting-dies")
        .expect("registered")
        .kill();
    wait_for_names(&client, |n| n.is_empty()).await;
    let started = Instant::now();
    while finished.load(Ordering::SeqCst) < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no finishing work ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Shutdown stops what is left and lets the host release its own things.
    spawn("hosting-left", "4").await.unwrap();
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    assert!(shut_down.load(Ordering::SeqCst));
    assert_eq!(finished.load(Ordering::SeqCst), 4);
    let started = Instant::now();
    while ractor::registry::where_is("hosting-left").is_some() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "hosting-left still runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

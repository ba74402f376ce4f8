//! The worker's `Echo` (through its echo actor) and `IngestSamples` RPCs over real
//! gRPC, with the cluster token checked. Its own test binary: a worker daemon names its
//! actors process-wide, so two daemons of one process would share the echo actor.

use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_client::WorkerClient;
use manta_proto::common as pb;
use manta_runtime::{serve, BearerToken, WorkerDaemon};
use tokio::sync::oneshot;

const TOKEN: &str = "echo-test-token";

#[tokio::test]
async fn echo_round_trips_and_ingest_counts_what_arrived() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        WorkerDaemon::new(vec![]),
        listener,
        TOKEN.into(),
        async {
            let _ = stop_rx.await;
        },
    ));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let mut rpc = WorkerClient::with_interceptor(channel.clone(), BearerToken::new(TOKEN).unwrap());

    for sequence in [0u64, 7, 42] {
        let reply = rpc
            .echo(cpb::EchoRequest {
                sequence,
                payload: vec![sequence as u8; 3],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.sequence, sequence);
        assert_eq!(reply.payload, vec![sequence as u8; 3]);
    }

    let samples: Vec<pb::Sample> = (0..5u32)
        .map(|i| pb::Sample {
            id: i as u64,
            tokens: vec![1; 10 + i as usize],
            loss_mask: vec![1; 10 + i as usize],
            rollout_log_probs: vec![-0.5; 4],
            ..Default::default()
        })
        .collect();
    let reply = rpc
        .ingest_samples(futures::stream::iter(samples))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.samples, 5);
    assert_eq!(reply.tokens, 10 + 11 + 12 + 13 + 14);
    assert_eq!(reply.array_bytes, 4 * (2 * 60 + 5 * 4));

    let mut wrong = WorkerClient::with_interceptor(channel, BearerToken::new("nope").unwrap());
    let err = wrong
        .echo(cpb::EchoRequest::default())
        .await
        .expect_err("a wrong token must be refused");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);

    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}

//! The channel `WorkerClient` gives every gRPC client of a worker: unary calls (one at a
//! time and many at once), a client stream several times the HTTP/2 receive windows,
//! gRPC errors passed through, a named error while the worker is down, and reconnection
//! to a worker restarted on the same address.

use std::net::SocketAddr;
use std::time::Duration;

use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_client::WorkerClient as WorkerRpc;
use manta_proto::common as pb;
use manta_runtime::{serve, AuthedChannel, WorkerClient, WorkerDaemon};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const TOKEN: &str = "transport-test-token";

type Server = (
    oneshot::Sender<()>,
    JoinHandle<Result<(), tonic::transport::Error>>,
);

async fn start_server(addr: SocketAddr) -> Server {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        WorkerDaemon::new(vec![]),
        listener,
        TOKEN.into(),
        async {
            let _ = stop_rx.await;
        },
    ));
    (stop_tx, server)
}

async fn stop_server((stop, handle): Server) {
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}

/// hyper's HTTP/2 connection receive window, which tonic keeps: a stream past it must
/// wait for window updates.
const CONNECTION_WINDOW: usize = 5 * 1024 * 1024;

type Rpc = WorkerRpc<AuthedChannel>;

/// The `Worker` service over `WorkerClient`'s own channel to `addr`, with `token`.
fn client(addr: SocketAddr, token: &str) -> Rpc {
    let worker = WorkerClient::new(&addr.to_string(), token).unwrap();
    WorkerRpc::new(worker.channel()).max_encoding_message_size(64 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_calls_streams_errors_and_reconnects() {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    let server = start_server(addr).await;
    let mut rpc = client(addr, TOKEN);

    // Unary, one at a time.
    for sequence in 0..20u64 {
        let reply = rpc
            .echo(cpb::EchoRequest {
                sequence,
                payload: vec![sequence as u8; 100],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((reply.sequence, reply.payload.len()), (sequence, 100));
    }
    // Many calls in flight on one connection, each answered with its own payload.
    let calls = (0..64u64).map(|i| {
        let mut c = rpc.clone();
        async move {
            let r = c
                .echo(cpb::EchoRequest {
                    sequence: i,
                    payload: i.to_le_bytes().to_vec(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.payload, i.to_le_bytes().to_vec());
            r.sequence
        }
    });
    let mut got = futures::future::join_all(calls).await;
    got.sort_unstable();
    assert_eq!(got, (0..64).collect::<Vec<_>>());

    // A client stream of ~13 MB: past the receive windows, so flow control paces it.
    let samples: Vec<pb::Sample> = (0..200u64)
        .map(|i| pb::Sample {
            id: i,
            tokens: vec![i as u32; 10_000],
            loss_mask: vec![1; 10_000],
            rollout_log_probs: vec![-0.5; 10_000],
            ..Default::default()
        })
        .collect();
    let wire: usize = samples.iter().map(prost::Message::encoded_len).sum();
    assert!(wire > 2 * CONNECTION_WINDOW, "{wire}");
    let reply = rpc
        .ingest_samples(futures::stream::iter(samples))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((reply.samples, reply.tokens), (200, 2_000_000));

    // gRPC errors come through as statuses.
    let mut wrong = client(addr, "nope");
    let status = wrong.echo(cpb::EchoRequest::default()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    // The worker goes away: calls fail, naming the connection problem...
    stop_server(server).await;
    let err = rpc
        .heartbeat(cpb::HeartbeatRequest {
            sequence: 1,
            ..Default::default()
        })
        .await;
    assert!(err.is_err());
    let err = rpc
        .heartbeat(cpb::HeartbeatRequest {
            sequence: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        manta_runtime::tls::status_chain(&err).contains("tcp connect error"),
        "{err:?}"
    );
    // ...and it comes back on the same address: the same channel reconnects.
    let server = start_server(addr).await;
    let mut answered = false;
    for _ in 0..20 {
        if rpc
            .heartbeat(cpb::HeartbeatRequest {
                sequence: 2,
                ..Default::default()
            })
            .await
            .is_ok()
        {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered, "the channel never reconnected");
    stop_server(server).await;
}

//! The remote pool against in-process worker daemons: placement errors are refused
//! before anything starts, a stopped worker is declared dead (after `dead_after` without
//! a heartbeat), and a worker back on the same port rejoins with its actors re-spawned.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use manta_hosting::rollout::pool::{NodeSpec, PauseMode};
use manta_hosting::weights::{self, WeightSet};
use manta_hosting::{
    serve, PoolOptions, RemotePool, RemoteTrainer, RolloutSpawnConfig, ShippedTrainConfig,
    TrainerSpawnConfig,
};
use manta_proto::weight_sync::TensorDigest;
use manta_runtime::{Lease, WorkerClient, WorkerDaemon};
use std::sync::Arc;
use tokio::sync::oneshot;

const TOKEN: &str = "pool-test-token";

/// Hosted actors register their names process-wide (ractor's registry), and every test
/// here hosts `rollout-0-0`: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn spawn_config() -> RolloutSpawnConfig {
    RolloutSpawnConfig {
        model_dir: workspace().join("assets/tiny-qwen3"),
        seed: 1,
        // Shipped as text: the worker never reads the file, so its path need not exist.
        train_config: ShippedTrainConfig {
            path: PathBuf::from("/nowhere/train_config.yaml"),
            yaml: std::fs::read_to_string(workspace().join("train_config.yaml")).unwrap(),
        },
        max_concurrent_episodes: 4,
        max_batch_size: 4,
        openreward: Default::default(),
        sglang: None,
        engine_gpus: Default::default(),
        mem_fraction_static: None,
    }
}

const OPTS: PoolOptions = PoolOptions {
    heartbeat_interval: Duration::from_millis(100),
    dead_after: Duration::from_millis(500),
    no_live_node_timeout: Duration::from_secs(5),
    lease_timeout: Duration::from_secs(30),
};

async fn start_worker(
    addr: std::net::SocketAddr,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        let stop = async {
            let _ = rx.await;
        };
        serve(WorkerDaemon::new(vec![]), listener, TOKEN.into(), stop)
            .await
            .unwrap();
    });
    (tx, handle)
}

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Only stops a test that would otherwise hang: far beyond any `OPTS` duration, so a
/// loaded machine never trips it.
const HANG: Duration = Duration::from_secs(60);

/// Polls until the pool counts `live` live nodes; fails after `limit`.
async fn wait_for(pool: &RemotePool, live: usize, limit: Duration) {
    let started = Instant::now();
    while pool.live_nodes() != live {
        assert!(
            started.elapsed() < limit,
            "live nodes stayed {} (wanted {live}) for {limit:?}",
            pool.live_nodes()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A worker daemon's stop signal and task.
type Worker = (oneshot::Sender<()>, tokio::task::JoinHandle<()>);

/// Stops a worker daemon and waits for it.
async fn stop_worker((stop, handle): Worker) {
    let _ = stop.send(());
    handle.await.unwrap();
}

/// A worker on a free port and a pool of that one node (no GPUs) on it.
async fn one_worker_pool() -> (std::net::SocketAddr, RemotePool, Worker) {
    let addr = free_addr();
    let worker = start_worker(addr).await;
    let node = NodeSpec {
        address: addr.to_string(),
        gpus: vec![],
    };
    let pool = RemotePool::start(&[node], TOKEN, spawn_config(), 1, OPTS)
        .await
        .unwrap();
    (addr, pool, worker)
}

/// Shuts the pool down, then its worker.
async fn finish(pool: RemotePool, worker: Worker) {
    pool.shutdown().await;
    stop_worker(worker).await;
}

/// The first engine's digests on the pool's first live node.
async fn first_engine(pool: &RemotePool) -> manta_proto::weight_sync::EngineDigest {
    pool.engine_digests().await.remove(0).1.unwrap().remove(0)
}

/// This test as rank 0 of `group`, a store-backed group of two on this host.
fn store_rank0(group: &str, timeout: Duration) -> manta_cuda::weight_group::WeightGroup {
    use manta_cuda::process_group::GroupSpec;
    use manta_cuda::weight_group::{Backend, WeightGroup};
    WeightGroup::join(
        GroupSpec {
            master_address: "127.0.0.1".into(),
            master_port: 0,
            rank: 0,
            world_size: 2,
            group_name: group.into(),
            device: 0,
            timeout,
        },
        Backend::Store,
    )
    .unwrap()
}

/// A `ReceiveBroadcast` of version `version` (`names`, drained) for `actors` as rank 1
/// of `group`, the store group of two [`store_rank0`] roots at `port`, with `timeout_s`.
fn receive_request(
    group: &str,
    port: u16,
    version: u64,
    actors: Vec<String>,
    names: Vec<String>,
    timeout_s: u32,
) -> manta_proto::weight_sync::ReceiveBroadcastRequest {
    use manta_proto::weight_sync as wpb;
    wpb::ReceiveBroadcastRequest {
        version,
        pause: wpb::PauseMode::Drain as i32,
        backend: wpb::GroupBackend::Store as i32,
        master_address: "127.0.0.1".into(),
        master_port: u32::from(port),
        group_name: group.into(),
        world_size: 2,
        actors,
        ranks: vec![1],
        names,
        timeout_s,
    }
}

/// Random weights (seeded with `seed`) of the engine's tensors' names and shapes.
fn random_weights(
    engine: &manta_proto::weight_sync::EngineDigest,
    seed: i64,
) -> Vec<(String, tch::Tensor)> {
    tch::manual_seed(seed);
    engine
        .tensors
        .iter()
        .map(|d| {
            let t = tch::Tensor::randn(d.shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu));
            (d.name.clone(), t)
        })
        .collect()
}

/// Rank 0 in this process: a store group rooted here, with `timeout`.
fn root_here(timeout: Duration) -> manta_hosting::rollout::pool::GroupRoot {
    use manta_hosting::rollout::pool::{GroupRoot, RootAt};
    GroupRoot {
        backend: manta_cuda::weight_group::Backend::Store,
        timeout,
        at: RootAt::Here {
            master_address: "127.0.0.1".into(),
            device: 0,
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_is_checked_before_anything_starts() {
    let _serial = SERIAL.lock().await;
    let addr = free_addr();
    let worker = start_worker(addr).await;
    let node = |address: String, gpus: Vec<u32>| NodeSpec { address, gpus };
    let err = RemotePool::start(
        &[node(addr.to_string(), vec![])],
        "wrong",
        spawn_config(),
        1,
        OPTS,
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("placement cannot be satisfied")
            && err.contains(&addr.to_string())
            && err.contains("wrong cluster token"),
        "{err}"
    );
    let err = RemotePool::start(
        &[node(addr.to_string(), vec![0])],
        TOKEN,
        spawn_config(),
        1,
        OPTS,
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("should offer GPU 0"), "{err}");
    let dead = free_addr();
    let err = RemotePool::start(
        &[
            node(addr.to_string(), vec![]),
            node(dead.to_string(), vec![]),
        ],
        TOKEN,
        spawn_config(),
        1,
        OPTS,
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains(&dead.to_string()), "{err}");
    // The model must be there on every node; the error names node, path and setting.
    let missing = RolloutSpawnConfig {
        model_dir: PathBuf::from("/nowhere/model"),
        ..spawn_config()
    };
    let err = RemotePool::start(&[node(addr.to_string(), vec![])], TOKEN, missing, 1, OPTS)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&addr.to_string())
            && err.contains("/nowhere/model does not exist")
            && err.contains("`model` under [train]"),
        "{err}"
    );
    stop_worker(worker).await;
}

/// Weights published over gRPC (in small chunks: many per tensor) are what the engine
/// then holds, bit for bit, with the new version; weights the engine cannot take fail
/// at once, naming the worker and the tensor, and do not make the node look dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_weights_reach_the_engine_bit_for_bit() {
    let _serial = SERIAL.lock().await;
    let (addr, pool, worker) = one_worker_pool().await;
    // The engine's tensors (names, dtypes, shapes) filled with new random values.
    let before = first_engine(&pool).await;
    assert_eq!(before.version, 0);
    tch::manual_seed(11);
    let set = WeightSet {
        tensors: before
            .tensors
            .iter()
            .map(|d| {
                assert_eq!(d.dtype, "F32", "{}", d.name);
                let t =
                    tch::Tensor::randn(d.shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu));
                weights::tensor_bytes(&d.name, &t).unwrap()
            })
            .collect(),
    };
    let largest = set.tensors.iter().map(|t| t.data.len()).max().unwrap();
    assert!(
        largest > 3 * 1024,
        "the test needs a tensor of several chunks"
    );
    let set = std::sync::Arc::new(set);
    let sync = pool
        .publish_weights(set.clone(), 5, 1024, PauseMode::Drain)
        .await
        .unwrap();
    assert_eq!((sync.nodes, sync.engines), (1, 1));
    let after = first_engine(&pool).await;
    assert_eq!(after.version, 5);
    assert_eq!(after.tensors, set.digests());
    assert_ne!(after.tensors, before.tensors);

    // A tensor of the wrong shape is refused; the engine keeps version 5.
    let mut bad = (*set).clone();
    bad.tensors[0].shape = vec![bad.tensors[0].data.len() as i64 / 4];
    let name = bad.tensors[0].name.clone();
    let err = pool
        .publish_weights(std::sync::Arc::new(bad), 6, 1024, PauseMode::Drain)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&addr.to_string()) && err.contains(&name) && err.contains("shape"),
        "{err}"
    );
    assert_eq!(pool.live_nodes(), 1);
    let still = first_engine(&pool).await;
    assert_eq!((still.version, still.tensors), (5, set.digests()));
    finish(pool, worker).await;
}

/// The group protocol across processes' boundary (gRPC): the test is rank 0 of a
/// store-backed weight-update group; `ReceiveBroadcast` tells the worker's engine the
/// group's address, name and its rank, the engine joins and receives every tensor while
/// rank 0 broadcasts, bit for bit; a second version goes through the same group, and a
/// request naming an actor the worker does not host is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_on_a_worker_joins_a_group_named_over_grpc() {
    use manta_hosting::weights::WeightSyncCalls;

    let _serial = SERIAL.lock().await;
    let (_, pool, worker) = one_worker_pool().await;
    let (client, actors) = pool.placed().remove(0);
    let before = first_engine(&pool).await;
    let mut root = store_rank0("pool-test-group", Duration::from_secs(30));
    let port = root.store_port();
    let names: Vec<String> = before.tensors.iter().map(|d| d.name.clone()).collect();
    let request = |version: u64, actors: Vec<String>| {
        receive_request("pool-test-group", port, version, actors, names.clone(), 30)
    };
    let wrong = client
        .receive_broadcast(request(1, vec!["rollout-9-9".into()]))
        .await
        .unwrap_err()
        .to_string();
    assert!(wrong.contains("no rollout actor rollout-9-9"), "{wrong}");
    for (version, seed) in [(1u64, 21i64), (2, 22)] {
        let tensors = random_weights(&before, seed);
        let digests = weights::digest_tensors(&tensors).unwrap();
        let receiving = client.receive_broadcast(request(version, actors.clone()));
        let sending = tokio::task::spawn_blocking(move || {
            let sent = root.broadcast(&tensors, 0);
            (root, sent)
        });
        let (received, sent) = tokio::join!(receiving, sending);
        let (back, sent) = sent.unwrap();
        root = back;
        sent.unwrap();
        let reply = received.unwrap();
        assert_eq!((reply.version, reply.engines), (version, 1));
        let after = first_engine(&pool).await;
        assert_eq!(after.version, version);
        assert_eq!(after.tensors, digests, "version {version} bit for bit");
        assert_ne!(after.tensors, before.tensors);
    }
    finish(pool, worker).await;
}

/// A worker's engine receiving from a rank 0 that never sends: `AbortBroadcast` ends its
/// receive at once (not at the group's 60 s timeout) and counts it; a name aborted before
/// any engine joined it fails a later receive on it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_broadcast_ends_an_engines_receive_at_once() {
    use manta_hosting::weights::WeightSyncCalls;

    let _serial = SERIAL.lock().await;
    let (_, pool, worker) = one_worker_pool().await;
    let (client, actors) = pool.placed().remove(0);
    let names: Vec<String> = first_engine(&pool)
        .await
        .tensors
        .into_iter()
        .map(|d| d.name)
        .collect();
    // Kept alive and silent: the member waits in the group until aborted.
    let root = store_rank0("pool-abort-group", Duration::from_secs(60));
    let port = root.store_port();
    let request = |group: &str| receive_request(group, port, 1, actors.clone(), names.clone(), 60);
    let started = Instant::now();
    let receiving = tokio::spawn({
        let (client, request) = (client.clone(), request("pool-abort-group"));
        async move { client.receive_broadcast(request).await }
    });
    // Time for the idle engine to pause and join (a local store): then it is receiving.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!receiving.is_finished(), "the receive waits for rank 0");
    let aborted = client.abort_broadcast("pool-abort-group").await.unwrap();
    assert_eq!(aborted, 1, "the engine receiving in the group");
    let why = receiving.await.unwrap().unwrap_err().to_string();
    assert!(why.contains("aborted"), "{why}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the receive ended {:?} after it started (the group's timeout is 60 s)",
        started.elapsed()
    );

    // Aborted before anyone joined: a receive on that name fails at once.
    assert_eq!(client.abort_broadcast("pool-abort-early").await.unwrap(), 0);
    let started = Instant::now();
    let why = client
        .receive_broadcast(request("pool-abort-early"))
        .await
        .unwrap_err()
        .to_string();
    assert!(why.contains("was aborted"), "{why}");
    assert!(started.elapsed() < Duration::from_secs(30));
    drop(root);
    finish(pool, worker).await;
}

/// Rank 0's side fails while a member waits (here: a tensor it cannot send): the driver
/// aborts the member's receive, so the broadcast fails with rank 0's cause long before
/// the group's 60 s timeout, and the member, not at fault, stays live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rank_0_ends_the_members_receive() {
    let _serial = SERIAL.lock().await;
    let (_, pool, worker) = one_worker_pool().await;
    let shapes = first_engine(&pool).await;
    let root = root_here(Duration::from_secs(60));
    let mut strided = false;
    let tensors: Vec<(String, tch::Tensor)> = shapes
        .tensors
        .iter()
        .map(|d| {
            let cpu = (tch::Kind::Float, tch::Device::Cpu);
            let t = match d.shape.as_slice() {
                // One tensor transposed: not dense, so the store backend refuses it.
                [rows, cols] if !strided => {
                    strided = true;
                    tch::Tensor::zeros([*cols, *rows], cpu).tr()
                }
                shape => tch::Tensor::zeros(shape, cpu),
            };
            (d.name.clone(), t)
        })
        .collect();
    assert!(strided, "the model has a 2-D tensor");
    let started = Instant::now();
    let why = pool
        .publish_broadcast(&root, Some(tensors), 1, PauseMode::Drain, false)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        why.contains("not a dense CPU tensor"),
        "rank 0's cause: {why}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the broadcast failed {:?} after it started (the group's timeout is 60 s)",
        started.elapsed()
    );
    assert_eq!(pool.live_nodes(), 1, "the member is not at fault");
    finish(pool, worker).await;
}

/// Handles on the same tensors.
fn shallow(tensors: &[(String, tch::Tensor)]) -> Vec<(String, tch::Tensor)> {
    tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect()
}

/// Every live node's engine holds `version` with exactly `tensors`; answers how many
/// nodes were read.
async fn holds(pool: &RemotePool, version: u64, tensors: &[(String, tch::Tensor)]) -> usize {
    let want = weights::digest_tensors(&shallow(tensors)).unwrap();
    let mut nodes = 0;
    for (addr, engines) in pool.engine_digests().await {
        for e in engines.unwrap() {
            assert_eq!(e.version, version, "{addr}");
            assert_eq!(e.tensors, want, "{addr}: version {version} bit for bit");
        }
        nodes += 1;
    }
    nodes
}

/// Broadcasts to the pool across worker daemons over gRPC: one group for both nodes'
/// engines; a node that dies leaves it (the next broadcast makes a group of the live
/// one); the node back on its port waits, not live, until the next broadcast makes a
/// group with it in and gives it the weights. Every engine that took a version holds it
/// bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcasts_make_a_new_group_when_a_node_leaves_and_when_it_rejoins() {
    let _serial = SERIAL.lock().await;
    let (a, b) = (free_addr(), free_addr());
    let (stop_a, handle_a) = start_worker(a).await;
    let (stop_b, handle_b) = start_worker(b).await;
    let nodes: Vec<NodeSpec> = [a, b]
        .iter()
        .map(|addr| NodeSpec {
            address: addr.to_string(),
            gpus: vec![],
        })
        .collect();
    let pool = RemotePool::start(&nodes, TOKEN, spawn_config(), 1, OPTS)
        .await
        .unwrap();
    let shapes = first_engine(&pool).await;
    let root = root_here(Duration::from_secs(30));
    let version_weights = |seed: i64| random_weights(&shapes, seed);

    let w1 = version_weights(31);
    let sync = pool
        .publish_broadcast(&root, Some(shallow(&w1)), 1, PauseMode::Drain, false)
        .await
        .unwrap()
        .0;
    assert_eq!((sync.nodes, sync.engines), (2, 2));
    assert_eq!(holds(&pool, 1, &w1).await, 2);
    let first = pool.group_name().await.expect("a group");
    let w2 = version_weights(32);
    pool.publish_broadcast(&root, Some(shallow(&w2)), 2, PauseMode::Drain, false)
        .await
        .unwrap();
    assert_eq!(
        pool.group_name().await.as_deref(),
        Some(first.as_str()),
        "same members, same group"
    );

    // Node b goes: the next broadcast is a group of a alone.
    let _ = stop_b.send(());
    handle_b.await.unwrap();
    wait_for(&pool, 1, HANG).await;
    let w3 = version_weights(33);
    let sync = pool
        .publish_broadcast(&root, Some(shallow(&w3)), 3, PauseMode::Drain, false)
        .await
        .unwrap()
        .0;
    assert_eq!((sync.nodes, sync.engines), (1, 1));
    let second = pool.group_name().await.expect("a group");
    assert_ne!(second, first, "a member left: a new group");
    assert_eq!(holds(&pool, 3, &w3).await, 1);

    // b comes back: its actors are spawned again, but it waits for the weights.
    let (stop_b, handle_b) = start_worker(b).await;
    let started = Instant::now();
    while !pool.awaiting_weights() {
        assert!(started.elapsed() < HANG, "node b never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        pool.live_nodes(),
        1,
        "a rejoined node is not live before it has the weights"
    );
    let w4 = version_weights(34);
    let sync = pool
        .publish_broadcast(&root, Some(shallow(&w4)), 4, PauseMode::Drain, false)
        .await
        .unwrap()
        .0;
    assert_eq!((sync.nodes, sync.engines), (2, 2));
    assert_ne!(
        pool.group_name().await.expect("a group"),
        second,
        "a member joined: a new group"
    );
    assert_eq!(pool.live_nodes(), 2);
    assert_eq!(holds(&pool, 4, &w4).await, 2);
    pool.shutdown().await;
    for worker in [(stop_a, handle_a), (stop_b, handle_b)] {
        stop_worker(worker).await;
    }
}

/// The trainer's digests as its worker serves them (the reference), by name.
async fn trainer_digests(trainer: &RemoteTrainer) -> Vec<TensorDigest> {
    by_name(trainer.pull_weights().await.unwrap().digests())
}

fn by_name(mut d: Vec<TensorDigest>) -> Vec<TensorDigest> {
    d.sort_by(|a, b| a.name.cmp(&b.name));
    d
}

/// Every live node's engine holds `version` with exactly `want`; how many engines.
async fn engines_hold(pool: &RemotePool, version: u64, want: &[TensorDigest]) -> usize {
    let mut engines = 0;
    for (addr, found) in pool.engine_digests().await {
        for e in found.unwrap() {
            assert_eq!(e.version, version, "{addr}");
            assert_eq!(
                by_name(e.tensors),
                want,
                "{addr}: version {version} bit for bit"
            );
            engines += 1;
        }
    }
    engines
}

/// A batch the tiny model trains on (token ids below its vocabulary of 265).
fn batch() -> manta_trainer::TrainBatch {
    let sample = |id: u64, tokens: Vec<u32>, mask: Vec<u8>| manta_core::Sample {
        id,
        group_index: 0,
        index: id as u32,
        response_length: mask.len(),
        rollout_log_probs: vec![-5.5; mask.len()],
        tokens,
        loss_mask: mask,
        reward: 0.0,
        status: manta_core::SampleStatus::Completed,
        weight_version: 0,
        metadata: Default::default(),
        routed_experts: None,
    };
    manta_trainer::TrainBatch {
        samples: vec![
            sample(0, vec![3, 17, 42, 99, 100, 7], vec![1, 1, 0, 1]),
            sample(1, vec![5, 6, 200, 201, 13], vec![1, 1, 1]),
        ],
        advantages: vec![1.0, -0.5],
        global_samples: 2,
    }
}

/// Rank 0 on the trainer's worker: worker A hosts the trainer and roots a store group
/// (`OpenWeightGroup`, `BroadcastWeights`), worker B's engine receives, and the driver
/// side (this test) only decides the members and holds no weights. Two versions (a
/// training step between them) arrive bit for bit in one kept group; B stopped and
/// back gets a new group — fed at once from the trainer's worker, since no other node
/// is live — and the next version keeps that group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainers_worker_roots_the_group_and_rebuilds_it_when_the_engine_node_returns() {
    use manta_cuda::weight_group::Backend;
    use manta_hosting::rollout::pool::{GroupRoot, RootAt};

    let _serial = SERIAL.lock().await;
    let (a, b) = (free_addr(), free_addr());
    let (stop_a, handle_a) = start_worker(a).await;
    let (stop_b, handle_b) = start_worker(b).await;
    let client = WorkerClient::connect(&a.to_string(), TOKEN, None)
        .unwrap()
        .with_lease(Lease::new(OPTS.lease_timeout));
    let options = manta_trainer::TrainerOptions {
        model_dir: workspace().join("assets/tiny-qwen3"),
        seed: 1,
        device: tch::Device::Cpu,
        adam: manta_trainer::optimizer::AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        clip: manta_trainer::loss::ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
        },
        clip_grad: 1.0,
        temperature: 1.0,
        max_tokens_per_gpu: 1000,
        layout: Default::default(),
        bf16: None,
        use_rollout_logprobs: true,
        logprob_chunk: 8,
        recompute: None,
        algo: Default::default(),
    };
    let trainer = Arc::new(
        RemoteTrainer::start(
            client,
            "trainer-0",
            TrainerSpawnConfig::from_options(&options),
            vec![],
            Duration::from_secs(30),
            OPTS.heartbeat_interval,
            OPTS.dead_after,
        )
        .await
        .unwrap(),
    );
    let pool = RemotePool::start(
        &[NodeSpec {
            address: b.to_string(),
            gpus: vec![],
        }],
        TOKEN,
        spawn_config(),
        1,
        OPTS,
    )
    .await
    .unwrap();
    let root = GroupRoot {
        backend: Backend::Store,
        timeout: Duration::from_secs(30),
        at: RootAt::Trainer {
            trainer: trainer.clone(),
            master_address: "127.0.0.1".into(),
        },
    };

    // Version 1: the trainer's initial weights; rank 0 sends their digests back.
    let want1 = trainer_digests(&trainer).await;
    let (sync, sent) = pool
        .publish_broadcast(&root, None, 1, PauseMode::Drain, true)
        .await
        .unwrap();
    assert_eq!((sync.nodes, sync.engines), (1, 1));
    assert_eq!(by_name(sent.expect("rank 0's digests")), want1);
    assert_eq!(engines_hold(&pool, 1, &want1).await, 1);
    let first = pool.group_name().await.expect("a group");

    // Version 2 after a training step: new weights, same members, same group.
    trainer.train_step(1, &batch()).await.unwrap();
    let want2 = trainer_digests(&trainer).await;
    assert_ne!(want1, want2, "the step changed the weights");
    pool.publish_broadcast(&root, None, 2, PauseMode::Drain, false)
        .await
        .unwrap();
    assert_eq!(pool.group_name().await.as_deref(), Some(first.as_str()));
    assert_eq!(engines_hold(&pool, 2, &want2).await, 1);

    // B goes and comes back on its port: it is the only rollout node, so the trainer's
    // worker broadcasts version 2 to it at once, through a new group.
    let _ = stop_b.send(());
    handle_b.await.unwrap();
    wait_for(&pool, 0, HANG).await;
    let (stop_b, handle_b) = start_worker(b).await;
    wait_for(&pool, 1, HANG).await;
    let second = pool.group_name().await.expect("a group");
    assert_ne!(second, first, "the engine node returned: a new group");
    assert_eq!(engines_hold(&pool, 2, &want2).await, 1);

    // Version 3: the same members again, the same group.
    trainer.train_step(2, &batch()).await.unwrap();
    let want3 = trainer_digests(&trainer).await;
    let (sync, _) = pool
        .publish_broadcast(&root, None, 3, PauseMode::Drain, false)
        .await
        .unwrap();
    assert_eq!((sync.nodes, sync.engines), (1, 1));
    assert_eq!(pool.group_name().await.as_deref(), Some(second.as_str()));
    assert_eq!(engines_hold(&pool, 3, &want3).await, 1);

    // The trainer re-created (the group it rooted went with it): version 4 goes through
    // a new group at once, not into the old one until its timeout.
    trainer.restart(HANG).await.unwrap();
    let want4 = trainer_digests(&trainer).await;
    let (sync, _) = pool
        .publish_broadcast(&root, None, 4, PauseMode::Drain, false)
        .await
        .unwrap();
    assert_eq!((sync.nodes, sync.engines), (1, 1));
    let third = pool.group_name().await.expect("a group");
    assert_ne!(third, second, "the trainer was re-created: a new group");
    assert_eq!(engines_hold(&pool, 4, &want4).await, 1);

    pool.shutdown().await;
    trainer.shutdown().await;
    for worker in [(stop_a, handle_a), (stop_b, handle_b)] {
        stop_worker(worker).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_is_declared_dead_and_rejoins() {
    let _serial = SERIAL.lock().await;
    let (addr, pool, worker) = one_worker_pool().await;
    assert_eq!(pool.live_nodes(), 1);
    stop_worker(worker).await;
    // The node is declared dead once its heartbeats have failed for `dead_after`. How
    // long that takes on a loaded machine is not the point: the pool's state is. The
    // deadline only stops a hang (a pool that never notices).
    wait_for(&pool, 0, HANG).await;
    let worker = start_worker(addr).await;
    wait_for(&pool, 1, HANG).await;
    finish(pool, worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_actor_is_dropped_by_the_node_supervisor_and_respawned() {
    let _serial = SERIAL.lock().await;
    let (addr, pool, worker) = one_worker_pool().await;
    let client = manta_runtime::WorkerClient::new(&addr.to_string(), TOKEN).unwrap();
    let listed = |reply: manta_proto::cluster::HeartbeatReply| reply.actors;
    let before = client.heartbeat(1, Duration::from_secs(2)).await.unwrap();
    assert_eq!(listed(before), vec!["rollout-0-0".to_string()]);
    // The actor dies without being asked to (the daemon runs in this process).
    let cell = ractor::registry::where_is("rollout-0-0").expect("actor registered");
    let old_id = cell.get_id();
    cell.kill();
    // The supervisor takes it off the node; the pool's heartbeat sees it missing and
    // spawns it again: a new actor under the same name.
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < HANG, "never respawned within {HANG:?}");
        if let Some(cell) = ractor::registry::where_is("rollout-0-0") {
            if cell.get_id() != old_id {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for(&pool, 1, HANG).await;
    let after = client.heartbeat(2, Duration::from_secs(2)).await.unwrap();
    assert_eq!(listed(after), vec!["rollout-0-0".to_string()]);
    finish(pool, worker).await;
}

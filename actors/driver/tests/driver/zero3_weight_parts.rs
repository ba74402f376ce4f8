//! ZeRO-3 weight sync reads the ranks a shard group at a time: through the driver's
//! `TrainerHandle` over two CPU rank actors (`TrainerRankActor`, ZeRO-3), the weights come
//! as one part per decoder layer plus one for the embedding, norm and head, and when part
//! k arrives rank 0 has run exactly k all-gathers — the next layer is gathered only once
//! this one is answered copied. A sync that gathered the whole model first (the old
//! `GatherWeights` path) would have run every gather before handing out the first part.
//! The parts are the gathered model bit for bit, and the byte set built from them (what
//! verification and gRPC read) is too. Through the weight-sync actor, two real CPU native
//! engines take ZeRO-3 weights bit for bit both ways: one store-backed broadcast round per
//! layer, and a copy per layer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use std::collections::BTreeMap;
use std::path::Path;

use manta_config::TrainConfig;
use manta_driver::trainer_handle::TrainerHandle;
use manta_engine::{Engine, NamedTensors, NativeEngine, NativeEngineOptions};
use manta_hosting::rollout::spawn::start_rollout_actor;
use manta_rollout::RolloutMsg;
use manta_tokenizer::Tokenizer;
use manta_trainer::data_parallel::{Collective, CollectiveError, ReduceOp, ThreadCollective};
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{RankGroupKind, TrainerOptions, TrainerRankActor, TrainerRankArgs};
use manta_weight_sync::{
    BroadcastRoot, TrainerWeights, WeightSyncActor, WeightSyncArgs, WeightSyncMsg,
};
use ractor::{call, Actor, ActorRef};
use tch::{Device, Tensor};

/// Rank 0's collective, counting its all-gathers (each is one shard group gathered).
struct Counting {
    inner: ThreadCollective,
    gathers: Arc<AtomicUsize>,
}

impl Collective for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn reduce_scatter(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        self.gathers.fetch_add(1, Ordering::SeqCst);
        self.inner.all_gather(input, output)
    }
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CollectiveError> {
        self.inner.all_reduce(tensor, op)
    }
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        self.inner.broadcast(tensor, root)
    }
}

fn options() -> TrainerOptions {
    TrainerOptions {
        model_dir: model_dir(),
        seed: 5,
        device: Device::Cpu,
        adam: AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
        },
        clip_grad: 1.0,
        temperature: 1.0,
        max_tokens_per_gpu: 1000,
        use_rollout_logprobs: true,
        logprob_chunk: 8,
        recompute: None,
        layout: Default::default(),
        bf16: Some(false),
        algo: Default::default(),
    }
}

fn model_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3")
}

/// Two ZeRO-3 rank actors (named `<name>-<rank>`) behind the driver's handle; rank 0's
/// all-gathers counted in `gathers`.
async fn zero3_ranks(
    name: &str,
    gathers: &Arc<AtomicUsize>,
) -> (TrainerHandle, Vec<ActorRef<manta_trainer::TrainerMsg>>) {
    let mut comms: Vec<Box<dyn Collective>> = Vec::new();
    for (rank, comm) in ThreadCollective::group(2).unwrap().into_iter().enumerate() {
        comms.push(if rank == 0 {
            Box::new(Counting {
                inner: comm,
                gathers: Arc::clone(gathers),
            })
        } else {
            Box::new(comm)
        });
    }
    // Building a rank waits for the other in its first collective: start both at once.
    let spawned: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let args = TrainerRankArgs {
                options: options(),
                comm,
                bucket_numel: 0,
                kind: RankGroupKind::Zero3,
                checkpoint_owner: None,
            };
            let name = format!("{name}-{rank}");
            tokio::spawn(async move { Actor::spawn(Some(name), TrainerRankActor, args).await })
        })
        .collect();
    let mut ranks = Vec::new();
    for task in spawned {
        ranks.push(task.await.unwrap().unwrap().0);
    }
    let handle = TrainerHandle::local_ranks(ranks.clone(), 1, RankGroupKind::Zero3);
    (handle, ranks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zero3_weights_reach_weight_sync_one_layer_at_a_time() {
    let gathers = Arc::new(AtomicUsize::new(0));
    let (handle, ranks) = zero3_ranks("parts-rank", &gathers).await;

    // The whole model, gathered at once (the reference), then in parts.
    let whole = handle.tensors().await.unwrap().unwrap();
    let layers = 2; // assets/tiny-qwen3
    let before = gathers.load(Ordering::SeqCst);
    let mut parts = handle
        .weight_parts()
        .await
        .unwrap()
        .expect("ZeRO-3 streams");
    let largest: usize = 4 * whole.iter().map(|(_, t)| t.numel()).max().unwrap();
    let mut seen = Vec::new();
    let mut k = 0;
    while let Some(part) = parts.parts.recv().await {
        k += 1;
        // Rank 0 waits for this part's answer: it has gathered this group and no other.
        assert_eq!(
            gathers.load(Ordering::SeqCst) - before,
            k,
            "part {k} arrived after {} gathers: exactly one group per part, none ahead of the reader",
            gathers.load(Ordering::SeqCst) - before
        );
        let (group, copied) = part.into_parts();
        let bytes: usize = group.iter().map(|(_, t)| 4 * t.numel()).sum();
        let model: usize = whole.iter().map(|(_, t)| 4 * t.numel()).sum();
        assert!(
            bytes < model,
            "part {k} holds {bytes} of the model's {model} bytes"
        );
        let layer_names: Vec<&str> = group
            .iter()
            .filter_map(|(n, _)| n.strip_prefix("model.layers."))
            .filter_map(|rest| rest.split('.').next())
            .collect();
        let mut distinct = layer_names.clone();
        distinct.dedup();
        assert!(distinct.len() <= 1, "part {k} mixes layers {distinct:?}");
        for (name, t) in &group {
            let (_, reference) = whole.iter().find(|(n, _)| n == name).unwrap();
            assert!(t.equal(reference), "{name} differs from the gathered model");
            assert!(4 * t.numel() <= largest);
            seen.push(name.clone());
        }
        drop(group);
        copied.done();
    }
    parts.finish().await.unwrap();
    assert_eq!(
        k,
        layers + 1,
        "one part per layer, one for the embedding and head"
    );
    seen.sort();
    let mut names: Vec<String> = whole.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    assert_eq!(seen, names, "every weight exactly once");

    // The byte set (verification, gRPC) is built from parts too, and equals the whole.
    let set = handle.weight_set().await.unwrap();
    let expected = manta_hosting::weights::WeightSet::from_tensors(&whole).unwrap();
    let mut got = set.digests();
    let mut want = expected.digests();
    got.sort_by(|a, b| a.name.cmp(&b.name));
    want.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(got, want);

    // A reader that gives up after the first part leaves no rank waiting in a gather:
    // the next read still completes.
    let mut parts = handle.weight_parts().await.unwrap().unwrap();
    let first = parts.parts.recv().await.unwrap();
    drop(first);
    parts.finish().await.unwrap();
    let again = handle.tensors().await.unwrap().unwrap();
    assert_eq!(again.len(), whole.len());
    for r in ranks {
        r.stop(None);
    }
}

/// A real native engine on the CPU (seed `100 + i`: other weights than the trainer's)
/// behind a rollout actor named `name`.
async fn engine(name: &str, i: u64, tokenizer: &Arc<Tokenizer>) -> ActorRef<RolloutMsg> {
    let engine: Arc<dyn Engine> = NativeEngine::start(NativeEngineOptions {
        seed: 100 + i,
        max_total_tokens: Some(4096),
        ..NativeEngineOptions::new(model_dir(), Device::Cpu)
    })
    .expect("the tiny model's engine starts");
    let yaml = "environments:\n  manta/Digits:\n    url: builtin\n    variant: digits\n";
    let train = TrainConfig::from_yaml_str(yaml, Path::new("inline.yaml")).unwrap();
    start_rollout_actor(name, engine, tokenizer, &train, BTreeMap::new(), None, 4)
        .await
        .expect("rollout actor starts")
}

fn identical(a: &NamedTensors, b: &NamedTensors) -> bool {
    let by_name: BTreeMap<_, _> = b.iter().map(|(n, t)| (n.clone(), t)).collect();
    a.len() == b.len()
        && a.iter()
            .all(|(n, t)| by_name.get(n).is_some_and(|u| t.equal(u)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zero3_engines_take_the_weights_by_broadcast_rounds_or_copies_bit_for_bit() {
    let gathers = Arc::new(AtomicUsize::new(0));
    let (handle, ranks) = zero3_ranks("sync-rank", &gathers).await;
    let whole = handle.tensors().await.unwrap().unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir()).unwrap());
    for (route, root) in [("bc", Some(BroadcastRoot::Cpu)), ("copy", None)] {
        let engines = vec![
            engine(&format!("z3-{route}-0"), 0, &tokenizer).await,
            engine(&format!("z3-{route}-1"), 1, &tokenizer).await,
        ];
        let before = call!(engines[0], RolloutMsg::ReadWeights).unwrap().unwrap();
        assert!(!identical(&whole, &before), "engines start elsewhere");
        let (sync, _) = Actor::spawn(
            None,
            WeightSyncActor,
            WeightSyncArgs {
                trainer: Arc::new(handle.clone()),
                engines: engines.clone(),
                broadcast_from: root,
            },
        )
        .await
        .unwrap();
        for version in 1..=2 {
            let report = call!(sync, WeightSyncMsg::Sync, version)
                .unwrap()
                .unwrap_or_else(|e| panic!("{route} sync {version}: {e}"));
            assert_eq!(report.broadcast, root.is_some(), "{route}");
            assert_eq!(report.tensors, whole.len());
            for (i, e) in engines.iter().enumerate() {
                let got = call!(e, RolloutMsg::ReadWeights).unwrap().unwrap();
                assert!(
                    identical(&whole, &got),
                    "{route}: engine {i}, version {version}"
                );
                assert_eq!(call!(e, RolloutMsg::WeightVersion).unwrap(), version);
            }
        }
        sync.stop(None);
        for e in engines {
            e.stop(None);
        }
    }
    for r in ranks {
        r.stop(None);
    }
}

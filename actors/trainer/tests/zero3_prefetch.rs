//! ZeRO-3's layer prefetch (`MANTA_ZERO3_PREFETCH`) changes when the collectives run,
//! never what they compute: ranks with it on end every step with the same losses and the
//! same weights, bit for bit, as ranks with it off, and both follow one rank on the whole
//! batch — with every layer recomputed, block recompute of fewer layers than the model
//! has, no recompute, and uniform groups of two (whose backward the direction guess gets
//! wrong: those gathers are dropped), through training passes, filler passes and π_old's
//! log-prob passes (`forward_hidden_hooked`).
//!
//! On the CPU the collectives run at once (no streams), so this proves the prefetch
//! logic and the deferred reduce-scatter adds; the NCCL test at the end, on two GPUs,
//! proves the side stream and its events.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use common::{adam, global_samples, max_diff, tiny_model};
use manta_trainer::data_parallel::{Collective, NcclCollective, PrefetchStats, ThreadCollective};
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{
    AlgoOptions, NamedTensors, Recompute, RecomputeMethod, TrainBatch, Trainer, TrainerOptions,
};

/// Decoder layers of the model here: enough for a recomputed head, a kept tail and
/// prefetches in both directions.
const LAYERS: usize = 4;

/// The knob is one per process, read when a rank is built: the tests here hold this
/// while they build ranks, one test at a time (which also keeps libtorch's global seed
/// to one trainer build at a time).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn set_prefetch(on: bool) {
    manta_knobs::set_override("MANTA_ZERO3_PREFETCH", if on { "1" } else { "0" })
        .expect("a known knob");
}

#[derive(Clone, Copy, Debug)]
struct Setup {
    recompute: Option<Recompute>,
    /// Whether every guess is right, so no gather is wasted.
    exact_guesses: bool,
}

const fn block(num_layers: usize) -> Option<Recompute> {
    Some(Recompute {
        method: RecomputeMethod::Block,
        num_layers,
    })
}

/// The tiny model with [`LAYERS`] layers, its weights drawn from seed 7 and saved, so
/// every run starts from the same ones.
fn model(dir: &Path) -> PathBuf {
    let shape = dir.join("shape");
    std::fs::create_dir_all(&shape).unwrap();
    let text = std::fs::read_to_string(tiny_model().join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["num_hidden_layers"] = LAYERS.into();
    std::fs::write(shape.join("config.json"), cfg.to_string()).unwrap();
    let init = dir.join("init");
    Trainer::new(options(&shape, 7, None))
        .unwrap()
        .save_checkpoint(&init, 0)
        .unwrap();
    init
}

/// fp32 on the CPU, 16 tokens a micro-batch, two updates per rollout (so π_old's
/// log-prob passes run through `forward_hidden_hooked`).
fn options(model_dir: &Path, seed: u64, recompute: Option<Recompute>) -> TrainerOptions {
    TrainerOptions {
        model_dir: model_dir.to_path_buf(),
        seed,
        adam: AdamWConfig {
            eps: 1e-4,
            weight_decay: 0.01,
            ..adam(1e-2)
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        },
        max_tokens_per_gpu: 16,
        bf16: Some(false),
        recompute,
        algo: AlgoOptions {
            num_steps_per_rollout: 2,
            ..Default::default()
        },
        ..common::options()
    }
}

fn pick(indices: &[usize]) -> TrainBatch {
    let (samples, advantages) = global_samples();
    TrainBatch {
        global_samples: samples.len(),
        samples: indices.iter().map(|&i| samples[i].clone()).collect(),
        advantages: indices.iter().map(|&i| advantages[i]).collect(),
    }
}

fn copies(w: NamedTensors) -> NamedTensors {
    w.into_iter().map(|(k, v)| (k, v.copy())).collect()
}

type StepMetrics = Vec<BTreeMap<String, f64>>;

/// What a rank ends with: each step's metrics, its weights, its prefetch counts.
type RankRun = (StepMetrics, NamedTensors, PrefetchStats);

const STEPS: usize = 3;

/// Rank 0's samples 0, 1, 3, 4 and rank 1's 2, 5, 6: chunk k of the two ranks makes one
/// rank's chunk k (as tests/zero3.rs).
fn shares() -> [Vec<usize>; 2] {
    [vec![0, 1, 3, 4], vec![2, 5, 6]]
}

/// Two ZeRO-3 thread ranks, the prefetch `on` or off, [`STEPS`] steps.
fn zero3_ranks(init: &Path, recompute: Option<Recompute>, on: bool) -> Vec<RankRun> {
    set_prefetch(on);
    let handles: Vec<_> = ThreadCollective::group(2)
        .unwrap()
        .into_iter()
        .zip(shares())
        .map(|(comm, indices)| {
            let batch = pick(&indices);
            let rank = comm.rank();
            // Ranks other than 0 start elsewhere: the trainer takes rank 0's weights.
            let opts = options(init, 7 + rank as u64, recompute);
            std::thread::spawn(move || {
                let mut t = Trainer::new_zero3(opts, Box::new(comm)).unwrap();
                let metrics = (0..STEPS).map(|_| t.train_step(&batch).unwrap()).collect();
                let stats = t.zero3_prefetch_stats().expect("a ZeRO-3 rank");
                (metrics, copies(t.export_weights()), stats)
            })
        })
        .collect();
    let runs = handles.into_iter().map(|h| h.join().unwrap()).collect();
    manta_knobs::clear_overrides();
    runs
}

/// One trainer on the whole batch, no recompute.
fn single(init: &Path) -> (StepMetrics, NamedTensors) {
    let mut t = Trainer::new(options(init, 7, None)).unwrap();
    let batch = pick(&(0..7).collect::<Vec<_>>());
    let metrics = (0..STEPS).map(|_| t.train_step(&batch).unwrap()).collect();
    (metrics, copies(t.export_weights()))
}

fn bitwise_equal(a: &NamedTensors, b: &NamedTensors) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|((na, ta), (nb, tb))| na == nb && ta.equal(tb))
}

fn check(setup: Setup) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let init = model(dir.path());
    let (one_metrics, one_weights) = single(&init);
    let on = zero3_ranks(&init, setup.recompute, true);
    let off = zero3_ranks(&init, setup.recompute, false);
    for (rank, ((m_on, w_on, s_on), (m_off, w_off, s_off))) in on.iter().zip(&off).enumerate() {
        let what = format!("{setup:?} rank {rank}");
        // The same steps, bit for bit.
        assert_eq!(m_on, m_off, "{what}: metrics with and without the prefetch");
        assert!(bitwise_equal(w_on, w_off), "{what}: weights differ");
        assert!(bitwise_equal(w_on, &on[0].1), "{what}: ranks differ");
        // The prefetch ran (and without it, none).
        assert_eq!(*s_off, PrefetchStats::default(), "{what}: off");
        assert!(s_on.used > 0, "{what}: no gather was prefetched: {s_on:?}");
        assert_eq!(s_on.issued, s_on.used + s_on.wasted, "{what}: {s_on:?}");
        assert_eq!(s_on.on_side_stream, 0, "{what}: no streams on the CPU");
        if setup.exact_guesses {
            assert_eq!(s_on.wasted, 0, "{what}: {s_on:?}");
        } else {
            assert!(s_on.wasted > 0, "{what}: expected wrong guesses: {s_on:?}");
        }
        // And one rank's steps, within the rounding of the summation order.
        for (step, (m, m1)) in m_on.iter().zip(&one_metrics).enumerate() {
            for (key, tol) in [("train/loss", 1e-6), ("train/grad_norm", 1e-5)] {
                let (a, b) = (m[key], m1[key]);
                // π_old's passes group a rank's samples unlike one rank's, so the loss
                // carries ~1e-7 of its terms' 0.05 (as tests/zero3.rs).
                assert!(
                    (a - b).abs() <= tol * b.abs().max(0.05),
                    "{what} step {step} {key}: {a} vs one rank {b}"
                );
            }
        }
        let d = max_diff(w_on, &one_weights);
        assert!(d < 1e-5, "{what}: weights differ from one rank by {d}");
    }
}

#[test]
fn prefetch_with_every_layer_recomputed_changes_nothing() {
    check(Setup {
        recompute: Some(Recompute::EVERY_LAYER),
        exact_guesses: true,
    });
}

#[test]
fn prefetch_with_block_recompute_of_fewer_layers_changes_nothing() {
    // Layers 0 and 1 recomputed one at a time, 2 and 3 kept gathered to their backward.
    check(Setup {
        recompute: block(2),
        exact_guesses: true,
    });
}

#[test]
fn prefetch_without_recompute_changes_nothing() {
    check(Setup {
        recompute: None,
        exact_guesses: true,
    });
}

#[test]
fn wrong_guesses_of_uniform_groups_change_nothing() {
    check(Setup {
        recompute: Some(Recompute {
            method: RecomputeMethod::Uniform,
            num_layers: 2,
        }),
        exact_guesses: false,
    });
}

/// Two NCCL ranks on GPUs 0 and 1 (threads of this process, each joining with the
/// other's unique id as the driver's ranks do), bf16: ZeRO-3 with the prefetch — its
/// gathers and reduce-scatters on a side stream ordered by events — ends every step with
/// the same losses and weights, bit for bit, as with the prefetch off (every collective
/// on libtorch's stream), with every layer recomputed, block recompute (bf16 gradient
/// reduction too) and none. Each rank's thread leaves its current device at GPU 0 after
/// joining, so a stream or event on the wrong device fails here.
#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[test]
fn nccl_zero3_with_prefetch_equals_without_on_two_gpus() {
    if tch::Cuda::device_count() < 2 {
        eprintln!("skipped: needs two CUDA devices (a two-GPU device machine runs this)");
        return;
    }
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let init = model(dir.path());
    let run = |recompute: Option<Recompute>, grad_bf16: bool, on: bool| -> Vec<RankRun> {
        set_prefetch(on);
        let id = NcclCollective::unique_id().expect("unique id");
        let runs = std::thread::scope(|s| {
            let handles: Vec<_> = shares()
                .into_iter()
                .enumerate()
                .map(|(rank, indices)| {
                    let (id, init) = (&id, &init);
                    s.spawn(move || {
                        let comm = NcclCollective::new(rank, 2, id, rank).expect("join");
                        manta_cuda::set_device(0).expect("set device 0");
                        let mut opts = options(init, 7 + rank as u64, recompute);
                        opts.device = tch::Device::Cuda(rank);
                        opts.bf16 = Some(true);
                        opts.algo.grad_reduce_in_bf16 = grad_bf16;
                        let mut t = Trainer::new_zero3(opts, Box::new(comm)).unwrap();
                        let batch = pick(&indices);
                        let metrics = (0..STEPS).map(|_| t.train_step(&batch).unwrap()).collect();
                        let stats = t.zero3_prefetch_stats().expect("a ZeRO-3 rank");
                        let weights = t
                            .export_weights()
                            .into_iter()
                            .map(|(k, v)| (k, v.to_device(tch::Device::Cpu)))
                            .collect();
                        (metrics, weights, stats)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        manta_knobs::clear_overrides();
        runs
    };
    for (recompute, grad_bf16) in [
        (Some(Recompute::EVERY_LAYER), false),
        (block(2), true),
        (None, false),
    ] {
        let off = run(recompute, grad_bf16, false);
        // The premise: the same run twice gives the same bits (the tiny rows keep flash
        // attention's backward to one block, so no atomics reorder its sums).
        let again = run(recompute, grad_bf16, false);
        assert!(
            off.iter()
                .zip(&again)
                .all(|(a, b)| a.0 == b.0 && bitwise_equal(&a.1, &b.1)),
            "{recompute:?}: two runs without the prefetch differ: the kernels are not \
             deterministic here, so this test cannot compare bits"
        );
        let on = run(recompute, grad_bf16, true);
        for (rank, ((m_on, w_on, s_on), (m_off, w_off, s_off))) in on.iter().zip(&off).enumerate() {
            let what = format!("{recompute:?} bf16 reduce {grad_bf16} rank {rank}");
            assert_eq!(m_on, m_off, "{what}: metrics with and without the prefetch");
            assert!(bitwise_equal(w_on, w_off), "{what}: weights differ");
            assert!(bitwise_equal(w_on, &on[0].1), "{what}: ranks differ");
            assert!(
                s_on.used > 0 && s_on.wasted == 0 && s_on.on_side_stream > s_on.issued,
                "{what}: gathers and reduce-scatters on the side stream: {s_on:?}"
            );
            assert_eq!(*s_off, PrefetchStats::default(), "{what}: off");
            let loss = m_on[STEPS - 1]["train/loss"];
            assert!(loss.is_finite(), "{what}: loss {loss}");
        }
    }
}

//! Data parallel on the CPU: N trainer ranks as threads (`ThreadCollective`), each given
//! its share of a global batch, take the same steps as one trainer on the whole batch —
//! same loss, grad norm and updated weights (fp32, up to summation order) — and every
//! rank ends each step with bit-identical weights. The shares are uneven (samples and
//! tokens), so this also checks that the loss is normalised by global counts.
//!
//! NCCL cannot run here (no GPU): the same trainer code runs over `NcclCollective` on the
//! device through bench/run_trainer_dp.sh.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{adam, global_samples, max_diff, one_at_a_time, tiny_model};
use manta_trainer::data_parallel::{Collective, ThreadCollective};
use manta_trainer::loss::{ClipRange, LossOptions};
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{AlgoOptions, NamedTensors, TrainBatch, Trainer, TrainerOptions};
use tch::Kind;

thread_local! {
    /// Recompute setting of the trainers a test builds (threads it spawns copy it).
    static RECOMPUTE: std::cell::Cell<Option<manta_trainer::Recompute>> =
        const { std::cell::Cell::new(None) };
}

fn options(model_dir: &Path, seed: u64, per_token: bool, clip_grad: f64) -> TrainerOptions {
    TrainerOptions {
        model_dir: model_dir.to_path_buf(),
        seed,
        adam: AdamWConfig {
            // Adam's update is about lr × sign(g) wherever |g| ≫ eps, so with a tiny eps
            // the summation-order noise of near-zero gradients (k_proj of a random model)
            // flips whole steps, as changing the micro-batch split of one rank does.
            // This eps keeps such gradients' steps proportional to them.
            eps: 1e-4,
            weight_decay: 0.01,
            ..adam(1e-2)
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        },
        clip_grad,
        max_tokens_per_gpu: 16,
        bf16: Some(false),
        recompute: RECOMPUTE.with(|r| r.get()),
        algo: AlgoOptions {
            loss: LossOptions {
                calculate_per_token_loss: per_token,
                ..Default::default()
            },
            ..Default::default()
        },
        ..common::options()
    }
}

/// Weights copied out (export_weights aliases the live parameters).
fn weights(t: &Trainer) -> NamedTensors {
    t.export_weights()
        .into_iter()
        .map(|(k, v)| (k, v.copy()))
        .collect()
}

type StepMetrics = Vec<BTreeMap<String, f64>>;

/// The initial weights saved once, so every trainer of a comparison starts from them.
fn initial_checkpoint(dir: &Path) -> PathBuf {
    let t = Trainer::new(options(&tiny_model(), 7, false, 1.0)).unwrap();
    let init = dir.join("init");
    t.save_checkpoint(&init, 0).unwrap();
    init
}

/// One rank on the whole batch for `steps` steps.
fn single(model: &Path, per_token: bool, clip: f64, steps: usize) -> (StepMetrics, NamedTensors) {
    let (samples, advantages) = global_samples();
    let batch = TrainBatch {
        global_samples: samples.len(),
        samples,
        advantages,
    };
    let mut t = Trainer::new(options(model, 7, per_token, clip)).unwrap();
    let metrics = (0..steps).map(|_| t.train_step(&batch).unwrap()).collect();
    (metrics, weights(&t))
}

/// `shares.len()` ranks, rank r on the next `shares[r]` samples, `steps` steps; each
/// rank's metrics and final weights. Ranks other than 0 start from another seed's random
/// weights: the trainer must take rank 0's.
fn ranks(
    model: &Path,
    shares: &[usize],
    per_token: bool,
    clip: f64,
    steps: usize,
) -> Vec<(StepMetrics, NamedTensors)> {
    let (samples, advantages) = global_samples();
    assert_eq!(shares.iter().sum::<usize>(), samples.len());
    let world = shares.len();
    let comms = ThreadCollective::group(world).unwrap();
    let mut start = 0;
    let handles: Vec<_> = comms
        .into_iter()
        .zip(shares)
        .map(|(comm, &share)| {
            let batch = TrainBatch {
                samples: samples[start..start + share].to_vec(),
                advantages: advantages[start..start + share].to_vec(),
                global_samples: samples.len(),
            };
            start += share;
            let rank = comm.rank();
            // Rank 0 loads the saved weights; the others start from random ones.
            let opts = if rank == 0 {
                options(model, 7, per_token, clip)
            } else {
                options(&tiny_model(), 100 + rank as u64, per_token, clip)
            };
            std::thread::spawn(move || {
                // Small buckets: several per model, most with padding.
                let mut t = Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap();
                assert_eq!(t.data_parallel_rank(), (rank, world));
                let metrics = (0..steps).map(|_| t.train_step(&batch).unwrap()).collect();
                (metrics, weights(&t))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

fn compare(shares: &[usize], per_token: bool, clip: f64) {
    compare_with(shares, per_token, clip, None);
}

/// [`compare`], every run recomputing `recompute` layers in its backward pass.
fn compare_with(
    shares: &[usize],
    per_token: bool,
    clip: f64,
    recompute: Option<manta_trainer::Recompute>,
) {
    RECOMPUTE.with(|r| r.set(recompute));
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let steps = 2;
    let (one_metrics, one_weights) = single(&init, per_token, clip, steps);
    let start = weights(&Trainer::new(options(&init, 7, per_token, clip)).unwrap());
    assert!(
        max_diff(&start, &one_weights) > 1e-3,
        "the single rank's weights moved"
    );
    let results = ranks(&init, shares, per_token, clip, steps);
    for (rank, (metrics, w)) in results.iter().enumerate() {
        for (step, (m, m1)) in metrics.iter().zip(&one_metrics).enumerate() {
            for key in [
                "train/loss",
                "train/pg_loss",
                "train/grad_norm",
                "train/ppo_kl",
            ] {
                let (a, b) = (m[key], m1[key]);
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                    "rank {rank} step {step} {key}: {a} vs one rank {b}"
                );
            }
            assert_eq!(
                m["train/tokens"], m1["train/tokens"],
                "rank {rank} step {step}"
            );
            assert_eq!(
                m.keys().collect::<Vec<_>>(),
                m1.keys().collect::<Vec<_>>(),
                "rank {rank} step {step}: metric names"
            );
        }
        let d = max_diff(w, &one_weights);
        assert!(d < 2e-6, "rank {rank}: weights differ from one rank by {d}");
        let same = results[0]
            .1
            .iter()
            .zip(w)
            .all(|((_, a), (_, b))| a.equal(b));
        assert!(same, "rank {rank}'s weights are not rank 0's bit for bit");
    }
}

#[test]
fn two_ranks_equal_one_rank_on_the_global_batch() {
    compare(&[4, 3], false, 1.0);
}

#[test]
fn three_uneven_ranks_equal_one_rank_with_clipping() {
    // A small max norm: the global norm clips every step.
    compare(&[2, 4, 1], false, 0.05);
}

#[test]
fn per_token_loss_over_ranks_with_different_token_counts() {
    // Rank 0: 3 + 3 trained tokens, rank 1: 4 + 2 + 7 + 1 + 3.
    compare(&[2, 5], true, 1.0);
}

#[test]
fn a_group_of_one_is_the_single_rank_path() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let (one_metrics, one_weights) = single(&init, false, 1.0, 2);
    let comm = ThreadCollective::group(1).unwrap().pop().unwrap();
    let mut t =
        Trainer::new_data_parallel(options(&init, 7, false, 1.0), Box::new(comm), 3_000).unwrap();
    assert_eq!(
        t.data_parallel_rank(),
        (0, 1),
        "no group: the whole optimizer"
    );
    let (samples, advantages) = global_samples();
    let batch = TrainBatch {
        global_samples: samples.len(),
        samples,
        advantages,
    };
    let metrics: StepMetrics = (0..2).map(|_| t.train_step(&batch).unwrap()).collect();
    assert_eq!(metrics, one_metrics);
    let w = weights(&t);
    assert!(w
        .iter()
        .zip(&one_weights)
        .all(|((_, a), (_, b))| a.equal(b)));
}

#[test]
fn bf16_ranks_stay_identical_and_follow_their_masters() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let (samples, advantages) = global_samples();
    let comms = ThreadCollective::group(2).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let r = comm.rank();
            let (lo, hi) = if r == 0 { (0, 3) } else { (3, 7) };
            let batch = TrainBatch {
                samples: samples[lo..hi].to_vec(),
                advantages: advantages[lo..hi].to_vec(),
                global_samples: 7,
            };
            let mut opts = options(&init, 7, false, 1.0);
            opts.bf16 = Some(true);
            std::thread::spawn(move || {
                let mut t = Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap();
                assert!(t.is_bf16());
                let before = t.master_weights();
                t.train_step(&batch).unwrap();
                let masters = t.master_weights();
                let w = weights(&t);
                for ((nw, w), (nm, m)) in w.iter().zip(&masters) {
                    assert_eq!(nw, nm);
                    assert_eq!(w.kind(), Kind::BFloat16);
                    assert!(
                        w.equal(&m.to_kind(Kind::BFloat16)),
                        "{nw}: not its rounded master"
                    );
                }
                assert!(max_diff(&before, &masters) > 1e-3, "the masters moved");
                w
            })
        })
        .collect();
    let w: Vec<NamedTensors> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(w[0].iter().zip(&w[1]).all(|((_, a), (_, b))| a.equal(b)));
}

#[test]
fn a_rank_with_a_bad_share_stops_every_rank_with_an_error() {
    let _serial = one_at_a_time();
    let (samples, advantages) = global_samples();
    let comms = ThreadCollective::group(2).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let r = comm.rank();
            let mut batch = TrainBatch {
                samples: samples[r * 3..r * 3 + 3].to_vec(),
                advantages: advantages[r * 3..r * 3 + 3].to_vec(),
                global_samples: 6,
            };
            if r == 1 {
                batch.advantages.pop();
            }
            let opts = options(&tiny_model(), 7, false, 1.0);
            std::thread::spawn(move || {
                let mut t = Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap();
                let e = t.train_step(&batch).unwrap_err().to_string();
                // The group is still usable: the next (good) step runs on both ranks.
                batch.advantages = vec![0.5; batch.samples.len()];
                let m = t.train_step(&batch).unwrap();
                (e, m["train/tokens"])
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        out[0].0.contains("another data-parallel rank rejected"),
        "{}",
        out[0].0
    );
    assert!(
        out[1].0.contains("3 samples but 2 advantages"),
        "{}",
        out[1].0
    );
    assert_eq!(
        out[0].1, out[1].1,
        "both ranks report the global token count"
    );
}

#[test]
fn ranks_recomputing_every_layer_equal_one_rank() {
    compare_with(
        &[3, 4],
        false,
        1.0,
        Some(manta_trainer::Recompute::EVERY_LAYER),
    );
}

#[test]
fn ranks_resume_from_a_sharded_checkpoint() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let ckpt = dir.path().join("step1");
    let (samples, advantages) = global_samples();
    let share = |r: usize| TrainBatch {
        samples: samples[r * 3..r * 3 + 3 + r].to_vec(),
        advantages: advantages[r * 3..r * 3 + 3 + r].to_vec(),
        global_samples: 7,
    };
    // Two ranks: step 1, save, step 2.
    let spawn = |resume: bool| {
        let handles: Vec<_> = ThreadCollective::group(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let r = comm.rank();
                let batch = share(r);
                // Resumed ranks start from other random weights: the checkpoint must
                // restore them.
                let opts = if resume {
                    options(&tiny_model(), 50 + r as u64, false, 1.0)
                } else {
                    options(&init, 7, false, 1.0)
                };
                let ckpt = ckpt.clone();
                std::thread::spawn(move || {
                    let mut t = Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap();
                    if resume {
                        assert_eq!(t.load_checkpoint(&ckpt).unwrap(), 1);
                        assert_eq!(t.optimizer_steps(), 1);
                    } else {
                        t.train_step(&batch).unwrap();
                        t.save_checkpoint(&ckpt, 1).unwrap();
                    }
                    let m = t.train_step(&batch).unwrap();
                    (m["train/loss"], weights(&t))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    let kept = spawn(false);
    let mut files: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert!(
        files.contains(&"optimizer.rank0-of-2.safetensors".to_string())
            && files.contains(&"optimizer.rank1-of-2.safetensors".to_string())
            && files.contains(&"model.safetensors".to_string())
            && files.contains(&"trainer_state.json".to_string()),
        "{files:?}"
    );
    assert!(
        !ckpt.with_extension("tmp").exists(),
        "the temporary directory was renamed"
    );
    let resumed = spawn(true);
    for ((loss_a, wa), (loss_b, wb)) in kept.iter().zip(&resumed) {
        assert_eq!(loss_a, loss_b, "step 2 loss after resuming");
        assert!(
            wa.iter().zip(wb).all(|((_, a), (_, b))| a.equal(b)),
            "step 2 weights after resuming"
        );
    }
}

/// A checkpoint one rank cannot read stops every rank with an error (the others learn it
/// before the optimizer's all-gather; over NCCL they would otherwise wait there forever).
#[test]
fn an_unreadable_shard_on_one_rank_stops_every_rank() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let ckpt = dir.path().join("step1");
    let (samples, advantages) = global_samples();
    let run = |resume: bool| -> Vec<Result<u64, String>> {
        let handles: Vec<_> = ThreadCollective::group(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let r = comm.rank();
                let batch = TrainBatch {
                    samples: samples[r * 3..r * 3 + 3 + r].to_vec(),
                    advantages: advantages[r * 3..r * 3 + 3 + r].to_vec(),
                    global_samples: 7,
                };
                let (init, ckpt) = (init.clone(), ckpt.clone());
                std::thread::spawn(move || {
                    let opts = options(&init, 7, false, 1.0);
                    let mut t = Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap();
                    if resume {
                        return t.load_checkpoint(&ckpt).map_err(|e| e.to_string());
                    }
                    t.train_step(&batch).unwrap();
                    t.save_checkpoint(&ckpt, 1).unwrap();
                    Ok(1)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    assert!(run(false).iter().all(Result::is_ok));
    // Tear rank 1's optimizer shard in half, as a crash or a full disk would.
    let shard = ckpt.join("optimizer.rank1-of-2.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let loaded = run(true);
    let errors: Vec<&String> = loaded.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errors.len(), 2, "both ranks must fail: {loaded:?}");
    assert!(
        errors[1].contains("optimizer.rank1-of-2.safetensors"),
        "rank 1 names its shard: {}",
        errors[1]
    );
    assert!(
        errors[0].contains("another data-parallel rank"),
        "rank 0 says another rank failed: {}",
        errors[0]
    );
}

/// Ranks of one process are built at once from a model directory without weights: rank
/// 0 draws its random init from its seed exactly as a trainer alone does, whatever the
/// other ranks seed meanwhile (libtorch's generators are shared by the process), so the
/// group starts from the same weights in every run and as ranks in separate processes.
#[test]
fn ranks_built_at_once_start_from_rank_0s_seed() {
    let alone = weights(&Trainer::new(options(&tiny_model(), 7, false, 1.0)).unwrap());
    for attempt in 0..4 {
        let comms = ThreadCollective::group(3).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let seed = if comm.rank() == 0 {
                    7
                } else {
                    200 + comm.rank() as u64
                };
                let opts = options(&tiny_model(), seed, false, 1.0);
                std::thread::spawn(move || {
                    weights(&Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap())
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let got = h.join().expect("rank thread");
            assert_eq!(got.len(), alone.len());
            for ((name, t), (got_name, g)) in alone.iter().zip(&got) {
                assert_eq!(name, got_name);
                assert!(
                    t.equal(g),
                    "attempt {attempt}: rank {rank}'s {name} is not rank 0's seeded init"
                );
            }
        }
    }
}

//! ZeRO-3 on the CPU: trainer ranks as threads whose parameters are sharded too (each
//! decoder layer gathered before its forward and backward, its gradients reduce-scattered
//! right after) take the same steps as one trainer on the whole batch, hold only their
//! slices at rest, and resume exactly from their sharded checkpoint.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{adam, global_samples, max_diff, one_at_a_time, tiny_model};
use manta_trainer::data_parallel::{Collective, ThreadCollective};
use manta_trainer::loss::{ClipRange, LossOptions};
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{
    AlgoOptions, NamedTensors, Recompute, RecomputeMethod, TrainBatch, Trainer, TrainerOptions,
};

#[derive(Clone, Copy)]
struct Setup {
    recompute: Option<Recompute>,
    per_token: bool,
    clip_grad: f64,
    steps_per_rollout: usize,
    /// The losses' tolerance is relative to at least this (see [`compare`]).
    loss_floor: f64,
}

const DEFAULT: Setup = Setup {
    recompute: Some(Recompute::EVERY_LAYER),
    per_token: false,
    clip_grad: 1.0,
    steps_per_rollout: 1,
    loss_floor: 1e-2,
};

fn options(model_dir: &Path, seed: u64, s: Setup) -> TrainerOptions {
    TrainerOptions {
        model_dir: model_dir.to_path_buf(),
        seed,
        // As tests/data_parallel.rs: an eps that keeps near-zero gradients' steps
        // proportional to them, so summation order cannot flip whole steps.
        adam: AdamWConfig {
            eps: 1e-4,
            weight_decay: 0.01,
            ..adam(1e-2)
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        },
        clip_grad: s.clip_grad,
        max_tokens_per_gpu: 16,
        bf16: Some(false),
        recompute: s.recompute,
        algo: AlgoOptions {
            loss: LossOptions {
                calculate_per_token_loss: s.per_token,
                ..Default::default()
            },
            num_steps_per_rollout: s.steps_per_rollout,
            ..Default::default()
        },
        ..common::options()
    }
}

fn share(lo: usize, hi: usize) -> TrainBatch {
    pick(&(lo..hi).collect::<Vec<_>>())
}

/// The samples `indices` of the global batch.
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

fn initial_checkpoint(dir: &Path) -> PathBuf {
    let t = Trainer::new(options(&tiny_model(), 7, DEFAULT)).unwrap();
    let init = dir.join("init");
    t.save_checkpoint(&init, 0).unwrap();
    init
}

/// One rank (no recompute) on the whole batch.
fn single(model: &Path, s: Setup, steps: usize) -> (StepMetrics, NamedTensors) {
    let s = Setup {
        recompute: None,
        ..s
    };
    let mut t = Trainer::new(options(model, 7, s)).unwrap();
    let batch = share(0, 7);
    let metrics = (0..steps).map(|_| t.train_step(&batch).unwrap()).collect();
    (metrics, copies(t.export_weights()))
}

/// ZeRO-3 ranks, rank r on the samples `shares[r]`, `steps` steps. Ranks other than
/// 0 start from other random weights: the trainer must take rank 0's. Every rank checks
/// that its parameters hold no values at rest, after building and after every step.
fn zero3_ranks(
    model: &Path,
    shares: &[Vec<usize>],
    s: Setup,
    steps: usize,
) -> Vec<(StepMetrics, NamedTensors)> {
    let comms = ThreadCollective::group(shares.len()).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .zip(shares)
        .map(|(comm, indices)| {
            let batch = pick(indices);
            let rank = comm.rank();
            let opts = if rank == 0 {
                options(model, 7, s)
            } else {
                options(&tiny_model(), 100 + rank as u64, s)
            };
            std::thread::spawn(move || {
                let mut t = Trainer::new_zero3(opts, Box::new(comm)).unwrap();
                assert_eq!(t.zero3_parameter_bytes(), Some(0), "rank {rank} at rest");
                let mut metrics = Vec::new();
                for _ in 0..steps {
                    metrics.push(t.train_step(&batch).unwrap());
                    assert_eq!(t.zero3_parameter_bytes(), Some(0), "rank {rank} at rest");
                }
                (metrics, copies(t.export_weights()))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Each rank's micro-batches (16 tokens) and optimizer chunks are pieces of one rank's,
/// so the forward passes round alike and losses agree to 1e-6 relative (to at least
/// `loss_floor`: the GRPO loss is a sum of terms of either sign about 0.05 large, so its
/// own value can sit far below their rounding, which the summation order moves).
fn compare(shares: &[Vec<usize>], s: Setup) {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let steps = 3;
    let (one_metrics, one_weights) = single(&init, s, steps);
    let start = copies(
        Trainer::new(options(&init, 7, DEFAULT))
            .unwrap()
            .export_weights(),
    );
    assert!(max_diff(&start, &one_weights) > 1e-3, "the weights moved");
    let results = zero3_ranks(&init, shares, s, steps);
    for (rank, (metrics, w)) in results.iter().enumerate() {
        for (step, (m, m1)) in metrics.iter().zip(&one_metrics).enumerate() {
            for (key, tol) in [
                ("train/loss", 1e-6),
                ("train/pg_loss", 1e-6),
                ("train/grad_norm", 1e-5),
                ("train/ppo_kl", 1e-5),
            ] {
                let (a, b) = (m[key], m1[key]);
                assert!(
                    (a - b).abs() <= tol * b.abs().max(s.loss_floor),
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
        assert!(d < 1e-5, "rank {rank}: weights differ from one rank by {d}");
        let same = results[0]
            .1
            .iter()
            .zip(w)
            .all(|((_, a), (_, b))| a.equal(b));
        assert!(same, "rank {rank}'s gathered weights are not rank 0's");
    }
}

#[test]
fn zero3_over_two_ranks_equals_one_rank_over_three_steps() {
    compare(&[vec![0, 1, 2, 3], vec![4, 5, 6]], DEFAULT);
}

#[test]
fn zero3_uneven_shares_pad_with_fillers_and_clip_the_global_norm() {
    // Rank 0 has one micro-batch, rank 1 three: rank 0 runs filler passes so the
    // ranks' gathers and reduce-scatters pair up. A small max norm clips every step.
    compare(
        &[vec![0, 1], vec![2, 3, 4, 5, 6]],
        Setup {
            clip_grad: 0.05,
            ..DEFAULT
        },
    );
}

#[test]
fn zero3_with_kept_layers_per_token_loss_and_three_ranks() {
    // block 1 of 2 layers: layer 0 recomputed, layer 1 kept gathered until its backward.
    compare(
        &[vec![0, 1], vec![2, 3, 4, 5], vec![6]],
        Setup {
            recompute: Some(Recompute {
                method: RecomputeMethod::Block,
                num_layers: 1,
            }),
            per_token: true,
            ..DEFAULT
        },
    );
}

#[test]
fn zero3_without_recompute_and_two_updates_per_rollout() {
    // No recompute: every layer gathered for the whole pass. Two optimizer steps per
    // rollout: π_old's log-prob passes are gathered (and padded) too. Rank k's chunk
    // k halves make one rank's chunks (samples 0..3 and 3..7).
    compare(
        &[vec![0, 1, 3, 4], vec![2, 5, 6]],
        Setup {
            recompute: None,
            steps_per_rollout: 2,
            // π_old's passes cover a rank's whole share, grouped unlike one rank's
            // (rank 0: samples 0-1, 3-4; one rank: 0-1, 2-3, ...): its log-probs round
            // differently, so the ratio's terms carry ~1e-7 of their 0.05.
            loss_floor: 0.05,
            ..DEFAULT
        },
    );
}

#[test]
fn zero3_resumes_exactly_from_its_sharded_checkpoint() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let init = initial_checkpoint(dir.path());
    let ckpt = dir.path().join("step1");
    let run = |resume: bool| -> Vec<(f64, NamedTensors, NamedTensors)> {
        let handles: Vec<_> = ThreadCollective::group(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let r = comm.rank();
                let batch = if r == 0 { share(0, 3) } else { share(3, 7) };
                // Resumed ranks start from other random weights.
                let opts = if resume {
                    options(&tiny_model(), 50 + r as u64, DEFAULT)
                } else {
                    options(&init, 7, DEFAULT)
                };
                let ckpt = ckpt.clone();
                std::thread::spawn(move || {
                    let mut t = Trainer::new_zero3(opts, Box::new(comm)).unwrap();
                    if resume {
                        assert_eq!(t.load_checkpoint(&ckpt).unwrap(), 1);
                        assert_eq!(t.optimizer_steps(), 1);
                    } else {
                        t.train_step(&batch).unwrap();
                        t.save_checkpoint(&ckpt, 1).unwrap();
                    }
                    let at_save = copies(t.export_weights());
                    let m = t.train_step(&batch).unwrap();
                    (m["train/loss"], at_save, copies(t.export_weights()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let kept = run(false);
    for file in [
        "optimizer.rank0-of-2.safetensors",
        "optimizer.rank1-of-2.safetensors",
        "model.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(file).exists(), "{file}");
    }
    // The checkpoint's HF weights are the full gathered ones: one trainer loads them.
    let hf = copies(
        Trainer::new(options(&ckpt, 0, DEFAULT))
            .unwrap()
            .export_weights(),
    );
    assert_eq!(max_diff(&hf, &kept[0].1), 0.0, "model.safetensors");
    let resumed = run(true);
    for ((loss_a, _, wa), (loss_b, at_load, wb)) in kept.iter().zip(&resumed) {
        assert_eq!(max_diff(at_load, &kept[0].1), 0.0, "weights restored");
        assert_eq!(loss_a, loss_b, "step 2 loss after resuming");
        assert_eq!(max_diff(wa, wb), 0.0, "step 2 weights after resuming");
    }
}

#[test]
fn zero3_refuses_a_group_of_one_by_name() {
    let comm = ThreadCollective::group(1).unwrap().pop().unwrap();
    let err = Trainer::new_zero3(options(&tiny_model(), 7, DEFAULT), Box::new(comm))
        .err()
        .expect("one rank is refused")
        .to_string();
    assert!(
        err.contains("--zero-stage 3") && err.contains("at least two"),
        "{err}"
    );
}

#[test]
fn zero3_has_no_per_parameter_gradients_to_return() {
    let _serial = one_at_a_time();
    let handles: Vec<_> = ThreadCollective::group(2)
        .unwrap()
        .into_iter()
        .map(|comm| {
            let r = comm.rank();
            std::thread::spawn(move || {
                let mut t =
                    Trainer::new_zero3(options(&tiny_model(), 7, DEFAULT), Box::new(comm)).unwrap();
                let batch = if r == 0 { share(0, 3) } else { share(3, 7) };
                t.gradients(&batch).unwrap_err().to_string()
            })
        })
        .collect();
    for h in handles {
        let err = h.join().unwrap();
        assert!(err.contains("--zero-stage 3"), "{err}");
    }
}

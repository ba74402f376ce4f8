//! ZeRO-3 with bf16 weights (on the CPU) keeps no bf16 parameter shard: each gather
//! rounds its group's slice of the fp32 masters. Its weights stay bit for bit those of
//! ZeRO-2, which still keeps the shard (refreshed from the masters after each update),
//! and it resumes exactly. `--grad-reduce-in-bf16` reduce-scatters the gradients in bf16
//! and keeps the reduced-gradient shard in bf16: half the bytes, losses within bf16
//! noise of the fp32 reduction, and refused with fp32 weights or one trainer. On two
//! GPUs, the one-kernel bf16-gradient update keeps the bucket loop's bits.

mod common;

use std::path::Path;

use common::{adam, max_diff, one_at_a_time, sample_at, tiny_model};
use manta_trainer::data_parallel::{Collective, NcclCollective, ShardBytes, ThreadCollective};
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{AlgoOptions, NamedTensors, Recompute, TrainBatch, Trainer, TrainerOptions};
use tch::Kind;

fn options(model_dir: &Path, seed: u64, max_tokens: usize, bf16_grads: bool) -> TrainerOptions {
    TrainerOptions {
        model_dir: model_dir.to_path_buf(),
        seed,
        // As tests/zero3.rs: an eps that keeps near-zero gradients' steps proportional
        // to them, so rounding them (bf16 reduction) cannot flip whole steps.
        adam: AdamWConfig {
            eps: 1e-4,
            ..adam(1e-2)
        },
        bf16: Some(true),
        // Never clipped: the two stages sum the squared norm's slices in other orders.
        clip_grad: 1e9,
        max_tokens_per_gpu: max_tokens,
        recompute: Some(Recompute::EVERY_LAYER),
        algo: AlgoOptions {
            grad_reduce_in_bf16: bf16_grads,
            ..Default::default()
        },
        ..common::options()
    }
}

/// Samples `lo..hi` of eight of different lengths.
fn share(lo: u64, hi: u64) -> TrainBatch {
    let samples: Vec<_> = (lo..hi)
        .map(|i| {
            let len = 4 + (i as usize * 3) % 7;
            let tokens = (0..len)
                .map(|t| (7 + 31 * i as u32 + 13 * t as u32) % 260)
                .collect();
            sample_at(i, tokens, vec![1; len - 2], -5.5)
        })
        .collect();
    TrainBatch {
        advantages: (lo..hi)
            .map(|i| [1.0, -0.5, 0.25, -1.0][i as usize % 4])
            .collect(),
        samples,
        global_samples: 8,
    }
}

fn copies(w: NamedTensors) -> NamedTensors {
    w.into_iter().map(|(k, v)| (k, v.copy())).collect()
}

fn bit_equal(a: &NamedTensors, b: &NamedTensors) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|((na, ta), (nb, tb))| na == nb && ta.kind() == tb.kind() && ta.equal(tb))
}

#[derive(Clone, Copy, PartialEq)]
enum Stage {
    Two,
    Three,
}

/// What one rank ends with.
struct RankRun {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    weights: NamedTensors,
    masters: NamedTensors,
    bytes: ShardBytes,
    grad_kind: Kind,
}

/// Two ranks of `stage`, rank r on samples `4r..4r + 4`, `steps` steps. Rank 1 starts
/// from other random weights: the group takes rank 0's.
fn two_ranks(stage: Stage, max_tokens: usize, bf16_grads: bool, steps: usize) -> Vec<RankRun> {
    let handles: Vec<_> = ThreadCollective::group(2)
        .unwrap()
        .into_iter()
        .map(|comm| {
            let r = comm.rank() as u64;
            let opts = options(&tiny_model(), 7 + 50 * r, max_tokens, bf16_grads);
            std::thread::spawn(move || {
                let mut t = match stage {
                    Stage::Two => Trainer::new_data_parallel(opts, Box::new(comm), 1000),
                    Stage::Three => Trainer::new_zero3(opts, Box::new(comm)),
                }
                .unwrap();
                let batch = share(4 * r, 4 * r + 4);
                let mut run = RankRun {
                    losses: Vec::new(),
                    grad_norms: Vec::new(),
                    weights: Vec::new(),
                    masters: Vec::new(),
                    bytes: t.shard_bytes().expect("sharded").0,
                    grad_kind: Kind::Float,
                };
                for _ in 0..steps {
                    let m = t.train_step(&batch).unwrap();
                    run.losses.push(m["train/loss"]);
                    run.grad_norms.push(m["train/grad_norm"]);
                }
                (run.bytes, run.grad_kind) = t.shard_bytes().expect("sharded");
                run.weights = copies(t.export_weights());
                // In layout order, which differs between the stages.
                run.masters = copies(t.master_weights());
                run.masters.sort_by(|a, b| a.0.cmp(&b.0));
                run
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The bf16 weights are the fp32 masters rounded (the rounding the dropped shard held).
fn assert_weights_are_rounded_masters(run: &RankRun) {
    let rounded: NamedTensors = run
        .masters
        .iter()
        .map(|(k, m)| (k.clone(), m.to_kind(Kind::BFloat16)))
        .collect();
    assert!(
        bit_equal(&run.weights, &rounded),
        "weights are not the rounded masters"
    );
}

/// One micro-batch a rank (ZeRO-3's fp32 slice then takes exactly one reduction, as
/// ZeRO-2's bf16 parameter gradients): after three steps ZeRO-3's weights gathered from
/// rounded masters equal ZeRO-2's gathered from its bf16 shard, bit for bit, and so do
/// the masters.
#[test]
fn zero3_without_a_bf16_shard_equals_zero2_bit_for_bit() {
    let _serial = one_at_a_time();
    let two = two_ranks(Stage::Two, 1000, false, 3);
    let three = two_ranks(Stage::Three, 1000, false, 3);
    let start = copies(
        Trainer::new(options(&tiny_model(), 7, 1000, false))
            .unwrap()
            .export_weights(),
    );
    assert!(
        max_diff(&start, &two[0].weights) > 1e-3,
        "the weights moved"
    );
    for (r, (a, b)) in two.iter().zip(&three).enumerate() {
        assert_eq!(a.weights[0].1.kind(), Kind::BFloat16);
        assert!(
            bit_equal(&a.weights, &b.weights),
            "rank {r}: bf16 weights differ"
        );
        assert!(
            bit_equal(&a.masters, &b.masters),
            "rank {r}: fp32 masters differ"
        );
        assert_eq!(a.losses, b.losses, "rank {r}");
        assert_weights_are_rounded_masters(b);
        // ZeRO-2 keeps its bf16 shard (2 bytes an element of the master's 4); ZeRO-3 none.
        assert_eq!(a.bytes.parameters * 2, a.bytes.master);
        assert_eq!(
            b.bytes.parameters, 0,
            "rank {r}: ZeRO-3 holds a parameter shard"
        );
        assert_eq!(b.bytes.gradients, b.bytes.master, "fp32 gradient shard");
    }
}

/// Saved after one step, loaded into ranks that start from other weights, the second
/// step of a bf16 ZeRO-3 run equals the uninterrupted run's bit for bit.
#[test]
fn zero3_bf16_resumes_exactly() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("step1");
    let run = |resume: bool| -> Vec<(f64, NamedTensors, NamedTensors)> {
        let handles: Vec<_> = ThreadCollective::group(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let r = comm.rank() as u64;
                let seed = if resume { 90 + r } else { 7 };
                let opts = options(&tiny_model(), seed, 16, false);
                let ckpt = ckpt.clone();
                std::thread::spawn(move || {
                    let mut t = Trainer::new_zero3(opts, Box::new(comm)).unwrap();
                    let batch = share(4 * r, 4 * r + 4);
                    if resume {
                        assert_eq!(t.load_checkpoint(&ckpt).unwrap(), 1);
                    } else {
                        t.train_step(&batch).unwrap();
                        t.save_checkpoint(&ckpt, 1).unwrap();
                    }
                    let at_save = copies(t.export_weights());
                    let loss = t.train_step(&batch).unwrap()["train/loss"];
                    (loss, at_save, copies(t.export_weights()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let kept = run(false);
    let resumed = run(true);
    for ((loss_a, at_save, wa), (loss_b, at_load, wb)) in kept.iter().zip(&resumed) {
        assert!(bit_equal(at_save, at_load), "weights restored");
        assert_eq!(loss_a, loss_b, "step 2 loss after resuming");
        assert!(bit_equal(wa, wb), "step 2 weights after resuming");
    }
    // The checkpoint's model.safetensors holds the rounded masters: one trainer loads
    // them bit for bit.
    let hf = copies(
        Trainer::new(options(&ckpt, 0, 16, false))
            .unwrap()
            .export_weights(),
    );
    assert!(bit_equal(&hf, &kept[0].1), "model.safetensors");
}

/// bf16's relative rounding step (2^-8).
const BF16_EPS: f64 = 1.0 / 256.0;

/// Three steps with and without the flag, several micro-batches a rank (so ZeRO-3
/// accumulates its bf16 shard over them): the first loss is the same (same weights), the
/// reduced gradients are not (their norm differs, and so do the weights after), the
/// losses stay within bf16 noise (one rounding step of the loss's terms: advantages up
/// to 1 times ratios near 1, so a quarter or more, while the loss itself, their signed
/// mean, can be far smaller), and the gradient shard is bf16 at half the bytes.
fn compare_grad_reduce(stage: Stage) {
    let _serial = one_at_a_time();
    let fp32 = two_ranks(stage, 16, false, 3);
    let bf16 = two_ranks(stage, 16, true, 3);
    for (r, (a, b)) in fp32.iter().zip(&bf16).enumerate() {
        assert_eq!(
            a.losses[0], b.losses[0],
            "rank {r}: step 1 starts from the same weights"
        );
        for (step, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
            assert!(
                (x - y).abs() <= BF16_EPS * x.abs().max(0.25),
                "rank {r} step {step}: loss {y} with bf16 gradients, {x} without"
            );
        }
        let (na, nb) = (a.grad_norms[0], b.grad_norms[0]);
        assert_ne!(
            na, nb,
            "rank {r}: bf16 reduction left the gradient's norm unchanged"
        );
        assert!((na - nb).abs() <= 1e-2 * na, "rank {r}: norm {nb} vs {na}");
        let d = max_diff(&a.weights, &b.weights);
        assert!(d > 0.0, "rank {r}: the flag changed no weight");
        assert!(d < 0.05, "rank {r}: weights differ by {d}");
        assert_weights_are_rounded_masters(b);
        assert_eq!((a.grad_kind, b.grad_kind), (Kind::Float, Kind::BFloat16));
        assert_eq!(a.bytes.gradients, a.bytes.master);
        assert_eq!(
            2 * b.bytes.gradients,
            a.bytes.gradients,
            "rank {r}: half the bytes"
        );
        assert_eq!(
            (a.bytes.master, a.bytes.moments, a.bytes.parameters),
            (b.bytes.master, b.bytes.moments, b.bytes.parameters)
        );
    }
    for runs in [&fp32, &bf16] {
        assert!(bit_equal(&runs[0].weights, &runs[1].weights), "ranks agree");
    }
}

#[test]
fn zero3_grad_reduce_in_bf16_keeps_a_bf16_gradient_shard() {
    compare_grad_reduce(Stage::Three);
}

#[test]
fn zero2_grad_reduce_in_bf16_keeps_a_bf16_gradient_shard() {
    compare_grad_reduce(Stage::Two);
}

/// The flag reduces bf16 gradients over ranks: fp32 weights and one trainer are refused
/// by name, before anything is built.
#[test]
fn grad_reduce_in_bf16_is_refused_with_fp32_weights_or_one_trainer() {
    let fp32 = |comm| {
        let opts = TrainerOptions {
            bf16: Some(false),
            ..options(&tiny_model(), 7, 16, true)
        };
        Trainer::new_zero3(opts, Box::new(comm))
            .err()
            .map(|e| e.to_string())
    };
    let errors: Vec<_> = ThreadCollective::group(2)
        .unwrap()
        .into_iter()
        .map(|comm| std::thread::spawn(move || fp32(comm)))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap().expect("fp32 weights are refused"))
        .collect();
    for err in errors {
        assert!(
            err.contains("--grad-reduce-in-bf16") && err.contains("fp32"),
            "{err}"
        );
    }
    let one = Trainer::new(options(&tiny_model(), 7, 16, true))
        .err()
        .expect("one trainer is refused")
        .to_string();
    assert!(
        one.contains("--grad-reduce-in-bf16") && one.contains("has 1"),
        "{one}"
    );
    let comm = ThreadCollective::group(1).unwrap().pop().unwrap();
    let group_of_one =
        Trainer::new_data_parallel(options(&tiny_model(), 7, 16, true), Box::new(comm), 1000)
            .err()
            .expect("a group of one is refused")
            .to_string();
    assert!(
        group_of_one.contains("--grad-reduce-in-bf16"),
        "{group_of_one}"
    );
}

/// The two-GPU test's clip: far below the tiny model's gradient norms.
const CLIP_GRAD: f64 = 1e-3;

/// Two NCCL ranks on GPUs 0 and 1 of `stage`, bf16 weights and gradient reduction, the
/// gradient clipped every step (`clip_grad` far below the norm, so the update applies a
/// pending clip scale), `steps` steps with the process's knobs as the caller set them.
fn nccl_two_ranks(stage: Stage, steps: usize) -> Vec<RankRun> {
    let id = NcclCollective::unique_id().expect("unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2usize)
            .map(|rank| {
                let id = &id;
                s.spawn(move || {
                    let comm = NcclCollective::new(rank, 2, id, rank).expect("join");
                    manta_cuda::set_device(0).expect("set device 0");
                    let mut opts = options(&tiny_model(), 7 + 50 * rank as u64, 16, true);
                    opts.device = tch::Device::Cuda(rank);
                    opts.clip_grad = CLIP_GRAD;
                    opts.adam.weight_decay = 0.1;
                    let mut t = match stage {
                        Stage::Two => Trainer::new_data_parallel(opts, Box::new(comm), 1000),
                        Stage::Three => Trainer::new_zero3(opts, Box::new(comm)),
                    }
                    .unwrap();
                    let batch = share(4 * rank as u64, 4 * rank as u64 + 4);
                    let mut losses = Vec::new();
                    let mut grad_norms = Vec::new();
                    for _ in 0..steps {
                        let m = t.train_step(&batch).unwrap();
                        losses.push(m["train/loss"]);
                        grad_norms.push(m["train/grad_norm"]);
                    }
                    let (bytes, grad_kind) = t.shard_bytes().expect("sharded");
                    let cpu = |w: NamedTensors| -> NamedTensors {
                        w.into_iter()
                            .map(|(k, v)| (k, v.to_device(tch::Device::Cpu)))
                            .collect()
                    };
                    let weights = cpu(t.export_weights());
                    let mut masters = cpu(t.master_weights());
                    masters.sort_by(|a, b| a.0.cmp(&b.0));
                    RankRun {
                        losses,
                        grad_norms,
                        weights,
                        masters,
                        bytes,
                        grad_kind,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// On two GPUs, bf16 gradient shards: the one-kernel update (`MANTA_FUSED_ADAMW_BF16_GRAD`,
/// the whole shard at once, reading bf16 and scaling as it reads) ends three clipped steps
/// with the same losses, norms, bf16 weights and fp32 masters, bit for bit, as the bucket
/// loop (widen, `mul_`, ATen's fused AdamW), under ZeRO-2 (whose bf16 shard the kernel
/// refreshes) and ZeRO-3. The norm kernel (`MANTA_GRAD_NORM_KERNEL`) gives step 1's
/// norm (same weights, same gradients) within fp64 rounding of the fp64 slices' sum.
#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[test]
fn nccl_bf16_gradient_kernels_keep_the_bucket_paths_bits_on_two_gpus() {
    if tch::Cuda::device_count() < 2 {
        eprintln!("skipped: needs two CUDA devices (a two-GPU device machine runs this)");
        return;
    }
    let _serial = one_at_a_time();
    let with = |update_kernel: bool, norm_kernel: bool, stage: Stage| {
        let flag = |on: bool| if on { "1" } else { "0" };
        manta_knobs::set_override("MANTA_FUSED_ADAMW_BF16_GRAD", flag(update_kernel))
            .expect("a known knob");
        manta_knobs::set_override("MANTA_GRAD_NORM_KERNEL", flag(norm_kernel))
            .expect("a known knob");
        let runs = nccl_two_ranks(stage, 3);
        manta_knobs::clear_overrides();
        runs
    };
    for stage in [Stage::Two, Stage::Three] {
        let name = if stage == Stage::Two {
            "ZeRO-2"
        } else {
            "ZeRO-3"
        };
        let off = with(false, true, stage);
        // The premise: the same run twice gives the same bits.
        let again = with(false, true, stage);
        assert!(
            off.iter().zip(&again).all(|(a, b)| a.losses == b.losses
                && bit_equal(&a.weights, &b.weights)
                && bit_equal(&a.masters, &b.masters)),
            "{name}: two runs of the bucket loop differ: the kernels are not deterministic \
             here, so this test cannot compare bits"
        );
        let on = with(true, true, stage);
        for (rank, (a, b)) in on.iter().zip(&off).enumerate() {
            let what = format!("{name} rank {rank}");
            assert_eq!(a.grad_kind, Kind::BFloat16, "{what}");
            assert!(
                a.grad_norms.iter().all(|&n| n > CLIP_GRAD),
                "{what}: every step should clip (norms {:?})",
                a.grad_norms
            );
            assert_eq!(a.losses, b.losses, "{what}: losses");
            assert_eq!(a.grad_norms, b.grad_norms, "{what}: gradient norms");
            assert!(bit_equal(&a.weights, &b.weights), "{what}: bf16 weights");
            assert!(bit_equal(&a.masters, &b.masters), "{what}: fp32 masters");
            assert!(
                bit_equal(&a.weights, &on[0].weights),
                "{what}: ranks differ"
            );
            assert_weights_are_rounded_masters(a);
        }
        let sliced = with(true, false, stage);
        for (rank, (a, b)) in on.iter().zip(&sliced).enumerate() {
            let (x, y) = (a.grad_norms[0], b.grad_norms[0]);
            assert!(
                (x - y).abs() <= 1e-12 * y,
                "{name} rank {rank}: step 1 norm {x} with the kernel, {y} from fp64 slices"
            );
        }
    }
}

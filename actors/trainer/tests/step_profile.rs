//! `MANTA_TRAINER_PROFILE`: with the knob on, a training step returns this rank's seconds
//! per phase (`perf/trainer/<phase>_s`) and the whole step's (`perf/trainer/total_s`) in
//! every mode — one rank, ZeRO-2, ZeRO-3, context parallel — each phase that the mode
//! runs above zero, those it does not run at zero, and the phases adding up to the total
//! (they are disjoint and cover the step); with it off, none of them.

mod common;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use manta_core::Sample;
use manta_trainer::data_parallel::ThreadCollective;
use manta_trainer::loss::LossOptions;
use manta_trainer::{AlgoOptions, Recompute, TrainBatch, Trainer, TrainerOptions};

/// Every phase the profile reports, by its metric's name.
const PHASES: [&str; 13] = [
    "other",
    "prepare",
    "old_logprobs",
    "ref_logprobs",
    "forward",
    "backward",
    "param_gather",
    "grad_reduce",
    "filler",
    "cp_all_gather",
    "cp_reduce_scatter",
    "cp_all_reduce",
    "optimizer",
];

/// The knob is one per process: the tests here set it one at a time.
struct Knob(#[allow(dead_code)] MutexGuard<'static, ()>);

fn knob(on: bool) -> Knob {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    manta_knobs::set_override("MANTA_TRAINER_PROFILE", if on { "1" } else { "0" }).unwrap();
    Knob(guard)
}

impl Drop for Knob {
    fn drop(&mut self) {
        manta_knobs::clear_overrides();
    }
}

/// Two updates per rollout (a π_old pass) and a KL reference (a reference pass), one
/// sample per micro-batch, fp32.
fn options() -> TrainerOptions {
    TrainerOptions {
        max_tokens_per_gpu: 10,
        bf16: Some(false),
        algo: AlgoOptions {
            num_steps_per_rollout: 2,
            loss: LossOptions {
                use_kl_loss: true,
                kl_loss_coef: 0.1,
                ..Default::default()
            },
            ..Default::default()
        },
        ..common::options()
    }
}

/// The first six of the shared global batch.
fn samples() -> Vec<Sample> {
    common::global_samples().0[..6].to_vec()
}

/// Samples `range` of [`samples`], out of all six.
fn share(range: std::ops::Range<usize>) -> TrainBatch {
    let advantages = [1.0, 0.5, -0.25, -1.0, 0.75, 0.2];
    TrainBatch {
        samples: samples()[range.clone()].to_vec(),
        advantages: advantages[range].to_vec(),
        global_samples: 6,
    }
}

/// The profile's metrics of a step.
fn profile(m: &BTreeMap<String, f64>) -> BTreeMap<&str, f64> {
    m.iter()
        .filter_map(|(k, &v)| Some((k.strip_prefix("perf/trainer/")?, v)))
        .collect()
}

/// Every phase and the total are reported, finite and >= 0, the phases sum to the total,
/// `ran` are above zero and `not_run` exactly zero.
fn check(who: &str, m: &BTreeMap<String, f64>, ran: &[&str], not_run: &[&str]) {
    let p = profile(m);
    assert!(
        m.contains_key("train/loss"),
        "{who}: the step's own metrics stay"
    );
    assert_eq!(p.len(), PHASES.len() + 1, "{who}: {p:?}");
    let total = p["total_s"];
    let mut sum = 0.0;
    for phase in PHASES {
        let key = format!("{phase}_s");
        let s = *p
            .get(key.as_str())
            .unwrap_or_else(|| panic!("{who}: no {key} in {p:?}"));
        assert!(s.is_finite() && s >= 0.0, "{who}: {key} = {s}");
        sum += s;
    }
    assert!(total > 0.0, "{who}: total {total}");
    assert!(
        (sum - total).abs() <= 1e-6 * total + 1e-9,
        "{who}: the phases sum to {sum}, the step took {total}: {p:?}"
    );
    for phase in ran {
        assert!(
            p[format!("{phase}_s").as_str()] > 0.0,
            "{who}: {phase} did not run: {p:?}"
        );
    }
    for phase in not_run {
        assert_eq!(
            p[format!("{phase}_s").as_str()],
            0.0,
            "{who}: {phase}: {p:?}"
        );
    }
}

/// Runs `steps` training steps on every rank of a thread group, each rank built by
/// `build` and given `batch(rank)`; every rank's metrics of its last step.
fn ranks(
    size: usize,
    build: fn(TrainerOptions, ThreadCollective) -> Trainer,
    batch: fn(usize) -> TrainBatch,
    opts: TrainerOptions,
) -> Vec<BTreeMap<String, f64>> {
    let handles: Vec<_> = ThreadCollective::group(size)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let opts = opts.clone();
            std::thread::spawn(move || {
                let mut t = build(opts, comm);
                let b = batch(rank);
                t.train_step(&b).unwrap();
                t.train_step(&b).unwrap()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

#[test]
fn with_the_knob_off_a_step_reports_no_phase() {
    let _knob = knob(false);
    let mut t = Trainer::new(options()).unwrap();
    let m = t.train_step(&share(0..6)).unwrap();
    assert!(m.contains_key("train/loss"));
    assert!(profile(&m).is_empty(), "{m:?}");
}

#[test]
fn one_rank_reports_its_passes_and_its_optimizer() {
    let _knob = knob(true);
    let mut t = Trainer::new(options()).unwrap();
    for step in 0..2 {
        let m = t.train_step(&share(0..6)).unwrap();
        check(
            &format!("step {step}"),
            &m,
            &[
                "prepare",
                "old_logprobs",
                "ref_logprobs",
                "forward",
                "backward",
                "optimizer",
            ],
            &[
                "param_gather",
                "grad_reduce",
                "filler",
                "cp_all_gather",
                "cp_reduce_scatter",
                "cp_all_reduce",
            ],
        );
    }
    // One update per rollout and no reference: neither pass runs.
    let mut plain = Trainer::new(TrainerOptions {
        algo: AlgoOptions::default(),
        ..options()
    })
    .unwrap();
    let m = plain.train_step(&share(0..6)).unwrap();
    check(
        "plain",
        &m,
        &["forward", "backward", "optimizer"],
        &["old_logprobs", "ref_logprobs"],
    );
}

#[test]
fn zero2_ranks_time_the_gradient_reduce_scatter_and_the_parameter_gather() {
    let _knob = knob(true);
    let all = ranks(
        2,
        |opts, comm| Trainer::new_data_parallel(opts, Box::new(comm), 3_000).unwrap(),
        |rank| share(rank * 3..rank * 3 + 3),
        options(),
    );
    for (rank, m) in all.iter().enumerate() {
        check(
            &format!("ZeRO-2 rank {rank}"),
            m,
            &[
                "old_logprobs",
                "ref_logprobs",
                "forward",
                "backward",
                "grad_reduce",
                "param_gather",
                "optimizer",
            ],
            &[
                "filler",
                "cp_all_gather",
                "cp_reduce_scatter",
                "cp_all_reduce",
            ],
        );
    }
}

#[test]
fn zero3_ranks_time_their_layer_gathers_reduces_and_fillers() {
    let _knob = knob(true);
    // Rank 0 has four one-sample micro-batches, rank 1 two: rank 1 runs fillers.
    let all = ranks(
        2,
        |opts, comm| Trainer::new_zero3(opts, Box::new(comm)).unwrap(),
        |rank| if rank == 0 { share(0..4) } else { share(4..6) },
        TrainerOptions {
            recompute: Some(Recompute::EVERY_LAYER),
            ..options()
        },
    );
    let cp = ["cp_all_gather", "cp_reduce_scatter", "cp_all_reduce"];
    let ran = [
        "old_logprobs",
        "ref_logprobs",
        "forward",
        "backward",
        "param_gather",
        "grad_reduce",
        "optimizer",
    ];
    let not_run: Vec<&str> = cp.iter().copied().chain(["filler"]).collect();
    check("ZeRO-3 rank 0", &all[0], &ran, &not_run);
    let ran: Vec<&str> = ran.iter().copied().chain(["filler"]).collect();
    check("ZeRO-3 rank 1", &all[1], &ran, &cp);
}

#[test]
fn context_parallel_ranks_time_their_collectives() {
    let _knob = knob(true);
    let all = ranks(
        2,
        |opts, comm| Trainer::new_context_parallel(opts, Box::new(comm), 3_000).unwrap(),
        |_| share(0..6),
        options(),
    );
    for (rank, m) in all.iter().enumerate() {
        check(
            &format!("CP rank {rank}"),
            m,
            &[
                "prepare",
                "old_logprobs",
                "ref_logprobs",
                "forward",
                "backward",
                "cp_all_gather",
                "cp_reduce_scatter",
                "cp_all_reduce",
                "grad_reduce",
                "param_gather",
                "optimizer",
            ],
            &["filler"],
        );
    }
}

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use super::super::ThreadCollective;
use super::flat::sum_of_squares_by;
use super::*;
use crate::optimizer::AdamWConfig;

/// Slicing changes only the order of an fp64 sum: uneven slices, one slice, the whole.
#[test]
fn sliced_sum_of_squares_equals_the_whole_sum() {
    tch::manual_seed(3);
    let t = Tensor::randn([1003], (Kind::Float, Device::Cpu));
    let whole = t
        .to_kind(Kind::Double)
        .square()
        .sum(Kind::Double)
        .double_value(&[]);
    for slice in [7, 1000, 1003, 5000] {
        let got = sum_of_squares_by(&t, slice);
        assert!(
            (got - whole).abs() <= 1e-12 * whole,
            "slice {slice}: {got} vs {whole}"
        );
    }
    assert_eq!(
        sum_of_squares_by(&Tensor::zeros([0], (Kind::Float, Device::Cpu)), 7),
        0.0
    );
}

fn params() -> BTreeMap<String, Tensor> {
    [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
    ]
    .into_iter()
    .map(|n| {
        (
            n.to_string(),
            Tensor::randn([4, 3], (Kind::Float, Device::Cpu)),
        )
    })
    .collect()
}

fn optimizer(stage3: bool) -> ZeroAdamW {
    let comm = ThreadCollective::group(1)
        .expect("a group of one")
        .pop()
        .expect("rank 0");
    let config = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    if stage3 {
        ZeroAdamW::new_stage3(params(), config, Box::new(comm), 1, false).expect("stage 3")
    } else {
        ZeroAdamW::new(
            params(),
            config,
            Box::new(comm),
            DEFAULT_BUCKET_NUMEL,
            false,
        )
        .expect("stage 2")
    }
}

/// ZeRO-3 allocates its moments and fp32 gradient shard only once the whole weights
/// it was built from are released (the build's peak holds neither beside them);
/// ZeRO-2 has them from the start.
#[test]
fn zero3_allocates_its_moments_after_the_whole_weights_are_released() {
    let mut three = optimizer(true);
    let n = three.layout.shard_numel as i64;
    for t in [&three.exp_avg, &three.exp_avg_sq, &three.grad] {
        assert_eq!(t.numel(), 0);
    }
    three.release_all();
    for t in [&three.exp_avg, &three.exp_avg_sq, &three.grad] {
        assert_eq!(t.numel() as i64, n);
    }
    let two = optimizer(false);
    for t in [&two.exp_avg, &two.exp_avg_sq, &two.grad] {
        assert_eq!(t.numel() as i64, two.layout.shard_numel as i64);
    }
}

/// A resume with the other stage is refused naming the flag, both ways; the same
/// stage loads.
#[test]
fn a_shard_resumes_only_with_the_zero_stage_that_saved_it() {
    for (saved, resumed) in [(false, true), (true, false)] {
        let dir = tempfile::tempdir().expect("tempdir");
        optimizer(saved).save(dir.path()).expect("save");
        let err = optimizer(resumed)
            .load(dir.path(), 1)
            .expect_err("the other stage's shard");
        let (s, r) = if saved { (3, 2) } else { (2, 3) };
        assert!(
            err.contains(&format!("saved by --zero-stage {s}"))
                && err.contains(&format!("uses --zero-stage {r}")),
            "{err}"
        );
        optimizer(saved)
            .load(dir.path(), 1)
            .expect("the same stage resumes");
    }
}

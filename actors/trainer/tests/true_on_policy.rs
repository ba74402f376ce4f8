//! True on-policy mode (`--true-on-policy-mode`) runs attention through a CUDA kernel; on
//! the CPU the trainer must refuse it by name rather than train with other numerics. The
//! GPU behaviour is tested on the device machine (crates/model/tests/cuda.rs,
//! crates/engine/tests/native_engine_cuda.rs).

mod common;

use manta_trainer::{AlgoOptions, Trainer, TrainerOptions};

#[test]
fn true_on_policy_mode_on_the_cpu_is_refused_by_name() {
    let opts = TrainerOptions {
        algo: AlgoOptions {
            true_on_policy: true,
            ..Default::default()
        },
        ..common::options()
    };
    let err = Trainer::new(opts)
        .err()
        .expect("true on-policy mode on the CPU must fail")
        .to_string();
    assert!(
        err.contains("--true-on-policy-mode") && err.contains("CUDA"),
        "{err}"
    );
}

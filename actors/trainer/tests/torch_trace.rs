//! `MANTA_TORCH_PROFILE`: the trainer writes a Kineto trace of exactly the step the knob
//! names, with the step's aten ops in it, and training goes on around it.

mod common;

use manta_trainer::{TrainBatch, Trainer};

#[test]
fn the_named_step_and_only_it_is_traced() {
    let dir = tempfile::tempdir().unwrap();
    manta_knobs::set_override("MANTA_TORCH_PROFILE", dir.path().to_str().unwrap()).unwrap();
    manta_knobs::set_override("MANTA_TORCH_PROFILE_STEP", "2").unwrap();
    let (samples, advantages) = common::global_samples();
    let batch = TrainBatch {
        global_samples: samples.len(),
        samples,
        advantages,
    };
    let mut t = Trainer::new(common::options()).unwrap();
    for _ in 0..3 {
        let m = t.train_step(&batch).unwrap();
        assert!(m.contains_key("train/loss"), "{m:?}");
    }
    manta_knobs::clear_overrides();

    let mut written: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    written.sort();
    assert_eq!(written, ["trainer_step2_rank0.json"]);
    let text = std::fs::read_to_string(dir.path().join(&written[0])).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ops: Vec<&str> = trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["cat"] == "cpu_op")
        .filter_map(|e| e["name"].as_str())
        .collect();
    // The forward's projections and the backward's gradients of them.
    for op in ["aten::mm", "MmBackward0"] {
        assert!(
            ops.iter().any(|o| o.contains(op)),
            "no {op} among {} cpu ops",
            ops.len()
        );
    }
}

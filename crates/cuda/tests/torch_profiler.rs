//! The Kineto profiler on the CPU: a trace of a matmul names its aten op, and a second
//! profile cannot start while one runs.

use std::sync::Mutex;

use manta_cuda::{TorchProfile, TorchProfileError};
use tch::{Device, Kind, Tensor};

/// The profiler is one per process and the tests run on threads of one process.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_cpu_trace_holds_the_matmul() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/trace.json");
    let profile = TorchProfile::start(false).unwrap();
    let a = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
    let b = Tensor::randn([32, 16], (Kind::Float, Device::Cpu));
    let c = a.matmul(&b);
    assert_eq!(c.size(), [64, 16]);
    profile.finish(&path).unwrap();

    let text = std::fs::read_to_string(&path).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let mm = events.iter().find(|e| {
        e["cat"] == "cpu_op" && matches!(e["name"].as_str(), Some("aten::mm" | "aten::matmul"))
    });
    let mm = mm.unwrap_or_else(|| panic!("no aten::mm cpu_op in {} events", events.len()));
    assert_eq!(mm["ph"], "X", "{mm}");
    assert!(mm["dur"].as_f64().is_some(), "{mm}");
}

#[test]
fn one_profile_at_a_time() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let first = TorchProfile::start(false).unwrap();
    assert!(matches!(
        TorchProfile::start(false),
        Err(TorchProfileError::AlreadyRunning)
    ));
    // Dropped unfinished, it stops the profiler: the next one starts.
    drop(first);
    let dir = tempfile::tempdir().unwrap();
    let again = TorchProfile::start(false).unwrap();
    let _ = Tensor::ones([4], (Kind::Float, Device::Cpu)).sum(Kind::Float);
    again.finish(&dir.path().join("t.json")).unwrap();
}

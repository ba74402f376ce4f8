//! bench/py/kernel_summary.py on a synthetic Kineto trace: kernels grouped by name and
//! sorted by total time, long names cut, and the idle fraction from the union of kernel
//! intervals (two streams overlapping count once), not from their summed durations.

use std::path::Path;
use std::process::Command;

/// Device 0: a long-named kernel twice, another overlapping the first on a second stream,
/// a copy; span 40 µs, summed 35 µs, covered 30 µs (idle 25%). Plus a CPU op, a runtime
/// call and an instant event, which are not GPU time.
const TRACE: &str = r#"{"traceEvents": [
 {"ph": "X", "cat": "kernel", "name": "LONG", "pid": 0, "tid": 7, "ts": 1000, "dur": 10, "args": {"device": 0}},
 {"ph": "X", "cat": "kernel", "name": "other_stream", "pid": 0, "tid": 8, "ts": 1005, "dur": 10, "args": {"device": 0}},
 {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": 1020, "dur": 5, "args": {"device": 0}},
 {"ph": "X", "cat": "kernel", "name": "LONG", "pid": 0, "tid": 7, "ts": 1030, "dur": 10, "args": {"device": 0}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 990, "dur": 3},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 991, "dur": 1},
 {"ph": "i", "cat": "kernel", "name": "instant", "pid": 0, "tid": 7, "ts": 1}
]}"#;

fn python() -> String {
    std::env::var("MANTA_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn kernels_are_summed_by_name_and_idle_time_merges_overlaps() {
    let dir = std::env::temp_dir().join(format!("manta-kernel-summary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let long = format!("void gemm<{}>(int)", "float, ".repeat(40));
    std::fs::write(dir.join("trace.json"), TRACE.replace("LONG", &long)).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("py/kernel_summary.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(dir.join("trace.json"))
        .args(["--top", "2", "--json"])
        .arg(dir.join("summary.json"))
        .output()
        .expect("run python3 (set MANTA_PYTHON)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("idle 25.0%"), "{stdout}");

    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let gpu = &s["gpu"];
    let close = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-9;
    assert!(close(&gpu["span_ms"], 0.040), "{gpu}");
    assert!(close(&gpu["summed_ms"], 0.035), "{gpu}");
    assert!(close(&gpu["busy_ms"], 0.030), "{gpu}");
    assert!(close(&gpu["idle_fraction"], 0.25), "{gpu}");

    let kernels = s["kernels"].as_array().unwrap();
    assert_eq!(kernels.len(), 2, "--top 2: {kernels:?}");
    let first = kernels[0]["name"].as_str().unwrap();
    assert!(
        first.starts_with("void gemm<float, ") && first.chars().count() == 90,
        "{first}"
    );
    assert_eq!(kernels[0]["count"], 2);
    assert!(close(&kernels[0]["total_ms"], 0.020));
    assert!(close(&kernels[0]["mean_us"], 10.0));
    assert_eq!(s["kernel_names"], 3);
    assert_eq!(s["cpu_ops"][0]["name"], "aten::mm");
}

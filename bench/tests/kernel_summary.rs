//! bench/py/kernel_summary.py on a synthetic Kineto trace: kernels grouped by name and
//! sorted by total time, long names cut, and the idle fraction from the union of kernel
//! intervals (two streams overlapping count once), not from their summed durations.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

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

/// bench/py/kernel_summary.py run with `args`, whatever its exit status.
fn kernel_summary<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Output {
    Command::new(python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("py/kernel_summary.py"))
        .args(args)
        .output()
        .expect("run python3 (set MANTA_PYTHON)")
}

/// Its stdout, after checking that it succeeded.
fn stdout_of_success(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn kernels_are_summed_by_name_and_idle_time_merges_overlaps() {
    let dir = std::env::temp_dir().join(format!("manta-kernel-summary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let long = format!("void gemm<{}>(int)", "float, ".repeat(40));
    std::fs::write(dir.join("trace.json"), TRACE.replace("LONG", &long)).unwrap();
    let stdout = stdout_of_success(&kernel_summary([
        dir.join("trace.json").as_os_str(),
        OsStr::new("--top"),
        OsStr::new("2"),
        OsStr::new("--json"),
        dir.join("summary.json").as_os_str(),
    ]));
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

/// `--minus BASE --per N`: what a trace adds over a trace of part of its work, per step —
/// by name, time and count, with names that do not grow left out.
#[test]
fn a_trace_less_its_base_is_the_added_work_per_step() {
    let dir = std::env::temp_dir().join(format!("manta-kernel-minus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let event = |name: &str, ts: u32, dur: u32| {
        format!(
            r#"{{"ph": "X", "cat": "kernel", "name": "{name}", "pid": 0, "tid": 7, "ts": {ts}, "dur": {dur}}}"#
        )
    };
    let trace = |events: &[String]| format!(r#"{{"traceEvents": [{}]}}"#, events.join(","));
    // The base: a prefill (gemm 100 µs, norm 10 µs). The full trace: the same prefill, then
    // two decode steps (gemm 30 µs and attention 20 µs each), and a shorter norm.
    let base = trace(&[event("gemm", 0, 100), event("norm", 100, 10)]);
    let full = trace(&[
        event("gemm", 0, 100),
        event("norm", 100, 8),
        event("gemm", 200, 30),
        event("attention", 230, 20),
        event("gemm", 300, 30),
        event("attention", 330, 20),
    ]);
    std::fs::write(dir.join("base.json"), base).unwrap();
    std::fs::write(dir.join("full.json"), full).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            dir.join("full.json").into_os_string(),
            "--minus".into(),
            dir.join("base.json").into_os_string(),
        ];
        args.extend(extra.iter().map(|a| a.into()));
        kernel_summary(args)
    };
    let out = run(&[
        "--per",
        "2",
        "--json",
        dir.join("minus.json").to_str().unwrap(),
    ]);
    let stdout = stdout_of_success(&out);
    assert!(stdout.contains("summed per 2: 0.050 ms"), "{stdout}");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("minus.json")).unwrap()).unwrap();
    let rows = s["kernels"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["gemm", "attention"],
        "norm shrank, so it is left out"
    );
    let close = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-9;
    assert!(close(&rows[0]["total_ms"], 0.030) && close(&rows[0]["count"], 1.0));
    assert!(close(&rows[1]["total_ms"], 0.020) && close(&rows[1]["mean_us"], 20.0));

    let bad = run(&["--per", "0"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--per must be at least 1"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--by-launch`: one kernel name launched with two grids (a GEMV that serves two
/// projections) is two rows, each with its own quartiles.
#[test]
fn kernels_by_launch_shape_keep_one_names_grids_apart() {
    let dir = std::env::temp_dir().join(format!("manta-kernel-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let event = |grid: u32, ts: u32, dur: u32| {
        format!(
            r#"{{"ph": "X", "cat": "kernel", "name": "gemv", "pid": 0, "tid": 7, "ts": {ts}, "dur": {dur}, "args": {{"grid": [{grid}, 1, 1], "block": [128, 1, 1]}}}}"#
        )
    };
    // Grid 512: 30, 34, 40 µs (median 34); grid 4096: 10, 11 µs (median at the upper rank).
    let events = [
        event(512, 0, 34),
        event(512, 100, 30),
        event(512, 200, 40),
        event(4096, 300, 10),
        event(4096, 400, 11),
    ];
    let trace = format!(r#"{{"traceEvents": [{}]}}"#, events.join(","));
    std::fs::write(dir.join("trace.json"), trace).unwrap();
    stdout_of_success(&kernel_summary([
        dir.join("trace.json").as_os_str(),
        OsStr::new("--by-launch"),
        OsStr::new("--json"),
        dir.join("launch.json").as_os_str(),
    ]));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("launch.json")).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let rows = s["launches"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["grid"], "[512, 1, 1]");
    assert_eq!(rows[0]["count"], 3);
    assert_eq!(rows[0]["median_us"], 34.0);
    assert_eq!(rows[0]["p25_us"], 30.0);
    assert_eq!(rows[0]["p75_us"], 40.0);
    assert_eq!(rows[1]["grid"], "[4096, 1, 1]");
    assert_eq!(rows[1]["median_us"], 11.0);
    // The two options answer different questions; together they are an error, not a guess.
    let both = kernel_summary(["missing.json", "--by-launch", "--minus", "x.json"]);
    assert!(!both.status.success());
    assert!(
        String::from_utf8_lossy(&both.stderr).contains("do not combine"),
        "{}",
        String::from_utf8_lossy(&both.stderr)
    );
}

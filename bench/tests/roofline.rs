//! bench/py/roofline.py and its place in bench/py/peers_report.py: the floor of a peer row
//! checked against the weight bytes of the checkpoint tensors the benchmarks build
//! (`manta_bench::qwen3_tensor_shapes`), so the script's shape table cannot drift from
//! them; and the report of a synthetic run directory carries each row's floor and the
//! native side's knobs.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

const PROMPT: f64 = 512.0;
const NEW: f64 = 256.0;
const BANDWIDTH: f64 = 4.0e12;
const PEAK: f64 = 989e12;

fn python() -> String {
    std::env::var("MANTA_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("py").join(name)
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("manta-roofline-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Parameters of the matrices a decode step reads (every layer's, and the LM head: the
/// embedding when tied), from the benchmark's own tensor list; norms are vectors.
fn matmul_params(shape: &str) -> f64 {
    let (tensors, _) = manta_bench::qwen3_tensor_shapes(shape).unwrap();
    let has_head = tensors.iter().any(|(n, _)| n == "lm_head.weight");
    tensors
        .iter()
        .filter(|(n, s)| s.len() == 2 && !(has_head && n == "model.embed_tokens.weight"))
        .map(|(_, s)| s.iter().product::<i64>() as f64)
        .sum()
}

/// 8B at batch 1: the projections are bandwidth-bound (weight bytes / bandwidth) and the
/// attention reads each token's keys and values once per step.
fn decode_step_floor_8b_b1() -> f64 {
    let (layers, kv_heads, head_dim) = (36.0, 8.0, 128.0);
    let kv_bytes = 2.0 * layers * kv_heads * head_dim * 2.0 * (PROMPT + NEW / 2.0);
    matmul_params("8b") * 2.0 / BANDWIDTH + kv_bytes / BANDWIDTH
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(python())
        .args(args)
        .output()
        .expect("run python3 (set MANTA_PYTHON)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn floors_follow_the_checkpoint_shapes_and_fractions_follow_wall_times() {
    let dir = temp_dir("rows");
    let step = decode_step_floor_8b_b1();
    // Prefill of one 512-token prompt at the peak (attention and the last token's head
    // included), then 255 bandwidth-bound steps.
    let params_8b = matmul_params("8b");
    let head = 151936.0 * 4096.0;
    let attention = 4.0 * 36.0 * 32.0 * 128.0 * PROMPT * PROMPT / 2.0;
    let prefill = (2.0 * (params_8b - head) * PROMPT + attention + 2.0 * head) / PEAK;
    let floor = prefill + (NEW - 1.0) * step;
    // Manta at twice the floor, SGLang at three times: 50 % and 33 %; a 1.3x lead needs
    // 1.3 / 3 of the floor's speed, and SGLang's time allows 3x at most.
    let tps = |wall: f64| NEW / wall;
    let doc = json!({
        "prompt": PROMPT, "new_tokens": NEW, "copy_bandwidth_gb_s_8b": BANDWIDTH / 1e9,
        "rows": [
            {"shape": "8b", "batch": 1,
             "native_e2e_tokens_per_s": tps(2.0 * floor), "native_prefill_s": 2.0 * prefill,
             "sglang_e2e_tokens_per_s": tps(3.0 * floor), "sglang_prefill_s": 3.0 * prefill},
            {"shape": "70b", "batch": 1, "native_e2e_tokens_per_s": 10.0},
        ]
    });
    let path = dir.join("peers.json");
    std::fs::write(&path, doc.to_string()).unwrap();
    let (ok, text) = run(&[
        script("roofline.py").to_str().unwrap(),
        path.to_str().unwrap(),
        "--write",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("| 8b | 1 |"), "{text}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let f = &doc["rows"][0]["roofline"];
    let close = |key: &str, want: f64| {
        let got = f[key].as_f64().unwrap_or(f64::NAN);
        assert!(
            (got - want).abs() <= 1e-9 * want.abs().max(1e-12),
            "{key}: {got} vs {want}; {f}"
        );
    };
    close("decode_step_floor_s", step);
    close("prefill_floor_s", prefill);
    close("e2e_floor_s", floor);
    close("native_fraction_of_floor", 0.5);
    close("sglang_fraction_of_floor", 1.0 / 3.0);
    close("native_prefill_fraction_of_floor", 0.5);
    close("native_decode_step_fraction_of_floor", 0.5);
    close("fraction_of_floor_for_target", 1.3 / 3.0);
    close("largest_possible_native_over_sglang", 3.0);
    assert!(
        doc["rows"][1].get("roofline").is_none(),
        "a shape the script does not know gets no floor: {}",
        doc["rows"][1]
    );

    // No bandwidth in the file and none given: a clear error, the file untouched.
    let bare = dir.join("bare.json");
    std::fs::write(
        &bare,
        json!({"rows": [{"shape": "8b", "batch": 1, "native_e2e_tokens_per_s": 100.0}]})
            .to_string(),
    )
    .unwrap();
    let before = std::fs::read_to_string(&bare).unwrap();
    let (ok, text) = run(&[
        script("roofline.py").to_str().unwrap(),
        bare.to_str().unwrap(),
        "--write",
    ]);
    assert!(!ok && text.contains("--bandwidth-gb-s"), "{text}");
    assert_eq!(std::fs::read_to_string(&bare).unwrap(), before);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_peer_report_carries_each_rows_floor() {
    let dir = temp_dir("report");
    let write = |name: &str, text: String| std::fs::write(dir.join(name), text).unwrap();
    write("gpu.txt", "NVIDIA H200, 143771 MiB\n".into());
    write(
        "peers_meta.json",
        json!({"shapes": ["0.6b"], "batches": [64], "prompt": 512, "new_tokens": 256,
               "manta_knobs": {"MANTA_GEMV_NORM_KSPLIT": "2"}})
        .to_string(),
    );
    write("peers_runs.tsv", "native\t0.6b\t0\t30\t300\n".into());
    write(
        "native_0_6b.json",
        json!({"shape": "0.6b", "prompt": 512, "new_tokens": 256,
               "copy_bandwidth_bytes_per_s": BANDWIDTH,
               "results": [{"batch": 64, "tokens": 64 * 256, "wall_s": 0.7,
                            "tokens_per_s": 64.0 * 256.0 / 0.7, "prefill_s": 0.1,
                            "decode_tokens_per_s": 64.0 * 255.0 / 0.6}]})
        .to_string(),
    );
    let (ok, text) = run(&[
        script("peers_report.py").to_str().unwrap(),
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("Wall time against the floor"), "{text}");
    assert!(
        text.contains("native knobs: MANTA_GEMV_NORM_KSPLIT=2"),
        "the knobs of the run are in the table's title: {text}"
    );
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("peers.json")).unwrap()).unwrap();
    let f = &doc["rows"][0]["roofline"];
    let native = f["native_fraction_of_floor"].as_f64().unwrap_or(f64::NAN);
    let floor = f["e2e_floor_s"].as_f64().unwrap_or(f64::NAN);
    assert!(
        (native - floor / 0.7).abs() < 1e-9,
        "the native side's wall time is 0.7 s: {f}"
    );
    assert!(
        f.get("sglang_fraction_of_floor").is_none(),
        "no SGLang run, no SGLang fraction: {f}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

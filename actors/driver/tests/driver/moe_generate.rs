//! `driver generate` on random Qwen3-MoE checkpoints written by transformers (renormalised
//! top-k, a dense layer among sparse ones, `decoder_sparse_step` 2): the real binary's
//! greedy ids equal transformers' `generate` and its log-probs agree within 1e-3.

use crate::common;

use common::workspace;
use std::process::Command;

const CASES: [&str; 3] = ["renorm", "dense_layer", "step2"];

fn read(path: &std::path::Path, name: &str) -> tch::Tensor {
    tch::Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{} has no `{name}`", path.display()))
        .1
}

#[test]
fn greedy_moe_generate_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let script = workspace().join("crates/model/tests/py/hf_moe.py");
    let out = Command::new(common::python())
        .arg(&script)
        .arg("make")
        .arg(tmp.path())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "hf_moe.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for case in CASES {
        let dir = tmp.path().join(case);
        let expected = dir.join("expected.safetensors");
        let prompt: Vec<i64> = Vec::try_from(&read(&expected, "prompt")).unwrap();
        let want: Vec<i64> = Vec::try_from(&read(&expected, "greedy")).unwrap();
        let want_lp: Vec<f32> = Vec::try_from(&read(&expected, "greedy_logprobs")).unwrap();
        let prompt: Vec<String> = prompt.iter().map(i64::to_string).collect();
        let out = Command::new(env!("CARGO_BIN_EXE_driver"))
            .args(["generate", "--model", dir.to_str().unwrap()])
            .args(["--prompt-ids", &prompt.join(",")])
            .args(["--max-new-tokens", &want.len().to_string()])
            .args(["--temperature", "0", "--json"])
            .env("RUST_LOG", "warn")
            .output()
            .expect("driver runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{case}: driver generate failed\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON");
        let ids: Vec<i64> = serde_json::from_value(json["output_ids"].clone()).unwrap();
        let lps: Vec<f64> = serde_json::from_value(json["logprobs"].clone()).unwrap();
        assert_eq!(ids, want, "{case}: greedy ids differ from transformers'");
        for (i, (a, b)) in lps.iter().zip(&want_lp).enumerate() {
            assert!(
                (a - f64::from(*b)).abs() <= 1e-3,
                "{case}: token {i} log-prob {a} vs transformers' {b}"
            );
        }
    }
}

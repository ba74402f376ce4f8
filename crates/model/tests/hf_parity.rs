//! Parity with Hugging Face transformers (fp32, CPU), both directions:
//! checkpoints written by transformers (single file, tied, sharded) load here with the same
//! logits, and checkpoints written here load in transformers with the same logits.
//!
//! Needs the project venv's Python (or `MANTA_PYTHON`) with torch and transformers.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{causal, max_abs_diff, model, positions};
use manta_model::{load_weights, save_pretrained, CausalLm, ModelConfig};
use tch::nn::VarStore;
use tch::{Device, Tensor};

const TOLERANCE: f64 = 1e-4;

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

fn run_helper(mode: &str, dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/hf_parity.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(mode)
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (set MANTA_PYTHON): {e}", python().display()));
    assert!(
        out.status.success(),
        "hf_parity.py {mode} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read(path: &Path, name: &str) -> Tensor {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{} has no `{name}`", path.display()))
        .1
}

/// max |a - b| / max |b|.
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs_diff(a, b) / b.abs().max().double_value(&[])
}

fn logits(m: &CausalLm, ids: &Tensor) -> Tensor {
    let (b, t) = (ids.size()[0], ids.size()[1]);
    tch::no_grad(|| m.forward(ids, &positions(b, t, 0), &causal(), None))
}

#[test]
fn logits_match_transformers_both_ways() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf_root = tmp.path().join("hf");
    run_helper("make", &hf_root);

    // transformers -> Manta.
    let cases = ["qwen3", "qwen3_tied", "qwen2", "llama3", "qwen3_sharded"];
    for case in cases {
        let dir = hf_root.join(case);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("config");
        let mut vs = VarStore::new(Device::Cpu);
        let m = CausalLm::new(&vs.root(), &cfg);
        load_weights(&mut vs, &dir).unwrap_or_else(|e| panic!("{case}: {e}"));
        let expected = dir.join("expected.safetensors");
        let ids = read(&expected, "input_ids");
        let d = rel_diff(&logits(&m, &ids), &read(&expected, "logits"));
        eprintln!("{case}: transformers -> manta relative logit difference {d:e}");
        assert!(
            d <= TOLERANCE,
            "{case}: logits differ from transformers by {d:e} (relative)"
        );
    }
    assert!(
        hf_root
            .join("qwen3_sharded/model.safetensors.index.json")
            .is_file(),
        "the sharded case must really be sharded"
    );

    // Manta -> transformers, with configs as transformers wrote them (odd shapes, llama3 rope).
    let manta_root = tmp.path().join("manta");
    let mut ours = Vec::new();
    for (i, case) in ["qwen3", "qwen3_tied", "qwen2", "llama3"]
        .into_iter()
        .enumerate()
    {
        let cfg = ModelConfig::from_file(&hf_root.join(case).join("config.json")).expect("config");
        let (vs, m) = model(&cfg, 100 + i as i64);
        let dir = manta_root.join(case);
        save_pretrained(&vs, &cfg, &dir).expect("save");
        let ids = read(
            &hf_root.join(case).join("expected.safetensors"),
            "input_ids",
        );
        Tensor::write_safetensors(&[("input_ids", &ids)], dir.join("input.safetensors"))
            .expect("write input");
        ours.push((case, logits(&m, &ids)));
    }
    run_helper("check", &manta_root);
    for (case, mine) in ours {
        let theirs = read(
            &manta_root.join(case).join("hf_logits.safetensors"),
            "logits",
        );
        let d = rel_diff(&theirs, &mine);
        eprintln!("{case}: manta -> transformers relative logit difference {d:e}");
        assert!(
            d <= TOLERANCE,
            "{case}: transformers logits differ from ours by {d:e} (relative)"
        );
    }
}

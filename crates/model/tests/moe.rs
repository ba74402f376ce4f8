//! Qwen3-MoE against Hugging Face transformers (fp32, CPU) on random configurations:
//! renormalised and raw top-k, a dense layer among sparse ones, `decoder_sparse_step` 2.
//! Checkpoints load both ways with the same logits and the same routed experts, greedy
//! decoding gives transformers' ids, and rollout routing replay routes as told while the
//! router keeps its gradient.
//!
//! Needs the project venv's Python (or `MANTA_PYTHON`) with torch and transformers.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{causal, max_abs_diff, positions};
use manta_model::{load_weights, save_pretrained, CausalLm, KvCache, ModelConfig};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const CASES: [&str; 3] = ["renorm", "dense_layer", "step2"];
const TOLERANCE: f64 = 1e-4;

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

fn run_helper(mode: &str, dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/hf_moe.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(mode)
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (set MANTA_PYTHON): {e}", python().display()));
    assert!(
        out.status.success(),
        "hf_moe.py {mode} failed:\n{}",
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

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs_diff(a, b) / b.abs().max().double_value(&[])
}

fn load(dir: &Path) -> (VarStore, CausalLm) {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("config");
    assert!(cfg.moe().is_some(), "{}: not read as MoE", dir.display());
    let mut vs = VarStore::new(Device::Cpu);
    let m = CausalLm::new(&vs.root(), &cfg);
    load_weights(&mut vs, dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (vs, m)
}

fn logits(m: &CausalLm, ids: &Tensor) -> Tensor {
    let (b, t) = (ids.size()[0], ids.size()[1]);
    tch::no_grad(|| m.forward(ids, &positions(b, t, 0), &causal(), None))
}

/// Each token's expert ids sorted, so two records compare as sets per (token, layer).
fn sorted(ids: &Tensor) -> Tensor {
    ids.to_kind(Kind::Int64).sort(-1, false).0
}

fn greedy(m: &CausalLm, prompt: &Tensor, new: i64) -> Vec<i64> {
    let mut cache = KvCache::new(m.config().num_hidden_layers as usize);
    let mut input = prompt.view([1, -1]);
    let mut pos = 0;
    let mut out = Vec::new();
    tch::no_grad(|| {
        for _ in 0..new {
            let t = input.size()[1];
            let logits = m.forward(&input, &positions(1, t, pos), &causal(), Some(&mut cache));
            pos += t;
            let next = logits.select(1, t - 1).argmax(-1, false);
            out.push(next.int64_value(&[0]));
            input = next.view([1, 1]);
        }
    });
    out
}

#[test]
fn moe_matches_transformers_both_ways() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf = tmp.path().join("hf");
    run_helper("make", &hf);
    let ours = tmp.path().join("manta");
    for case in CASES {
        let dir = hf.join(case);
        let (vs, m) = load(&dir);
        let expected = dir.join("expected.safetensors");
        let ids = read(&expected, "input_ids");

        m.record_routing(true);
        let d = rel_diff(&logits(&m, &ids), &read(&expected, "logits"));
        let routed = m.take_routed_experts().expect("routing was recorded");
        m.record_routing(false);
        eprintln!("{case}: transformers -> manta relative logit difference {d:e}");
        assert!(d <= TOLERANCE, "{case}: logits differ by {d:e} (relative)");
        let want = read(&expected, "routed");
        assert_eq!(routed.size(), want.size(), "{case}: routing record shape");
        assert!(
            sorted(&routed).equal(&sorted(&want)),
            "{case}: routed experts differ from transformers' top-k"
        );

        let new = read(&expected, "greedy");
        let got = greedy(&m, &read(&expected, "prompt"), new.size()[0]);
        assert_eq!(
            got,
            Vec::<i64>::try_from(&new).expect("ids"),
            "{case}: greedy ids"
        );

        let out = ours.join(case);
        save_pretrained(&vs, m.config(), &out).expect("save");
        ids.save_safetensors_named(&out.join("input.safetensors"));
    }
    run_helper("check", &ours);
    for case in CASES {
        let dir = hf.join(case);
        let (_vs, m) = load(&dir);
        let ids = read(&ours.join(case).join("input.safetensors"), "input_ids");
        let theirs = read(&ours.join(case).join("hf_logits.safetensors"), "logits");
        let d = rel_diff(&logits(&m, &ids), &theirs);
        eprintln!("{case}: manta -> transformers relative logit difference {d:e}");
        assert!(d <= TOLERANCE, "{case}: exported logits differ by {d:e}");
    }
}

trait SaveNamed {
    fn save_safetensors_named(&self, path: &Path);
}

impl SaveNamed for Tensor {
    fn save_safetensors_named(&self, path: &Path) {
        Tensor::write_safetensors(&[("input_ids", self)], path).expect("write input");
    }
}

/// A random `qwen3_moe` model made here (seeded), with routers wide enough to choose.
fn random_moe(layers: i64, seed: i64) -> (VarStore, CausalLm) {
    let json = format!(
        r#"{{"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 40,
        "moe_intermediate_size": 24, "num_hidden_layers": {layers}, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 61, "num_experts": 6,
        "num_experts_per_tok": 2, "norm_topk_prob": true, "rms_norm_eps": 1e-6,
        "initializer_range": 0.2}}"#
    );
    let cfg = ModelConfig::from_json_str(&json, "test config").expect("config");
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    let m = CausalLm::new(&vs.root(), &cfg);
    (vs, m)
}

fn router_grads(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(n, _)| n.ends_with("mlp.gate.weight"))
        .map(|(n, v)| (n, v.grad().copy()))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    grads
}

fn zero_grads(vs: &VarStore) {
    for (_, mut v) in vs.variables() {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.zero_();
        }
        let _ = &mut v;
    }
}

#[test]
fn replay_routes_as_recorded_and_router_keeps_gradient() {
    let (vs, mut m) = random_moe(3, 11);
    let ids = Tensor::from_slice(&[3i64, 9, 27, 4, 44, 12, 8, 30, 1, 19]).view([2, 5]);
    let pos = positions(2, 5, 0);
    m.record_routing(true);
    let _ = logits(&m, &ids);
    let own = m.take_routed_experts().expect("recorded");
    assert_eq!(own.size(), [10, 3, 2]);
    // Another routing: every token's experts shifted by one (still k distinct experts).
    let replay = (&own + 1).remainder(6);
    for recompute in [false, true] {
        m.set_gradient_checkpointing(recompute);
        m.set_routing_replay(Some(replay.shallow_clone()));
        zero_grads(&vs);
        let loss = m.forward_backward(&ids, &pos, &causal(), |h| h.square().sum(Kind::Float));
        let used = m.take_routed_experts().expect("recorded under replay");
        assert!(
            used.equal(&replay),
            "recompute {recompute}: the forward did not route by the replayed ids"
        );
        for (name, g) in router_grads(&vs) {
            let norm = g.norm().double_value(&[]);
            assert!(
                norm > 1e-6,
                "recompute {recompute}: {name} got no gradient ({norm:e})"
            );
        }
        // The replayed forward is the one the loss saw: its value differs from own routing's.
        m.set_routing_replay(None);
        let own_loss = tch::no_grad(|| {
            m.forward_hidden(&ids, &pos, &causal(), None)
                .square()
                .sum(Kind::Float)
        });
        assert!(
            (loss.double_value(&[]) - own_loss.double_value(&[])).abs() > 1e-6,
            "replay made no difference to the loss"
        );
        let _ = m.take_routed_experts();
    }
}

#[test]
fn aux_loss_adds_router_gradient_alike_with_and_without_recompute() {
    let (vs, mut m) = random_moe(2, 5);
    let ids = Tensor::from_slice(&[3i64, 9, 27, 4, 44, 12]).view([1, 6]);
    let pos = positions(1, 6, 0);
    let grads = |m: &mut CausalLm, coeff: f64, recompute: bool| {
        m.set_gradient_checkpointing(recompute);
        m.set_moe_aux_loss_coeff(coeff);
        zero_grads(&vs);
        let _ = m.forward_backward(&ids, &pos, &causal(), |h| h.sum(Kind::Float));
        router_grads(&vs)
    };
    let plain = grads(&mut m, 0.0, false);
    let with_aux = grads(&mut m, 0.5, false);
    let with_aux_recompute = grads(&mut m, 0.5, true);
    for ((name, a), ((_, b), (_, c))) in plain
        .iter()
        .zip(with_aux.iter().zip(with_aux_recompute.iter()))
    {
        assert!(
            max_abs_diff(a, b) > 1e-6,
            "{name}: the aux loss added no gradient"
        );
        assert!(
            max_abs_diff(b, c) < 1e-5,
            "{name}: recompute changed the aux gradient"
        );
    }
}

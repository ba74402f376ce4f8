//! Loading an fp32 checkpoint into a bf16 VarStore and running it on CPU.
//!
//! Its own test binary, because it caps oneDNN's instruction set before libtorch first
//! runs: bf16 matmuls otherwise use AMX tiles, which some sandboxes (this CI among them)
//! do not enable and which then kill the process with SIGILL.

mod common;

use common::{causal, config, ids, model, positions};
use manta_model::{load_weights, save_pretrained, CausalLm};
use tch::nn::VarStore;
use tch::{Device, Kind};

const SEQ: [i64; 9] = [3, 17, 8, 44, 1, 29, 52, 0, 11];

#[test]
fn loading_into_bf16_converts_dtype() {
    if std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none() {
        // The only test in this binary, so no other thread reads the environment meanwhile.
        std::env::set_var("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16");
    }
    let cfg = config("llama", false);
    let (vs, m32) = model(&cfg, 7);
    let dir = tempfile::tempdir().expect("tempdir");
    save_pretrained(&vs, &cfg, dir.path()).expect("save");
    tch::manual_seed(8);
    let mut vs16 = VarStore::new(Device::Cpu);
    let m16 = CausalLm::new(&vs16.root(), &cfg);
    vs16.set_kind(Kind::BFloat16);
    load_weights(&mut vs16, dir.path()).expect("load");
    let w = &vs16.variables()["model.layers.0.mlp.up_proj.weight"];
    assert_eq!(w.kind(), Kind::BFloat16);
    let expected = vs.variables()["model.layers.0.mlp.up_proj.weight"].to_kind(Kind::BFloat16);
    assert!(w.equal(&expected));
    let logits = m16.forward(&ids(&[&SEQ]), &positions(1, 9, 0), &causal(), None);
    assert_eq!(logits.kind(), Kind::BFloat16);
    let reference = m32.forward(&ids(&[&SEQ]), &positions(1, 9, 0), &causal(), None);
    let err = (logits.to_kind(Kind::Float) - &reference)
        .abs()
        .max()
        .double_value(&[]);
    let scale = reference.abs().max().double_value(&[]);
    assert!(
        err <= 0.05 * scale,
        "bf16 logits off by {err} (scale {scale})"
    );
}

//! The model on CUDA: fp32 matches CPU fp32 closely, bf16 matches within bf16 rounding, for
//! every attention mode (plain causal, left padding with a key mask and a KV cache, packed
//! rows) and for the checkpointed backward pass. Returns early, saying so, on machines
//! without CUDA (the CI machine); run the built binary on the GPU machine.

mod common;

use common::{causal, ids, max_abs_diff, model, positions};
use manta_model::{
    load_weights, save_pretrained, token_logprobs, Attention, CausalLm, KvCache, ModelConfig,
};
use tch::nn::VarStore;
use tch::{Cuda, Device, Kind, Tensor};

/// head_dim 64 so that the fused CUDA attention kernels are eligible.
fn gpu_config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 512,
        "initializer_range": 0.05}"#,
        "gpu test config",
    )
    .expect("valid config")
}

fn rel(a: &Tensor, reference: &Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(Kind::Float);
    max_abs_diff(&a, reference) / reference.abs().max().double_value(&[])
}

/// Logits of every attention mode, on whatever device/dtype `m` lives.
fn all_modes(m: &CausalLm, device: Device) -> Vec<(&'static str, Tensor)> {
    let on = |t: Tensor| t.to_device(device);
    let seq: Vec<i64> = (0..24).map(|i| (i * 37 + 11) % 300).collect();
    let mut out = Vec::new();
    tch::no_grad(|| {
        let x = on(ids(&[
            &seq,
            &seq[3..]
                .iter()
                .chain(&seq[..3])
                .copied()
                .collect::<Vec<_>>(),
        ]));
        out.push((
            "causal",
            m.forward(&x, &on(positions(2, 24, 0)), &causal(), None),
        ));

        // Left padding by 8 on row 1, prefill then two decode steps.
        let mut row1 = vec![0i64; 8];
        row1.extend_from_slice(&seq[..16]);
        let x = on(ids(&[&seq, &row1]));
        let mut mask: Vec<i64> = vec![1; 24];
        mask.extend(std::iter::repeat_n(0, 8).chain(std::iter::repeat_n(1, 16)));
        let mut key_mask = on(Tensor::from_slice(&mask).view([2, 24]));
        let pos = (key_mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
        let mut cache = KvCache::new(2);
        let attn = Attention::Causal {
            key_mask: Some(&key_mask),
        };
        let prefill = m.forward(&x, &pos, &attn, Some(&mut cache));
        out.push(("padded prefill", prefill));
        for step in 0..2i64 {
            key_mask = Tensor::cat(
                &[
                    &key_mask,
                    &on(Tensor::ones([2, 1], (Kind::Int64, Device::Cpu))),
                ],
                1,
            );
            let next = on(Tensor::from_slice(&[5 + step, 7 + step]).view([2, 1]));
            let p = on(Tensor::from_slice(&[24 + step, 16 + step]).view([2, 1]));
            let attn = Attention::Causal {
                key_mask: Some(&key_mask),
            };
            out.push((
                "padded decode",
                m.forward(&next, &p, &attn, Some(&mut cache)),
            ));
        }

        let seq_ids: Vec<i64> = (0..24)
            .map(|i| i64::from(i >= 10) + i64::from(i >= 19))
            .collect();
        let pos: Vec<i64> = (0..24)
            .map(|i| {
                if i >= 19 {
                    i - 19
                } else if i >= 10 {
                    i - 10
                } else {
                    i
                }
            })
            .collect();
        let sids = on(Tensor::from_slice(&seq_ids).view([1, 24]));
        let packed = m.forward(
            &on(ids(&[&seq])),
            &on(Tensor::from_slice(&pos).view([1, 24])),
            &Attention::Packed { seq_ids: &sids },
            None,
        );
        out.push(("packed", packed));
    });
    out
}

fn grads(m: &CausalLm, vs: &VarStore, device: Device) -> Vec<(String, Tensor)> {
    let seq: Vec<i64> = (0..32).map(|i| (i * 53 + 3) % 300).collect();
    let x = ids(&[&seq, &seq]).to_device(device);
    let targets = x.view([-1]).roll([-1], [0]);
    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }
    let loss = m.forward_backward(&x, &positions(2, 32, 0).to_device(device), &causal(), |h| {
        let (logp, _) = token_logprobs(m, &h.view([64, 128]), &targets, 1.0, 16);
        -logp.mean(Kind::Float)
    });
    assert!(loss.isfinite().all().int64_value(&[]) == 1);
    let mut g: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(k, v)| (k, v.grad().to_device(Device::Cpu).to_kind(Kind::Float)))
        .collect();
    g.sort_by(|a, b| a.0.cmp(&b.0));
    g
}

#[test]
fn cuda_fp32_and_bf16_match_cpu() {
    if !Cuda::is_available() {
        eprintln!("no CUDA device: nothing to check here");
        return;
    }
    let gpu = Device::Cuda(0);
    let cfg = gpu_config();
    let (vs_cpu, m_cpu) = model(&cfg, 11);
    let reference = all_modes(&m_cpu, Device::Cpu);
    let dir = tempfile::tempdir().expect("tempdir");
    save_pretrained(&vs_cpu, &cfg, dir.path()).expect("save");

    for (kind, tol) in [(Kind::Float, 1e-4), (Kind::BFloat16, 5e-2)] {
        let mut vs = VarStore::new(gpu);
        let mut m = CausalLm::new(&vs.root(), &cfg);
        vs.set_kind(kind);
        load_weights(&mut vs, dir.path()).expect("load");
        for ((name, got), (_, want)) in all_modes(&m, gpu).iter().zip(&reference) {
            assert_eq!(got.kind(), kind);
            let d = rel(got, want);
            eprintln!("{kind:?} {name}: relative difference to CPU fp32 {d:e}");
            assert!(d <= tol, "{kind:?} {name}: {d:e} > {tol:e}");
        }
        // Checkpointed backward equals the plain one on the GPU too.
        let plain = grads(&m, &vs, gpu);
        m.set_gradient_checkpointing(true);
        let ckpt = grads(&m, &vs, gpu);
        for ((name, a), (_, b)) in plain.iter().zip(&ckpt) {
            let scale = a.abs().max().double_value(&[]);
            assert!(scale > 0.0, "{kind:?} {name}: no gradient");
            let d = max_abs_diff(a, b) / scale;
            assert!(
                d <= tol,
                "{kind:?} {name}: checkpointed gradient differs by {d:e}"
            );
        }
    }
}

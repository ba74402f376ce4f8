//! Behaviour of the tch model on CPU fp32: shapes, KV cache, padding, packing, chunked
//! log-probs, checkpoint round trips and config errors.

mod common;

use common::{causal, config, ids, max_abs_diff, model, positions};
use manta_model::{
    load_weights, save_pretrained, token_logprobs, Attention, KvCache, ModelConfig, ModelError,
    ModelFamily,
};
use tch::{Device, Kind, Tensor};

const SEQ: [i64; 9] = [3, 17, 8, 44, 1, 29, 52, 0, 11];

#[test]
fn forward_shapes_and_families() {
    for (mt, family, bias, qk_norm) in [
        ("qwen3", ModelFamily::Qwen3, false, true),
        ("qwen2", ModelFamily::Qwen2, true, false),
        ("llama", ModelFamily::Llama, false, false),
    ] {
        let cfg = config(mt, false);
        assert_eq!(cfg.family(), family);
        assert_eq!(cfg.attention_bias, bias, "{mt} attention_bias default");
        let (vs, m) = model(&cfg, 0);
        let vars = vs.variables();
        assert_eq!(
            vars.contains_key("model.layers.1.self_attn.q_norm.weight"),
            qk_norm
        );
        assert_eq!(
            vars.contains_key("model.layers.0.self_attn.v_proj.bias"),
            bias
        );
        assert_eq!(
            vars["model.layers.0.self_attn.q_proj.weight"].size(),
            [48, 32]
        );
        assert_eq!(
            vars["model.layers.0.self_attn.k_proj.weight"].size(),
            [12, 32]
        );
        assert_eq!(vars["lm_head.weight"].size(), [53, 32]);
        let input = ids(&[&SEQ[..5], &SEQ[4..9]]);
        let hidden = m.forward_hidden(&input, &positions(2, 5, 0), &causal(), None);
        assert_eq!(hidden.size(), [2, 5, 32]);
        let logits = m.forward(&input, &positions(2, 5, 0), &causal(), None);
        assert_eq!(logits.size(), [2, 5, 53]);
        assert!(logits.isfinite().all().int64_value(&[]) == 1);
    }
    let tied = config("qwen3", true);
    let (vs, m) = model(&tied, 0);
    assert!(!vs.variables().contains_key("lm_head.weight"));
    assert_eq!(
        max_abs_diff(
            m.lm_head_weight(),
            &vs.variables()["model.embed_tokens.weight"]
        ),
        0.0
    );
}

#[test]
fn kv_cache_decoding_matches_full_forward() {
    for mt in ["qwen3", "llama"] {
        let cfg = config(mt, false);
        let (_vs, m) = model(&cfg, 1);
        let full = m.forward(&ids(&[&SEQ]), &positions(1, 9, 0), &causal(), None);
        let mut cache = KvCache::new(2);
        let mut pieces = vec![m.forward(
            &ids(&[&SEQ[..4]]),
            &positions(1, 4, 0),
            &causal(),
            Some(&mut cache),
        )];
        assert_eq!(cache.seq_len(), 4);
        // A multi-token chunk on top of a cache, then single tokens.
        pieces.push(m.forward(
            &ids(&[&SEQ[4..6]]),
            &positions(1, 2, 4),
            &causal(),
            Some(&mut cache),
        ));
        for t in 6..9 {
            pieces.push(m.forward(
                &ids(&[&SEQ[t..t + 1]]),
                &positions(1, 1, t as i64),
                &causal(),
                Some(&mut cache),
            ));
        }
        assert_eq!(cache.seq_len(), 9);
        let incremental = Tensor::cat(&pieces, 1);
        let d = max_abs_diff(&full, &incremental);
        assert!(d < 1e-5, "{mt}: cached decoding differs by {d}");
    }
}

#[test]
fn left_padded_batch_matches_single_rows() {
    let cfg = config("qwen3", false);
    let (_vs, m) = model(&cfg, 2);
    let long: &[i64] = &SEQ[..6];
    let short: &[i64] = &SEQ[6..9];
    let pad = 0;
    // Row 1 is left-padded by 3.
    let input = ids(&[long, &[pad, pad, pad, short[0], short[1], short[2]]]);
    let key_mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1]).view([2, 6]);
    let pos = (key_mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut cache = KvCache::new(2);
    let batch = m.forward(
        &input,
        &pos,
        &Attention::Causal {
            key_mask: Some(&key_mask),
        },
        Some(&mut cache),
    );
    let alone_long = m.forward(&ids(&[long]), &positions(1, 6, 0), &causal(), None);
    let alone_short = m.forward(&ids(&[short]), &positions(1, 3, 0), &causal(), None);
    let d0 = max_abs_diff(&batch.get(0), &alone_long.get(0));
    let d1 = max_abs_diff(&batch.get(1).narrow(0, 3, 3), &alone_short.get(0));
    assert!(d0 < 1e-5 && d1 < 1e-5, "padded batch differs: {d0}, {d1}");
    assert!(batch.isfinite().all().int64_value(&[]) == 1);

    // One decoding step for both rows with the key mask grown by one real position.
    let next = ids(&[&[40], &[41]]);
    let key_mask2 = Tensor::cat(
        &[&key_mask, &Tensor::ones([2, 1], (Kind::Int64, Device::Cpu))],
        1,
    );
    let next_pos = Tensor::from_slice(&[6i64, 3]).view([2, 1]);
    let step = m.forward(
        &next,
        &next_pos,
        &Attention::Causal {
            key_mask: Some(&key_mask2),
        },
        Some(&mut cache),
    );
    let long_next: Vec<i64> = long.iter().copied().chain([40]).collect();
    let short_next: Vec<i64> = short.iter().copied().chain([41]).collect();
    let ref_long = m.forward(&ids(&[&long_next]), &positions(1, 7, 0), &causal(), None);
    let ref_short = m.forward(&ids(&[&short_next]), &positions(1, 4, 0), &causal(), None);
    let d0 = max_abs_diff(&step.get(0).get(0), &ref_long.get(0).get(6));
    let d1 = max_abs_diff(&step.get(1).get(0), &ref_short.get(0).get(3));
    assert!(
        d0 < 1e-5 && d1 < 1e-5,
        "padded decode step differs: {d0}, {d1}"
    );

    // Dropping a finished row keeps the other row's cache intact.
    let only_long = cache.select_rows(&Tensor::from_slice(&[0i64]));
    assert_eq!(only_long.seq_len(), 7);
}

#[test]
fn packed_rows_match_separate_samples() {
    let cfg = config("qwen2", false);
    let (_vs, m) = model(&cfg, 3);
    let samples: [&[i64]; 3] = [&SEQ[..4], &SEQ[4..7], &SEQ[7..9]];
    let mut flat = Vec::new();
    let mut seq_ids = Vec::new();
    let mut pos = Vec::new();
    for (i, s) in samples.iter().enumerate() {
        flat.extend_from_slice(s);
        seq_ids.extend(std::iter::repeat_n(i as i64, s.len()));
        pos.extend(0..s.len() as i64);
    }
    // Two padding tokens at the end with their own id.
    flat.extend([0, 0]);
    seq_ids.extend([-1, -1]);
    pos.extend([0, 1]);
    let n = flat.len() as i64;
    let seq_ids = Tensor::from_slice(&seq_ids).view([1, n]);
    let packed = m.forward(
        &Tensor::from_slice(&flat).view([1, n]),
        &Tensor::from_slice(&pos).view([1, n]),
        &Attention::Packed { seq_ids: &seq_ids },
        None,
    );
    let mut offset = 0;
    for s in samples {
        let t = s.len() as i64;
        let alone = m.forward(&ids(&[s]), &positions(1, t, 0), &causal(), None);
        let d = max_abs_diff(&packed.get(0).narrow(0, offset, t), &alone.get(0));
        assert!(d < 1e-5, "packed sample at {offset} differs by {d}");
        offset += t;
    }
}

#[test]
fn chunked_token_logprobs_match_naive_values_and_gradients() {
    let cfg = config("qwen3", true);
    let (_vs, m) = model(&cfg, 4);
    let input = ids(&[&SEQ, &SEQ]);
    let hidden = m
        .forward_hidden(&input, &positions(2, 9, 0), &causal(), None)
        .view([18, 32])
        .detach()
        .set_requires_grad(true);
    let targets = Tensor::randint(53, [18], (Kind::Int64, Device::Cpu));
    let temperature = 0.7;

    let (logp, entropy) = token_logprobs(&m, &hidden, &targets, temperature, 5);
    let naive_all = (m.logits(&hidden) / temperature).log_softmax(-1, Kind::Float);
    let naive_logp = naive_all
        .gather(-1, &targets.unsqueeze(-1), false)
        .squeeze_dim(-1);
    let naive_entropy = -(naive_all.exp() * &naive_all).sum_dim_intlist(-1, false, None::<Kind>);
    assert_eq!(logp.size(), [18]);
    assert!(max_abs_diff(&logp, &naive_logp) <= 1e-5);
    assert!(max_abs_diff(&entropy, &naive_entropy) <= 1e-5);

    let w = m.lm_head_weight();
    let grads = |loss: Tensor| {
        let g = Tensor::run_backward(&[loss], &[&hidden, w], false, false);
        (g[0].copy(), g[1].copy())
    };
    // Entropy is reported, not trained on: it carries no graph.
    assert!(!entropy.requires_grad());
    let (gh, gw) = grads((logp * 1.3).sum(Kind::Float));
    let (nh, nw) = grads((naive_logp * 1.3).sum(Kind::Float));
    assert!(max_abs_diff(&gh, &nh) <= 1e-5);
    assert!(max_abs_diff(&gw, &nw) <= 1e-5);
}

#[test]
fn gradient_checkpointing_gives_the_same_gradients() {
    let cfg = config("qwen3", true);
    let input = ids(&[&SEQ, &SEQ]);
    let pos = positions(2, 9, 0);
    let targets = Tensor::randint(53, [18], (Kind::Int64, Device::Cpu));
    // One model for both runs: libtorch's RNG is process-global and tests run in
    // parallel, so two seeded inits could differ.
    let (vs, mut m) = model(&cfg, 5);
    let mut run = |ckpt: bool| {
        for mut g in vs.trainable_variables().iter().map(|v| v.grad()) {
            if g.defined() {
                let _ = g.zero_();
            }
        }
        m.set_gradient_checkpointing(ckpt);
        let loss = m.forward_backward(&input, &pos, &causal(), |h| {
            let (logp, _) = token_logprobs(&m, &h.view([18, 32]), &targets, 1.0, 7);
            -logp.mean(Kind::Float)
        });
        let mut grads: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .map(|(k, v)| (k, v.grad().copy()))
            .collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        (loss.double_value(&[]), grads)
    };
    let (loss_plain, plain) = run(false);
    let (loss_ckpt, ckpt) = run(true);
    assert!(
        (loss_plain - loss_ckpt).abs() < 1e-6,
        "loss {loss_plain} vs {loss_ckpt}"
    );
    assert_eq!(plain.len(), ckpt.len());
    for ((name, a), (_, b)) in plain.iter().zip(&ckpt) {
        assert!(
            a.defined() && a.abs().sum(Kind::Float).double_value(&[]) > 0.0,
            "{name} has no gradient"
        );
        let d = max_abs_diff(a, b);
        assert!(d < 1e-5, "{name}: checkpointed gradient differs by {d}");
    }
}

#[test]
fn save_then_load_is_bit_exact() {
    for tied in [false, true] {
        let cfg = config("qwen2", tied);
        let (vs, m) = model(&cfg, 6);
        let dir = tempfile::tempdir().expect("tempdir");
        save_pretrained(&vs, &cfg, dir.path()).expect("save");
        let reread = ModelConfig::from_file(&dir.path().join("config.json")).expect("config");
        assert_eq!(reread, cfg);
        let (mut vs2, m2) = model(&reread, 99);
        load_weights(&mut vs2, dir.path()).expect("load");
        let a = vs.variables();
        let b = vs2.variables();
        assert_eq!(a.len(), b.len());
        for (name, t) in &a {
            assert!(t.equal(&b[name]), "{name} changed in the round trip");
        }
        let x = ids(&[&SEQ]);
        let p = positions(1, 9, 0);
        assert!(m
            .forward(&x, &p, &causal(), None)
            .equal(&m2.forward(&x, &p, &causal(), None)));
        let names = Tensor::read_safetensors(dir.path().join("model.safetensors")).expect("read");
        assert_eq!(
            names.iter().any(|(n, _)| n == "lm_head.weight"),
            !tied,
            "lm_head.weight present iff untied"
        );
    }
}

#[test]
fn checkpoint_problems_name_the_tensor() {
    let cfg = config("qwen3", false);
    let (vs, _m) = model(&cfg, 9);
    let dir = tempfile::tempdir().expect("tempdir");
    save_pretrained(&vs, &cfg, dir.path()).expect("save");

    // A model with a bigger vocabulary: shape mismatch on the embedding.
    let mut bigger = cfg.clone();
    bigger.vocab_size = 60;
    let (mut vs2, _) = model(&bigger, 9);
    let err = load_weights(&mut vs2, dir.path()).expect_err("shape mismatch");
    let msg = err.to_string();
    assert!(matches!(err, ModelError::ShapeMismatch { .. }), "{msg}");
    assert!(
        msg.contains("model.safetensors")
            && (msg.contains("embed_tokens") || msg.contains("lm_head")),
        "{msg}"
    );

    // A Qwen2 model has biases the Qwen3 checkpoint lacks; Qwen3's q_norm is unexpected there.
    let (mut vs3, _) = model(&config("qwen2", false), 9);
    let err = load_weights(&mut vs3, dir.path()).expect_err("unexpected tensor");
    assert!(err.to_string().contains("_norm.weight"), "{err}");

    // A tensor removed from the file is reported missing.
    let tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(dir.path().join("model.safetensors"))
            .expect("read")
            .into_iter()
            .filter(|(n, _)| n != "model.norm.weight")
            .collect();
    Tensor::write_safetensors(&tensors, dir.path().join("model.safetensors")).expect("write");
    // Another seed, so that any tensor copied before the check would show.
    let (mut vs4, _) = model(&cfg, 10);
    let before: Vec<(String, Tensor)> = vs4
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    let err = load_weights(&mut vs4, dir.path()).expect_err("missing tensor");
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
    // Nothing was copied before the problem was found: the model is as it was.
    let after = vs4.variables();
    for (name, t) in &before {
        assert!(t.equal(&after[name]), "{name} changed by a failed load");
    }

    let empty = tempfile::tempdir().expect("tempdir");
    let err = load_weights(&mut vs4, empty.path()).expect_err("no checkpoint");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn malformed_config_errors_name_file_and_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.json");
    let base = config("qwen3", false).to_json_pretty();

    let broken = base.replace("\"hidden_size\": 32", "\"hidden_size\": \"thirty-two\"");
    assert_ne!(broken, base);
    std::fs::write(&path, &broken).expect("write");
    let msg = ModelConfig::from_file(&path)
        .expect_err("bad type")
        .to_string();
    assert!(
        msg.contains("config.json") && msg.contains("hidden_size"),
        "{msg}"
    );

    let missing = base.replace("\"vocab_size\"", "\"vocab_sz\"");
    assert_ne!(missing, base);
    let msg = ModelConfig::from_json_str(&missing, "x.json")
        .expect_err("missing")
        .to_string();
    assert!(
        msg.contains("x.json") && msg.contains("vocab_size"),
        "{msg}"
    );

    let gqa = base.replace("\"num_key_value_heads\": 1", "\"num_key_value_heads\": 3");
    let msg = ModelConfig::from_json_str(&gqa, "x.json")
        .expect_err("gqa")
        .to_string();
    assert!(
        msg.contains("num_key_value_heads") && msg.contains('3'),
        "{msg}"
    );

    let mt = base.replace("\"qwen3\"", "\"gpt2\"");
    let msg = ModelConfig::from_json_str(&mt, "x.json")
        .expect_err("model type")
        .to_string();
    assert!(msg.contains("model_type") && msg.contains("gpt2"), "{msg}");

    let yarn = base.replace(
        "\"rope_scaling\": null",
        "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}",
    );
    assert_ne!(yarn, base);
    let msg = ModelConfig::from_json_str(&yarn, "x.json")
        .expect_err("yarn")
        .to_string();
    assert!(
        msg.contains("rope_scaling") && msg.contains("yarn"),
        "{msg}"
    );

    let bad_factor = base.replace(
        "\"rope_scaling\": null",
        "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": \"big\", \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}",
    );
    let msg = ModelConfig::from_json_str(&bad_factor, "x.json")
        .expect_err("factor")
        .to_string();
    assert!(msg.contains("rope_scaling.factor"), "{msg}");

    let msg = ModelConfig::from_json_str("{not json", "x.json")
        .expect_err("syntax")
        .to_string();
    assert!(msg.contains("x.json"), "{msg}");
}

#[test]
fn config_reads_hub_and_transformers5_layouts() {
    // Hub layout (Qwen3-0.6B style): top-level rope_theta, eos as int, unknown keys kept.
    let hub = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": null, "tie_word_embeddings": true,
        "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "sliding_window": null, "use_sliding_window": false}"#;
    let cfg = ModelConfig::from_json_str(hub, "hub").expect("hub config");
    assert_eq!(cfg.rope_theta, 1e6);
    assert_eq!(cfg.eos_token_ids(), &[151645]);
    assert!(cfg.tie_word_embeddings && !cfg.attention_bias);
    let again = ModelConfig::from_json_str(&cfg.to_json_pretty(), "again").expect("round trip");
    assert_eq!(again, cfg);
    assert!(cfg
        .to_json_pretty()
        .contains("\"use_sliding_window\": false"));

    // transformers 5 layout: rope_parameters, llama3 scaling, defaults derived.
    let v5 = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97, "rms_norm_eps": 1e-5,
        "eos_token_id": [1, 2],
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    let cfg = ModelConfig::from_json_str(v5, "v5").expect("v5 config");
    assert_eq!(cfg.rope_theta, 500000.0);
    assert_eq!(cfg.num_key_value_heads, 4);
    assert_eq!(cfg.head_dim(), 16);
    assert_eq!(cfg.eos_token_ids(), &[1, 2]);
    let rs = cfg.rope_scaling.as_ref().expect("llama3 scaling");
    assert_eq!((rs.rope_type.as_str(), rs.factor), ("llama3", 8.0));
    let again = ModelConfig::from_json_str(&cfg.to_json_pretty(), "again").expect("round trip");
    assert_eq!(again, cfg);
}

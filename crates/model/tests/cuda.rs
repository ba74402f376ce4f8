//! The model on CUDA: fp32 matches CPU fp32 closely, bf16 matches within bf16 rounding, for
//! every attention mode (plain causal, left padding with a key mask and a KV cache, packed
//! rows) and for the checkpointed backward pass. Returns early, saying so, on machines
//! without CUDA (the CI machine); run the built binary on the GPU machine.

mod common;

use common::{causal, ids, max_abs_diff, model, positions};
use manta_model::{
    decode_counters, load_weights, save_pretrained, token_logprobs, Attention, CausalLm, KvCache,
    ModelConfig, PagedBatch, PagedKvCache, PagedSeq,
};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

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

/// Qwen3-0.6B's layer shapes, four layers, a small vocabulary.
fn four_layers_of_0_6b(vocab: i64) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": {vocab}, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true,
            "max_position_embeddings": 1024, "initializer_range": 0.02}}"#
        ),
        "0.6B layers",
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

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn cuda_fp32_and_bf16_match_cpu() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("no CUDA device: nothing to check here");
        return;
    };
    let gpu = Device::Cuda(index);
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

/// The CUDA decode kernels (fused projections, q/k norm with rotary and cache store,
/// residual add with norm, SiLU×up, paged attention) against the composite tensor ops, bf16 on the GPU:
/// a mixed prefill step, then decode steps with a sequence joining mid-way; and a weight
/// update after fusing reaches the fused buffers.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn paged_decode_kernels_match_the_tensor_ops() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("no CUDA device: nothing to check here");
        return;
    };
    let gpu = Device::Cuda(index);
    for json in [
        // Qwen3: q/k norms, head_dim 128, two query heads per kv head.
        r#"{"model_type": "qwen3", "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "max_position_embeddings": 4096,
        "initializer_range": 0.05}"#,
        // Qwen2: q/k/v biases, no head norms, head_dim 64.
        r#"{"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "max_position_embeddings": 4096,
        "initializer_range": 0.05}"#,
    ] {
        let cfg = ModelConfig::from_json_str(json, "kernel test").expect("valid config");
        let (vs_cpu, _) = model(&cfg, 21);
        let dir = tempfile::tempdir().expect("tempdir");
        save_pretrained(&vs_cpu, &cfg, dir.path()).expect("save");
        let load = || {
            let mut vs = VarStore::new(gpu);
            let m = CausalLm::new(&vs.root(), &cfg);
            vs.set_kind(Kind::BFloat16);
            load_weights(&mut vs, dir.path()).expect("load");
            (vs, m)
        };
        let (_vs_ref, reference) = load();
        let (mut vs_fused, mut fused) = load();
        fused.enable_decode_kernels().expect("kernels build");
        assert!(fused.decode_kernels_enabled());

        let bs = 16usize;
        let kv_ref = PagedKvCache::new(&cfg, 64, bs, Kind::BFloat16, gpu);
        let kv_fused = PagedKvCache::new(&cfg, 64, bs, Kind::BFloat16, gpu);
        // Sequence k owns blocks 8k.. (shuffled order within: 8k+7, 8k+2, ...).
        let slot = |k: usize, pos: usize| {
            let order = [7usize, 2, 5, 0, 3, 6, 1, 4];
            ((8 * k + order[pos / bs]) * bs + pos % bs) as i64
        };
        let prompt = |k: usize, len: usize| -> Vec<i64> {
            (0..len)
                .map(|i| ((i * 31 + k * 7 + 3) % 300) as i64)
                .collect()
        };
        // (sequence, tokens so far, prompt length)
        let mut seqs: Vec<(usize, Vec<i64>)> = vec![(0, prompt(0, 37)), (1, prompt(1, 5))];
        let mut computed = [0usize; 3];
        let logits = |m: &CausalLm, h: &Tensor| m.logits(h).to_kind(Kind::Float);
        for step in 0..8 {
            if step == 3 {
                seqs.push((2, prompt(2, 70)));
            }
            // Decode rows (one new token) first, then prefills, as the engine orders them.
            let mut order: Vec<usize> = (0..seqs.len()).collect();
            order.sort_by_key(|&i| seqs[i].1.len() - computed[seqs[i].0] != 1);
            let (mut ids, mut pos, mut layout) = (Vec::new(), Vec::new(), Vec::new());
            for &i in &order {
                let (k, toks) = &seqs[i];
                let start = computed[*k];
                ids.extend_from_slice(&toks[start..]);
                pos.extend((start..toks.len()).map(|p| p as i64));
                layout.push(PagedSeq {
                    q_len: toks.len() - start,
                    slots: (0..toks.len()).map(|p| slot(*k, p)).collect(),
                });
            }
            let ids_t = Tensor::from_slice(&ids).to(gpu);
            let pos_t = Tensor::from_slice(&pos).to(gpu);
            let (h_ref, h_fused) = tch::no_grad(|| {
                (
                    reference.forward_paged(
                        &ids_t,
                        &pos_t,
                        &PagedBatch::new(&layout, gpu),
                        &kv_ref,
                    ),
                    fused.forward_paged(
                        &ids_t,
                        &pos_t,
                        &PagedBatch::new_paged(&layout, gpu, bs),
                        &kv_fused,
                    ),
                )
            });
            let (l_ref, l_fused) = (logits(&reference, &h_ref), logits(&fused, &h_fused));
            let d = (&l_fused - &l_ref).abs().max().double_value(&[])
                / l_ref.abs().max().double_value(&[]);
            eprintln!(
                "{} step {step}: relative logit difference {d:e}",
                cfg.model_type
            );
            assert!(
                d < 3e-2,
                "{} step {step}: logits differ by {d:e}",
                cfg.model_type
            );
            // Every sequence takes the reference's greedy token next.
            let mut row = 0i64;
            for &i in &order {
                let (k, toks) = &mut seqs[i];
                row += (toks.len() - computed[*k]) as i64;
                computed[*k] = toks.len();
                let next = l_ref.get(row - 1).argmax(0, false).int64_value(&[]);
                toks.push(next);
            }
        }

        // fp32 logits: through the GEMV kernel at one or two rows (decode kernels on), through
        // cuBLAS otherwise; both sum in fp32 and neither rounds to bf16.
        for rows in [1i64, 2, 3] {
            let h = Tensor::randn([rows, cfg.hidden_size], (Kind::BFloat16, gpu));
            let (want, got) = tch::no_grad(|| (reference.logits_f32(&h), fused.logits_f32(&h)));
            assert_eq!(got.kind(), Kind::Float);
            let scale = want.abs().max().double_value(&[]);
            let err = (&got - &want).abs().max().double_value(&[]);
            assert!(
                err <= scale * 1e-5,
                "{} logits of {rows} rows differ by {err:e} of {scale:e}",
                cfg.model_type
            );
        }

        // A weight update copied into the fused model's variables reaches the kernels.
        let (vs_new, _) = model(&cfg, 22);
        let dir_new = tempfile::tempdir().expect("tempdir");
        save_pretrained(&vs_new, &cfg, dir_new.path()).expect("save");
        load_weights(&mut vs_fused, dir_new.path()).expect("load into fused");
        let mut vs_check = VarStore::new(gpu);
        let check = CausalLm::new(&vs_check.root(), &cfg);
        vs_check.set_kind(Kind::BFloat16);
        load_weights(&mut vs_check, dir_new.path()).expect("load");
        let layout = vec![PagedSeq {
            q_len: 20,
            slots: (0..20).map(|p| slot(0, p)).collect(),
        }];
        let ids_t = Tensor::from_slice(&prompt(5, 20)).to(gpu);
        let pos_t = Tensor::arange(20, (Kind::Int64, gpu));
        let (a, b) = tch::no_grad(|| {
            (
                check.forward_paged(&ids_t, &pos_t, &PagedBatch::new(&layout, gpu), &kv_ref),
                fused.forward_paged(
                    &ids_t,
                    &pos_t,
                    &PagedBatch::new_paged(&layout, gpu, bs),
                    &kv_fused,
                ),
            )
        });
        let d = rel(&b, &a.to_device(Device::Cpu).to_kind(Kind::Float));
        assert!(
            d < 3e-2,
            "{}: after a weight update the outputs differ by {d:e}",
            cfg.model_type
        );
    }
}

/// True on-policy mode in the trainer's packed forward (`Attention::Segments`): with
/// autograd on, the hidden states are the batch-invariant kernel's bits (equal to a no-grad
/// forward's), and the gradients — from flash attention's backward — are within bf16 noise
/// of the default mode's.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn invariant_attention_keeps_its_bits_under_autograd() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("no CUDA device: nothing to check here");
        return;
    };
    let gpu = Device::Cuda(index);
    let cfg = gpu_config();
    tch::manual_seed(21);
    let mut vs = VarStore::new(gpu);
    let mut m = CausalLm::new(&vs.root(), &cfg);
    vs.bfloat16();
    let lengths = [40i64, 17, 70];
    let total: i64 = lengths.iter().sum();
    let tokens: Vec<i64> = (0..total).map(|i| (i * 31 + 7) % 300).collect();
    let x = Tensor::from_slice(&tokens).view([1, total]).to(gpu);
    let pos: Vec<i64> = lengths.iter().flat_map(|&l| 0..l).collect();
    let pos = Tensor::from_slice(&pos).view([1, total]).to(gpu);
    let attn = Attention::Segments { lengths: &lengths };
    let targets = x.view([-1]).roll([-1], [0]);
    let grads = |m: &CausalLm| {
        for mut v in vs.trainable_variables() {
            v.zero_grad();
        }
        let loss = m.forward_backward(&x, &pos, &attn, |h| {
            let (logp, _) = token_logprobs(m, &h.view([total, -1]), &targets, 1.0, 64);
            -logp.mean(Kind::Float)
        });
        assert!(loss.isfinite().all().int64_value(&[]) == 1);
        let mut g: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .map(|(k, v)| (k, v.grad().to_kind(Kind::Float)))
            .collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        g
    };
    let plain = grads(&m);
    m.set_invariant_attention(true).expect("kernel builds");
    let no_grad = tch::no_grad(|| m.forward_hidden(&x, &pos, &attn, None));
    let with_grad = m.forward_hidden(&x, &pos, &attn, None);
    assert!(
        with_grad.requires_grad(),
        "autograd reaches the hidden states"
    );
    assert!(
        with_grad.detach().equal(&no_grad),
        "under autograd the forward value is not the kernel's"
    );
    let invariant = grads(&m);
    for ((name, a), (_, b)) in plain.iter().zip(&invariant) {
        let scale = a.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name}: no gradient");
        let d = (a - b).abs().max().double_value(&[]) / scale;
        assert!(
            d <= 5e-2,
            "{name}: true on-policy gradient differs by {d:e}"
        );
    }
}

/// True on-policy mode: the engine's paged forward (prompts in prefill chunks beside other
/// sequences, then decode steps of two rows, as a CUDA graph replays them) gives every token
/// the same bits as the trainer's packed forward of the whole sequences. Qwen3-0.6B's
/// layer shapes, four layers.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn invariant_paged_forward_equals_the_packed_forward() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("no CUDA device: nothing to check here");
        return;
    };
    let gpu = Device::Cuda(index);
    let cfg = four_layers_of_0_6b(2000);
    tch::manual_seed(8);
    let mut vs = VarStore::new(gpu);
    let mut m = CausalLm::new(&vs.root(), &cfg);
    vs.bfloat16();
    m.set_invariant_attention(true).expect("kernel builds");
    let lens = [300usize, 150];
    let tokens: Vec<Vec<i64>> = lens
        .iter()
        .enumerate()
        .map(|(s, &l)| {
            (0..l as i64)
                .map(|i| (i * 37 + 11 * s as i64 + 5) % 2000)
                .collect()
        })
        .collect();
    let packed = tch::no_grad(|| {
        let flat: Vec<i64> = tokens.concat();
        let pos: Vec<i64> = lens.iter().flat_map(|&l| 0..l as i64).collect();
        let lengths: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
        m.forward_hidden(
            &Tensor::from_slice(&flat).view([1, -1]).to(gpu),
            &Tensor::from_slice(&pos).view([1, -1]).to(gpu),
            &Attention::Segments { lengths: &lengths },
            None,
        )
        .squeeze_dim(0)
    });
    let reference = |s: usize, from: usize, n: usize| {
        let start = if s == 0 { 0 } else { lens[0] } + from;
        packed.narrow(0, start as i64, n as i64)
    };
    let bs = 16usize;
    let kv = PagedKvCache::new(&cfg, 40, bs, Kind::BFloat16, gpu);
    // Sequence s owns blocks 20s.. in reverse order.
    let slot = |s: usize, pos: usize| ((20 * s + 19 - pos / bs) * bs + pos % bs) as i64;
    let seq = |s: usize, ctx: usize, q_len: usize| PagedSeq {
        q_len,
        slots: (0..ctx).map(|p| slot(s, p)).collect(),
    };
    let run = |parts: &[(usize, usize, usize)], batch: &PagedBatch| {
        let ids: Vec<i64> = parts
            .iter()
            .flat_map(|&(s, from, n)| tokens[s][from..from + n].to_vec())
            .collect();
        let pos: Vec<i64> = parts
            .iter()
            .flat_map(|&(_, from, n)| (from as i64)..(from + n) as i64)
            .collect();
        tch::no_grad(|| {
            m.forward_paged(
                &Tensor::from_slice(&ids).to(gpu),
                &Tensor::from_slice(&pos).to(gpu),
                batch,
                &kv,
            )
        })
    };
    let check = |what: &str, got: &Tensor, parts: &[(usize, usize, usize)]| {
        let want = Tensor::cat(
            &parts
                .iter()
                .map(|&(s, from, n)| reference(s, from, n))
                .collect::<Vec<_>>(),
            0,
        );
        let differ = got.ne_tensor(&want).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(
            differ, 0,
            "{what}: {differ} elements differ from the packed forward"
        );
    };
    // Two prompts' first chunks together, then their second chunks over the cached prefix.
    for parts in [[(0, 0, 200), (1, 0, 140)], [(0, 200, 90), (1, 140, 5)]] {
        let seqs: Vec<PagedSeq> = parts
            .iter()
            .map(|&(s, from, n)| seq(s, from + n, n))
            .collect();
        let got = run(&parts, &PagedBatch::new_invariant(&seqs, gpu, bs));
        check(&format!("prefill {parts:?}"), &got, &parts);
    }
    // Decode steps of both rows, laid out as the engine's CUDA graphs lay them out.
    let counters = decode_counters(2, gpu);
    for step in 0..5usize {
        let parts = [(0usize, 290 + step, 1usize), (1, 145 + step, 1)];
        let width = 19i64;
        let mut tables = vec![0i32; 2 * width as usize];
        for (row, &(s, from, _)) in parts.iter().enumerate() {
            for b in 0..(from + 1).div_ceil(bs) {
                tables[row * width as usize + b] = (slot(s, b * bs) / bs as i64) as i32;
            }
        }
        let lens_v: Vec<i32> = parts.iter().map(|&(_, from, _)| from as i32 + 1).collect();
        let mapping: Vec<i64> = parts.iter().map(|&(s, from, _)| slot(s, from)).collect();
        let batch = PagedBatch::decode_paged(
            &Tensor::from_slice(&mapping).to(gpu),
            &Tensor::from_slice(&tables).view([2, width]).to(gpu),
            &Tensor::from_slice(&lens_v).to(gpu),
            &counters,
            bs,
        );
        let got = run(&parts, &batch);
        check(&format!("decode step {step}"), &got, &parts);
    }
}

/// Programmatic dependent launch lets each decode kernel start before the one it follows
/// has finished; a kernel that read its input (or wrote anything) before its wait would
/// race. The kernels are deterministic, so a decode step replayed as a CUDA graph must give
/// the same bits with PDL on and off (`MANTA_PDL=0`), replay after replay, at one and two
/// rows (the GEMV path), five (cuBLAS with the norm and SiLU kernels) and forty (enough
/// sequences that attention runs unsplit, one CTA per sequence and kv head).
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn programmatic_dependent_launch_changes_no_bits() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("no CUDA device: nothing to check here");
        return;
    };
    let gpu = Device::Cuda(index);
    let cfg = four_layers_of_0_6b(4096);
    tch::manual_seed(9);
    let mut vs = VarStore::new(gpu);
    let mut m = CausalLm::new(&vs.root(), &cfg);
    vs.bfloat16();
    m.enable_decode_kernels().expect("kernels build");
    let (bs, per_row, context) = (16i64, 32i64, 300i64);
    for rows in [1i64, 2, 5, 40] {
        let kv = PagedKvCache::new(&cfg, (rows * per_row) as usize, 16, Kind::BFloat16, gpu);
        for i in 0..cfg.num_hidden_layers as usize {
            let (k, v) = kv.layer(i);
            let _ = k.shallow_clone().normal_(0.0, 1.0);
            let _ = v.shallow_clone().normal_(0.0, 1.0);
        }
        let tables = Tensor::arange(rows * per_row, (Kind::Int, gpu)).view([rows, per_row]);
        let lens = Tensor::full([rows], context, (Kind::Int, gpu));
        let slots = Tensor::arange(rows, (Kind::Int64, gpu)) * per_row * bs + (context - 1);
        let ids = (Tensor::arange(rows, (Kind::Int64, gpu)) * 797 + 13).remainder(4096);
        let positions = Tensor::full([rows], context - 1, (Kind::Int64, gpu));
        let counters = decode_counters(rows, gpu);
        let step = || {
            let b = PagedBatch::decode_paged(&slots, &tables, &lens, &counters, bs as usize);
            m.logits_f32(&m.forward_paged(&ids, &positions, &b, &kv))
        };
        let _guard = tch::no_grad_guard();
        let _ = step();
        let capture = |pdl: &str| {
            manta_knobs::set_override("MANTA_PDL", pdl).expect("a PDL setting");
            let captured = manta_cuda::CudaGraph::capture(index, None, step).expect("capture");
            manta_knobs::clear_overrides();
            captured
        };
        let (serial, serial_out) = capture("0");
        let (overlapped, overlapped_out) = capture("1");
        serial.replay().expect("replay");
        let want = serial_out.to_device(Device::Cpu);
        for replay in 0..50 {
            overlapped.replay().expect("replay");
            let got = overlapped_out.to_device(Device::Cpu);
            assert!(
                got.equal(&want),
                "{rows} rows, replay {replay}: logits with PDL differ from the serial step's by \
                 {:e}",
                max_abs_diff(&got, &want)
            );
        }
    }
}

use super::*;
use tch::{Device, Kind, Tensor};

#[test]
fn the_test_gpu_is_an_index_of_a_visible_gpu() {
    assert_eq!(parse_test_gpu(None, 1), Ok(0));
    assert_eq!(parse_test_gpu(Some(" 1 "), 2), Ok(1));
    let e = parse_test_gpu(Some("one"), 2).unwrap_err();
    assert!(
        e.contains("MANTA_TEST_GPU=\"one\" is not a GPU index"),
        "{e}"
    );
    let e = parse_test_gpu(Some("1"), 1).unwrap_err();
    assert!(
        e.contains("MANTA_TEST_GPU=1, but libtorch sees 1 CUDA device"),
        "{e}"
    );
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn a_graph_replays_its_captured_work_on_new_inputs() {
    let Some(gpu) = crate::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = crate::gpu_test_lock();
    let dev = Device::Cuda(gpu);
    let x = Tensor::zeros([4], (Kind::Float, dev));
    let w = Tensor::ones([4], (Kind::Float, dev)) * 2.0;
    let _ = (&x * &w + 1.0).sum(Kind::Float); // warm-up
    let (graph, y) = CudaGraph::capture(gpu, None, || (&x * &w + 1.0).sum(Kind::Float)).unwrap();
    let mut xin = x.shallow_clone();
    xin.copy_(&Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).to(dev));
    graph.replay().unwrap();
    assert_eq!(y.double_value(&[]), 24.0);
    assert!(total_memory(gpu).unwrap() > 0);
}

/// Waiting on an event sees the copy queued before it, while later work is still queued.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn an_event_waits_for_the_work_queued_before_it() {
    let Some(gpu) = crate::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = crate::gpu_test_lock();
    let dev = Device::Cuda(gpu);
    let a = Tensor::randn([2048, 2048], (Kind::Float, dev));
    let x = (a.matmul(&a).sum(Kind::Float) * 0.0 + 7.0).reshape([1]);
    let mut host = pin_memory(&Tensor::zeros([1], (Kind::Float, Device::Cpu))).unwrap();
    copy_nonblocking(&mut host, &x).unwrap();
    let event = CudaEvent::record(gpu).unwrap();
    // Work queued after the event, which the wait below need not cover.
    let mut later = a.shallow_clone();
    for _ in 0..8 {
        later = later.matmul(&a);
    }
    event.synchronize().unwrap();
    assert_eq!(host.double_value(&[0]), 7.0);
    drop(later);
}

/// Varlen flash attention against fp32 attention with an explicit mask, per sequence:
/// sequences with a cached prefix (more keys than queries) see keys up to their own
/// position, aligned at the end of their keys; grouped heads (GQA) share a key head.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn varlen_flash_attention_matches_masked_attention() {
    let Some(gpu) = crate::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = crate::gpu_test_lock();
    tch::manual_seed(11);
    let dev = Device::Cuda(gpu);
    let (heads, kv_heads, hd) = (8i64, 2i64, 128i64);
    // (queries, keys) per sequence: cached prefixes, a plain prefill, one token.
    let seqs = [(5i64, 12i64), (7, 7), (1, 9), (64, 200)];
    let (tq, tk): (i64, i64) = (
        seqs.iter().map(|s| s.0).sum(),
        seqs.iter().map(|s| s.1).sum(),
    );
    let opts = (Kind::BFloat16, dev);
    let q = Tensor::randn([tq, heads, hd], opts);
    let k = Tensor::randn([tk, kv_heads, hd], opts);
    let v = Tensor::randn([tk, kv_heads, hd], opts);
    let cum = |f: fn(&(i64, i64)) -> i64| {
        let mut c = vec![0i32];
        for s in &seqs {
            c.push(c[c.len() - 1] + f(s) as i32);
        }
        Tensor::from_slice(&c).to(dev)
    };
    let scale = 1.0 / (hd as f64).sqrt();
    let out =
        flash_attention_varlen(&q, &k, &v, &cum(|s| s.0), &cum(|s| s.1), 64, 200, scale).unwrap();
    assert_eq!(out.size(), [tq, heads, hd]);
    let (mut at_q, mut at_k) = (0i64, 0i64);
    for &(nq, nk) in &seqs {
        let qs = q.narrow(0, at_q, nq).to_kind(Kind::Float).transpose(0, 1);
        let rep = |t: &Tensor| {
            t.narrow(0, at_k, nk)
                .to_kind(Kind::Float)
                .transpose(0, 1)
                .repeat_interleave_self_int(heads / kv_heads, 0, None)
        };
        let scores = qs.matmul(&rep(&k).transpose(1, 2)) * scale;
        let q_pos = Tensor::arange_start(nk - nq, nk, (Kind::Int64, dev));
        let k_pos = Tensor::arange(nk, (Kind::Int64, dev));
        let visible = k_pos.unsqueeze(0).le_tensor(&q_pos.unsqueeze(1));
        let scores = scores.masked_fill(&visible.logical_not(), f64::NEG_INFINITY);
        let expected = scores
            .softmax(-1, Kind::Float)
            .matmul(&rep(&v))
            .transpose(0, 1);
        let got = out.narrow(0, at_q, nq).to_kind(Kind::Float);
        let err = (&got - &expected).abs().max().double_value(&[]);
        assert!(
            err < 2e-2,
            "sequence ({nq} queries, {nk} keys): max error {err}"
        );
        at_q += nq;
        at_k += nk;
    }
}

/// The trainer's fused kernels (rotary embedding, RMSNorm, gated activation) compile
/// for Ampere and Hopper with NVRTC, with no GPU needed.
#[test]
fn trainer_kernels_compile_for_hopper_and_ampere() {
    if !built_with_cuda() {
        eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
        return;
    }
    type CompileCheck = fn(u32) -> Result<(), CudaError>;
    let kernels: [(&str, CompileCheck); 3] = [
        ("rope", rope::compile_check),
        ("rms_norm", rms_norm::compile_check),
        ("swiglu", swiglu::compile_check),
    ];
    for (name, compile) in kernels {
        for arch in [80, 90] {
            if let Err(e) = compile(arch) {
                panic!("{name}, sm_{arch}: {e}");
            }
        }
    }
}

/// The trainer's fused ops refuse CPU tensors with an error that says so.
#[test]
fn trainer_kernels_refuse_cpu_tensors_with_an_error() {
    if !built_with_cuda() {
        eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
        return;
    }
    let rows = Tensor::zeros([4, 16], (Kind::BFloat16, Device::Cpu));
    let table = Tensor::zeros([4, 8], (Kind::BFloat16, Device::Cpu));
    let weight = Tensor::ones([16], (Kind::BFloat16, Device::Cpu));
    let errors = [
        rope::rope(&rows.view([4, 2, 8]), &table, &table).map(|_| ()),
        rms_norm::rms_norm(&rows, &weight, 1e-6).map(|_| ()),
        swiglu::swiglu(&rows, &rows).map(|_| ()),
    ];
    for e in errors {
        let e = e.expect_err("a CPU tensor").to_string();
        assert!(e.contains("CUDA tensor"), "{e}");
    }
}

/// NVRTC compiles every decode kernel for the shapes the engine uses (Qwen3-0.6B,
/// Qwen3-8B, and a Qwen2-0.5B-like head_dim 64 without q/k norms) on Hopper, with no
/// GPU needed.
#[test]
fn decode_kernels_compile_for_hopper() {
    if !built_with_cuda() {
        eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
        return;
    }
    let shapes = [
        (1024, 3072, 16, 8, 128, true),
        (4096, 12288, 32, 8, 128, true),
        (896, 4864, 14, 2, 64, false),
    ];
    for (hidden, intermediate, heads, kv_heads, head_dim, qk_norm) in shapes {
        let shape = KernelShape {
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            qk_norm,
        };
        if let Err(e) = decode_kernels_compile(shape, 90) {
            panic!("{shape:?}: {e}");
        }
    }
}

/// The kernel against gather + softmax in fp32, over a shuffled block table.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn paged_decode_attention_matches_gathered_attention() {
    let Some(gpu) = crate::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = crate::gpu_test_lock();
    let dev = Device::Cuda(gpu);
    tch::manual_seed(3);
    // Four rows split the context across CTAs (the lane-group kernel); forty rows fill
    // the GPU unsplit (the tensor-core kernel, MANTA_PAGED_MMA).
    let few = vec![1i32, 17, 200, 333];
    let many: Vec<i32> = (0..40).map(|i| 1 + (i * 97) % 384).collect();
    let shapes = [(16i64, 8i64, 128i64), (32, 8, 128), (8, 8, 64)];
    // Queries × 8 make scores of spread ~8: a sharp softmax whose running max jumps
    // by several units between tokens, so the rescaling of the running sums matters.
    for ((nh, nkv, hd), lens_v, sharpness) in shapes.iter().flat_map(|s| {
        [
            (*s, few.clone(), 1.0),
            (*s, many.clone(), 1.0),
            (*s, many.clone(), 8.0),
        ]
    }) {
        let (bs, blocks) = (16i64, 64i64);
        let kp = Tensor::randn([blocks * bs, nkv, hd], (Kind::BFloat16, dev));
        let vp = Tensor::randn([blocks * bs, nkv, hd], (Kind::BFloat16, dev));
        let b = lens_v.len() as i64;
        let q = Tensor::randn([b, nh, hd], (Kind::BFloat16, dev)) * sharpness;
        let max_blocks = 24i64;
        let perm: Vec<i64> =
            Vec::try_from(&Tensor::randperm(blocks, (Kind::Int64, Device::Cpu))).unwrap();
        let table_v: Vec<i32> = (0..b * max_blocks)
            .map(|i| perm[(i as usize * 7) % perm.len()] as i32)
            .collect();
        let tables = Tensor::from_slice(&table_v).view([b, max_blocks]).to(dev);
        let lens = Tensor::from_slice(&lens_v).to(dev);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = q.zeros_like();
        paged_decode_attention(
            &q,
            &kp,
            &vp,
            &tables,
            &lens,
            None,
            &mut out,
            bs as usize,
            scale,
        )
        .unwrap();
        // Merged in the kernel: twice over one counter buffer, which must stay zero.
        let counters = Tensor::zeros([b * nkv], (Kind::Int, dev));
        for _ in 0..2 {
            let mut merged = q.zeros_like();
            let c = Some(&counters);
            paged_decode_attention(
                &q,
                &kp,
                &vp,
                &tables,
                &lens,
                c,
                &mut merged,
                bs as usize,
                scale,
            )
            .unwrap();
            assert!(
                merged.equal(&out),
                "in-kernel merge differs from the combine kernel"
            );
        }
        assert_eq!(
            counters.abs().sum(Kind::Int64).int64_value(&[]),
            0,
            "counters reset"
        );
        for row in 0..b as usize {
            let len = lens_v[row] as i64;
            let slots: Vec<i64> = (0..len)
                .map(|t| {
                    table_v[row * max_blocks as usize + (t / bs) as usize] as i64 * bs + t % bs
                })
                .collect();
            let idx = Tensor::from_slice(&slots).to(dev);
            let k = kp.index_select(0, &idx).to_kind(Kind::Float); // [len, nkv, hd]
            let v = vp.index_select(0, &idx).to_kind(Kind::Float);
            let qr = q
                .get(row as i64)
                .to_kind(Kind::Float)
                .view([nkv, nh / nkv, hd]);
            let scores = qr.matmul(&k.permute([1, 2, 0])) * scale; // [nkv, rep, len]
            let expect = scores
                .softmax(-1, Kind::Float)
                .matmul(&v.transpose(0, 1))
                .view([nh, hd]);
            let got = out.get(row as i64).to_kind(Kind::Float);
            let diff = (got - &expect).abs().max().double_value(&[]);
            assert!(
                diff < 2e-2,
                "heads {nh}/{nkv} hd {hd} batch {b} sharpness {sharpness} row {row}: max diff {diff}"
            );
        }
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

/// The fused decode ops against the tensor ops they replace (bf16 on the GPU).
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn lt_linear_matches_the_fp32_product() {
    let Some(gpu) = crate::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = crate::gpu_test_lock();
    let bf = (Kind::BFloat16, Device::Cuda(gpu));
    tch::manual_seed(9);
    // Decode-sized rows, a projection's shape and an odd one, and an x that starts 2
    // bytes into its buffer (cuBLASLt must pick a kernel for that alignment).
    for (rows, n, k, offset) in [
        (1i64, 4096i64, 1024i64, 0i64),
        (3, 1000, 72, 0),
        (64, 6144, 1024, 0),
        (130, 1024, 3072, 0),
        (64, 512, 256, 1),
    ] {
        let buf = Tensor::randn([rows * k + offset], bf);
        let x = buf.narrow(0, offset, rows * k).view([rows, k]);
        let w = Tensor::randn([n, k], bf) * 0.05;
        let mut y = Tensor::empty([rows, n], bf);
        linear(&x, &w, &mut y).unwrap();
        let want = x
            .to_kind(Kind::Float)
            .matmul(&w.to_kind(Kind::Float).transpose(0, 1));
        let scale = want.abs().max().double_value(&[]);
        let d = (y.to_kind(Kind::Float) - &want)
            .abs()
            .max()
            .double_value(&[]);
        // bf16 output: within one ulp (≤ 2⁻⁷ of the largest value; a wrong layout or
        // operand is off by the values themselves).
        assert!(
            d <= 8e-3 * scale,
            "{rows}x{k} by {n}x{k} (offset {offset}): max diff {d} of {scale}"
        );
    }
    let x = Tensor::randn([4, 64], bf);
    let w = Tensor::randn([32, 64], bf);
    let mut wrong = Tensor::empty([4, 31], bf);
    let e = linear(&x, &w, &mut wrong).unwrap_err().to_string();
    assert!(e.contains("y must be [4, 32]"), "{e}");
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_ops_match_the_tensor_ops_they_replace() {
    let Some(gpu) = crate::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = crate::gpu_test_lock();
    let dev = Device::Cuda(gpu);
    let bf = (Kind::BFloat16, dev);
    tch::manual_seed(5);
    let eps = 1e-6;
    // add_rms_norm, with and without the residual add.
    for hidden in [1024i64, 4096, 896] {
        let n = 7;
        let x = Tensor::randn([n, hidden], bf);
        let delta = Tensor::randn([n, hidden], bf);
        let w = Tensor::rand([hidden], bf) + 0.5;
        let sum = &x + &delta;
        // transformers' order: the normalised row rounded to bf16, then times the weight.
        let expect = sum.rms_norm([hidden], None::<Tensor>, eps) * &w;
        let mut residual = x.copy();
        let mut out = x.empty_like();
        add_rms_norm(&mut residual, Some(&delta), &w, &mut out, eps).unwrap();
        assert_eq!(max_diff(&residual, &sum), 0.0, "hidden {hidden}: residual");
        let d = max_diff(&out, &expect);
        assert!(d < 3e-2, "hidden {hidden}: add_rms_norm max diff {d}");
        let mut plain = x.empty_like();
        let mut same = x.copy();
        add_rms_norm(&mut same, None, &w, &mut plain, eps).unwrap();
        let d = max_diff(&plain, &(x.rms_norm([hidden], None::<Tensor>, eps) * &w));
        assert!(d < 3e-2, "hidden {hidden}: rms_norm max diff {d}");
        assert_eq!(
            max_diff(&same, &x),
            0.0,
            "no delta leaves the residual alone"
        );
    }
    // silu_mul: decode's few rows and a prefill chunk's thousands (a grid of thousands
    // of blocks).
    for (rows, inter) in [(5i64, 3072i64), (5, 4864), (3001, 3072)] {
        let gu = Tensor::randn([rows, 2 * inter], bf) * 3.0;
        let expect = gu.narrow(1, 0, inter).silu() * gu.narrow(1, inter, inter);
        let mut out = Tensor::empty([rows, inter], bf);
        silu_mul(&gu, &mut out).unwrap();
        let d = max_diff(&out, &expect);
        assert!(d < 6e-2, "{rows} x {inter}: silu_mul max diff {d}");
    }
    // qk_norm_rope_store against norm + rotate-half rope + index_copy into the pools;
    // 7 + 2 × 1 heads leave most of a CTA with no head.
    for (nh, nkv, hd, norm) in [
        (16i64, 8i64, 128i64, true),
        (14, 2, 64, false),
        (7, 1, 128, true),
        (4, 2, 256, true),
    ] {
        let n = 6i64;
        let slots_total = 64i64;
        let qkv = Tensor::randn([n, (nh + 2 * nkv) * hd], bf);
        let qw = Tensor::rand([hd], bf) + 0.5;
        let kw = Tensor::rand([hd], bf) + 0.5;
        let positions = Tensor::from_slice(&[0i64, 1, 17, 500, 4095, 40000]).to(dev);
        let inv_freq = Tensor::pow_scalar(
            1_000_000f64,
            &(Tensor::arange_start_step(0, hd, 2, (Kind::Float, dev)) / hd as f64),
        )
        .reciprocal();
        let slots = Tensor::from_slice(&[3i64, 9, 10, 40, 41, 63]).to(dev);
        let kp = Tensor::zeros([slots_total, nkv, hd], bf);
        let vp = Tensor::zeros([slots_total, nkv, hd], bf);
        let mut q_out = Tensor::empty([n, nh, hd], bf);
        let weights = norm.then_some((&qw, &kw));
        let rope = rope_table(&positions, &inv_freq).unwrap();
        qk_norm_rope_store(&qkv, weights, &rope, &slots, &kp, &vp, &mut q_out, eps).unwrap();
        // The reference, as the model's composite path computes it.
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        let (cos, sin) = (
            emb.cos().to_kind(Kind::BFloat16).unsqueeze(1),
            emb.sin().to_kind(Kind::BFloat16).unsqueeze(1),
        );
        // The table holds the model's rounded cosines and sines, bit for bit.
        let half = hd / 2;
        assert_eq!(
            max_diff(
                &rope.narrow(1, 0, half),
                &cos.squeeze_dim(1).narrow(1, 0, half)
            ),
            0.0,
            "rope table cosines"
        );
        assert_eq!(
            max_diff(
                &rope.narrow(1, half, half),
                &sin.squeeze_dim(1).narrow(1, 0, half)
            ),
            0.0,
            "rope table sines"
        );
        let what = format!("heads {nh}/{nkv}, head_dim {hd}");
        let rotate = |x: &Tensor| {
            let rot = Tensor::cat(
                &[&x.narrow(-1, half, half).neg(), &x.narrow(-1, 0, half)],
                -1,
            );
            x * &cos + rot * &sin
        };
        let q = qkv.narrow(1, 0, nh * hd).view([n, nh, hd]);
        let k = qkv.narrow(1, nh * hd, nkv * hd).view([n, nkv, hd]);
        let v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view([n, nkv, hd]);
        let (q, k) = if norm {
            (
                q.rms_norm([hd], None::<Tensor>, eps) * &qw,
                k.rms_norm([hd], None::<Tensor>, eps) * &kw,
            )
        } else {
            (q, k)
        };
        let (q, k) = (rotate(&q), rotate(&k));
        let d = max_diff(&q_out, &q);
        assert!(d < 6e-2, "{what}: queries max diff {d}");
        let d = max_diff(&kp.index_select(0, &slots), &k);
        assert!(d < 6e-2, "{what}: keys max diff {d}");
        assert_eq!(
            max_diff(&vp.index_select(0, &slots), &v),
            0.0,
            "values are copied"
        );
        let untouched = Tensor::from_slice(&[0i64, 1, 2, 4, 62]).to(dev);
        assert_eq!(
            kp.index_select(0, &untouched)
                .abs()
                .sum(Kind::Float)
                .double_value(&[]),
            0.0,
            "only the given slots are written"
        );
    }
}

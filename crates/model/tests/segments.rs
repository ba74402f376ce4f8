//! `Attention::Segments`: sequences packed back to back in one row, positions restarting
//! per sequence, give each sequence's own logits and gradients (no attention across
//! sequence boundaries), the same as the T x T mask of `Attention::Packed`. On CUDA (bf16,
//! flash kernels) the same holds within bf16 rounding; that part returns early, saying
//! so, on machines without CUDA.

mod common;

use common::{config, ids, max_abs_diff, model, positions};
use manta_model::{Attention, CausalLm};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const SEQ: [i64; 16] = [3, 17, 8, 44, 1, 29, 52, 0, 11, 9, 23, 31, 2, 40, 7, 13];

/// Lengths 5, 3, 3 and 5: the two 3s run as one batched call, the rest alone.
const LENGTHS: [i64; 4] = [5, 3, 3, 5];

fn packed_inputs(device: Device) -> (Tensor, Tensor, Tensor) {
    let mut pos = Vec::new();
    let mut seq_ids = Vec::new();
    for (i, &len) in LENGTHS.iter().enumerate() {
        pos.extend(0..len);
        seq_ids.extend(std::iter::repeat_n(i as i64, len as usize));
    }
    let n = SEQ.len() as i64;
    (
        Tensor::from_slice(&SEQ).view([1, n]).to(device),
        Tensor::from_slice(&pos).view([1, n]).to(device),
        Tensor::from_slice(&seq_ids).view([1, n]).to(device),
    )
}

/// A small random bf16 Qwen3 on `device`, head_dim 64 so that flash attention applies.
fn gpu_model(device: Device, seed: i64) -> (VarStore, CausalLm) {
    let cfg = manta_model::ModelConfig::from_json_str(
        r#"{"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 60, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 512,
        "initializer_range": 0.05}"#,
        "gpu segments config",
    )
    .unwrap();
    tch::manual_seed(seed);
    let mut vs = VarStore::new(device);
    let m = CausalLm::new(&vs.root(), &cfg);
    vs.bfloat16();
    (vs, m)
}

/// Each sequence's logits computed on its own, concatenated [T, vocab].
fn alone(m: &CausalLm, device: Device) -> Tensor {
    let mut out = Vec::new();
    let mut offset = 0usize;
    for &len in &LENGTHS {
        let s = &SEQ[offset..offset + len as usize];
        let logits = m.forward(
            &ids(&[s]).to(device),
            &positions(1, len, 0).to(device),
            &Attention::Causal { key_mask: None },
            None,
        );
        out.push(logits.get(0));
        offset += len as usize;
    }
    Tensor::cat(&out, 0)
}

#[test]
fn segments_equal_each_sequence_alone_and_the_packed_mask() {
    let cfg = config("qwen3", false);
    let (_vs, m) = model(&cfg, 7);
    let (input, pos, seq_ids) = packed_inputs(Device::Cpu);
    let segments = tch::no_grad(|| {
        m.forward(
            &input,
            &pos,
            &Attention::Segments { lengths: &LENGTHS },
            None,
        )
        .get(0)
    });
    let reference = tch::no_grad(|| alone(&m, Device::Cpu));
    let masked = tch::no_grad(|| {
        m.forward(&input, &pos, &Attention::Packed { seq_ids: &seq_ids }, None)
            .get(0)
    });
    assert!(max_abs_diff(&segments, &reference) < 1e-5);
    assert!(max_abs_diff(&segments, &masked) < 1e-5);
    // Plain causal attention over the row (leaking across sequences) is different.
    let leaky = tch::no_grad(|| {
        m.forward(&input, &pos, &Attention::Causal { key_mask: None }, None)
            .get(0)
    });
    assert!(max_abs_diff(&leaky, &reference) > 1e-3);
}

#[test]
fn segment_gradients_equal_the_packed_masks() {
    let cfg = config("qwen3", true);
    let (input, pos, seq_ids) = packed_inputs(Device::Cpu);
    // One model for every variant (tests run in parallel and share the global seed).
    let (vs, mut m) = model(&cfg, 8);
    let weights = Tensor::arange(SEQ.len() as i64, (Kind::Float, Device::Cpu)) / 10.0;
    let mut grads = |attn: &Attention, checkpointing: bool| {
        m.set_gradient_checkpointing(checkpointing);
        for (_, v) in vs.variables() {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let _ = m.forward_backward(&input, &pos, attn, |h| {
            let logp = m.logits(&h.get(0)).log_softmax(-1, Kind::Float);
            (logp.select(1, 0) * &weights).sum(Kind::Float)
        });
        let mut g: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .map(|(k, v)| (k, v.grad().copy()))
            .collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        g
    };
    let masked = grads(&Attention::Packed { seq_ids: &seq_ids }, false);
    for checkpointing in [false, true] {
        let segmented = grads(&Attention::Segments { lengths: &LENGTHS }, checkpointing);
        for ((name, a), (_, b)) in segmented.iter().zip(&masked) {
            let d = max_abs_diff(a, b) / b.abs().max().double_value(&[]);
            assert!(
                d < 1e-5,
                "{name} (checkpointing {checkpointing}): {d} relative"
            );
        }
    }
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn cuda_bf16_segments_match_each_sequence_alone() {
    let Some(gpu) = manta_cuda::test_gpu() else {
        eprintln!("skipped: CUDA is not available (run this test binary on the GPU machine)");
        return;
    };
    let device = Device::Cuda(gpu);
    let (_vs, m) = gpu_model(device, 3);
    let (input, pos, _) = packed_inputs(device);
    let segments = tch::no_grad(|| {
        m.forward(
            &input,
            &pos,
            &Attention::Segments { lengths: &LENGTHS },
            None,
        )
        .get(0)
        .to_kind(Kind::Float)
    });
    let reference = tch::no_grad(|| alone(&m, device).to_kind(Kind::Float));
    let scale = reference.abs().max().double_value(&[]);
    let d = max_abs_diff(&segments, &reference) / scale;
    assert!(
        d < 2e-2,
        "bf16 segments differ from each sequence alone by {d} (relative)"
    );
}

/// The variable-length flash kernel (one call per layer) and one SDPA call per run of
/// equal lengths give the same logits and parameter gradients on CUDA in bf16, within
/// bf16 rounding; both differ from a row that leaks attention across sequences.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn cuda_varlen_segments_match_per_run_segments_in_gradients() {
    use manta_model::SegmentKernel;
    let Some(gpu) = manta_cuda::test_gpu() else {
        eprintln!("skipped: CUDA is not available (run this test binary on the GPU machine)");
        return;
    };
    let device = Device::Cuda(gpu);
    let (vs, mut m) = gpu_model(device, 5);
    let (input, pos, _) = packed_inputs(device);
    let weights = Tensor::arange(SEQ.len() as i64, (Kind::Float, device)) / 10.0;
    let mut run = |kernel: SegmentKernel, attn: &Attention| {
        m.set_segment_kernel(kernel);
        for (_, v) in vs.variables() {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let mut logits = None;
        let _ = m.forward_backward(&input, &pos, attn, |h| {
            let l = m.logits(&h.get(0)).to_kind(Kind::Float);
            logits = Some(l.detach().copy());
            (l.log_softmax(-1, Kind::Float).select(1, 0) * &weights).sum(Kind::Float)
        });
        let mut g: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .map(|(k, v)| (k, v.grad().to_kind(Kind::Float)))
            .collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        (logits.expect("the loss closure ran"), g)
    };
    let segments = Attention::Segments { lengths: &LENGTHS };
    let (varlen_logits, varlen) = run(SegmentKernel::Varlen, &segments);
    let (per_run_logits, per_run) = run(SegmentKernel::PerRun, &segments);
    let scale = per_run_logits.abs().max().double_value(&[]);
    let d = max_abs_diff(&varlen_logits, &per_run_logits) / scale;
    assert!(d < 2e-2, "logits differ by {d} (relative)");
    assert_eq!(varlen.len(), per_run.len());
    for ((name, a), (_, b)) in varlen.iter().zip(&per_run) {
        let d = max_abs_diff(a, b) / b.abs().max().double_value(&[]).max(1e-12);
        assert!(d < 5e-2, "{name}: gradients differ by {d} (relative)");
    }
    let (leaky_logits, _) = run(SegmentKernel::Varlen, &Attention::Causal { key_mask: None });
    let leak = max_abs_diff(&leaky_logits, &per_run_logits) / scale;
    assert!(
        leak > 3.0 * d && leak > 1e-3,
        "attention across sequences changes the logits by {leak}, kernels differ by {d}"
    );
}

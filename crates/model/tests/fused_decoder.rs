//! The decoder with each fused kernel (on unless its knob is 0) against its tensor ops, on a
//! small random bf16 Qwen3 (head_dim 128, q/k head norms, GQA) on CUDA: a left-to-right
//! batch (`Attention::Causal`, B = 2) with every activation kept, and packed sequences
//! (`Attention::Segments`) with every layer recomputed.
//!
//! - the rotary embedding (`MANTA_FUSED_ROPE`) and the MLP's gated activation
//!   (`MANTA_FUSED_SWIGLU`): the forward is bit-identical (logits and the loss);
//! - RMSNorm (`MANTA_FUSED_RMSNORM`): its sums of squares run in another order than
//!   libtorch's, so a normed element can round the other way and the logits move by a bf16
//!   ulp here and there: the loss within 1e-3, every logit within 5e-2 of the largest;
//! - the parameters' gradients differ only by rounding (the fused backwards round once or
//!   in another order where autograd rounds each op, a bf16 ulp here and there, carried
//!   through the bf16 GEMMs), so each parameter's gradient is within 3e-2 of its largest
//!   element and 1e-2 on average — a wrong sign or term in a backward moves a gradient by
//!   its whole size and the projections' by tens of percent.
//!
//! Returns early, saying so, without a CUDA device.

use std::sync::Mutex;

use manta_model::{fused_runs, Attention, CausalLm, Fused, ModelConfig};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// One test at a time: they share the knob override and the CUDA generator.
static SERIAL: Mutex<()> = Mutex::new(());

const VOCAB: i64 = 1000;

fn config() -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "vocab_size": {VOCAB}, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": false,
            "max_position_embeddings": 4096, "initializer_range": 0.05}}"#
        ),
        "fused decoder test config",
    )
    .expect("valid config")
}

/// One path's results, on the CPU.
struct Outcome {
    logits: Tensor,
    loss: Tensor,
    /// (name, fp32 gradient), sorted by name.
    grads: Vec<(String, Tensor)>,
}

/// The batch on a fresh copy of `reference`, with the fused kernel of `knob` on or off:
/// logits without a graph, then a `forward_backward` of a log-likelihood loss.
fn run(
    Case { knob, op, .. }: Case,
    reference: &VarStore,
    ids: &Tensor,
    positions: &Tensor,
    attn: &Attention,
    recompute: bool,
    fused: bool,
) -> Outcome {
    manta_knobs::set_override(knob, if fused { "1" } else { "0" }).expect("a knob");
    let runs_before = fused_runs(op);
    let device = reference.device();
    let mut vs = VarStore::new(device);
    let mut m = CausalLm::new(&vs.root(), &config());
    vs.bfloat16();
    vs.copy(reference).expect("same variables");
    m.set_gradient_checkpointing(recompute);
    let logits = tch::no_grad(|| m.forward(ids, positions, attn, None))
        .to_device(Device::Cpu)
        .to_kind(Kind::Float);
    // Next-token log-likelihood of the ids themselves.
    let targets = ids.roll([-1], [1]);
    let loss = m.forward_backward(ids, positions, attn, |hidden| {
        m.logits_f32(hidden)
            .log_softmax(-1, Kind::Float)
            .gather(-1, &targets.unsqueeze(-1), false)
            .mean(Kind::Float)
            .neg()
    });
    let mut grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, var)| {
            let g = var.grad();
            assert!(g.defined(), "{name} has no gradient");
            (name, g.to_device(Device::Cpu).to_kind(Kind::Float))
        })
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    manta_knobs::clear_overrides();
    // The two paths give the same values: that the kernels ran is asserted here.
    let runs = fused_runs(op) - runs_before;
    assert_eq!(
        runs > 0,
        fused,
        "{knob}={}: {op:?} ran {runs} times",
        fused as u8
    );
    Outcome {
        logits,
        loss: loss.to_device(Device::Cpu),
        grads,
    }
}

/// How a fused kernel's forward compares with the tensor ops.
#[derive(Clone, Copy, PartialEq)]
enum Forward {
    BitIdentical,
    WithinRounding,
}

/// A fused kernel under test: its knob, the op it turns on, and what its forward promises.
#[derive(Clone, Copy)]
struct Case {
    knob: &'static str,
    op: Fused,
    forward: Forward,
}

fn check(
    case: Case,
    what: &str,
    reference: &VarStore,
    ids: &Tensor,
    positions: &Tensor,
    attn: &Attention,
    recompute: bool,
) {
    let Case { knob, forward, .. } = case;
    let want = run(case, reference, ids, positions, attn, recompute, false);
    let got = run(case, reference, ids, positions, attn, recompute, true);
    let what = format!("{knob}, {what}");
    let differ = got
        .logits
        .ne_tensor(&want.logits)
        .sum(Kind::Int64)
        .int64_value(&[]);
    let (loss, want_loss) = (got.loss.double_value(&[]), want.loss.double_value(&[]));
    if forward == Forward::BitIdentical {
        assert_eq!(differ, 0, "{what}: {differ} logits differ");
        assert!(
            got.loss.equal(&want.loss),
            "{what}: loss {loss} vs {want_loss}"
        );
    } else {
        let gap = (&got.logits - &want.logits).abs().max().double_value(&[])
            / want.logits.abs().max().double_value(&[]).max(1e-30);
        eprintln!("{what}: {differ} logits differ, by at most {gap:.2e} of the largest");
        assert!(gap <= 5e-2, "{what}: logits off by {gap:e} of the largest");
        assert!(
            (loss - want_loss).abs() <= 1e-3 * want_loss.abs(),
            "{what}: loss {loss} vs {want_loss}"
        );
    }
    for ((name, g), (_, w)) in got.grads.iter().zip(&want.grads) {
        let d = (g - w).abs();
        let scale = w.abs();
        let max = d.max().double_value(&[]) / scale.max().double_value(&[]).max(1e-30);
        let mean = d.mean(Kind::Double).double_value(&[])
            / scale.mean(Kind::Double).double_value(&[]).max(1e-30);
        eprintln!("{what} {name}: gradient max {max:.2e}, mean {mean:.2e}");
        assert!(
            max <= 3e-2 && mean <= 1e-2,
            "{what} {name}: gradient off by {max:e} (max), {mean:e} (mean)"
        );
    }
}

/// Every fused kernel of the decoder against its tensor ops: a causal batch, then packed
/// sequences with every layer recomputed.
fn check_knob(case: Case, compile: fn(u32) -> Result<(), manta_cuda::CudaError>) {
    let knob = case.knob;
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // The fused path is taken only where its kernels compile: make sure they do, so the
    // comparison is not of the tensor ops with themselves.
    let arch = manta_cuda::device_arch(index).expect("device arch");
    compile(arch).unwrap_or_else(|e| panic!("{knob}'s kernels do not compile: {e}"));
    let gpu = Device::Cuda(index);
    tch::manual_seed(31);
    let mut reference = VarStore::new(gpu);
    let _ = CausalLm::new(&reference.root(), &config());
    reference.bfloat16();
    // Norm weights away from one, so the head norms matter.
    tch::no_grad(|| {
        let mut vars: Vec<_> = reference.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut var) in vars {
            if name.contains("norm") {
                let _ = var.g_add_(&(var.randn_like() * 0.2));
            }
        }
    });

    let (b, t) = (2, 300);
    let ids = Tensor::randint(VOCAB, [b, t], (Kind::Int64, gpu));
    let positions = Tensor::arange(t, (Kind::Int64, gpu))
        .unsqueeze(0)
        .expand([b, t], false)
        .contiguous();
    let causal = Attention::Causal { key_mask: None };
    check(
        case,
        "causal B=2",
        &reference,
        &ids,
        &positions,
        &causal,
        false,
    );

    let lengths = [700i64, 1, 299, 1000];
    let n: i64 = lengths.iter().sum();
    let ids = Tensor::randint(VOCAB, [1, n], (Kind::Int64, gpu));
    let positions = Tensor::cat(
        &lengths
            .iter()
            .map(|&len| Tensor::arange(len, (Kind::Int64, gpu)))
            .collect::<Vec<_>>(),
        0,
    )
    .unsqueeze(0);
    let segments = Attention::Segments { lengths: &lengths };
    let what = "segments, every layer recomputed";
    check(case, what, &reference, &ids, &positions, &segments, true);
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rope_model_matches_the_tensor_ops() {
    check_knob(
        Case {
            knob: "MANTA_FUSED_ROPE",
            op: Fused::Rope,
            forward: Forward::BitIdentical,
        },
        manta_cuda::rope::compile_check,
    );
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_swiglu_model_matches_the_tensor_ops() {
    check_knob(
        Case {
            knob: "MANTA_FUSED_SWIGLU",
            op: Fused::Swiglu,
            forward: Forward::BitIdentical,
        },
        manta_cuda::swiglu::compile_check,
    );
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_rms_norm_model_matches_the_tensor_ops() {
    check_knob(
        Case {
            knob: "MANTA_FUSED_RMSNORM",
            op: Fused::RmsNorm,
            forward: Forward::WithinRounding,
        },
        manta_cuda::rms_norm::compile_check,
    );
}

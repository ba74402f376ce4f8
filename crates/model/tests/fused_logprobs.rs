//! The fused log-prob kernels (`manta_cuda::logprobs`, on unless `MANTA_FUSED_LOGPROBS=0`)
//! against the tensor ops and autograd they replace, on 16-bit models on CUDA with Qwen's
//! vocabulary (and an odd one, the kernels' scalar path): the log-probs and entropies of
//! `DeferredLogprobs` and of `token_logprobs` without a graph, the hidden rows' gradient and
//! the LM head's, accumulated over two micro-batches (the first allocates `.grad`, the second
//! adds to it), at T = 0.7 and 1, tied and untied heads, chunks of 256 rows with a partial
//! last one, and losses on the log-probs, on log-probs and entropies, and on the entropies
//! alone. Both paths read the same fp32 logits; they differ in the order of their fp32 sums
//! and where the 16-bit gradients round, so the tolerances are: log-probs within 1e-5 and
//! entropies within 5e-5 (a few fp32 ulps of log(vocab) ≈ 12); the hidden rows' gradient
//! within 1e-2 of its largest element (one bf16 rounding of it, 2^-7, plus the rare flip of
//! a rounded logit gradient); the LM head's within 3e-2 of its largest element and 1e-2 on
//! average (autograd rounds each chunk's product to bf16 and then the running sum, the fused
//! path rounds the sum once per chunk, so elements drift apart by a few bf16 ulps at most). A
//! wrong term in the gradient (the entropy's, the 1/T) is tens of percent. Returns early,
//! saying so, without a CUDA device.

use manta_model::{fused_runs, token_logprobs, CausalLm, DeferredLogprobs, Fused, ModelConfig};
use std::sync::Mutex;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// One test at a time: they share the knob override and the CUDA generator.
static SERIAL: Mutex<()> = Mutex::new(());

const CHUNK: i64 = 256;
/// Two micro-batches: 600 rows (chunks of 256, 256, 88) and 300 (256, 44).
const ROWS: [i64; 2] = [600, 300];
const HIDDEN: i64 = 128;

fn config(vocab: i64, tied: bool) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"model_type": "qwen3", "hidden_size": {HIDDEN}, "intermediate_size": 256,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 64, "vocab_size": {vocab}, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": {tied},
            "max_position_embeddings": 1024, "initializer_range": 0.05}}"#
        ),
        "fused log-prob test config",
    )
    .expect("valid config")
}

/// What the loss trains on.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Loss {
    Logp,
    LogpAndEntropy,
    /// The entropies alone: the log-probs get no gradient at all.
    Entropy,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    kind: Kind,
    vocab: i64,
    tied: bool,
    temperature: f64,
    loss: Loss,
}

/// One micro-batch's scored rows (16-bit values, not yet leaves), targets and per-row loss
/// coefficients.
struct Batch {
    hidden: Tensor,
    targets: Tensor,
    a: Tensor,
    b: Tensor,
}

/// Non-linear in the log-probs (as the trainer's ratio terms are), linear in the entropies
/// with coefficients of either sign and the log-probs' size.
fn loss_of(logp: &Tensor, entropy: &Tensor, batch: &Batch, loss: Loss) -> Tensor {
    let logp_term = (logp * &batch.a + logp.square() * 0.05).sum(Kind::Float);
    let entropy_term = (entropy * &batch.b).sum(Kind::Float);
    match loss {
        Loss::Logp => logp_term,
        Loss::LogpAndEntropy => logp_term + entropy_term,
        Loss::Entropy => entropy_term,
    }
}

/// One path's results, on the CPU in fp32.
struct Outcome {
    logp: Vec<Tensor>,
    entropy: Vec<Tensor>,
    /// `token_logprobs` under `no_grad`.
    scored: Vec<(Tensor, Tensor)>,
    g_hidden: Vec<Tensor>,
    g_head: Tensor,
}

fn cpu(t: &Tensor) -> Tensor {
    t.detach().to_device(Device::Cpu).to_kind(Kind::Float)
}

/// Both micro-batches through `DeferredLogprobs` on a fresh copy of `reference` (no `.grad`
/// yet), with the fused kernels on or off.
fn run(case: Case, reference: &VarStore, gpu: Device, batches: &[Batch], fused: bool) -> Outcome {
    manta_knobs::set_override("MANTA_FUSED_LOGPROBS", if fused { "1" } else { "0" })
        .expect("a knob");
    let runs_before = fused_runs(Fused::Logprobs);
    let mut vs = VarStore::new(gpu);
    let m = CausalLm::new(&vs.root(), &config(case.vocab, case.tied));
    vs.set_kind(case.kind);
    vs.copy(reference).expect("same variables");
    assert!(!m.lm_head_weight().grad().defined());
    let entropy_grad = case.loss != Loss::Logp;
    let mut out = Outcome {
        logp: Vec::new(),
        entropy: Vec::new(),
        scored: Vec::new(),
        g_hidden: Vec::new(),
        g_head: Tensor::new(),
    };
    for batch in batches {
        let leaf = batch.hidden.copy().set_requires_grad(true);
        let terms = DeferredLogprobs::new(
            &m,
            &leaf,
            &batch.targets,
            case.temperature,
            CHUNK,
            entropy_grad,
        );
        out.logp.push(cpu(terms.logp()));
        out.entropy.push(cpu(terms.entropy()));
        let loss = loss_of(terms.logp(), terms.entropy(), batch, case.loss);
        terms.backward(&loss).backward();
        out.g_hidden.push(cpu(&leaf.grad()));
        let (logp, entropy) = tch::no_grad(|| {
            token_logprobs(&m, &batch.hidden, &batch.targets, case.temperature, CHUNK)
        });
        out.scored.push((cpu(&logp), cpu(&entropy)));
    }
    out.g_head = cpu(&m.lm_head_weight().grad());
    manta_knobs::clear_overrides();
    // Both paths give the same values: that the kernels ran (for every scoring) is
    // asserted here.
    let runs = fused_runs(Fused::Logprobs) - runs_before;
    let want = if fused { 2 * batches.len() as u64 } else { 0 };
    assert_eq!(runs, want, "MANTA_FUSED_LOGPROBS={}", fused as u8);
    out
}

/// (max |a - b|, mean |a - b|) / (max |b|, mean |b|).
fn relative(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let d = (a - b).abs();
    let scale = b.abs();
    let max = scale.max().double_value(&[]);
    let mean = scale.mean(Kind::Double).double_value(&[]);
    assert!(max > 0.0, "no gradient to compare");
    (
        d.max().double_value(&[]) / max,
        d.mean(Kind::Double).double_value(&[]) / mean,
    )
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn check_case(case: Case, gpu: Device) {
    tch::manual_seed(23);
    let mut reference = VarStore::new(gpu);
    let _ = CausalLm::new(&reference.root(), &config(case.vocab, case.tied));
    reference.set_kind(case.kind);
    let batches: Vec<Batch> = ROWS
        .iter()
        .map(|&n| {
            let on = |t: Tensor| t.to_device(gpu);
            // Logits of std ~2: peaked rows as well as flat ones.
            Batch {
                hidden: on(Tensor::randn([n, HIDDEN], (Kind::Float, Device::Cpu)) * 4.0)
                    .to_kind(case.kind),
                targets: on(Tensor::randint(case.vocab, [n], (Kind::Int64, Device::Cpu))),
                a: on(Tensor::rand([n], (Kind::Float, Device::Cpu)) * 2.0 - 1.0),
                b: on(Tensor::rand([n], (Kind::Float, Device::Cpu)) * 2.0 - 1.0),
            }
        })
        .collect();
    let want = run(case, &reference, gpu, &batches, false);
    let got = run(case, &reference, gpu, &batches, true);
    let what = format!("{case:?}");
    for i in 0..batches.len() {
        let dl = max_abs(&got.logp[i], &want.logp[i]);
        let de = max_abs(&got.entropy[i], &want.entropy[i]);
        eprintln!("{what} micro-batch {i}: |Δ logp| {dl:.2e}, |Δ entropy| {de:.2e}");
        assert!(
            dl <= 1e-5,
            "{what} micro-batch {i}: log-probs differ by {dl:e}"
        );
        assert!(
            de <= 5e-5,
            "{what} micro-batch {i}: entropies differ by {de:e}"
        );
        let (got_lp, got_ent) = &got.scored[i];
        let (want_lp, want_ent) = &want.scored[i];
        assert!(max_abs(got_lp, want_lp) <= 1e-5, "{what}: token_logprobs");
        assert!(
            max_abs(got_ent, want_ent) <= 5e-5,
            "{what}: token_logprobs entropy"
        );
        // Both come from the fused kernel: the same bits.
        assert!(
            got_lp.equal(&got.logp[i]),
            "{what}: token_logprobs vs deferred"
        );
        let (max, mean) = relative(&got.g_hidden[i], &want.g_hidden[i]);
        eprintln!("{what} micro-batch {i}: hidden gradient max {max:.2e}, mean {mean:.2e}");
        assert!(
            max <= 1e-2,
            "{what} micro-batch {i}: hidden gradient off by {max:e}"
        );
    }
    let (max, mean) = relative(&got.g_head, &want.g_head);
    eprintln!("{what}: LM head gradient max {max:.2e}, mean {mean:.2e}");
    assert!(
        max <= 3e-2 && mean <= 1e-2,
        "{what}: LM head gradient off by {max:e} (max), {mean:e} (mean)"
    );
}

#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn fused_logprobs_match_the_tensor_ops() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // The fused path is taken only where its kernels compile: make sure they do, so the
    // comparison is not of the tensor ops with themselves.
    let arch = manta_cuda::device_arch(index).expect("device arch");
    manta_cuda::logprobs::compile_check(arch).expect("the log-prob kernels compile");
    let gpu = Device::Cuda(index);
    let qwen = 151_936;
    let cases = [
        (Kind::BFloat16, qwen, true, 0.7, Loss::LogpAndEntropy),
        (Kind::BFloat16, qwen, true, 1.0, Loss::LogpAndEntropy),
        (Kind::BFloat16, qwen, false, 0.7, Loss::Logp),
        (Kind::BFloat16, 50_001, false, 1.0, Loss::Entropy),
        (Kind::Half, qwen, true, 0.7, Loss::LogpAndEntropy),
    ];
    for (kind, vocab, tied, temperature, loss) in cases {
        check_case(
            Case {
                kind,
                vocab,
                tied,
                temperature,
                loss,
            },
            gpu,
        );
    }
}

/// Under autograd `token_logprobs` keeps the tensor ops, so its log-probs stay
/// differentiable with the fused kernels on.
#[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
#[test]
fn token_logprobs_under_autograd_stay_differentiable() {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let gpu = Device::Cuda(index);
    let mut vs = VarStore::new(gpu);
    let m = CausalLm::new(&vs.root(), &config(1000, true));
    vs.set_kind(Kind::BFloat16);
    let hidden = Tensor::randn([10, HIDDEN], (Kind::BFloat16, gpu)).set_requires_grad(true);
    let targets = Tensor::randint(1000, [10], (Kind::Int64, gpu));
    let (logp, _) = token_logprobs(&m, &hidden, &targets, 0.7, 4);
    assert!(logp.requires_grad());
    logp.sum(Kind::Float).backward();
    assert!(hidden.grad().defined() && m.lm_head_weight().grad().defined());
}

//! `DeferredLogprobs` (the training loss path with the LM head's backward deferred and
//! chunked) against the autograd path it replaces — a backward through every chunk's
//! kept log-softmax (`token_logprobs` under autograd, or the former whole log-softmax of
//! the entropy bonus) — on tiny random fp32 models on CPU: same loss, same gradient of
//! every parameter (tied and untied embeddings, temperature != 1, a partial last chunk).

mod common;

use common::{causal, config, ids, model, positions};
use manta_model::{token_logprobs, CausalLm, DeferredLogprobs, Recompute};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const ROWS: [[i64; 9]; 2] = [
    [3, 17, 8, 44, 1, 29, 52, 0, 11],
    [7, 2, 40, 13, 13, 51, 6, 30, 9],
];
/// Positions of the 18 hidden rows that are scored (13: chunks of 4 end with a 1).
const SCORED: [i64; 13] = [0, 1, 2, 4, 5, 7, 9, 10, 11, 12, 14, 15, 16];
const TARGETS: [i64; 13] = [17, 8, 44, 29, 52, 11, 2, 40, 13, 13, 6, 30, 9];
const TEMPERATURE: f64 = 0.7;
const CHUNK: i64 = 4;

/// A loss shaped like the trainer's: non-linear in every log-prob (a ratio against fixed
/// old log-probs times an advantage, a square), per-token weights, and with
/// `entropy_coef` an entropy bonus.
fn loss_of(logp: &Tensor, entropy: &Tensor, entropy_coef: f64) -> Tensor {
    let n = logp.size()[0];
    let steps = Tensor::arange(n, (Kind::Float, Device::Cpu));
    let old: Tensor = &steps * 0.05 - 4.0;
    let advantages = (&steps * 0.9).sin();
    let weights = 1.0 / (&steps + 2.0);
    let ratio = (logp - old).exp();
    let per_token = -(ratio * advantages) + logp.square() * 0.1;
    (per_token * &weights).sum(Kind::Float) - entropy_coef * (entropy * &weights).sum(Kind::Float)
}

/// The former training path: log-probs (and with an entropy bonus, the entropies) under
/// autograd through the chunks' kept softmaxes.
fn autograd_terms(m: &CausalLm, selected: &Tensor, targets: &Tensor, entropy: bool) -> Tensor {
    if entropy {
        // What the trainer's entropy-bonus branch did: one whole log-softmax.
        let all = (m.logits_f32(selected) / TEMPERATURE).log_softmax(-1, None::<Kind>);
        let logp = all
            .gather(-1, &targets.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let ent = -(all.exp() * &all).sum_dim_intlist(-1, false, None::<Kind>);
        loss_of(&logp, &ent, 0.3)
    } else {
        let (logp, ent) = token_logprobs(m, selected, targets, TEMPERATURE, CHUNK);
        loss_of(&logp, &ent, 0.0)
    }
}

fn deferred_terms(m: &CausalLm, selected: &Tensor, targets: &Tensor, entropy: bool) -> Tensor {
    let terms = DeferredLogprobs::new(m, selected, targets, TEMPERATURE, CHUNK, entropy);
    let coef = if entropy { 0.3 } else { 0.0 };
    let loss = loss_of(terms.logp(), terms.entropy(), coef);
    terms.backward(&loss)
}

fn zero_grads(vs: &VarStore) {
    for mut g in vs.trainable_variables().iter().map(|v| v.grad()) {
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// One training pass through `forward_backward`: (loss, every parameter's gradient).
fn pass(
    vs: &VarStore,
    m: &CausalLm,
    deferred: bool,
    entropy: bool,
) -> (f64, Vec<(String, Tensor)>) {
    zero_grads(vs);
    let scored = Tensor::from_slice(&SCORED);
    let targets = Tensor::from_slice(&TARGETS);
    let loss = m.forward_backward(
        &ids(&[&ROWS[0], &ROWS[1]]),
        &positions(2, 9, 0),
        &causal(),
        |h| {
            let selected = h.view([18, -1]).index_select(0, &scored);
            if deferred {
                deferred_terms(m, &selected, &targets, entropy)
            } else {
                autograd_terms(m, &selected, &targets, entropy)
            }
        },
    );
    let mut grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(k, v)| (k, v.grad().copy()))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    (loss.double_value(&[]), grads)
}

/// max |a - b| / max |b|.
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b.abs().max().double_value(&[]);
    (a - b).abs().max().double_value(&[]) / scale
}

#[test]
fn deferred_backward_gives_the_autograd_gradients() {
    for tied in [true, false] {
        let cfg = config("qwen3", tied);
        // One model per config for every run: libtorch's RNG is process-global and
        // tests run in parallel, so two seeded inits could differ.
        let (vs, mut m) = model(&cfg, 11);
        for recompute in [None, Some(Recompute::EVERY_LAYER)] {
            m.set_recompute(recompute).expect("recompute setting");
            for entropy in [false, true] {
                let case = format!("tied {tied}, recompute {recompute:?}, entropy {entropy}");
                let (want_loss, want) = pass(&vs, &m, false, entropy);
                let (got_loss, got) = pass(&vs, &m, true, entropy);
                if entropy {
                    // The former entropy path scored all rows at once, not in chunks.
                    let d = (got_loss - want_loss).abs() / want_loss.abs();
                    assert!(d <= 1e-6, "{case}: loss {got_loss} vs {want_loss}");
                } else {
                    assert_eq!(got_loss.to_bits(), want_loss.to_bits(), "{case}: loss");
                }
                assert_eq!(got.len(), want.len());
                assert_eq!(got.len(), if tied { 24 } else { 25 }, "{case}");
                for ((name, g), (_, w)) in got.iter().zip(&want) {
                    assert!(
                        w.abs().max().double_value(&[]) > 0.0,
                        "{case}: {name} has no gradient"
                    );
                    let r = relative(g, w);
                    assert!(r <= 1e-6, "{case}: {name} gradient off by {r:e} (relative)");
                    // The head sums its chunks' gradients in another order; every
                    // gradient from the rows' on is autograd's own, bit for bit.
                    let head = name == "lm_head.weight" || (tied && name.contains("embed"));
                    if !entropy && !head {
                        assert!(g.equal(w), "{case}: {name} gradient not bit-equal");
                    }
                }
            }
        }
    }
}

#[test]
fn surrogate_carries_the_exact_hidden_gradient_and_the_loss_value() {
    let cfg = config("qwen3", true);
    let (vs, m) = model(&cfg, 12);
    let input = ids(&[&ROWS[0], &ROWS[1]]);
    let hidden = tch::no_grad(|| m.forward_hidden(&input, &positions(2, 9, 0), &causal(), None))
        .view([18, 32])
        .index_select(0, &Tensor::from_slice(&SCORED));
    let targets = Tensor::from_slice(&TARGETS);
    let w = m.lm_head_weight();
    for entropy in [false, true] {
        let leaf = hidden.detach().set_requires_grad(true);
        let coef = if entropy { 0.3 } else { 0.0 };
        // The autograd path, chunked the same way (entropy through the chunks too).
        let (logp, ent) = token_logprobs(&m, &leaf, &targets, TEMPERATURE, CHUNK);
        let ent = if entropy {
            let all = (m.logits_f32(&leaf) / TEMPERATURE).log_softmax(-1, None::<Kind>);
            -(all.exp() * &all).sum_dim_intlist(-1, false, None::<Kind>)
        } else {
            ent
        };
        let want_loss = loss_of(&logp, &ent, coef);
        let want = Tensor::run_backward(&[&want_loss], &[&leaf, w], false, false);

        zero_grads(&vs);
        let leaf = hidden.detach().set_requires_grad(true);
        let terms = DeferredLogprobs::new(&m, &leaf, &targets, TEMPERATURE, CHUNK, entropy);
        assert!(terms.logp().requires_grad());
        assert_eq!(terms.entropy().requires_grad(), entropy);
        let loss = loss_of(terms.logp(), terms.entropy(), coef);
        let surrogate = terms.backward(&loss);
        assert_eq!(
            surrogate.double_value(&[]).to_bits(),
            loss.double_value(&[]).to_bits(),
            "entropy {entropy}: the surrogate's value is the loss's"
        );
        if !entropy {
            assert!(loss.equal(&want_loss), "loss");
        }
        // Before the surrogate's backward the head has its gradient, the rows none.
        let head = w.grad().copy();
        assert!(!leaf.grad().defined());
        surrogate.backward();
        let r = relative(&head, &want[1]);
        assert!(r <= 1e-6, "entropy {entropy}: head gradient off by {r:e}");
        if entropy {
            let r = relative(&leaf.grad(), &want[0]);
            assert!(r <= 1e-6, "hidden gradient off by {r:e}");
        } else {
            // Same chunks, same ops: the rows' gradient is autograd's bit for bit.
            assert!(leaf.grad().equal(&want[0]), "hidden gradient");
        }
        // And the surrogate adds nothing to the head.
        assert!(w.grad().equal(&head));
    }
}

#[test]
fn a_loss_without_a_graph_back_propagates_nothing() {
    let cfg = config("qwen3", false);
    let (vs, m) = model(&cfg, 13);
    zero_grads(&vs);
    let hidden = Tensor::randn([5, 32], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let targets = Tensor::from_slice(&[1i64, 2, 3, 4, 5]);
    let terms = DeferredLogprobs::new(&m, &hidden, &targets, 1.0, 2, false);
    let loss = terms.logp().detach().sum(Kind::Float);
    let out = terms.backward(&loss);
    assert!(!out.requires_grad());
    assert!(out.equal(&loss));
    let head = m.lm_head_weight().grad();
    assert!(!head.defined() || head.abs().max().double_value(&[]) == 0.0);
}

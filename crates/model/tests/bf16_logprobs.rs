//! bf16 log-probs on the CPU: the native engine's paged forward (chunked prefill, then one
//! decode step per token, as the engine schedules them) against the trainer's packed
//! forward (`Attention::Segments` + `token_logprobs`), and both against Hugging Face
//! transformers in bf16. slime's `train_rollout_logprob_abs_diff` is the engine/trainer
//! figure: every importance ratio in the loss is off by it.
//!
//! Its own test binary, because it caps oneDNN's instruction set before libtorch first
//! runs (bf16 matmuls otherwise use AMX tiles, which some sandboxes do not enable).
//! Needs the project venv's Python (or `MANTA_PYTHON`) with torch and transformers.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use manta_model::{
    load_weights, save_pretrained, token_logprobs, Attention, CausalLm, ModelConfig, PagedBatch,
    PagedKvCache, PagedSeq,
};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// A small Qwen3 (q/k head norms, GQA 2, head_dim 64) initialised like a fresh model
/// (std 0.02); the norm weights are perturbed so that their rounding shows.
const CONFIG: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 3000, "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 1024, "tie_word_embeddings": true,
    "initializer_range": 0.02, "eos_token_id": 2}"#;

/// Tokens per prefill chunk: longer prompts take several engine steps.
const CHUNK: usize = 48;
const BLOCK: usize = 16;
const OUTPUTS: usize = 24;

fn oned_nn_isa() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none() {
            // Before libtorch first runs; the other test waits on this lock.
            std::env::set_var("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16");
        }
    });
}

fn config() -> ModelConfig {
    ModelConfig::from_json_str(CONFIG, "bf16 test config").expect("valid config")
}

/// The model in bf16 and its fp32 checkpoint (the one transformers loads).
fn model(dir: &Path) -> CausalLm {
    let cfg = config();
    tch::manual_seed(11);
    let mut vs = VarStore::new(Device::Cpu);
    let m = CausalLm::new(&vs.root(), &cfg);
    tch::no_grad(|| {
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut var) in vars {
            if name.contains("norm") {
                let _ = var.g_add_(&(var.randn_like() * 0.2));
            }
        }
    });
    save_pretrained(&vs, &cfg, dir).expect("save checkpoint");
    vs.set_kind(Kind::BFloat16);
    m
}

/// (tokens, prompt length) per sequence: prompts of 20..150 tokens and `OUTPUTS` more.
fn sequences() -> Vec<(Vec<i64>, usize)> {
    let mut state = 12345u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % 3000) as i64
    };
    (0..6)
        .map(|i| {
            let prompt = 20 + (i * 47) % 130;
            ((0..prompt + OUTPUTS).map(|_| next()).collect(), prompt)
        })
        .collect()
}

fn log_softmax_at(model: &CausalLm, hidden: &Tensor, targets: &[i64]) -> Vec<f32> {
    let logp = model
        .logits_f32(hidden)
        .log_softmax(-1, Kind::Float)
        .gather(1, &Tensor::from_slice(targets).unsqueeze(1), false)
        .view([-1]);
    Vec::<f32>::try_from(&logp).expect("f32 log-probs")
}

/// The engine's way: each step takes one token of every decoding sequence (those first)
/// and up to `CHUNK` prompt tokens of every prefilling one, over a paged cache; a row whose
/// sequence has its whole context computed scores the next token.
fn engine_logprobs(model: &CausalLm, seqs: &[(Vec<i64>, usize)]) -> Vec<Vec<f32>> {
    let cfg = config();
    let blocks_per_seq = 1024 / BLOCK;
    let cache = PagedKvCache::new(
        &cfg,
        seqs.len() * blocks_per_seq,
        BLOCK,
        Kind::BFloat16,
        Device::Cpu,
    );
    // Sequence k owns blocks k * blocks_per_seq.., visited in a shuffled order.
    let slot = |k: usize, pos: usize| {
        let block = (pos / BLOCK) * 7 % blocks_per_seq;
        ((k * blocks_per_seq + block) * BLOCK + pos % BLOCK) as i64
    };
    let mut computed = vec![0usize; seqs.len()];
    let mut out = vec![Vec::new(); seqs.len()];
    tch::no_grad(|| loop {
        let mut order: Vec<usize> = (0..seqs.len())
            .filter(|&k| computed[k] < seqs[k].0.len() - 1)
            .collect();
        if order.is_empty() {
            break;
        }
        order.sort_by_key(|&k| computed[k] < seqs[k].1);
        let (mut ids, mut pos, mut layout, mut rows, mut targets) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut scored = Vec::new();
        for &k in &order {
            let (tokens, prompt) = &seqs[k];
            let start = computed[k];
            let end = if start < *prompt {
                (start + CHUNK).min(*prompt)
            } else {
                start + 1
            };
            ids.extend_from_slice(&tokens[start..end]);
            pos.extend((start..end).map(|p| p as i64));
            layout.push(PagedSeq {
                q_len: end - start,
                slots: (0..end).map(|p| slot(k, p)).collect(),
            });
            computed[k] = end;
            if end >= *prompt {
                rows.push(ids.len() as i64 - 1);
                targets.push(tokens[end]);
                scored.push(k);
            }
        }
        let hidden = model.forward_paged(
            &Tensor::from_slice(&ids),
            &Tensor::from_slice(&pos),
            &PagedBatch::new(&layout, Device::Cpu),
            &cache,
        );
        let rows = hidden.index_select(0, &Tensor::from_slice(&rows));
        for (k, lp) in scored
            .into_iter()
            .zip(log_softmax_at(model, &rows, &targets))
        {
            out[k].push(lp);
        }
    });
    out
}

/// The trainer's way: all sequences packed into one row, `token_logprobs` on the rows
/// that predict each output token.
fn trainer_logprobs(model: &CausalLm, seqs: &[(Vec<i64>, usize)]) -> Vec<Vec<f32>> {
    let lengths: Vec<i64> = seqs.iter().map(|(t, _)| t.len() as i64).collect();
    let tokens: Vec<i64> = seqs.iter().flat_map(|(t, _)| t.iter().copied()).collect();
    let positions: Vec<i64> = lengths.iter().flat_map(|&l| 0..l).collect();
    let (mut rows, mut targets) = (Vec::new(), Vec::new());
    let mut start = 0i64;
    for (t, prompt) in seqs {
        for (k, &target) in t.iter().enumerate().skip(*prompt) {
            rows.push(start + k as i64 - 1);
            targets.push(target);
        }
        start += t.len() as i64;
    }
    let flat = tch::no_grad(|| {
        let hidden = model.forward_hidden(
            &Tensor::from_slice(&tokens).view([1, -1]),
            &Tensor::from_slice(&positions).view([1, -1]),
            &Attention::Segments { lengths: &lengths },
            None,
        );
        let hidden = hidden.view([tokens.len() as i64, -1]);
        let (logp, _) = token_logprobs(
            model,
            &hidden.index_select(0, &Tensor::from_slice(&rows)),
            &Tensor::from_slice(&targets),
            1.0,
            64,
        );
        Vec::<f32>::try_from(&logp).expect("f32 log-probs")
    });
    split(&flat, seqs)
}

fn split(flat: &[f32], seqs: &[(Vec<i64>, usize)]) -> Vec<Vec<f32>> {
    let mut at = 0;
    seqs.iter()
        .map(|(t, prompt)| {
            let n = t.len() - prompt;
            at += n;
            flat[at - n..at].to_vec()
        })
        .collect()
}

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

/// transformers' bf16 log-probs of the same tokens, each sequence run alone.
fn hf_logprobs(dir: &Path, seqs: &[(Vec<i64>, usize)]) -> Vec<Vec<f32>> {
    let tokens: Vec<i64> = seqs.iter().flat_map(|(t, _)| t.iter().copied()).collect();
    let lengths: Vec<i64> = seqs.iter().map(|(t, _)| t.len() as i64).collect();
    let prompts: Vec<i64> = seqs.iter().map(|(_, p)| *p as i64).collect();
    Tensor::write_safetensors(
        &[
            ("tokens", Tensor::from_slice(&tokens)),
            ("lengths", Tensor::from_slice(&lengths)),
            ("prompt_lens", Tensor::from_slice(&prompts)),
        ],
        dir.join("input.safetensors"),
    )
    .expect("write inputs");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/hf_bf16_logprobs.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (set MANTA_PYTHON): {e}", python().display()));
    assert!(
        out.status.success(),
        "hf_bf16_logprobs.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.join("hf_logprobs.safetensors");
    let logp = Tensor::read_safetensors(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .find(|(n, _)| n == "logp")
        .unwrap_or_else(|| panic!("{} has no `logp`", path.display()))
        .1;
    split(&Vec::<f32>::try_from(&logp).expect("f32"), seqs)
}

/// (mean, max, mean over each sequence's first output token) of |a - b|.
fn abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f64, f64, f64) {
    let (mut sum, mut n, mut max, mut first) = (0f64, 0usize, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "one log-prob per output token");
        for (k, (p, q)) in x.iter().zip(y).enumerate() {
            let d = (*p as f64 - *q as f64).abs();
            sum += d;
            n += 1;
            max = max.max(d);
            if k == 0 {
                first += d;
            }
        }
    }
    (sum / n as f64, max, first / a.len() as f64)
}

/// The same model in fp32, from the checkpoint `model` wrote.
fn model_f32(dir: &Path) -> CausalLm {
    let mut vs = VarStore::new(Device::Cpu);
    let m = CausalLm::new(&vs.root(), &config());
    load_weights(&mut vs, dir).expect("load checkpoint");
    m
}

/// Whole sequences through the engine's paged prefill (several in one flat batch, blocks
/// shuffled) and through the trainer's packed forward: the same ops with the same
/// rounding points, so the same bits, not merely close values.
#[test]
fn engine_prefill_is_bitwise_the_trainer_forward_in_bf16() {
    oned_nn_isa();
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model(dir.path());
    let seqs = sequences();
    let lengths: Vec<i64> = seqs.iter().map(|(t, _)| t.len() as i64).collect();
    let tokens: Vec<i64> = seqs.iter().flat_map(|(t, _)| t.iter().copied()).collect();
    let positions: Vec<i64> = lengths.iter().flat_map(|&l| 0..l).collect();
    let (ids, pos) = (Tensor::from_slice(&tokens), Tensor::from_slice(&positions));
    let cache = PagedKvCache::new(&config(), 64, BLOCK, Kind::BFloat16, Device::Cpu);
    let mut next_block = 0i64;
    let layout: Vec<PagedSeq> = lengths
        .iter()
        .map(|&l| {
            let blocks = (l + BLOCK as i64 - 1) / BLOCK as i64;
            // Blocks of a sequence in reverse order: slots need not be contiguous.
            let first = next_block;
            next_block += blocks;
            let slots = (0..l)
                .map(|p| {
                    let block = first + blocks - 1 - p / BLOCK as i64;
                    block * BLOCK as i64 + p % BLOCK as i64
                })
                .collect();
            PagedSeq {
                q_len: l as usize,
                slots,
            }
        })
        .collect();
    let (paged, packed) = tch::no_grad(|| {
        (
            model.forward_paged(&ids, &pos, &PagedBatch::new(&layout, Device::Cpu), &cache),
            model
                .forward_hidden(
                    &ids.view([1, -1]),
                    &pos.view([1, -1]),
                    &Attention::Segments { lengths: &lengths },
                    None,
                )
                .view([tokens.len() as i64, -1]),
        )
    });
    assert_eq!(paged.kind(), Kind::BFloat16);
    let differing = paged.ne_tensor(&packed).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(
        differing,
        0,
        "{differing} of {} hidden values differ between the paged prefill and the packed forward",
        paged.numel()
    );
}

/// Chunked prefill then one decode step per token (the engine) against the packed
/// forward (the trainer). On the CPU the two cannot share bits: libtorch's CPU flash
/// attention rounds a row differently when the rows after it differ (a prompt alone vs
/// the prompt with its outputs), and the decode path has its own attention. So the bound
/// here is how far bf16 rounding alone moves these log-probs (bf16 vs fp32 trainer); the
/// 1e-3 acceptance is checked on the GPU (rollout's native_engine_cuda test).
#[test]
fn engine_and_trainer_logprobs_agree_in_bf16() {
    oned_nn_isa();
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model(dir.path());
    let seqs = sequences();
    let engine = engine_logprobs(&model, &seqs);
    let trainer = trainer_logprobs(&model, &seqs);
    let fp32 = trainer_logprobs(&model_f32(dir.path()), &seqs);
    let (mean, max, first) = abs_diff(&engine, &trainer);
    let (noise, _, _) = abs_diff(&trainer, &fp32);
    eprintln!(
        "engine vs trainer, bf16: mean {mean:.3e}, max {max:.3e}, first tokens {first:.3e}; \
         bf16 vs fp32 trainer: mean {noise:.3e}"
    );
    assert!(
        mean < noise,
        "engine and trainer log-probs differ by {mean:.3e} on average (max {max:.3e}), \
         bf16 rounding alone by {noise:.3e}"
    );
}

/// The trainer's packed forward in bf16 against transformers' bf16 forward of the same
/// checkpoint: the same rounding points (RMSNorm rounds before its weight, as transformers
/// does), so only accumulation order differs.
#[test]
fn trainer_logprobs_match_transformers_in_bf16() {
    oned_nn_isa();
    let dir = tempfile::tempdir().expect("tempdir");
    let model = model(dir.path());
    let seqs = sequences();
    let hf = hf_logprobs(dir.path(), &seqs);
    let trainer = trainer_logprobs(&model, &seqs);
    let (mean, max, _) = abs_diff(&trainer, &hf);
    eprintln!("trainer vs transformers, bf16: mean {mean:.3e}, max {max:.3e}");
    assert!(
        mean < 1e-3,
        "log-probs differ from transformers' by {mean:.3e} on average (max {max:.3e})"
    );
}

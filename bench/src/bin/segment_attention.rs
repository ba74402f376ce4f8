//! Packed-row attention as the trainer runs it inside the loop: one micro-batch of many
//! episode lengths (`Attention::Segments`), forward and backward through a random
//! Qwen3-shaped bf16 model on CUDA, with each `SegmentKernel` in the same run — one
//! variable-length flash call per layer against one SDPA call per run of equal lengths.
//! The micro-batch's lengths are drawn uniformly from [MIN_LEN, MAX_LEN] (seeded), packed
//! until TOKENS. Prints one JSON object: tokens/s of each and their ratio, and how far the
//! two kernels' final hidden states are apart.
//!
//! usage: segment_attention [0.6b|4b] [TOKENS] [MIN_LEN] [MAX_LEN] [ITERS] [GPU]

use std::time::Instant;

use anyhow::Context;
use manta_model::{Attention, CausalLm, ModelConfig, SegmentKernel};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map_or("0.6b", String::as_str);
    let num = |i: usize, default: i64| -> anyhow::Result<i64> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse()
                .with_context(|| format!("argument {i} ({s:?}) is not a number"))
        })
    };
    let (tokens, min_len, max_len, iters, gpu) = (
        num(2, 16384)?,
        num(3, 40)?,
        num(4, 400)?,
        num(5, 5)?,
        num(6, 0)?,
    );
    anyhow::ensure!(
        0 < min_len && min_len <= max_len && max_len <= tokens,
        "need 0 < MIN_LEN <= MAX_LEN <= TOKENS"
    );
    let config = match shape {
        "0.6b" => manta_bench::QWEN3_0_6B,
        "4b" => manta_bench::QWEN3_4B,
        other => anyhow::bail!("model shape {other:?}: expected 0.6b or 4b"),
    };
    anyhow::ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let device = Device::Cuda(usize::try_from(gpu).context("GPU")?);
    let cfg = ModelConfig::from_json_str(config, shape)?;
    tch::manual_seed(0);
    let mut vs = VarStore::new(device);
    let mut model = CausalLm::new(&vs.root(), &cfg);
    vs.bfloat16();

    // Episode lengths, a small LCG so the row is the same in every run.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut lengths = Vec::new();
    let mut total = 0;
    while total < tokens {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let len = (min_len + ((state >> 33) as i64) % (max_len - min_len + 1)).min(tokens - total);
        lengths.push(len);
        total += len;
    }
    let ids = Tensor::randint(cfg.vocab_size, [1, tokens], (Kind::Int64, device));
    let pos: Vec<i64> = lengths.iter().flat_map(|&l| 0..l).collect();
    let pos = Tensor::from_slice(&pos).view([1, tokens]).to(device);
    let attn = Attention::Segments { lengths: &lengths };
    let mut distinct = lengths.clone();
    distinct.sort_unstable();
    distinct.dedup();

    let mut measure = |kernel: SegmentKernel| -> (f64, Tensor) {
        model.set_segment_kernel(kernel);
        let mut hidden = None;
        let mut times = Vec::new();
        for i in 0..iters + 2 {
            for (_, v) in vs.variables() {
                let mut g = v.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            tch::Cuda::synchronize(gpu);
            let t = Instant::now();
            let _ = model.forward_backward(&ids, &pos, &attn, |h| {
                // The decoder is what the kernels change; a loss on its output keeps
                // the lm_head's [T, vocab] logits (the same for both) out of the timing.
                let h = h.to_kind(Kind::Float);
                if hidden.is_none() {
                    hidden = Some(h.detach().narrow(1, 0, 512.min(tokens)).copy());
                }
                h.square().mean(Kind::Float)
            });
            tch::Cuda::synchronize(gpu);
            if i >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        (times[times.len() / 2], hidden.expect("one step ran"))
    };
    let (varlen_s, varlen_hidden) = measure(SegmentKernel::Varlen);
    let (per_run_s, per_run_hidden) = measure(SegmentKernel::PerRun);
    let diff = (&varlen_hidden - &per_run_hidden)
        .abs()
        .max()
        .double_value(&[])
        / per_run_hidden.abs().max().double_value(&[]);
    println!(
        "{}",
        serde_json::json!({
            "bench": "segment_attention", "shape": shape, "tokens": tokens,
            "sequences": lengths.len(), "distinct_lengths": distinct.len(),
            "min_len": min_len, "max_len": max_len, "iters": iters,
            "device": format!("cuda:{gpu}"),
            "varlen_median_s": varlen_s, "per_run_median_s": per_run_s,
            "varlen_tokens_per_s": tokens as f64 / varlen_s,
            "per_run_tokens_per_s": tokens as f64 / per_run_s,
            "varlen_over_per_run": per_run_s / varlen_s,
            "hidden_max_rel_diff": diff,
        })
    );
    Ok(())
}

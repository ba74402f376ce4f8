//! One GRPO training step of the trainer (`manta_trainer::Trainer::train_step`) on
//! CUDA: bf16 compute with fp32 master weights and fp32 AdamW state, the samples packed
//! into one micro-batch (`--max-tokens-per-gpu` = all tokens), clipped policy loss
//! against rollout log-probs, per-sample mean, grad-norm clip, AdamW. Random bf16
//! weights of a Qwen3 shape, made in the run. Prints one JSON object;
//! bench/py/trainer_step_eager.py is the PyTorch eager baseline.
//!
//! usage: trainer_step 0.6b|4b [SAMPLES] [SEQ] [ITERS] [RECOMPUTE]
//!
//! RECOMPUTE is Megatron's block recompute (`--recompute-method block
//! --recompute-num-layers N`): `none`, `all`, a layer count N, or `auto` (the default for
//! 4b; 0.6b defaults to none): the fewest recomputed layers with which a step runs
//! without running out of memory, found by trying steps (a step that runs out of memory
//! is split by the trainer's recovery and counted in `train/oom_splits`, so the probe
//! never crashes the bench).

use std::time::Instant;

use anyhow::Context;
use manta_bench::{QWEN3_0_6B, QWEN3_4B};
use manta_trainer::batch::MicroBatchLayout;
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{Recompute, RecomputeMethod, TrainBatch, Trainer, TrainerOptions};
use tch::Device;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map(String::as_str).unwrap_or("0.6b");
    let num = |i: usize, default: usize| -> anyhow::Result<usize> {
        match args.get(i) {
            None => Ok(default),
            Some(s) => s
                .parse()
                .with_context(|| format!("argument {i} ({s:?}) is not a count")),
        }
    };
    let (config, default_recompute) = match shape {
        "0.6b" => (QWEN3_0_6B, "none"),
        // 4B at 16k tokens does not fit an 80 GB GPU with every layer's activations.
        "4b" => (QWEN3_4B, "auto"),
        other => anyhow::bail!("model shape {other:?}: expected 0.6b or 4b"),
    };
    let (samples, seq, iters) = (num(2, 8)?, num(3, 2048)?, num(4, 5)?);
    let recompute_arg = args.get(5).map_or(default_recompute, String::as_str);
    anyhow::ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    anyhow::ensure!(seq >= 8, "SEQ must be at least 8");
    let dir = std::env::temp_dir().join(format!("manta-trainer-step-{shape}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("config.json"), config)?;
    let device = Device::Cuda(0);
    // Probes that run out of memory panic inside libtorch (caught and recovered by the
    // trainer): print one line for each instead of a C++ backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info.to_string();
        eprintln!(
            "panic: {}",
            msg.lines()
                .take(2)
                .collect::<Vec<_>>()
                .join(" ")
                .chars()
                .take(300)
                .collect::<String>()
        );
    }));
    let t0 = Instant::now();
    let mut trainer = Trainer::new(TrainerOptions {
        model_dir: dir.clone(),
        seed: 0,
        device,
        adam: AdamWConfig {
            lr: 1e-6,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        },
        clip_grad: 1.0,
        temperature: 1.0,
        max_tokens_per_gpu: samples * seq,
        layout: MicroBatchLayout::Packed,
        bf16: Some(true),
        use_rollout_logprobs: true,
        logprob_chunk: 1024,
        recompute: None,
        algo: Default::default(),
    })?;
    tch::Cuda::synchronize(0);
    let init_s = t0.elapsed().as_secs_f64();
    let cfg = trainer.model_config().clone();
    let layers = cfg.num_hidden_layers as usize;
    let batch = manta_bench::grpo_batch(samples, seq, cfg.vocab_size);
    let t_probe = Instant::now();
    let (recompute_layers, probes) = match recompute_arg {
        "auto" => fewest_recomputed_layers(&mut trainer, &batch, layers)?,
        "none" => (0, Vec::new()),
        "all" => (layers, Vec::new()),
        n => (
            n.parse().with_context(|| {
                format!("RECOMPUTE {n:?}: expected auto, none, all or a layer count")
            })?,
            Vec::new(),
        ),
    };
    let probe_s = t_probe.elapsed().as_secs_f64();
    // A count that fitted its probe can still run out of memory in the warm-up steps
    // (the caching allocator's fragmentation differs): then one more layer is recomputed
    // and the warm-up starts again.
    let mut recompute_layers = recompute_layers;
    let mut warmup_retries = 0;
    loop {
        trainer.set_recompute(block(recompute_layers))?;
        let mut splits = 0.0;
        for _ in 0..2 {
            let m = trainer.train_step(&batch)?;
            splits += m.get("train/oom_splits").copied().unwrap_or(0.0);
        }
        tch::Cuda::synchronize(0);
        if splits == 0.0 || recompute_layers >= layers {
            break;
        }
        warmup_retries += 1;
        recompute_layers += 1;
        eprintln!("out of memory in the warm-up steps: recomputing {recompute_layers} layers");
    }
    let mut times = Vec::new();
    let mut last: std::collections::BTreeMap<String, f64> = Default::default();
    let mut oom_splits = 0.0;
    for _ in 0..iters {
        let t = Instant::now();
        last = trainer.train_step(&batch)?;
        tch::Cuda::synchronize(0);
        times.push(t.elapsed().as_secs_f64());
        oom_splits += last.get("train/oom_splits").copied().unwrap_or(0.0);
    }
    let mut sorted = times.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];
    let tokens = (samples * seq) as f64;
    println!(
        "{}",
        serde_json::json!({
            "impl": "manta trainer (tch), bf16 + fp32 masters, packed",
            "shape": shape, "samples": samples, "seq": seq, "iters": iters,
            "response_tokens": samples * manta_bench::response_len(seq),
            "gradient_checkpointing": recompute_layers > 0,
            "recompute": if recompute_layers > 0 { "full, block" } else { "none" },
            "recompute_num_layers": recompute_layers,
            "num_layers": layers,
            "recompute_choice": recompute_arg,
            "recompute_probes": probes,
            "probe_s": probe_s,
            "timed_oom_splits": oom_splits,
            "warmup_oom_retries": warmup_retries,
            "init_s": init_s,
            "median_s": median, "times_s": times,
            "tokens_per_s": tokens / median,
            "loss": last.get("train/loss"), "grad_norm": last.get("train/grad_norm"),
            "pg_clipfrac": last.get("train/pg_clipfrac"),
        })
    );
    Ok(())
}

/// Megatron's block recompute of the first `n` layers (`None` for 0).
fn block(n: usize) -> Option<Recompute> {
    (n > 0).then_some(Recompute {
        method: RecomputeMethod::Block,
        num_layers: n,
    })
}

/// The fewest block-recomputed layers with which a step fits in memory: a binary search
/// between 0 and every layer, each probe one training step (the weights move, which does
/// not matter for timing). A probe does not fit when the trainer had to split the
/// micro-batch after running out of memory. Returns the count and each probe's
/// (layers, fitted).
fn fewest_recomputed_layers(
    trainer: &mut Trainer,
    batch: &TrainBatch,
    layers: usize,
) -> anyhow::Result<(usize, Vec<(usize, bool)>)> {
    let mut probes = Vec::new();
    let mut fits = |trainer: &mut Trainer, n: usize| -> anyhow::Result<bool> {
        trainer.set_recompute(block(n))?;
        let m = trainer.train_step(batch)?;
        tch::Cuda::synchronize(0);
        let ok = m.get("train/oom_splits").copied().unwrap_or(0.0) == 0.0
            && m.get("train/oom_skipped").copied().unwrap_or(0.0) == 0.0;
        eprintln!(
            "recompute probe: block {n} of {layers} layers: {}",
            if ok { "fits" } else { "out of memory" }
        );
        probes.push((n, ok));
        Ok(ok)
    };
    anyhow::ensure!(
        fits(trainer, layers)?,
        "the step does not fit in memory even with every layer recomputed"
    );
    // Invariant: `hi` fits; everything below `lo` was not shown to fit.
    let (mut lo, mut hi) = (0, layers);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if fits(trainer, mid)? {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok((hi, probes))
}

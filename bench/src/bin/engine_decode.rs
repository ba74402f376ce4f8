//! Decode throughput of the native engine on CUDA: Qwen3-0.6B or Qwen3-8B shape, random
//! bf16 weights, B concurrent requests of a 512-token prompt and 256 greedy new tokens
//! (ignore_eos). Also measures the device's copy bandwidth, for the bound. Prints one
//! JSON object; bench/py/engine_decode_hf.py is the transformers baseline.
//!
//! usage: engine_decode SHAPE(0.6b|8b) BATCHES(1,16,64) [PROMPT] [NEW] [CHUNK]
//! CHUNK: the engine's `chunked_prefill_size` (most tokens one step computes; default
//! the engine's own), to see what prefill gains from larger chunks.
//! `MANTA_DISABLE_OVERLAP_SCHEDULE=1` runs every decode step after the host has read the
//! one before (the engine's `disable_overlap_schedule`), for A/B runs.
//! `MANTA_TORCH_PROFILE=DIR` adds one prefill per batch size after the timed ones, traced
//! by Kineto into `DIR/engine_prefill_{SHAPE}_b{B}.json` (bench/py/kernel_summary.py);
//! the timings are those of the untraced runs. A second trace per batch size,
//! `DIR/engine_decode_{SHAPE}_b{B}.json`, holds a prefill and 32 decode steps.

use std::sync::atomic::Ordering;
use std::time::Instant;

use manta_cuda::TorchProfile;
use manta_engine::{Engine, GenerateRequest, NativeEngine, NativeEngineOptions, SamplingParams};
use serde_json::json;
use tch::{Device, Kind, Tensor};

/// Decode steps in the `MANTA_TORCH_PROFILE` trace of a prefill and decode.
const DECODE_TRACE_STEPS: usize = 32;

/// Waits for `device`'s queued work (a no-op off CUDA).
fn synchronize(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Device-to-device copy bandwidth (read + write bytes per second), median of 10.
fn copy_bandwidth(device: Device) -> f64 {
    let n = 1i64 << 30; // 2 GiB of bf16
    let src = Tensor::ones([n], (Kind::BFloat16, device));
    let mut dst = Tensor::zeros([n], (Kind::BFloat16, device));
    let mut times = Vec::new();
    for i in 0..12 {
        synchronize(device);
        let t = Instant::now();
        dst.copy_(&src);
        synchronize(device);
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    (2 * 2 * n) as f64 / times[times.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map(String::as_str).unwrap_or("0.6b");
    let batches: Vec<usize> = args
        .get(2)
        .map(String::as_str)
        .unwrap_or("1,16,64")
        .split(',')
        .map(|b| b.parse())
        .collect::<Result<_, _>>()?;
    let prompt_len: usize = args.get(3).map_or(Ok(512), |s| s.parse())?;
    let new_tokens: usize = args.get(4).map_or(Ok(256), |s| s.parse())?;
    let chunk: Option<usize> = args.get(5).map(|s| s.parse()).transpose()?;
    let trace_dir = manta_knobs::torch_profile()?.map(|at| at.dir);
    let config = manta_bench::decode_config(shape)?;
    anyhow::ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let device = Device::Cuda(0);
    let dir = std::env::temp_dir().join(format!("manta-engine-decode-{shape}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), config)?;
    let cfg = manta_model::ModelConfig::from_json_str(config, shape)?;
    let max_batch = *batches.iter().max().unwrap_or(&1);
    let ctx = prompt_len + new_tokens;

    let bandwidth = copy_bandwidth(device);
    let t_load = Instant::now();
    let defaults = NativeEngineOptions::new(&dir, device);
    let chunked_prefill_size = chunk.unwrap_or(defaults.chunked_prefill_size);
    let engine = NativeEngine::start(NativeEngineOptions {
        seed: 1,
        chunked_prefill_size,
        max_running_requests: max_batch,
        max_total_tokens: Some(max_batch * (ctx + 16) + 1024),
        context_length: Some(ctx + 16),
        disable_overlap_schedule: !manta_knobs::overlap_schedule(),
        ..defaults
    })?;
    let load_s = t_load.elapsed().as_secs_f64();
    // Bytes a decode step reads: every layer's matrices and the LM head (tied or not, a
    // vocab x hidden matrix), in bf16; embedding rows and norms are negligible.
    let weight_bytes: f64 = {
        let h = cfg.hidden_size as f64;
        let i = cfg.intermediate_size as f64;
        let l = cfg.num_hidden_layers as f64;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads as f64,
            cfg.num_key_value_heads as f64,
            cfg.head_dim() as f64,
        );
        let layer = 2.0 * h * nh * hd + 2.0 * h * nkv * hd + 3.0 * h * i;
        (l * layer + cfg.vocab_size as f64 * h) * 2.0
    };
    let kv_bytes_per_token =
        (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim() * 2) as f64;

    let run = |b: usize, seed: u64, new_tokens: usize| {
        let engine = engine.clone();
        async move {
            let reqs: Vec<GenerateRequest> = (0..b)
                .map(|r| {
                    let ids: Vec<u32> = (0..prompt_len)
                        .map(|j| ((seed as usize * 7919 + r * 104729 + j * 31) % 150000) as u32)
                        .collect();
                    GenerateRequest {
                        input_ids: ids,
                        params: SamplingParams {
                            max_new_tokens: new_tokens,
                            temperature: 0.0,
                            ignore_eos: true,
                            ..SamplingParams::default()
                        },
                        rid: None,
                        return_routed_experts: false,
                    }
                })
                .collect();
            let t = Instant::now();
            let outs =
                futures::future::join_all(reqs.into_iter().map(|r| engine.generate(r))).await;
            let wall = t.elapsed().as_secs_f64();
            let mut tokens = 0;
            for out in outs {
                // A failed request is a failed benchmark, not a slow one.
                tokens += out.expect("generate failed").output_ids.len();
            }
            (wall, tokens)
        }
    };
    // Warm-up: kernels, allocator.
    run(2, 999, new_tokens).await;
    let mut rows = Vec::new();
    for (k, &b) in batches.iter().enumerate() {
        // Steady state, as a serving engine runs: this batch size's CUDA graphs are
        // captured by a short untimed run first (the transformers baseline warms up too).
        run(b, 500 + k as u64, 8).await;
        let steps0 = engine.stats().steps.load(Ordering::Relaxed);
        let ahead0 = engine.stats().steps_ahead.load(Ordering::Relaxed);
        let (wall, tokens) = run(b, k as u64, new_tokens).await;
        let steps = engine.stats().steps.load(Ordering::Relaxed) - steps0;
        let steps_ahead = engine.stats().steps_ahead.load(Ordering::Relaxed) - ahead0;
        // The same batch's prefill and first token alone (other prompts: no prefix-cache
        // hits), so the decode phase's throughput is what the per-step bound describes
        // (as SGLang's bench_one_batch reports prefill and decode apart). The median of
        // three: one reading is a large share of the wall time at small shapes.
        let mut prefills = Vec::new();
        for r in 0..3u64 {
            prefills.push(run(b, 700 + 10 * k as u64 + r, 1).await.0);
        }
        prefills.sort_by(f64::total_cmp);
        let prefill_s = prefills[1];
        if let Some(dir) = &trace_dir {
            // Another prompt set, as the timed runs use (no prefix-cache hits). The engine
            // thread's aten ops are not in the trace (Kineto records the starting
            // thread's); its kernels are (CUPTI records the whole process).
            let path = dir.join(format!("engine_prefill_{shape}_b{b}.json"));
            synchronize(device);
            let profile = TorchProfile::start(true)?;
            run(b, 800 + 10 * k as u64, 1).await;
            synchronize(device);
            profile.finish(&path)?;
            eprintln!("torch profile of a prefill: {}", path.display());
            // The same with DECODE_TRACE_STEPS decode steps after it: the difference of the
            // two traces' kernel sums is what those decode steps cost.
            let path = dir.join(format!("engine_decode_{shape}_b{b}.json"));
            synchronize(device);
            let profile = TorchProfile::start(true)?;
            run(b, 900 + 10 * k as u64, 1 + DECODE_TRACE_STEPS).await;
            synchronize(device);
            profile.finish(&path)?;
            eprintln!(
                "torch profile of a prefill and {DECODE_TRACE_STEPS} decode steps: {}",
                path.display()
            );
        }
        let decode_tps = (b * (new_tokens - 1)) as f64 / (wall - prefill_s);
        let avg_ctx = prompt_len as f64 + new_tokens as f64 / 2.0;
        let bytes_per_step = weight_bytes + b as f64 * avg_ctx * kv_bytes_per_token;
        let bound = b as f64 / (bytes_per_step / bandwidth);
        let tps = tokens as f64 / wall;
        eprintln!(
            "{shape} batch {b:>4}: {tokens} tokens in {wall:.3}s = {tps:.0} tokens/s ({steps} steps, {steps_ahead} ahead); bound {bound:.0} -> {:.1}%; prefill {prefill_s:.3}s, decode {decode_tps:.0} tokens/s -> {:.1}%",
            100.0 * tps / bound,
            100.0 * decode_tps / bound
        );
        rows.push(json!({
            "batch": b, "tokens": tokens, "wall_s": wall, "tokens_per_s": tps,
            "steps": steps, "steps_ahead": steps_ahead, "prefill_runs_s": prefills,
            "bound_tokens_per_s": bound, "bandwidth_fraction": tps / bound,
            "prefill_s": prefill_s, "decode_tokens_per_s": decode_tps,
            "decode_bandwidth_fraction": decode_tps / bound,
        }));
    }
    println!(
        "{}",
        json!({
            "shape": shape, "prompt": prompt_len, "new_tokens": new_tokens,
            "chunked_prefill_size": chunked_prefill_size,
            "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token, "load_s": load_s, "results": rows,
        })
    );
    Ok(())
}

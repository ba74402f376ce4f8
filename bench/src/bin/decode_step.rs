//! GPU time of one decode step of the native engine's model (the forward over a paged KV
//! cache with the CUDA decode kernels, then the fp32 LM head), by CUDA-graph replay: no
//! host scheduling, no sampling, so differences of a few microseconds between kernel
//! variants show. Each variant is a copy of the model whose decode kernels were enabled
//! under its own knobs (manta_knobs overrides, such as MANTA_PAGED_MMA=0); the
//! variants replay in turn, several rounds, and the median per variant is reported. Each
//! variant's logits are checked first against the same step through the model's tensor
//! ops (gathered keys and values, cuBLAS), so a variant that skips work fails rather than
//! looks fast.
//!
//! usage: decode_step SHAPE(0.6b|8b) BATCH CONTEXT [VARIANT ...]
//! where VARIANT is NAME or NAME:KEY=VALUE,KEY=VALUE (default: the engine's settings).
//! Example: decode_step 0.6b 1 640 default lanes:MANTA_PAGED_MMA=0

use std::time::Instant;

use manta_bench::parse_variant;
use manta_model::ModelConfig;
use manta_model::{decode_counters, CausalLm, PagedBatch, PagedKvCache, PagedSeq};
use tch::{nn, Device, Kind, Tensor};

const BLOCK_SIZE: usize = 16;
const REPLAYS: usize = 200;
const ROUNDS: usize = 5;

struct Variant {
    name: String,
    graph: manta_cuda::CudaGraph,
    // Kept alive while the graph may replay (it reads and writes their memory).
    _model: (nn::VarStore, CausalLm),
    _kv: PagedKvCache,
    _inputs: Vec<Tensor>,
    times_us: Vec<f64>,
}

fn build(
    cfg: &ModelConfig,
    name: String,
    env: &[(String, String)],
    batch: i64,
    context: i64,
) -> anyhow::Result<Variant> {
    let device = Device::Cuda(0);
    tch::manual_seed(1);
    let mut vs = nn::VarStore::new(device);
    let mut model = CausalLm::new(&vs.root(), cfg);
    vs.set_kind(Kind::BFloat16);
    // The variant's knobs hold while its kernels are enabled and its step is captured
    // (knobs read at either point apply).
    for (k, v) in env {
        manta_knobs::set_override(k, v).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    }
    let captured = capture(cfg, &mut model, batch, context);
    manta_knobs::clear_overrides();
    let (graph, kv, inputs) = captured.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    Ok(Variant {
        name,
        graph,
        _model: (vs, model),
        _kv: kv,
        _inputs: inputs,
        times_us: Vec::new(),
    })
}

/// Enables the decode kernels and captures one step of `batch` rows of `context` tokens.
fn capture(
    cfg: &ModelConfig,
    model: &mut CausalLm,
    batch: i64,
    context: i64,
) -> anyhow::Result<(manta_cuda::CudaGraph, PagedKvCache, Vec<Tensor>)> {
    let device = Device::Cuda(0);
    // Every row's context is `context` tokens (its new token's slot included), in its own
    // blocks; the table is as wide as the engine's graph bucket for that context.
    let width = (context as usize).next_power_of_two().max(256) as i64;
    let per_row = width / BLOCK_SIZE as i64;
    let kv = PagedKvCache::new(
        cfg,
        (batch * per_row) as usize,
        BLOCK_SIZE,
        Kind::BFloat16,
        device,
    );
    kv_fill(&kv, cfg.num_hidden_layers as usize);
    let table: Vec<i32> = (0..batch * per_row).map(|b| b as i32).collect();
    let tables = Tensor::from_slice(&table).view([batch, per_row]).to(device);
    let lens = Tensor::full([batch], context, (Kind::Int, device));
    let slots = (Tensor::arange(batch, (Kind::Int64, device)) * per_row * BLOCK_SIZE as i64)
        + (context - 1);
    let ids = (Tensor::arange(batch, (Kind::Int64, device)) * 7919 + 13).remainder(150_000);
    let positions = Tensor::full([batch], context - 1, (Kind::Int64, device));
    let counters = decode_counters(batch, device);
    let _guard = tch::no_grad_guard();
    // The same step through the model's tensor ops (keys and values gathered, cuBLAS), to
    // check the kernels' logits against: a kernel that skipped work would be fast here.
    let reference = {
        let seqs: Vec<PagedSeq> = (0..batch)
            .map(|r| PagedSeq {
                q_len: 1,
                slots: (0..context)
                    .map(|p| r * per_row * BLOCK_SIZE as i64 + p)
                    .collect(),
            })
            .collect();
        let b = PagedBatch::new(&seqs, device);
        model.logits_f32(&model.forward_paged(&ids, &positions, &b, &kv))
    };
    model
        .enable_decode_kernels()
        .map_err(|e| anyhow::anyhow!("decode kernels: {e}"))?;
    let step = || {
        let b = PagedBatch::decode_paged(&slots, &tables, &lens, &counters, BLOCK_SIZE);
        let hidden = model.forward_paged(&ids, &positions, &b, &kv);
        model.logits_f32(&hidden)
    };
    let _ = step(); // compiles the kernels, grows the allocator
    let (graph, logits) = manta_cuda::CudaGraph::capture(0, None, step)?;
    graph.replay()?;
    let scale = reference.abs().max().double_value(&[]);
    let error = (&logits - &reference).abs().max().double_value(&[]) / scale;
    eprintln!("logits against the tensor-op step: max |difference| {error:.2e} of the largest");
    // bf16 rounding through 28–36 random layers puts 4e-2 to 6e-2 between the two.
    anyhow::ensure!(
        error < 1e-1,
        "the kernels' logits differ from the tensor ops' by {error:.2e} of the largest"
    );
    Ok((
        graph,
        kv,
        vec![tables, lens, slots, ids, positions, counters],
    ))
}

/// Random keys and values, so attention does real arithmetic.
fn kv_fill(kv: &PagedKvCache, layers: usize) {
    for i in 0..layers {
        let (k, v) = kv.layer(i);
        let _ = k.shallow_clone().normal_(0.0, 1.0);
        let _ = v.shallow_clone().normal_(0.0, 1.0);
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map_or("0.6b", String::as_str);
    let batch: i64 = args.get(2).map_or(Ok(1), |s| s.parse())?;
    let context: i64 = args.get(3).map_or(Ok(640), |s| s.parse())?;
    let specs: Vec<&str> = if args.len() > 4 {
        args[4..].iter().map(String::as_str).collect()
    } else {
        vec!["default"]
    };
    let config = manta_bench::decode_config(shape)?;
    anyhow::ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let cfg = ModelConfig::from_json_str(config, shape)?;
    let mut variants = Vec::new();
    for spec in specs {
        let (name, env) = parse_variant(spec)?;
        variants.push(build(&cfg, name, &env, batch, context)?);
    }
    for _ in 0..ROUNDS {
        for v in &mut variants {
            v.graph.replay()?;
            tch::Cuda::synchronize(0);
            let t = Instant::now();
            for _ in 0..REPLAYS {
                v.graph.replay()?;
            }
            tch::Cuda::synchronize(0);
            v.times_us
                .push(t.elapsed().as_secs_f64() * 1e6 / REPLAYS as f64);
        }
    }
    let mut rows = Vec::new();
    for v in &mut variants {
        v.times_us.sort_by(f64::total_cmp);
        let median = v.times_us[v.times_us.len() / 2];
        eprintln!(
            "{shape} batch {batch} context {context} {:>12}: {median:8.1} us/step = {:7.0} tokens/s (rounds {:?})",
            v.name,
            batch as f64 * 1e6 / median,
            v.times_us.iter().map(|t| t.round()).collect::<Vec<_>>()
        );
        rows.push(serde_json::json!({
            "variant": v.name, "median_us": median, "rounds_us": v.times_us,
            "tokens_per_s": batch as f64 * 1e6 / median,
        }));
    }
    println!(
        "{}",
        serde_json::json!({"shape": shape, "batch": batch, "context": context, "variants": rows})
    );
    Ok(())
}

//! GPU time of the paged decode-attention kernel on its own (diagnostic): B sequences of
//! CONTEXT tokens in contiguous blocks, Qwen3 attention heads (32 query, 8 kv, head_dim
//! 128 — the 8B shape), eight layers' pools cycled so L2 holds none of the next, launched
//! back to back in a CUDA graph. Reports µs per launch and the keys' and values' read
//! bandwidth, per variant (the kernel's knobs, as manta_knobs overrides: MANTA_PAGED_TT,
//! MANTA_PAGED_LANES, MANTA_PAGED_WARPS, MANTA_PAGED_CTAS_PER_SM). Set beside
//! bench/py/probe_kv_layout.py's plain stream of the same bytes, it says how much of the
//! kernel's time is its own structure and how much is the step around it.
//!
//! usage: paged_attention BATCH CONTEXT [VARIANT ...]
//! where VARIANT is NAME or NAME:KEY=VALUE,KEY=VALUE (default: the engine's settings).

use std::time::Instant;

use manta_bench::parse_variant;
use tch::{Device, Kind, Tensor};

const BLOCK_SIZE: i64 = 16;
const HEADS: i64 = 32;
const KV_HEADS: i64 = 8;
const HEAD_DIM: i64 = 128;
const LAYERS: usize = 8;
const REPLAYS: usize = 50;
const ROUNDS: usize = 5;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let batch: i64 = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let context: i64 = args.get(2).map_or(Ok(640), |s| s.parse())?;
    let specs: Vec<String> = if args.len() > 3 {
        args[3..].to_vec()
    } else {
        vec!["default".into()]
    };
    anyhow::ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let device = Device::Cuda(0);
    let _guard = tch::no_grad_guard();
    let per_row = (context + BLOCK_SIZE - 1) / BLOCK_SIZE;
    let slots = batch * per_row * BLOCK_SIZE;
    let pools: Vec<(Tensor, Tensor)> = (0..LAYERS)
        .map(|_| {
            let shape = [slots, KV_HEADS, HEAD_DIM];
            (
                Tensor::randn(shape, (Kind::BFloat16, device)),
                Tensor::randn(shape, (Kind::BFloat16, device)),
            )
        })
        .collect();
    let table: Vec<i32> = (0..batch * per_row).map(|b| b as i32).collect();
    let tables = Tensor::from_slice(&table).view([batch, per_row]).to(device);
    let lens = Tensor::full([batch], context, (Kind::Int, device));
    let counters = Tensor::zeros([batch * KV_HEADS], (Kind::Int, device));
    let q = Tensor::randn([batch, HEADS, HEAD_DIM], (Kind::BFloat16, device));
    let mut out = q.empty_like();
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let bytes = (2 * batch * context * KV_HEADS * HEAD_DIM * 2) as f64;
    let mut rows = Vec::new();
    for spec in &specs {
        let (name, env) = parse_variant(spec)?;
        for (k, v) in &env {
            manta_knobs::set_override(k, v).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        }
        let launch = |out: &mut Tensor| -> anyhow::Result<()> {
            for (k, v) in &pools {
                manta_cuda::paged_decode_attention(
                    &q,
                    k,
                    v,
                    &tables,
                    &lens,
                    Some(&counters),
                    out,
                    BLOCK_SIZE as usize,
                    scale,
                )?;
            }
            Ok(())
        };
        launch(&mut out)?; // compiles this variant's kernel
        let (graph, captured) = manta_cuda::CudaGraph::capture(0, None, || launch(&mut out))?;
        captured?;
        manta_knobs::clear_overrides();
        let mut times = Vec::new();
        for _ in 0..ROUNDS {
            graph.replay()?;
            tch::Cuda::synchronize(0);
            let t = Instant::now();
            for _ in 0..REPLAYS {
                graph.replay()?;
            }
            tch::Cuda::synchronize(0);
            times.push(t.elapsed().as_secs_f64() * 1e6 / (REPLAYS * LAYERS) as f64);
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        eprintln!(
            "batch {batch} context {context} {name:>14}: {median:7.1} us/launch, {:5.2} TB/s",
            bytes / median / 1e6
        );
        rows.push(serde_json::json!({"variant": name, "median_us": median,
            "tb_s": bytes / median / 1e6, "rounds_us": times}));
    }
    println!(
        "{}",
        serde_json::json!({"batch": batch, "context": context, "bytes": bytes, "variants": rows})
    );
    Ok(())
}

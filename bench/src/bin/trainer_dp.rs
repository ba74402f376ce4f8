//! Data-parallel trainer ranks on GPUs (bench/run_trainer_dp.sh): one process per GPU,
//! NCCL through `manta_trainer::data_parallel::NcclCollective`, ZeRO-2. Each run trains
//! a few steps on its share of one global batch (checked against one rank on the whole
//! batch by the script), writes its weights, then times steps on the same share.
//!
//! usage:
//!   trainer_dp init DIR [SHAPE]
//!       config.json (Qwen3 shape 0.6b, the default, or 8b) and random bf16 weights,
//!       made on cuda:0, in DIR
//!   trainer_dp run RANK WORLD ID_FILE MODEL_DIR GLOBAL_SAMPLES SEQ STEPS ITERS PRECISION WEIGHTS_OUT [MODE]
//!       rank RANK of WORLD on cuda:RANK (WORLD 1: the single-GPU trainer, no NCCL,
//!       ID_FILE unused; otherwise rank 0 writes a new NCCL unique id there and the
//!       others read it: the id names a bootstrap socket that lives in the process that
//!       made it, so rank 0 makes it, not a helper process that exits) trains STEPS
//!       steps on samples [RANK·G/WORLD, (RANK+1)·G/WORLD) of the global batch, writes its weights to WEIGHTS_OUT (safetensors), then
//!       times ITERS more steps; PRECISION is bf16 (fp32 masters) or fp32. Micro-batches
//!       hold G/2 samples whatever the world size. WEIGHTS_OUT `-` writes none (a shape
//!       whose gathered weights would not fit beside the trainer). MODE (WORLD > 1):
//!       `zero2` (the default, `Trainer::new_data_parallel`), `zero3` (`--zero-stage 3`,
//!       `Trainer::new_zero3`) or `cp` (`--context-parallel-size WORLD`: every rank gets
//!       the whole batch and holds a share of each sequence; one sample per micro-batch).
//!       Prints one JSON object.
//!
//! RECOMPUTE=1 recomputes every layer in the backward pass instead of keeping its
//! activations (RECOMPUTE_LAYERS=N with it: only the first N, the block method). GRAD_REDUCE_BF16=1 is `--grad-reduce-in-bf16` (WORLD > 1, bf16): the
//! gradients reduce-scattered and the rank's reduced-gradient shard kept in bf16. The
//! JSON names the driver flags the run stands for (`flags`), the sharded state's bytes
//! and the memory plan's figures beside the measured peak. GPU_CAP_GIB=N makes each GPU
//! look like an N GiB card: a ballast tensor takes the rest before the trainer starts
//! (an H200 standing in for an 80 GB H100); the peak reported excludes it.
//! MANTA_TRAINER_PROFILE=1 adds `profile`: this rank's median seconds per step phase
//! over the timed steps (`manta_trainer::profile`; the profile's syncs slow the steps).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use manta_model::{CausalLm, ModelConfig, Recompute, RecomputeMethod};
use manta_trainer::batch::MicroBatchLayout;
use manta_trainer::data_parallel::{nccl::UNIQUE_ID_BYTES, zero::DEFAULT_BUCKET_NUMEL};
use manta_trainer::data_parallel::{Collective, NcclCollective};
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::profile;
use manta_trainer::TrainerError;
use manta_trainer::{memory_plan, AlgoOptions, TrainBatch, Trainer, TrainerOptions};
use tch::{nn, Device, Kind, Tensor};

fn options(
    model_dir: &Path,
    device: Device,
    bf16: bool,
    micro_tokens: usize,
    recompute: Option<Recompute>,
) -> TrainerOptions {
    TrainerOptions {
        model_dir: model_dir.to_path_buf(),
        seed: 0,
        device,
        adam: AdamWConfig {
            // Large enough that one step moves many bf16 weights.
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        clip: ClipRange {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
        },
        clip_grad: 1.0,
        temperature: 1.0,
        max_tokens_per_gpu: micro_tokens,
        layout: MicroBatchLayout::Packed,
        bf16: Some(bf16),
        use_rollout_logprobs: true,
        logprob_chunk: 1024,
        recompute,
        algo: AlgoOptions {
            grad_reduce_in_bf16: env_flag("GRAD_REDUCE_BF16"),
            ..Default::default()
        },
    }
}

/// Whether the environment variable `name` is `1`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).as_deref() == Ok("1")
}

/// RECOMPUTE=1: every layer recomputed in the backward (shapes whose activations would
/// not fit otherwise); RECOMPUTE_LAYERS=N as well: only the first N layers (Megatron's
/// block method), the rest keep their activations in memory a plan has spare.
fn recompute_setting() -> anyhow::Result<Option<Recompute>> {
    if !env_flag("RECOMPUTE") {
        return Ok(None);
    }
    let Ok(raw) = std::env::var("RECOMPUTE_LAYERS") else {
        return Ok(Some(Recompute::EVERY_LAYER));
    };
    let num_layers = raw
        .parse()
        .with_context(|| format!("RECOMPUTE_LAYERS={raw:?} is not a layer count"))?;
    Ok(Some(Recompute {
        method: RecomputeMethod::Block,
        num_layers,
    }))
}

/// The driver's flags this run stands for.
fn driver_flags(mode: Mode, world: usize, opts: &TrainerOptions) -> Vec<String> {
    let mut flags = Vec::new();
    if opts.bf16 == Some(true) {
        flags.push("--bf16".to_string());
    }
    match mode {
        _ if world == 1 => {}
        Mode::Zero2 => flags.push("--zero-stage 2".into()),
        Mode::Zero3 => flags.push("--zero-stage 3".into()),
        Mode::ContextParallel => flags.push(format!("--context-parallel-size {world}")),
    }
    if opts.algo.grad_reduce_in_bf16 {
        flags.push("--grad-reduce-in-bf16".into());
    }
    if let Some(r) = opts.recompute {
        let method = match r.method {
            RecomputeMethod::Uniform => "uniform",
            RecomputeMethod::Block => "block",
        };
        flags.push(format!(
            "--recompute-granularity full --recompute-method {method} --recompute-num-layers {}",
            r.num_layers
        ));
    }
    flags
}

/// The memory plan's figures (GiB) for this rank, as the trainer logs them.
fn planned(
    cfg: &ModelConfig,
    mode: Mode,
    world: usize,
    opts: &TrainerOptions,
) -> serde_json::Value {
    let inputs = memory_plan::MemoryInputs {
        tokens_per_gpu: opts.max_tokens_per_gpu,
        data_parallel: world,
        zero_stage: if mode == Mode::Zero3 { 3 } else { 2 },
        bf16: opts.bf16 == Some(true),
        grad_reduce_in_bf16: opts.algo.grad_reduce_in_bf16,
        recompute: opts.recompute,
        reference: false,
        logprob_chunk: opts.logprob_chunk.max(1) as usize,
    };
    let plan = memory_plan::plan(cfg, &inputs);
    serde_json::json!({
        "static_gib": gib(plan.static_bytes() as usize),
        "build_gib": gib(plan.build_bytes() as usize),
        "peak_gib": gib(plan.peak() as usize),
    })
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn main() -> anyhow::Result<()> {
    // As the driver and worker do: ranks must agree on NCCL's buffer allocation.
    eprintln!("{}", manta_cuda::process_group::align_nccl_env());
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("init") => init(
            Path::new(args.get(2).context("usage: trainer_dp init DIR [SHAPE]")?),
            args.get(3).map_or("0.6b", String::as_str),
        ),
        Some("run") => run(&args[2..]),
        _ => bail!("usage: trainer_dp init DIR [SHAPE] | run RANK WORLD ID_FILE MODEL_DIR GLOBAL_SAMPLES SEQ STEPS ITERS PRECISION WEIGHTS_OUT [MODE]"),
    }
}

/// Random bf16 weights of `shape` (0.6b or 8b), saved as a model directory every run
/// loads. Made from the model alone on cuda:0 (no optimizer state: 8B's would not fit).
fn init(dir: &Path, shape: &str) -> anyhow::Result<()> {
    ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let config = manta_bench::decode_config(shape)?;
    let cfg = ModelConfig::from_json_str(config, shape)?;
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cuda(0));
    let _model = CausalLm::new(&vs.root(), &cfg);
    vs.set_kind(Kind::BFloat16);
    manta_model::save_pretrained(&vs, &cfg, dir)?;
    Ok(())
}

/// How the ranks of a group share the work.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Zero2,
    Zero3,
    ContextParallel,
}

impl Mode {
    fn parse(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "zero2" => Self::Zero2,
            "zero3" => Self::Zero3,
            "cp" => Self::ContextParallel,
            other => bail!("MODE {other:?}: expected zero2, zero3 or cp"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Zero2 => "zero2",
            Self::Zero3 => "zero3",
            Self::ContextParallel => "cp",
        }
    }
}

/// Holds all but `cap_gib` GiB of the GPU (GPU_CAP_GIB), so that a larger card behaves
/// as a smaller one; returns the ballast and its bytes.
fn ballast(rank: usize) -> anyhow::Result<Option<(Tensor, usize)>> {
    let cap = std::env::var("GPU_CAP_GIB").unwrap_or_default();
    if cap.is_empty() {
        return Ok(None);
    }
    let cap: f64 = cap
        .parse()
        .with_context(|| format!("GPU_CAP_GIB={cap:?} is not a number of GiB"))?;
    let total = manta_cuda::total_memory(rank)?;
    let keep = (cap * (1u64 << 30) as f64) as usize;
    ensure!(
        keep < total,
        "GPU_CAP_GIB={cap} is not below the card's {} GiB",
        total >> 30
    );
    let bytes = total - keep;
    let t = Tensor::empty([bytes as i64], (Kind::Uint8, Device::Cuda(rank)));
    eprintln!(
        "rank {rank}: ballast of {:.1} GiB holds the card to {cap} GiB",
        bytes as f64 / (1u64 << 30) as f64
    );
    Ok(Some((t, bytes)))
}

fn run(a: &[String]) -> anyhow::Result<()> {
    ensure!(
        a.len() == 10 || a.len() == 11,
        "run takes 10 or 11 arguments, got {}",
        a.len()
    );
    let mode = Mode::parse(a.get(10).map_or("zero2", String::as_str))?;
    let num = |i: usize| -> anyhow::Result<usize> {
        a[i].parse()
            .with_context(|| format!("argument {} ({:?}) is not a count", i + 1, a[i]))
    };
    let (rank, world) = (num(0)?, num(1)?);
    let (id_file, model_dir) = (&a[2], Path::new(&a[3]));
    let (global, seq, steps, iters) = (num(4)?, num(5)?, num(6)?, num(7)?);
    let bf16 = match a[8].as_str() {
        "bf16" => true,
        "fp32" => false,
        other => bail!("PRECISION {other:?}: expected bf16 or fp32"),
    };
    let weights_out = Path::new(&a[9]);
    ensure!(world >= 1 && rank < world, "rank {rank} of world {world}");
    ensure!(
        mode == Mode::ContextParallel || (global % world == 0 && global >= 2),
        "GLOBAL_SAMPLES {global} must split evenly over {world} ranks"
    );
    ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let device = Device::Cuda(rank);
    let held = ballast(rank)?;
    let held_bytes = held.as_ref().map_or(0, |(_, b)| *b);
    // Context parallelism budgets whole rows (each rank holds its share of one).
    let micro_tokens = if mode == Mode::ContextParallel {
        seq
    } else {
        (global / 2).max(1) * seq
    };
    let opts = options(model_dir, device, bf16, micro_tokens, recompute_setting()?);
    let flags = driver_flags(mode, world, &opts);
    eprintln!("rank {rank}: as the driver's {}", flags.join(" "));
    let plan_opts = opts.clone();
    let t0 = Instant::now();
    let mut trainer = if world == 1 {
        Trainer::new(opts)?
    } else {
        let id = if rank == 0 {
            publish_id(id_file)?
        } else {
            wait_for_id(id_file)?
        };
        let comm = NcclCollective::new(rank, world, &id, rank)?;
        eprintln!(
            "rank {rank}: NCCL communicator of {} ranks",
            comm.world_size()
        );
        let comm: Box<dyn Collective> = Box::new(comm);
        let built: Result<Trainer, TrainerError> = match mode {
            Mode::Zero2 => Trainer::new_data_parallel(opts, comm, DEFAULT_BUCKET_NUMEL),
            Mode::Zero3 => Trainer::new_zero3(opts, comm),
            Mode::ContextParallel => {
                Trainer::new_context_parallel(opts, comm, DEFAULT_BUCKET_NUMEL)
            }
        };
        built?
    };
    tch::Cuda::synchronize(rank as i64);
    let init_s = t0.elapsed().as_secs_f64();
    let plan = planned(trainer.model_config(), mode, world, &plan_opts);
    let vocab = trainer.model_config().vocab_size;
    let full = manta_bench::grpo_batch(global, seq, vocab);
    // Data parallel: this rank's share; context parallel: every rank the whole batch.
    let (share, first) = if mode == Mode::ContextParallel {
        (global, 0)
    } else {
        (global / world, rank * (global / world))
    };
    let batch = TrainBatch {
        samples: full.samples[first..first + share].to_vec(),
        advantages: full.advantages[first..first + share].to_vec(),
        global_samples: global,
    };
    let mut checked = Vec::new();
    for _ in 0..steps {
        let m = trainer.train_step(&batch)?;
        checked.push(serde_json::json!({
            "loss": m.get("train/loss"), "grad_norm": m.get("train/grad_norm"),
            "pg_loss": m.get("train/pg_loss"), "tokens": m.get("train/tokens"),
        }));
    }
    let checked_peak = manta_cuda::peak_allocated(rank, true)?;
    if weights_out != Path::new("-") {
        let named: Vec<(String, Tensor)> = trainer
            .try_export_weights()?
            .into_iter()
            .map(|(k, t)| (k, t.to_device(Device::Cpu)))
            .collect();
        Tensor::write_safetensors(&named, weights_out)
            .with_context(|| format!("writing {}", weights_out.display()))?;
        drop(named);
        manta_cuda::peak_allocated(rank, true)?;
    }
    let mut times = Vec::new();
    let mut phases: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for _ in 0..iters {
        let t = Instant::now();
        let m = trainer.train_step(&batch)?;
        tch::Cuda::synchronize(rank as i64);
        times.push(t.elapsed().as_secs_f64());
        for (k, v) in m {
            if let Some(phase) = k.strip_prefix(profile::METRIC_PREFIX) {
                phases.entry(phase.to_string()).or_default().push(v);
            }
        }
    }
    // MANTA_TRAINER_PROFILE: each phase's median over the timed steps.
    let phase_medians = (!phases.is_empty()).then(|| {
        phases
            .into_iter()
            .map(|(k, v)| (k, median(v)))
            .collect::<BTreeMap<_, _>>()
    });
    let peak = manta_cuda::peak_allocated(rank, false)?.max(checked_peak) - held_bytes;
    let shard = trainer.shard_bytes().map(|(b, kind)| {
        serde_json::json!({
            "master": gib(b.master), "moments": gib(b.moments),
            "gradients": gib(b.gradients), "gradient_kind": format!("{kind:?}"),
            "parameters": gib(b.parameters),
        })
    });
    drop(held);
    let median = median(times.clone());
    println!(
        "{}",
        serde_json::json!({
            "rank": rank, "world": world, "precision": a[8], "mode": mode.name(),
            "global_samples": global, "seq": seq, "rank_samples": share,
            "micro_batch_tokens": global / 2 * seq,
            "steps": checked, "init_s": init_s,
            "median_s": median, "times_s": times,
            "global_tokens_per_s": (global * seq) as f64 / median,
            "gpu_cap_gib": std::env::var("GPU_CAP_GIB").ok(),
            "recompute": env_flag("RECOMPUTE"),
            "grad_reduce_in_bf16": plan_opts.algo.grad_reduce_in_bf16,
            "flags": flags,
            "shard_gib": shard,
            "plan": plan,
            "peak_allocated_gib": gib(peak),
            "profile": phase_medians,
        })
    );
    Ok(())
}

/// The middle value (the upper of the two middles), NaN for none.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A new unique id, written to `file` whole (a temporary file renamed) for the other ranks.
fn publish_id(file: &str) -> anyhow::Result<Vec<u8>> {
    let id = NcclCollective::unique_id()?;
    let partial = format!("{file}.partial");
    std::fs::write(&partial, &id).with_context(|| format!("writing {partial}"))?;
    std::fs::rename(&partial, file).with_context(|| format!("renaming {partial} to {file}"))?;
    Ok(id)
}

/// Rank 0's unique id, read from the file rank 0 wrote (waits up to a minute).
fn wait_for_id(file: &str) -> anyhow::Result<Vec<u8>> {
    for _ in 0..600 {
        if let Ok(id) = std::fs::read(file) {
            if id.len() == UNIQUE_ID_BYTES {
                return Ok(id);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    bail!("no {UNIQUE_ID_BYTES}-byte NCCL unique id in {file} after 60 s")
}

//! Manta's side of bench/run_weight_sync_nccl.sh: rank 0 of an NCCL weight-update group
//! through `manta_cuda::process_group` (libtorch's ProcessGroupNCCL behind the shim) on
//! cuda:0, broadcasting Qwen3-shaped bf16 tensors to a Python peer that joined as SGLang
//! joins (bench/py/weight_sync_nccl_peer.py).
//!
//! - `weight_sync_nccl send PORT REPS MANIFEST GROUP [SHAPE]`: writes MANIFEST (the JSON
//!   list of [name, shape]), hosts the store on PORT, joins as rank 0, broadcasts every
//!   tensor once (the peer checks the bytes), then REPS timed rounds, each after a
//!   one-element broadcast; prints one JSON object (this side's times).
//! - `weight_sync_nccl recv PORT REPS MANIFEST GROUP`: rank 1 on cuda:1 in Rust (as an
//!   engine on a worker receives): fresh tensors from MANIFEST, the check round compared
//!   with the pattern on the GPU, then REPS timed rounds; prints one JSON object. With
//!   `send`, a Rust-to-Rust broadcast beside the Python peer's figures. `BALLAST_GIB`
//!   (either role) first fills that many GiB of its GPU, as a trainer or an engine does.
//! - `weight_sync_nccl digest MANIFEST`: the pattern's per-tensor int16 sums on the CPU
//!   (must equal the peer's `digest`: both sides generate the same bytes).
//!
//! Tensor contents are a deterministic integer hash of (tensor index, element index)
//! reinterpreted as bf16 bits, so the peer knows the expected bytes without sharing a
//! random generator.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use manta_cuda::process_group::{GroupSpec, ProcessGroup};
use serde_json::json;
use tch::{Device, Kind, Tensor};

/// The bf16 tensor whose int16 bits hash (index, element); the peer's `pattern` is the same.
fn pattern(index: usize, shape: &[i64], device: Device) -> Tensor {
    let n: i64 = shape.iter().product();
    let a = Tensor::arange(n, (Kind::Int64, device)) + (index as i64 * 7919 + 1);
    let x = a * 2_654_435_761i64;
    let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(15));
    let x = x.bitwise_and(0xFFF_FFFFi64) * 2_246_822_519i64;
    let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(13));
    let bits = x.bitwise_and(0xFFFFi64) - 32768;
    bits.to_kind(Kind::Int16)
        .view_dtype(Kind::BFloat16)
        .reshape(shape)
}

fn read_manifest(path: &str) -> anyhow::Result<Vec<(String, Vec<i64>)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    serde_json::from_str(&text).with_context(|| format!("{path}: not a [[name, shape], ...] list"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rank `rank` (on cuda:`rank`) of the two-rank group `group_name`, rank 0 hosting the
/// store on `port`.
fn join_pair(port: u16, rank: usize, group_name: &str) -> anyhow::Result<ProcessGroup> {
    Ok(ProcessGroup::join(GroupSpec {
        master_address: "127.0.0.1".into(),
        master_port: port,
        rank,
        world_size: 2,
        group_name: group_name.to_string(),
        device: rank,
        timeout: Duration::from_secs(600),
    })?)
}

/// `reps` timed broadcasts of `named` from rank 0, each after a one-element broadcast
/// that lines both sides up: the seconds of each, their median (NaN for none), and the
/// host seconds each spent issuing its collectives.
fn timed_rounds(
    mut group: ProcessGroup,
    named: &[(String, Tensor)],
    reps: usize,
    dev: Device,
) -> anyhow::Result<(Vec<f64>, f64, Vec<f64>)> {
    let marker = vec![(
        "marker".to_string(),
        Tensor::zeros([1], (Kind::BFloat16, dev)),
    )];
    let mut seconds = Vec::with_capacity(reps);
    let mut enqueue = Vec::with_capacity(reps);
    for _ in 0..reps {
        group.broadcast(&marker, 0)?;
        let t0 = Instant::now();
        group.broadcast(named, 0)?;
        seconds.push(t0.elapsed().as_secs_f64());
        enqueue.push(group.last_enqueue().as_secs_f64());
    }
    let med = if seconds.is_empty() {
        f64::NAN
    } else {
        median(seconds.clone())
    };
    Ok((seconds, med, enqueue))
}

fn send(args: &[String]) -> anyhow::Result<()> {
    let [port, reps, manifest, group_name, rest @ ..] = args else {
        bail!("usage: weight_sync_nccl send PORT REPS MANIFEST GROUP [SHAPE]");
    };
    let port: u16 = port.parse().with_context(|| format!("PORT {port}"))?;
    let reps: usize = reps.parse().with_context(|| format!("REPS {reps}"))?;
    let shape = rest.first().map_or("0.6b", String::as_str);
    let (tensors, _) = manta_bench::qwen3_tensor_shapes(shape)?;
    let tmp = format!("{manifest}.tmp");
    std::fs::write(&tmp, serde_json::to_string(&tensors)?)
        .with_context(|| format!("writing {tmp}"))?;
    std::fs::rename(&tmp, manifest).with_context(|| format!("writing {manifest}"))?;

    if tch::Cuda::device_count() < 2 {
        bail!(
            "needs two CUDA devices (cuda:0 sends, the peer receives on cuda:1); this machine has {}",
            tch::Cuda::device_count()
        );
    }
    let dev = Device::Cuda(0);
    let _ballast = ballast(dev)?;
    let named: Vec<(String, Tensor)> = tensors
        .iter()
        .enumerate()
        .map(|(i, (n, s))| (n.clone(), pattern(i, s, dev)))
        .collect();
    let bytes: i64 = named.iter().map(|(_, t)| t.numel() as i64 * 2).sum();
    let mut group = join_pair(port, 0, group_name)?;
    let started = Instant::now();
    group.broadcast(&named, 0).context("check round")?;
    let first_s = started.elapsed().as_secs_f64();
    let (seconds, med, enqueue) = timed_rounds(group, &named, reps, dev)?;
    println!(
        "{}",
        json!({
            "role": "send",
            "enqueue_s": enqueue,
            "sender": "manta",
            "shape": shape,
            "tensors": named.len(),
            "bytes": bytes,
            "first_round_s": first_s,
            "seconds": seconds,
            "median_s": med,
        })
    );
    Ok(())
}

/// `BALLAST_GIB` GiB held on `dev` for the process's life (none when unset).
fn ballast(dev: Device) -> anyhow::Result<Option<Tensor>> {
    let Ok(v) = std::env::var("BALLAST_GIB") else {
        return Ok(None);
    };
    let gib: f64 = v.parse().with_context(|| format!("BALLAST_GIB={v}"))?;
    let bytes = (gib * (1u64 << 30) as f64) as i64;
    Ok(Some(Tensor::ones([bytes], (Kind::Uint8, dev))))
}

fn recv(args: &[String]) -> anyhow::Result<()> {
    let [port, reps, manifest, group_name] = args else {
        bail!("usage: weight_sync_nccl recv PORT REPS MANIFEST GROUP");
    };
    let port: u16 = port.parse().with_context(|| format!("PORT {port}"))?;
    let reps: usize = reps.parse().with_context(|| format!("REPS {reps}"))?;
    let dev = Device::Cuda(1);
    let _ballast = ballast(dev)?;
    let shapes = read_manifest(manifest)?;
    let named: Vec<(String, Tensor)> = shapes
        .iter()
        .map(|(n, s)| {
            (
                n.clone(),
                Tensor::zeros(s.as_slice(), (Kind::BFloat16, dev)),
            )
        })
        .collect();
    let bytes: i64 = named.iter().map(|(_, t)| t.numel() as i64 * 2).sum();
    let mut group = join_pair(port, 1, group_name)?;
    group.broadcast(&named, 0).context("check round")?;
    let bit_exact = named.iter().enumerate().all(|(i, (_, t))| {
        t.view_dtype(Kind::Int16)
            .equal(&pattern(i, &t.size(), dev).view_dtype(Kind::Int16))
    });
    let (seconds, med, enqueue) = timed_rounds(group, &named, reps, dev)?;
    println!(
        "{}",
        json!({
            "role": "recv",
            "enqueue_s": enqueue,
            "receiver": "manta",
            "tensors": named.len(),
            "bytes": bytes,
            "bit_exact": bit_exact,
            "seconds": seconds,
            "median_s": med,
            "GB_per_s": bytes as f64 / med / 1e9,
        })
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // As the driver and worker do: ranks must agree on NCCL's buffer allocation.
    eprintln!("{}", manta_cuda::process_group::align_nccl_env());
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("send") => send(&args[1..]),
        Some("recv") => recv(&args[1..]),
        Some("digest") => {
            let path = args
                .get(1)
                .context("usage: weight_sync_nccl digest MANIFEST")?;
            let sums: Vec<i64> = read_manifest(path)?
                .iter()
                .enumerate()
                .map(|(i, (_, s))| {
                    pattern(i, s, Device::Cpu)
                        .view_dtype(Kind::Int16)
                        .to_kind(Kind::Int64)
                        .sum(Kind::Int64)
                        .int64_value(&[])
                })
                .collect();
            println!("{}", serde_json::to_string(&sums)?);
            Ok(())
        }
        _ => {
            bail!(
                "usage: weight_sync_nccl send PORT REPS MANIFEST GROUP [SHAPE] \
                 | recv PORT REPS MANIFEST GROUP | digest MANIFEST"
            )
        }
    }
}

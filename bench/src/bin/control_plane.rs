//! Control-plane benchmark (Manta side; bench/py/control_plane_ray.py is Ray's): actor
//! call round trips in-process (ractor `call!`) and across processes (gRPC `Echo` into
//! a `worker` daemon's echo actor, cluster token checked), pipelined calls per second,
//! time for two fresh `worker` processes to be ready, and a stream of samples totalling
//! SAMPLE_MB of protobuf driver -> worker. Prints one JSON object.
//!
//! Cross-process calls go over the channel `WorkerClient` gives every gRPC client of a
//! worker (tonic's `Channel`, cluster token attached).
//!
//! usage: control_plane WORKER_BIN [RTT_SAMPLES=10000] [SAMPLE_MB=100]
//! The worker needs MANTA_CLUSTER_TOKEN (set by bench/run_control_plane.sh).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use manta_proto::cluster as cpb;
use manta_proto::cluster::worker_client::WorkerClient as WorkerRpc;
use manta_proto::common as pb;
use manta_runtime::echo::{EchoActor, EchoMsg};
use manta_runtime::{AuthedChannel, WorkerClient};
use prost::Message;
use ractor::{call, Actor};
use serde_json::json;

type Rpc = WorkerRpc<AuthedChannel>;

/// Tokens per benchmark sample (response and prompt together).
const SAMPLE_TOKENS: usize = 2048;
/// Calls in flight for the pipelined figures.
const IN_FLIGHT: usize = 64;
const PIPELINED_CALLS: usize = 50_000;
const READY_REPEATS: usize = 5;
const INGEST_REPEATS: usize = 3;

/// Sorted latencies in µs -> (p50, p99, mean).
fn summarize(mut us: Vec<f64>) -> (f64, f64, f64) {
    us.sort_by(f64::total_cmp);
    let pick = |q: f64| us[((us.len() as f64 - 1.0) * q).round() as usize];
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    (pick(0.50), pick(0.99), mean)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Worker processes this benchmark started; killed on drop.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `Worker` service on `addr` over `WorkerClient`'s channel, room for 64 MB messages.
fn raw_client(addr: &str, token: &str) -> anyhow::Result<Rpc> {
    Ok(WorkerRpc::new(WorkerClient::new(addr, token)?.channel())
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20))
}

/// Starts two fresh workers and waits until both answer `Describe` (token accepted,
/// resources reported) and an `Echo` through their actor system. Returns the seconds
/// from spawning the processes to that point, the children and their addresses.
async fn start_cluster(
    worker_bin: &str,
    token: &str,
) -> anyhow::Result<(f64, Workers, Vec<String>)> {
    let addrs: Vec<String> = (0..2)
        .map(|_| free_port().map(|p| format!("127.0.0.1:{p}")))
        .collect::<Result<_, _>>()?;
    let t0 = Instant::now();
    let mut workers = Workers(Vec::new());
    for addr in &addrs {
        let child = Command::new(worker_bin)
            .args(["--listen", addr])
            .env("MANTA_CLUSTER_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {worker_bin}"))?;
        workers.0.push(child);
    }
    let ready = addrs.iter().map(|addr| async move {
        let client = WorkerClient::new(addr, token)?;
        let mut rpc = raw_client(addr, token)?;
        loop {
            if client.describe(Duration::from_secs(1)).await.is_ok() {
                break;
            }
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("worker {addr} not ready after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        rpc.echo(cpb::EchoRequest::default())
            .await
            .with_context(|| format!("echo on {addr}"))?;
        anyhow::Ok(())
    });
    for r in futures::future::join_all(ready).await {
        r?;
    }
    Ok((t0.elapsed().as_secs_f64(), workers, addrs))
}

/// One-at-a-time Echo round trips (after `warm` unmeasured ones): (p50, p99, mean) µs.
async fn echo_rtts(rpc: &mut Rpc, n: usize, warm: usize) -> anyhow::Result<(f64, f64, f64)> {
    for i in 0..warm as u64 {
        rpc.echo(cpb::EchoRequest {
            sequence: i,
            payload: Vec::new(),
        })
        .await?;
    }
    let mut us = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t = Instant::now();
        let r = rpc
            .echo(cpb::EchoRequest {
                sequence: i,
                payload: Vec::new(),
            })
            .await?
            .into_inner();
        us.push(t.elapsed().as_secs_f64() * 1e6);
        if r.sequence != i {
            bail!("echo {i} came back as {}", r.sequence);
        }
    }
    Ok(summarize(us))
}

/// Echo calls per second with IN_FLIGHT at once over the one channel.
async fn echo_pipelined(rpc: &Rpc) -> anyhow::Result<f64> {
    let t = Instant::now();
    let errors = futures::stream::iter(0..PIPELINED_CALLS as u64)
        .map(|i| {
            let mut c = rpc.clone();
            async move {
                c.echo(cpb::EchoRequest {
                    sequence: i,
                    payload: Vec::new(),
                })
                .await
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .filter(|r| futures::future::ready(r.is_err()))
        .count()
        .await;
    if errors > 0 {
        bail!("{errors} pipelined echo calls failed");
    }
    Ok(PIPELINED_CALLS as f64 / t.elapsed().as_secs_f64())
}

/// Deterministic pseudo-random samples (token ids below a Qwen-sized vocabulary) until
/// their protobuf encoding reaches `bytes`.
fn make_samples(bytes: usize) -> Vec<pb::Sample> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = Vec::new();
    let mut total = 0;
    while total < bytes {
        let id = out.len() as u64;
        let tokens: Vec<u32> = (0..SAMPLE_TOKENS)
            .map(|_| (next() % 151_936) as u32)
            .collect();
        let prompt = SAMPLE_TOKENS / 4;
        let s = pb::Sample {
            id,
            group_index: (id / 8) as u32,
            index: (id % 8) as u32,
            tokens,
            response_length: (SAMPLE_TOKENS - prompt) as u32,
            loss_mask: (0..SAMPLE_TOKENS).map(|i| u32::from(i >= prompt)).collect(),
            rollout_log_probs: (0..SAMPLE_TOKENS)
                .map(|_| -((next() % 10_000) as f32) / 1000.0)
                .collect(),
            reward: (id % 2) as f32,
            status: 0,
            weight_version: 1,
            metadata: Some(pb::EpisodeMetadata {
                environment: "bench/Env".into(),
                task_hash: format!("{id:016x}"),
                stop_reason: "stop".into(),
                ..Default::default()
            }),
            routed_experts: None,
        };
        total += s.encoded_len();
        out.push(s);
    }
    out
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let worker_bin = args
        .get(1)
        .context("usage: control_plane WORKER_BIN [RTT_SAMPLES] [SAMPLE_MB]")?
        .clone();
    let n: usize = args
        .get(2)
        .map_or(Ok(10_000), |s| s.parse())
        .context("RTT_SAMPLES")?;
    let sample_mb: usize = args
        .get(3)
        .map_or(Ok(100), |s| s.parse())
        .context("SAMPLE_MB")?;
    let token = std::env::var("MANTA_CLUSTER_TOKEN").context("MANTA_CLUSTER_TOKEN is not set")?;
    let warm = (n / 10).max(100);

    // In-process: a ractor actor's mailbox, same process.
    let (local, _) = Actor::spawn(None, EchoActor, ()).await?;
    for _ in 0..warm {
        call!(local, EchoMsg::Echo, Vec::new())?;
    }
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        call!(local, EchoMsg::Echo, Vec::new())?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (ip50, ip99, imean) = summarize(us);
    let t = Instant::now();
    futures::stream::iter(0..PIPELINED_CALLS)
        .map(|_| {
            let a = local.clone();
            async move { call!(a, EchoMsg::Echo, Vec::new()) }
        })
        .buffer_unordered(IN_FLIGHT)
        .for_each(|r| {
            r.expect("in-process echo");
            async {}
        })
        .await;
    let in_proc_cps = PIPELINED_CALLS as f64 / t.elapsed().as_secs_f64();
    local.stop(None);

    // Cluster ready: two fresh worker processes, repeated; the last pair stays up.
    let mut ready = Vec::new();
    let mut cluster = None;
    for _ in 0..READY_REPEATS {
        let (s, workers, addrs) = start_cluster(&worker_bin, &token).await?;
        ready.push(s);
        cluster = Some((workers, addrs));
    }
    let (_workers, addrs) = cluster.context("no cluster started")?;
    let mut rpc = raw_client(&addrs[0], &token)?;
    let client = WorkerClient::new(&addrs[0], &token)?;

    // Cross-process round trips: Echo through the worker's actor, and Heartbeat.
    let (xp50, xp99, xmean) = echo_rtts(&mut rpc, n, warm).await?;
    let mut us = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t = Instant::now();
        client.echo(i, Duration::from_secs(5)).await?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (cp50, cp99, _) = summarize(us);
    let mut us = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t = Instant::now();
        client.heartbeat(i, Duration::from_secs(5)).await?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (hp50, hp99, _) = summarize(us);
    let cross_cps = echo_pipelined(&rpc).await?;

    // Bulk samples driver -> worker over one client stream.
    let samples = make_samples(sample_mb * 1_000_000);
    let wire: usize = samples.iter().map(|s| s.encoded_len()).sum();
    let tokens: u64 = samples.iter().map(|s| s.tokens.len() as u64).sum();
    let mut secs = Vec::new();
    for _ in 0..INGEST_REPEATS {
        let batch = samples.clone();
        let t = Instant::now();
        let reply = rpc
            .ingest_samples(futures::stream::iter(batch))
            .await?
            .into_inner();
        secs.push(t.elapsed().as_secs_f64());
        if reply.samples != samples.len() as u64 || reply.tokens != tokens {
            bail!(
                "worker got {} samples / {} tokens, sent {} / {tokens}",
                reply.samples,
                reply.tokens,
                samples.len()
            );
        }
    }
    let ingest_s = median(secs.clone());

    let _ = client.shutdown().await;

    let out = json!({
        "rtt_samples": n,
        "warmup_calls": warm,
        "rtt_p50_us_in_process": round(ip50, 2),
        "rtt_p99_us_in_process": round(ip99, 2),
        "rtt_mean_us_in_process": round(imean, 2),
        "pipelined_calls_per_s_in_process": round(in_proc_cps, 0),
        "rtt_p50_us_cross_process": round(xp50, 1),
        "rtt_p99_us_cross_process": round(xp99, 1),
        "rtt_mean_us_cross_process": round(xmean, 1),
        "worker_client_echo_rtt_p50_us": round(cp50, 1),
        "worker_client_echo_rtt_p99_us": round(cp99, 1),
        "heartbeat_rtt_p50_us_cross_process": round(hp50, 1),
        "heartbeat_rtt_p99_us_cross_process": round(hp99, 1),
        "pipelined_calls": PIPELINED_CALLS,
        "pipelined_in_flight": IN_FLIGHT,
        "pipelined_calls_per_s_cross_process": round(cross_cps, 0),
        "cluster_ready_s": round(median(ready.clone()), 4),
        "cluster_ready_runs_s": ready.iter().map(|s| round(*s, 4)).collect::<Vec<_>>(),
        "samples_sent": samples.len(),
        "sample_tokens": SAMPLE_TOKENS,
        "samples_wire_bytes": wire,
        "samples_transfer_s": round(ingest_s, 4),
        "samples_transfer_runs_s": secs.iter().map(|s| round(*s, 4)).collect::<Vec<_>>(),
        "samples_mb_per_s": round(wire as f64 / 1e6 / ingest_s, 1),
        "samples_per_s": round(samples.len() as f64 / ingest_s, 0),
    });
    println!("{out}");
    Ok(())
}

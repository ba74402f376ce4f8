//! Weight sync on one GPU. Three measurements, Qwen3-0.6B or Qwen3-8B shapes with
//! random bf16 weights; prints one JSON object.
//!
//! - `weight_sync_ipc ipc SHAPE [REPS]`: this process (the "trainer") holds the weights
//!   and exports CUDA IPC handles of their allocations; a child process (the "engine",
//!   this binary again) maps them once and copies every tensor into its own tensors on
//!   the device, REPS times (median). Bit-exactness: after new random values are written
//!   in place and synced, the child exports its tensors back and this process compares
//!   them bit for bit (as int16) on the device. In the same run: the same copy inside
//!   one process (the bound the IPC path should reach).
//! - `weight_sync_ipc engine SHAPE [REPS]`: a native engine in this process takes new
//!   weights through the version protocol (pause → copy → version → resume, device
//!   synchronised), REPS times (median); then reads its weights back and compares them
//!   bit for bit with what it was sent.
//! - `weight_sync_ipc child`: the engine side of `ipc` (driven over stdin/stdout).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use manta_cuda::ipc::{export_handle, IpcHandle, IpcMapping, HANDLE_BYTES};
use manta_engine::{Engine, NativeEngine, NativeEngineOptions, PauseMode};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// Opened allocations and, per tensor, (allocation index, byte offset).
type Mapped = (Vec<IpcMapping>, Vec<(usize, u64)>);

const DEV: Device = Device::Cuda(0);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn sync() {
    tch::Cuda::synchronize(0);
}

/// Bit-for-bit equality on the device (bf16 compared as int16: NaN and ±0 count).
fn bits_equal(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size()
        && a.kind() == b.kind()
        && a.view_dtype(Kind::Int16)
            .eq_tensor(&b.view_dtype(Kind::Int16))
            .all()
            .int64_value(&[])
            == 1
}

fn handle_json(h: &IpcHandle) -> Value {
    json!({ "handle": hex(&h.handle), "base": h.base, "offset": h.offset, "device": h.device })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> anyhow::Result<[u8; HANDLE_BYTES]> {
    ensure!(
        s.len() == 2 * HANDLE_BYTES,
        "IPC handle of {} hex digits",
        s.len()
    );
    let mut out = [0u8; HANDLE_BYTES];
    for (k, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * k..2 * k + 2], 16)?;
    }
    Ok(out)
}

/// Handles of `tensors`, plus each distinct allocation once (tensors share them).
fn export_all(tensors: &[Tensor]) -> anyhow::Result<Value> {
    let handles: Vec<IpcHandle> = tensors
        .iter()
        .map(export_handle)
        .collect::<Result<_, _>>()?;
    let mut allocs: Vec<u64> = handles.iter().map(|h| h.base).collect();
    allocs.sort_unstable();
    allocs.dedup();
    let alloc_json: Vec<Value> = allocs
        .iter()
        .map(|b| handle_json(handles.iter().find(|h| h.base == *b).expect("exported")))
        .collect();
    let tensor_json: Vec<Value> = handles
        .iter()
        .map(|h| json!({ "alloc": allocs.binary_search(&h.base).expect("listed"), "offset": h.offset }))
        .collect();
    Ok(json!({ "allocations": alloc_json, "tensors": tensor_json }))
}

/// Maps every allocation of an `export_all` message.
fn open_all(msg: &Value) -> anyhow::Result<Mapped> {
    let maps = msg["allocations"]
        .as_array()
        .context("allocations")?
        .iter()
        .map(|a| {
            let handle = unhex(a["handle"].as_str().context("handle")?)?;
            Ok(IpcMapping::open(
                &handle,
                a["device"].as_i64().unwrap_or(0) as i32,
            )?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let places = msg["tensors"]
        .as_array()
        .context("tensors")?
        .iter()
        .map(|t| {
            Ok((
                t["alloc"].as_u64().context("alloc")? as usize,
                t["offset"].as_u64().context("offset")?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((maps, places))
}

struct Child {
    proc: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Child {
    fn send(&mut self, v: Value) -> anyhow::Result<Value> {
        writeln!(self.stdin, "{v}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        ensure!(!line.is_empty(), "the child process ended");
        let reply: Value = serde_json::from_str(&line)?;
        if let Some(e) = reply.get("error") {
            bail!("child: {e}");
        }
        Ok(reply)
    }
}

fn ipc(shape: &str, reps: usize) -> anyhow::Result<Value> {
    let (spec, _) = manta_bench::qwen3_tensor_shapes(shape)?;
    tch::manual_seed(1);
    let src: Vec<Tensor> = spec
        .iter()
        .map(|(_, s)| Tensor::randn(s.as_slice(), (Kind::BFloat16, DEV)))
        .collect();
    let bytes: i64 = src.iter().map(|t| t.numel() as i64 * 2).sum();
    // The bound: the same copies inside one process.
    let mut local: Vec<Tensor> = src.iter().map(|t| t.zeros_like()).collect();
    let mut local_ms = Vec::new();
    for r in 0..reps + 2 {
        sync();
        let t = Instant::now();
        for (d, s) in local.iter_mut().zip(&src) {
            d.copy_(s);
        }
        sync();
        if r >= 2 {
            local_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    drop(local);

    let exported = export_all(&src)?;
    let mut proc = Command::new(std::env::current_exe()?)
        .arg("child")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the child process")?;
    let mut child = Child {
        stdin: proc.stdin.take().context("child stdin")?,
        stdout: BufReader::new(proc.stdout.take().context("child stdout")?),
        proc,
    };
    let shapes: Vec<&Vec<i64>> = spec.iter().map(|(_, s)| s).collect();
    let ready = child.send(json!({ "open": exported, "shapes": shapes }))?;
    let mut copy_ms = Vec::new();
    let mut round_trip_ms = Vec::new();
    for r in 0..reps + 2 {
        let t = Instant::now();
        let done = child.send(json!({ "sync": r }))?;
        if r >= 2 {
            round_trip_ms.push(t.elapsed().as_secs_f64() * 1e3);
            copy_ms.push(done["copy_ms"].as_f64().context("copy_ms")?);
        }
    }
    // New values in the same storage (as an optimizer step writes them), one more sync,
    // then read the child's tensors back through IPC and compare bit for bit.
    for t in &src {
        let _ = t.shallow_clone().normal_(0.0, 1.0);
    }
    sync();
    child.send(json!({ "sync": "final" }))?;
    let back = child.send(json!({ "export": true }))?;
    let (maps, places) = open_all(&back)?;
    let mut mismatched = Vec::new();
    for ((s, (name, shape)), (alloc, offset)) in src.iter().zip(&spec).zip(&places) {
        let view = maps[*alloc].view(*offset, shape, Kind::BFloat16)?;
        if !bits_equal(s, &view) {
            mismatched.push(name.clone());
        }
    }
    sync();
    drop(maps);
    child.send(json!({ "quit": true }))?;
    let _ = child.proc.wait();
    let ipc_ms = median(copy_ms);
    let local_ms = median(local_ms);
    Ok(json!({
        "shape": shape,
        "tensors": spec.len(),
        "bytes": bytes,
        "allocations": exported["allocations"].as_array().map_or(0, Vec::len),
        "open_ms": ready["open_ms"],
        "ipc_copy_ms": ipc_ms,
        "ipc_round_trip_ms": median(round_trip_ms),
        "ipc_gb_s": bytes as f64 / ipc_ms / 1e6,
        "in_process_copy_ms": local_ms,
        "in_process_gb_s": bytes as f64 / local_ms / 1e6,
        "ipc_vs_in_process": local_ms / ipc_ms,
        "bit_exact": mismatched.is_empty(),
        "mismatched": mismatched,
        "reps": reps,
    }))
}

/// The engine side of `ipc`: one JSON command per line on stdin, one answer per line.
fn child() -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut state: Option<(Mapped, Vec<Tensor>)> = None;
    for line in stdin.lock().lines() {
        let msg: Value = serde_json::from_str(&line?)?;
        let reply = (|| -> anyhow::Result<Value> {
            if let Some(open) = msg.get("open") {
                let shapes: Vec<Vec<i64>> = serde_json::from_value(msg["shapes"].clone())?;
                let own: Vec<Tensor> = shapes
                    .iter()
                    .map(|s| Tensor::zeros(s.as_slice(), (Kind::BFloat16, DEV)))
                    .collect();
                sync();
                let t = Instant::now();
                let (maps, places) = open_all(open)?;
                let open_ms = t.elapsed().as_secs_f64() * 1e3;
                state = Some(((maps, places), own));
                return Ok(json!({ "open_ms": open_ms }));
            }
            let ((maps, places), own) = state.as_mut().context("no weights opened yet")?;
            if msg.get("sync").is_some() {
                sync();
                let t = Instant::now();
                for (dst, (alloc, offset)) in own.iter_mut().zip(places.iter()) {
                    maps[*alloc].copy_into(*offset, dst)?;
                }
                sync();
                return Ok(json!({ "copy_ms": t.elapsed().as_secs_f64() * 1e3 }));
            }
            if msg.get("export").is_some() {
                return export_all(own);
            }
            Ok(json!({ "bye": true }))
        })();
        let reply = reply.unwrap_or_else(|e| json!({ "error": format!("{e:#}") }));
        writeln!(out, "{reply}")?;
        out.flush()?;
        if msg.get("quit").is_some() {
            break;
        }
    }
    Ok(())
}

/// The native engine taking new weights in-process through the version protocol.
async fn engine(shape: &str, reps: usize) -> anyhow::Result<Value> {
    let (_, config) = manta_bench::qwen3_tensor_shapes(shape)?;
    let dir = std::env::temp_dir().join(format!("manta-weight-sync-{shape}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), config)?;
    let engine = NativeEngine::start(NativeEngineOptions {
        seed: 1,
        max_running_requests: 8,
        max_total_tokens: Some(8192),
        context_length: Some(2048),
        ..NativeEngineOptions::new(&dir, DEV)
    })?;
    // New weights: the engine's own tensors (names, shapes, bf16) with new values.
    tch::manual_seed(2);
    let fresh = engine.read_weights().await?;
    for (_, t) in &fresh {
        let _ = t.shallow_clone().normal_(0.0, 0.02);
    }
    let bytes: i64 = fresh
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as i64)
        .sum();
    sync();
    let mut ms = Vec::new();
    for r in 0..reps + 2 {
        let copy = fresh
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        sync();
        let t = Instant::now();
        engine.pause(PauseMode::Drain).await?;
        engine.update_weights(copy, r as u64 + 1).await?;
        engine.resume().await?;
        sync();
        if r >= 2 {
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let now = engine.read_weights().await?;
    let mismatched: Vec<String> = fresh
        .iter()
        .zip(&now)
        .filter(|((n0, a), (n1, b))| n0 != n1 || !bits_equal(a, b))
        .map(|((n, _), _)| n.clone())
        .collect();
    let pause_ms = median(ms);
    Ok(json!({
        "shape": shape,
        "bytes": bytes,
        "pause_to_resume_ms": pause_ms,
        "gb_s": bytes as f64 / pause_ms / 1e6,
        "version": engine.weight_version(),
        "bit_exact": mismatched.is_empty(),
        "mismatched": mismatched,
        "reps": reps,
    }))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("");
    if mode == "child" {
        return child();
    }
    let shape = args.get(2).map(String::as_str).unwrap_or("0.6b");
    let reps: usize = args.get(3).map_or(Ok(10), |s| s.parse())?;
    ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch (this benchmark runs on the device machine)"
    );
    let result = match mode {
        "ipc" => ipc(shape, reps)?,
        "engine" => engine(shape, reps).await?,
        other => bail!("usage: weight_sync_ipc ipc|engine 0.6b|8b [REPS] (got {other:?})"),
    };
    println!("{result}");
    Ok(())
}

//! `driver serve`: the native engine behind SGLang's HTTP API, so anything that launches
//! and talks to `python -m sglang.launch_server` (slime, Miles, Manta's own SGLang client)
//! can use Manta's engine unchanged.
//!
//! Flags carry `launch_server`'s names. Common SGLang flags that mean nothing here are
//! accepted and ignored with a logged note, so a launcher's command line works as is.
//!
//! - [`wire`]: the request and answer JSON.
//! - [`routes`]: the HTTP routes.
//! - [`distributed`]: SGLang's NCCL weight-update routes.

pub mod distributed;
pub mod routes;
pub mod wire;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use manta_engine::{NativeEngine, NativeEngineOptions};
use manta_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tch::{Device, Kind};
use tracing::{info, warn};

/// Options of `driver serve` (SGLang `launch_server` names).
#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    /// Model directory in Hugging Face layout (config.json, tokenizer files, safetensors).
    /// Without weights the model is randomly initialised from --random-seed.
    #[arg(long)]
    pub model_path: PathBuf,
    /// Tokenizer directory [--model-path].
    #[arg(long)]
    pub tokenizer_path: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the chosen address is printed).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// `cuda` or `cpu` [cuda when available].
    #[arg(long)]
    pub device: Option<String>,
    /// CUDA device index [0].
    #[arg(long)]
    pub base_gpu_id: Option<usize>,
    /// Share of GPU memory for weights + KV cache when --max-total-tokens is not set.
    #[arg(long)]
    pub mem_fraction_static: Option<f64>,
    /// Seeds random init and requests without a sampling_seed [0].
    #[arg(long)]
    pub random_seed: Option<u64>,
    /// Most requests decoding together [256].
    #[arg(long)]
    pub max_running_requests: Option<usize>,
    /// Longest prompt + output [config.json max_position_embeddings].
    #[arg(long)]
    pub context_length: Option<usize>,
    /// KV cache size in tokens.
    #[arg(long)]
    pub max_total_tokens: Option<usize>,
    /// Most tokens computed per step; longer prompts are prefilled in chunks.
    #[arg(long)]
    pub chunked_prefill_size: Option<usize>,
    /// Weights and KV dtype: auto (bf16 on CUDA, fp32 on CPU), bfloat16 or float32.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Batch-invariant results: each request's tokens and log-probs do not depend on what
    /// else is batched with it (attention through one fixed-order kernel, the trainer's
    /// layer ops), and equal a Manta trainer's in --true-on-policy-mode. CUDA bf16 only;
    /// decoding is slower.
    #[arg(long)]
    pub enable_deterministic_inference: bool,
    /// Run each decode step only after the host has read the previous step's tokens
    /// (by default the next step is launched first, hiding the host's turn).
    #[arg(long)]
    pub disable_overlap_schedule: bool,
    /// Record the experts every token is routed to, so `/generate` requests can ask for
    /// them (`return_routed_experts`; rollout routing replay). Mixture-of-experts models
    /// only; decode steps run without CUDA graphs.
    #[arg(long)]
    pub enable_return_routed_experts: bool,
    /// Model name reported by /get_model_info and /get_server_info [--model-path].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Tensor parallelism: only 1 (the native engine runs on one device).
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1)]
    pub tp_size: usize,
    /// Data parallelism: only 1 (start one server per device instead).
    #[arg(long, visible_alias = "data-parallel-size", default_value_t = 1)]
    pub dp_size: usize,
    /// Take and return token ids only: `text` inputs are refused, answers have no `text`.
    #[arg(long)]
    pub skip_tokenizer_init: bool,
    /// Serve without the warm-up generate (readiness is still /health_generate).
    #[arg(long)]
    pub skip_server_warmup: bool,

    #[command(flatten)]
    pub ignored: IgnoredSglangFlags,
}

/// SGLang flags launchers commonly pass that have no meaning for the native engine.
#[derive(Debug, Args, Clone, Default)]
pub struct IgnoredSglangFlags {
    #[arg(long, hide = true)]
    pub trust_remote_code: bool,
    #[arg(long, hide = true)]
    pub log_level: Option<String>,
    #[arg(long, hide = true)]
    pub log_level_http: Option<String>,
    #[arg(long, hide = true)]
    pub disable_cuda_graph: bool,
    #[arg(long, hide = true)]
    pub cuda_graph_max_bs: Option<String>,
    #[arg(long, hide = true)]
    pub enable_memory_saver: bool,
    #[arg(long, hide = true)]
    pub attention_backend: Option<String>,
    #[arg(long, hide = true)]
    pub sampling_backend: Option<String>,
    #[arg(long, hide = true)]
    pub load_format: Option<String>,
    #[arg(long, hide = true)]
    pub page_size: Option<String>,
    #[arg(long, hide = true)]
    pub enable_metrics: bool,
    #[arg(long, hide = true)]
    pub watchdog_timeout: Option<String>,
    #[arg(long, hide = true)]
    pub schedule_policy: Option<String>,
    #[arg(long, hide = true)]
    pub disable_radix_cache: bool,
    #[arg(long, hide = true)]
    pub disable_custom_all_reduce: bool,
    #[arg(long, hide = true)]
    pub nnodes: Option<usize>,
    #[arg(long, hide = true)]
    pub node_rank: Option<usize>,
}

impl IgnoredSglangFlags {
    /// The flags given, as typed, for the log note.
    fn given(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut flag = |on: bool, name: &str| {
            if on {
                out.push(format!("--{name}"));
            }
        };
        flag(self.trust_remote_code, "trust-remote-code");
        flag(self.log_level.is_some(), "log-level");
        flag(self.log_level_http.is_some(), "log-level-http");
        flag(self.disable_cuda_graph, "disable-cuda-graph");
        flag(self.cuda_graph_max_bs.is_some(), "cuda-graph-max-bs");
        flag(self.enable_memory_saver, "enable-memory-saver");
        flag(self.attention_backend.is_some(), "attention-backend");
        flag(self.sampling_backend.is_some(), "sampling-backend");
        flag(self.load_format.is_some(), "load-format");
        flag(self.page_size.is_some(), "page-size");
        flag(self.enable_metrics, "enable-metrics");
        flag(self.watchdog_timeout.is_some(), "watchdog-timeout");
        flag(self.schedule_policy.is_some(), "schedule-policy");
        flag(self.disable_radix_cache, "disable-radix-cache");
        flag(self.disable_custom_all_reduce, "disable-custom-all-reduce");
        flag(self.nnodes.is_some(), "nnodes");
        flag(self.node_rank.is_some(), "node-rank");
        out
    }
}

/// Which device `--device` / `--base-gpu-id` select.
fn pick_device(args: &ServeArgs) -> anyhow::Result<Device> {
    let cuda = tch::Cuda::is_available();
    let gpu = args.base_gpu_id.unwrap_or(0);
    let want_cuda = match args.device.as_deref() {
        Some("cpu") => false,
        Some("cuda") => {
            if !cuda {
                bail!("--device cuda: CUDA is not available on this machine");
            }
            true
        }
        Some(other) => bail!("--device {other}: expected cuda or cpu"),
        None => {
            if !cuda && args.base_gpu_id.is_some() {
                warn!("--base-gpu-id {gpu}: CUDA is not available, serving on the CPU");
            }
            cuda
        }
    };
    if !want_cuda {
        return Ok(Device::Cpu);
    }
    let count = tch::Cuda::device_count();
    if gpu as i64 >= count {
        bail!("--base-gpu-id {gpu}: this machine has {count} CUDA device(s)");
    }
    Ok(Device::Cuda(gpu))
}

fn parse_dtype(dtype: &str) -> anyhow::Result<Option<Kind>> {
    Ok(match dtype {
        "auto" => None,
        "bfloat16" | "bf16" => Some(Kind::BFloat16),
        "float32" | "float" | "fp32" => Some(Kind::Float),
        other => bail!("--dtype {other}: expected auto, bfloat16 or float32"),
    })
}

/// SGLang's spelling of the engine's dtype (`Float` -> `float32`).
fn dtype_name(kind: &str) -> String {
    match kind {
        "Float" => "float32".into(),
        "BFloat16" => "bfloat16".into(),
        "Half" => "float16".into(),
        other => other.to_lowercase(),
    }
}

/// Starts the engine, listens, warms up, prints `ready` and serves until Ctrl-C/SIGTERM.
pub async fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    if args.tp_size != 1 {
        bail!(
            "--tp-size {}: the native engine runs on one device; only --tp-size 1 is supported",
            args.tp_size
        );
    }
    if args.dp_size != 1 {
        bail!(
            "--dp-size {}: only 1 is supported; start one server per device",
            args.dp_size
        );
    }
    if args.ignored.nnodes.is_some_and(|n| n > 1) {
        bail!("--nnodes: the native engine runs on one node");
    }
    let ignored = args.ignored.given();
    if !ignored.is_empty() {
        info!(
            flags = %ignored.join(" "),
            "ignoring SGLang flags that have no meaning for the native engine"
        );
    }
    let kind = parse_dtype(&args.dtype)?;
    let device = pick_device(args)?;
    let model_path = args.model_path.clone();
    if !model_path.join("config.json").is_file() {
        bail!(
            "--model-path {}: no config.json in this directory",
            model_path.display()
        );
    }
    check_context_length(&model_path.join("config.json"), args.context_length)?;
    let tokenizer_path = args
        .tokenizer_path
        .clone()
        .unwrap_or_else(|| model_path.clone());
    let tokenizer = if args.skip_tokenizer_init {
        None
    } else if tokenizer_path.join("tokenizer.json").is_file() {
        Some(Arc::new(
            Tokenizer::from_dir(&tokenizer_path).with_context(|| {
                format!("cannot load the tokenizer in {}", tokenizer_path.display())
            })?,
        ))
    } else {
        warn!(
            dir = %tokenizer_path.display(),
            "no tokenizer.json: serving token ids only (text inputs and stop strings are refused)"
        );
        None
    };
    let model_config: Value = std::fs::read_to_string(model_path.join("config.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);

    let mut opts = NativeEngineOptions::new(model_path.clone(), device);
    opts.kind = kind;
    if let Some(seed) = args.random_seed {
        opts.seed = seed;
    }
    if let Some(n) = args.max_running_requests {
        opts.max_running_requests = n;
    }
    if let Some(n) = args.max_total_tokens {
        opts.max_total_tokens = Some(n);
    }
    if let Some(f) = args.mem_fraction_static {
        opts.mem_fraction_static = f;
    }
    if let Some(n) = args.chunked_prefill_size {
        opts.chunked_prefill_size = n;
    }
    if let Some(n) = args.context_length {
        opts.context_length = Some(n);
    }
    opts.true_on_policy = args.enable_deterministic_inference;
    opts.disable_overlap_schedule = args.disable_overlap_schedule;
    opts.enable_return_routed_experts = args.enable_return_routed_experts;
    for (name, value) in [
        ("--max-running-requests", opts.max_running_requests),
        ("--chunked-prefill-size", opts.chunked_prefill_size),
        ("--context-length", opts.context_length.unwrap_or(1)),
        ("--max-total-tokens", opts.max_total_tokens.unwrap_or(1)),
    ] {
        if value == 0 {
            bail!("{name} 0: must be at least 1");
        }
    }
    let (seed, mem_fraction_static, chunked_prefill_size) = (
        opts.seed,
        opts.mem_fraction_static,
        opts.chunked_prefill_size,
    );
    let engine = tokio::task::spawn_blocking(move || NativeEngine::start(opts))
        .await
        .context("engine start-up panicked")?
        .with_context(|| {
            let mode = if args.enable_deterministic_inference {
                " with --enable-deterministic-inference"
            } else {
                ""
            };
            format!("cannot start the engine on {}{mode}", model_path.display())
        })?;

    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local: SocketAddr = listener.local_addr().context("listening address")?;

    let served_model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| model_path.display().to_string());
    let info = engine.info().clone();
    let server_args = json!({
        "model_path": model_path.display().to_string(),
        "tokenizer_path": tokenizer_path.display().to_string(),
        "served_model_name": served_model_name,
        "host": args.host,
        "port": local.port(),
        "device": match device {
            Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".to_string(),
        },
        "base_gpu_id": args.base_gpu_id.unwrap_or(0),
        "dtype": dtype_name(&info.dtype),
        "mem_fraction_static": mem_fraction_static,
        "random_seed": seed,
        "max_running_requests": info.max_running_requests,
        "context_length": info.context_length,
        "max_total_tokens": info.max_total_tokens,
        "chunked_prefill_size": chunked_prefill_size,
        "page_size": info.block_size,
        "tp_size": 1,
        "dp_size": 1,
        "skip_tokenizer_init": args.skip_tokenizer_init,
        "skip_server_warmup": args.skip_server_warmup,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "is_embedding": false,
        "ignored_flags": ignored,
        // What SGLang's scheduler_info adds.
        "max_total_num_tokens": info.max_total_tokens,
        "max_req_input_len": info.context_length.saturating_sub(1),
        "vocab_size": info.vocab_size,
        "engine": "manta-native",
        "version": env!("CARGO_PKG_VERSION"),
    });
    let groups = Arc::new(distributed::WeightGroups::new(engine.clone(), device));
    let state = Arc::new(routes::AppState::new(
        engine,
        tokenizer,
        model_path.clone(),
        tokenizer_path,
        served_model_name,
        &model_config,
        server_args,
    ));

    info!(address = %local, "driver serve: listening");
    println!("driver serve: listening on http://{local}");

    if !args.skip_server_warmup {
        routes::warm_up(&state)
            .await
            .context("warm-up generate failed")?;
    }
    info!(address = %local, "driver serve: ready");
    println!("driver serve: ready on http://{local}");

    let shutdown_state = state.clone();
    let app = routes::router(state).merge(distributed::router(groups));
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            info!("shutting down: aborting running requests");
            routes::abort_everything(&shutdown_state).await;
        })
        .await
        .context("HTTP server failed")?;
    info!("driver serve: stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
/// `--context-length N` longer than the model's `max_position_embeddings` is refused,
/// as SGLang refuses it: positions past the trained ones give garbage, not an error.
fn check_context_length(config: &Path, asked: Option<usize>) -> anyhow::Result<()> {
    let Some(asked) = asked else {
        return Ok(());
    };
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", config.display()))?;
    let model = value
        .get("max_position_embeddings")
        .and_then(|v| v.as_u64())
        .or_else(|| {
            value
                .get("text_config")
                .and_then(|t| t.get("max_position_embeddings"))
                .and_then(|v| v.as_u64())
        });
    match model {
        Some(max) if asked as u64 > max => bail!(
            "--context-length {asked} is longer than the model's context: {} sets \
             max_position_embeddings = {max}",
            config.display()
        ),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod context_tests {
    use super::*;

    #[test]
    fn a_context_over_the_models_is_refused_naming_both() {
        let config =
            std::env::temp_dir().join(format!("manta-serve-context-{}.json", std::process::id()));
        std::fs::write(&config, r#"{"max_position_embeddings": 2048}"#).unwrap();
        check_context_length(&config, None).unwrap();
        check_context_length(&config, Some(2048)).unwrap();
        let err = check_context_length(&config, Some(100_000))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--context-length 100000")
                && err.contains("max_position_embeddings = 2048"),
            "{err}"
        );
        let _ = std::fs::remove_file(&config);
    }
}

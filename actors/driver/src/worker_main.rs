//! `worker`: the daemon that hosts rollout actors on one node for a remote-mode driver.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Hosts Manta actors on this node; the driver spawns, calls and stops them over gRPC.
/// Every call must carry the cluster token (MANTA_CLUSTER_TOKEN or MANTA_CLUSTER_TOKEN_FILE).
/// With --tls-cert and --tls-key it serves TLS only; the driver then needs
/// `[cluster] tls_ca` in cluster.toml naming the CA that signed the certificate.
#[derive(Parser, Debug)]
#[command(name = "worker", version)]
struct Args {
    /// Address to serve gRPC on, e.g. 0.0.0.0:7100.
    #[arg(long)]
    listen: SocketAddr,
    /// GPUs this node offers, e.g. 0,1 (none: CPU only).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<u32>,
    /// Serve TLS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert; needs --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics (GET /metrics: GPUs, hosted actors, uptime) here.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
}

fn main() -> ExitCode {
    // Before any thread: NCCL reads its environment once, and every rank must agree.
    let nccl_env = manta_cuda::process_group::align_nccl_env();
    if let Err(e) = manta_knobs::check() {
        eprintln!("error: {e} (docs/knobs.md lists the knobs)");
        return ExitCode::FAILURE;
    }
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(serve(nccl_env)),
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(nccl_env: &'static str) -> ExitCode {
    let args = Args::parse();
    let _telemetry = manta_telemetry::init_logging("manta-worker");
    tracing::debug!(nccl_env, "NCCL environment");
    let token = match manta_runtime::load_token() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => match manta_runtime::ServerTls::from_files(cert, key) {
            Ok(tls) => Some(tls),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
        _ => None,
    };
    let listener = match std::net::TcpListener::bind(args.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: listening on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let scheme = if tls.is_some() { "TLS" } else { "plaintext" };
    println!("worker listening on {} ({scheme})", args.listen);
    // Actors run on this (multi-thread) runtime; gRPC on a control-plane thread.
    let daemon = manta_runtime::WorkerDaemon::new(args.gpus.clone());
    let metrics_token = token.clone();
    let server = match manta_hosting::spawn_control_plane(daemon.clone(), listener, token, tls) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: starting the control-plane thread: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(addr) = args.metrics_addr {
        match manta_driver::worker_metrics::start(addr, args.listen, metrics_token, args.gpus).await
        {
            Ok(bound) => println!("worker metrics on http://{bound}/metrics"),
            Err(e) => {
                eprintln!("error: {e:#}");
                daemon.request_shutdown();
                return ExitCode::FAILURE;
            }
        }
    }
    let finished = tokio::task::spawn_blocking(move || server.join());
    tokio::pin!(finished);
    // SIGINT or SIGTERM (scancel, a pod deletion): stop the hosted actors and leave; the
    // driver sees the node go and re-queues its episodes elsewhere.
    let joined = tokio::select! {
        joined = &mut finished => joined,
        signal = manta_driver::signals::worker_stop_signal() => {
            match signal {
                Ok(name) => eprintln!("{name}: stopping the hosted actors and leaving"),
                Err(e) => eprintln!("error: watching SIGINT and SIGTERM: {e}"),
            }
            // Actors first: the driver's calls into them fail now (and are re-queued)
            // instead of the server waiting for them to end.
            daemon.stop_all().await;
            daemon.request_shutdown();
            finished.await
        }
    };
    match joined {
        Ok(Ok(Ok(()))) => ExitCode::SUCCESS,
        Ok(Ok(Err(e))) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
        _ => {
            eprintln!("error: the control-plane thread panicked");
            ExitCode::FAILURE
        }
    }
}

//! Which mechanism moves weights from a trainer to one engine, chosen by where the two
//! live: same process → in-memory copy; same GPU, other process → CUDA IPC; other GPU
//! → NCCL; no GPU on either side → bytes over Manta's gRPC.
//!
//! A mechanism this build cannot run yet is reported as [`Unavailable`] (never faked);
//! the sync then carries the weights over gRPC and says so in the log.

use std::fmt;

/// Where a trainer or an engine lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The process: "driver" for in-process actors, else the worker's address.
    pub process: String,
    /// The machine (the address's host; "driver" host for in-process actors).
    pub host: String,
    /// The CUDA device index on that machine, `None` on the CPU.
    pub gpu: Option<u32>,
}

impl Endpoint {
    /// An actor inside the driver process.
    pub fn in_driver(gpu: Option<u32>) -> Self {
        Self {
            process: "driver".into(),
            host: "localhost".into(),
            gpu,
        }
    }

    /// An actor on the worker at `address` (`host:port`).
    pub fn on_worker(address: &str, gpu: Option<u32>) -> Self {
        let host = address
            .rsplit_once(':')
            .map_or(address, |(h, _)| h)
            .to_string();
        Self {
            process: address.to_string(),
            host: normalize_host(&host),
            gpu,
        }
    }
}

/// Loopback names are one machine.
fn normalize_host(host: &str) -> String {
    match host {
        "127.0.0.1" | "::1" | "[::1]" | "localhost" => "localhost".into(),
        h => h.to_string(),
    }
}

/// How weights travel from a trainer to an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mechanism {
    /// The engine copies the trainer's tensors in its own process.
    InProcess,
    /// Bounded chunks over Manta's gRPC (no shared disk).
    Grpc,
    /// The engine maps the trainer's device memory (same GPU, other process).
    CudaIpc,
    /// Broadcast from the trainer's GPU into the engine's (other GPU or node).
    Nccl,
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mechanism::InProcess => "in-process copy",
            Mechanism::Grpc => "gRPC chunks",
            Mechanism::CudaIpc => "CUDA IPC",
            Mechanism::Nccl => "NCCL broadcast",
        })
    }
}

/// A mechanism placement asks for that this build cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{mechanism} is not available in this build: {reason}")]
pub struct Unavailable {
    pub mechanism: Mechanism,
    pub reason: &'static str,
}

/// The mechanism placement asks for between `trainer` and `engine`.
pub fn choose(trainer: &Endpoint, engine: &Endpoint) -> Mechanism {
    if trainer.process == engine.process {
        return Mechanism::InProcess;
    }
    match (trainer.gpu, engine.gpu) {
        (Some(a), Some(b)) if trainer.host == engine.host && a == b => Mechanism::CudaIpc,
        (Some(_), Some(_)) => Mechanism::Nccl,
        _ => Mechanism::Grpc,
    }
}

/// Whether this build can run `mechanism` in the training loop.
pub fn available(mechanism: Mechanism) -> Result<(), Unavailable> {
    match mechanism {
        Mechanism::InProcess | Mechanism::Grpc => Ok(()),
        Mechanism::CudaIpc => Err(Unavailable {
            mechanism,
            reason: "manta-cuda exports and maps IPC handles (bench weight_sync_ipc), \
                     but workers do not exchange them in the step loop yet",
        }),
        Mechanism::Nccl => Err(Unavailable {
            mechanism,
            reason: "NCCL feeds SGLang engines in local mode (manta_cuda::process_group, \
                     /update_weights_from_distributed); engines on rollout workers do not \
                     join a weight-update group yet",
        }),
    }
}

/// The mechanism that will run: the chosen one, or gRPC with the reason when the
/// chosen one is unavailable.
pub fn resolve(trainer: &Endpoint, engine: &Endpoint) -> (Mechanism, Option<Unavailable>) {
    let wanted = choose(trainer, engine);
    match available(wanted) {
        Ok(()) => (wanted, None),
        Err(why) => (Mechanism::Grpc, Some(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_picks_the_mechanism() {
        let driver_cpu = Endpoint::in_driver(None);
        assert_eq!(
            choose(&driver_cpu, &Endpoint::in_driver(None)),
            Mechanism::InProcess
        );
        assert_eq!(
            choose(&driver_cpu, &Endpoint::on_worker("10.0.0.2:7000", None)),
            Mechanism::Grpc
        );
        let t = Endpoint::on_worker("10.0.0.2:7000", Some(0));
        assert_eq!(
            choose(&t, &Endpoint::on_worker("10.0.0.2:7001", Some(0))),
            Mechanism::CudaIpc
        );
        assert_eq!(
            choose(&t, &Endpoint::on_worker("10.0.0.2:7001", Some(1))),
            Mechanism::Nccl
        );
        // Same GPU index on another machine is another GPU.
        assert_eq!(
            choose(&t, &Endpoint::on_worker("10.0.0.3:7000", Some(0))),
            Mechanism::Nccl
        );
        // A CPU engine gets bytes even from a GPU trainer.
        assert_eq!(
            choose(&t, &Endpoint::on_worker("10.0.0.3:7000", None)),
            Mechanism::Grpc
        );
        // Loopback spellings are one host.
        assert_eq!(
            choose(
                &Endpoint::on_worker("127.0.0.1:1", Some(0)),
                &Endpoint::on_worker("localhost:2", Some(0))
            ),
            Mechanism::CudaIpc
        );
    }

    #[test]
    fn unbuilt_mechanisms_are_reported_not_faked() {
        let t = Endpoint::on_worker("10.0.0.2:7000", Some(0));
        let (used, why) = resolve(&t, &Endpoint::on_worker("10.0.0.2:7001", Some(1)));
        assert_eq!(used, Mechanism::Grpc);
        let why = why.expect("NCCL is reported unavailable");
        assert_eq!(why.mechanism, Mechanism::Nccl);
        assert!(why.to_string().contains("NCCL broadcast is not available"));
        let (used, why) = resolve(&t, &Endpoint::on_worker("10.0.0.3:1", None));
        assert_eq!((used, why), (Mechanism::Grpc, None));
    }
}

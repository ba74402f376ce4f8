//! Which mechanism moves weights from a trainer to one engine, chosen by where the two
//! live: same process and device → in-memory copy; same GPU, other process → CUDA IPC;
//! other GPU → NCCL; no GPU on either side → bytes over Manta's gRPC.
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
    /// An SGLang server the trainer's process launched on its own host: it takes weights
    /// through its HTTP API (`/update_weights_from_distributed`, `_from_disk`).
    pub sglang_server: bool,
}

impl Endpoint {
    /// An actor inside the driver process.
    pub fn in_driver(gpu: Option<u32>) -> Self {
        Self {
            process: "driver".into(),
            host: "localhost".into(),
            gpu,
            sglang_server: false,
        }
    }

    /// SGLang engine `index`'s server, launched by the driver on its host.
    pub fn sglang_server(index: usize, gpu: Option<u32>) -> Self {
        Self {
            process: format!("sglang engine-{index}"),
            host: "localhost".into(),
            gpu,
            sglang_server: true,
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
            sglang_server: false,
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
    /// The engine copies the trainer's tensors in its own process (same device, or no GPU).
    InProcess,
    /// Bounded chunks over Manta's gRPC (no shared disk).
    Grpc,
    /// The engine maps the trainer's device memory (same GPU, other process).
    CudaIpc,
    /// Broadcast from the trainer's GPU into the engine's (other GPU or node).
    Nccl,
    /// A safetensors file the engine's server loads (`/update_weights_from_disk`).
    File,
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mechanism::InProcess => "in-process copy",
            Mechanism::Grpc => "gRPC chunks",
            Mechanism::CudaIpc => "CUDA IPC",
            Mechanism::Nccl => "NCCL broadcast",
            Mechanism::File => "safetensors file",
        })
    }
}

/// A mechanism placement asks for that this build or the configuration does not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{mechanism} is not used for this pair: {reason}")]
pub struct Unavailable {
    pub mechanism: Mechanism,
    pub reason: &'static str,
}

/// The mechanism placement asks for between `trainer` and `engine`.
pub fn choose(trainer: &Endpoint, engine: &Endpoint) -> Mechanism {
    if trainer.process == engine.process {
        return match (trainer.gpu, engine.gpu) {
            (Some(a), Some(b)) if a != b => Mechanism::Nccl,
            _ => Mechanism::InProcess,
        };
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
        Mechanism::InProcess | Mechanism::Grpc | Mechanism::File => Ok(()),
        Mechanism::CudaIpc => Err(Unavailable {
            mechanism,
            reason: "manta-cuda exports and maps IPC handles (bench weight_sync_ipc), \
                     but workers do not exchange them in the step loop yet",
        }),
        Mechanism::Nccl => Err(Unavailable {
            mechanism,
            reason: "NCCL feeds engines in the trainer's process (one broadcast group), \
                     SGLang engines in local mode (/update_weights_from_distributed), and \
                     engines on rollout workers only with cluster.worker_weights = \"nccl\"",
        }),
    }
}

/// The mechanism that will run: the chosen one, or gRPC with the reason when the
/// chosen one is unavailable.
pub fn resolve(trainer: &Endpoint, engine: &Endpoint) -> (Mechanism, Option<Unavailable>) {
    let wanted = choose(trainer, engine);
    if wanted == Mechanism::Nccl && trainer.process == engine.process {
        // Engines in the trainer's process join its broadcast group.
        return (wanted, None);
    }
    if engine.sglang_server && trainer.host == engine.host {
        // The trainer's process hosts a group the server joins
        // (`/init_weights_update_group`), or writes a file the server loads.
        return match wanted {
            Mechanism::Nccl => (wanted, None),
            Mechanism::CudaIpc => (
                Mechanism::File,
                Some(Unavailable {
                    mechanism: wanted,
                    reason: "SGLang servers on the trainer's GPU take weights by file:                              /update_weights_from_tensor with CUDA IPC handles is not wired",
                }),
            ),
            _ => (Mechanism::File, None),
        };
    }
    match available(wanted) {
        Ok(()) => (wanted, None),
        Err(why) => (Mechanism::Grpc, Some(why)),
    }
}

/// Engines on workers fed by the one weight-update group `cluster.worker_weights` asks
/// for: where its rank 0 (the trainer) is and how it moves tensors. Placement, not this
/// table, decided it, so the route log names rank 0 and the key instead of
/// [`resolve`]'s reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerGroupRoute {
    /// The trainer: in the driver, or on its worker.
    pub rank0: Endpoint,
    /// NCCL between GPUs; else the TCPStore backend (CPU engines).
    pub nccl: bool,
}

impl WorkerGroupRoute {
    /// The mechanism's name for the route log.
    pub fn mechanism(&self) -> &'static str {
        if self.nccl {
            "NCCL broadcast"
        } else {
            "TCPStore broadcast"
        }
    }

    /// Who rank 0 is, for the route log.
    pub fn rank0(&self) -> String {
        if self.rank0.process == "driver" {
            "the trainer in the driver".into()
        } else {
            format!("the trainer on worker {}", self.rank0.process)
        }
    }

    /// Why this mechanism: the key and value that asked for it.
    pub fn why(&self) -> &'static str {
        if self.nccl {
            "cluster.worker_weights = \"nccl\""
        } else {
            "cluster.worker_weights = \"store\""
        }
    }
}

/// The trainer's GPU when one NCCL group can feed every engine of its process: each
/// engine on a GPU of its own, none on the trainer's (NCCL allows one rank per GPU).
pub fn in_process_broadcast(trainer: &Endpoint, engines: &[Endpoint]) -> Option<u32> {
    let from = trainer.gpu?;
    let mut seen = std::collections::BTreeSet::from([from]);
    let all_apart = engines
        .iter()
        .all(|e| e.process == trainer.process && e.gpu.is_some_and(|g| seen.insert(g)));
    (all_apart && !engines.is_empty()).then_some(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_group_feeds_in_process_engines_on_gpus_of_their_own() {
        let on = |gpu: Option<u32>| Endpoint::in_driver(gpu);
        let trainer = on(Some(0));
        assert_eq!(
            in_process_broadcast(&trainer, &[on(Some(2)), on(Some(3))]),
            Some(0)
        );
        // An engine on the trainer's GPU, two engines on one GPU, a CPU engine, an
        // engine on a worker, no engine: copies.
        assert_eq!(in_process_broadcast(&trainer, &[on(Some(0))]), None);
        assert_eq!(
            in_process_broadcast(&trainer, &[on(Some(2)), on(Some(2))]),
            None
        );
        assert_eq!(in_process_broadcast(&trainer, &[on(None)]), None);
        let remote = Endpoint::on_worker("10.0.0.2:7000", Some(1));
        assert_eq!(in_process_broadcast(&trainer, &[remote]), None);
        assert_eq!(in_process_broadcast(&trainer, &[]), None);
        assert_eq!(in_process_broadcast(&on(None), &[on(Some(1))]), None);
    }

    #[test]
    fn placement_picks_the_mechanism() {
        let driver_cpu = Endpoint::in_driver(None);
        assert_eq!(
            choose(&driver_cpu, &Endpoint::in_driver(None)),
            Mechanism::InProcess
        );
        // In one process: the same GPU copies, another GPU joins the broadcast group.
        let driver_gpu0 = Endpoint::in_driver(Some(0));
        assert_eq!(
            choose(&driver_gpu0, &Endpoint::in_driver(Some(0))),
            Mechanism::InProcess
        );
        assert_eq!(
            resolve(&driver_gpu0, &Endpoint::in_driver(Some(2))),
            (Mechanism::Nccl, None)
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
    fn sglang_servers_of_the_driver_take_nccl_or_a_file() {
        let trainer = Endpoint::in_driver(Some(0));
        assert_eq!(
            resolve(&trainer, &Endpoint::sglang_server(0, Some(1))),
            (Mechanism::Nccl, None)
        );
        let (used, why) = resolve(&trainer, &Endpoint::sglang_server(0, Some(0)));
        assert_eq!(used, Mechanism::File);
        assert_eq!(
            why.expect("CUDA IPC is named").mechanism,
            Mechanism::CudaIpc
        );
        assert_eq!(
            resolve(
                &Endpoint::in_driver(None),
                &Endpoint::sglang_server(0, None)
            ),
            (Mechanism::File, None)
        );
    }

    #[test]
    fn a_worker_group_route_names_rank_0_and_the_key() {
        let on_worker = WorkerGroupRoute {
            rank0: Endpoint::on_worker("10.0.0.2:7000", Some(0)),
            nccl: true,
        };
        assert_eq!(on_worker.rank0(), "the trainer on worker 10.0.0.2:7000");
        assert_eq!(on_worker.mechanism(), "NCCL broadcast");
        assert_eq!(on_worker.why(), "cluster.worker_weights = \"nccl\"");
        let in_driver = WorkerGroupRoute {
            rank0: Endpoint::in_driver(None),
            nccl: false,
        };
        assert_eq!(in_driver.rank0(), "the trainer in the driver");
        assert_eq!(in_driver.mechanism(), "TCPStore broadcast");
    }

    #[test]
    fn unbuilt_mechanisms_are_reported_not_faked() {
        let t = Endpoint::on_worker("10.0.0.2:7000", Some(0));
        let (used, why) = resolve(&t, &Endpoint::on_worker("10.0.0.2:7001", Some(1)));
        assert_eq!(used, Mechanism::Grpc);
        let why = why.expect("NCCL is reported unavailable");
        assert_eq!(why.mechanism, Mechanism::Nccl);
        assert!(why
            .to_string()
            .contains("NCCL broadcast is not used for this pair"));
        let (used, why) = resolve(&t, &Endpoint::on_worker("10.0.0.3:1", None));
        assert_eq!((used, why), (Mechanism::Grpc, None));
    }
}

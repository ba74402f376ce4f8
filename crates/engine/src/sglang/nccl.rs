//! Weights into an SGLang server over NCCL, with no disk: SGLang's own protocol, with
//! this process as the trainer.
//!
//! This process is rank 0 of a weight-update group: it hosts torch.distributed's
//! TCPStore and joins libtorch's `ProcessGroupNCCL` on the trainer's GPU
//! (`manta_cuda::process_group`), then POSTs `/init_weights_update_group` so the server's
//! ranks (one per tensor-parallel GPU) join at `rank_offset` 1. Each update POSTs
//! `/update_weights_from_distributed` (names, dtypes, shapes in order) while broadcasting
//! the same tensors from rank 0; the server receives them by `broadcast(src=0)` and loads
//! them. One group per engine, so each engine's update is independent of the others'.
//!
//! A restarted server has left the group: the next update joins a new one. The weights it
//! was sent over NCCL died with it, so until then it serves its model directory's weights
//! and reports version 0; the step loop sees its first stale group and has the weight
//! sync send the current version again (`WeightSync::refresh_lagging`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use manta_cuda::process_group::{GroupSpec, ProcessGroup};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use tracing::{info, warn};

use super::Inner;
use crate::{EngineError, NamedTensors};

/// Bounds reaching the store, each broadcast and each HTTP call of the protocol.
const TIMEOUT: Duration = Duration::from_secs(600);

/// How long the server may take to answer its half of an update after this rank's
/// broadcast failed, before the update is given up.
const BROADCAST_FAILED_GRACE: Duration = Duration::from_secs(30);

/// Where the trainer's side of the group lives.
#[derive(Debug, Clone)]
pub struct NcclTarget {
    /// The trainer's CUDA device (its tensors are broadcast from there).
    pub device: usize,
    /// The address the server reaches this process's store at.
    pub master_address: String,
}

/// The trainer's membership of one engine's group.
pub(super) struct Feed {
    group: ProcessGroup,
    /// The server process (its generation) that joined.
    generation: u64,
}

/// How many GPUs (group ranks) the server uses: its `--tp-size`.
fn tensor_parallel(argv: &[String]) -> Result<usize, EngineError> {
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let value = match a.split_once('=') {
            Some(("--tp-size" | "--tensor-parallel-size", v)) => Some(v.to_string()),
            _ if matches!(a.as_str(), "--tp-size" | "--tensor-parallel-size" | "--tp") => {
                it.next().cloned()
            }
            _ => None,
        };
        if let Some(v) = value {
            return v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
                EngineError::Weights(format!("{a} {v}: not a tensor-parallel size"))
            });
        }
    }
    Ok(1)
}

/// SGLang's name for a tensor's dtype.
fn dtype_name(kind: Kind) -> Result<&'static str, EngineError> {
    Ok(match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Float => "float32",
        Kind::Double => "float64",
        Kind::Int64 => "int64",
        Kind::Int => "int32",
        Kind::Int8 => "int8",
        Kind::Uint8 => "uint8",
        Kind::Bool => "bool",
        other => {
            return Err(EngineError::Weights(format!(
                "{other:?} tensors have no torch dtype name for SGLang"
            )))
        }
    })
}

fn success(path: &str, name: &str, status: u16, answer: &Value) -> Result<(), EngineError> {
    let ok = answer
        .get("success")
        .and_then(Value::as_bool)
        .unwrap_or(status == 200);
    if ok && status == 200 {
        return Ok(());
    }
    Err(EngineError::Weights(format!(
        "{name}: {path}: HTTP {status}: {}",
        answer.get("message").cloned().unwrap_or(answer.clone())
    )))
}

impl Inner {
    /// Joins a new group as rank 0 and has the running server join it.
    async fn join_group(&self, target: &NcclTarget) -> Result<Feed, EngineError> {
        let (_, generation) = self.current()?;
        let engine_ranks = tensor_parallel(&self.opts.launch.argv)?;
        let group_name = format!(
            "manta-{}-{}-{:08x}",
            self.opts.name,
            generation,
            rand::random::<u32>()
        );
        let spec = GroupSpec {
            master_address: target.master_address.clone(),
            master_port: 0,
            rank: 0,
            world_size: 1 + engine_ranks,
            group_name: group_name.clone(),
            device: target.device,
            timeout: TIMEOUT,
        };
        let group = tokio::task::spawn_blocking(move || ProcessGroup::join(spec))
            .await
            .map_err(|e| EngineError::Weights(format!("joining the group panicked: {e}")))?
            .map_err(|e| EngineError::Weights(format!("{}: {e}", self.opts.name)))?;
        let body = json!({
            "master_address": target.master_address,
            "master_port": group.store_port(),
            "rank_offset": 1,
            "world_size": 1 + engine_ranks,
            "group_name": group_name,
            "backend": "nccl",
        });
        let (status, answer) = self
            .post_with("/init_weights_update_group", &body, TIMEOUT, false)
            .await?;
        success(
            "/init_weights_update_group",
            &self.opts.name,
            status,
            &answer,
        )?;
        info!(engine = %self.opts.name, group = %group_name, ranks = 1 + engine_ranks, device = target.device, "weight update group joined (NCCL)");
        Ok(Feed { group, generation })
    }

    /// Joins a group with the running server now (replacing any older one).
    pub(super) async fn connect_nccl(&self, target: &NcclTarget) -> Result<(), EngineError> {
        let feed = self.join_group(target).await?;
        *self.nccl_feed.lock().unwrap_or_else(|p| p.into_inner()) = Some(feed);
        Ok(())
    }

    /// Sends `weights` as `version` over the engine's group, joining one first when there
    /// is none for the running server.
    pub(super) async fn update_over_nccl(
        &self,
        target: &NcclTarget,
        weights: NamedTensors,
        version: u64,
    ) -> Result<(), EngineError> {
        let (_, generation) = self.current()?;
        let held = self
            .nccl_feed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let feed = match held {
            Some(f) if f.generation == generation => f,
            stale => {
                // The server that joined it is gone: abort, so dropping the group does not
                // wait on a peer that will never answer.
                if let Some(old) = stale {
                    info!(engine = %self.opts.name, group = %old.group.spec().group_name, "the server left its weight-update group (restarted); joining a new one");
                    if let Err(e) = old.group.aborter().abort() {
                        warn!(engine = %self.opts.name, error = %e, "aborting the old weight-update group failed");
                    }
                }
                self.join_group(target).await?
            }
        };
        let device = Device::Cuda(target.device);
        let mut names = Vec::with_capacity(weights.len());
        let mut dtypes = Vec::with_capacity(weights.len());
        let mut shapes = Vec::with_capacity(weights.len());
        let mut tensors: Vec<(String, Tensor)> = Vec::with_capacity(weights.len());
        for (name, t) in weights {
            dtypes.push(dtype_name(t.kind())?);
            shapes.push(t.size());
            names.push(name.clone());
            let t = if t.device() == device && t.is_contiguous() {
                t
            } else {
                t.to_device(device).contiguous()
            };
            tensors.push((name, t));
        }
        let body = json!({
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": feed.group.spec().group_name,
            // Flushed afterwards, by request: see `Inner::flush_after_update`.
            "flush_cache": false,
            "weight_version": version.to_string(),
        });
        let mut group = feed.group;
        // Each side's failure must release the other: a server that answers its half with
        // an error leaves this rank's broadcast waiting for a receiver that is gone, so
        // the group is aborted; a broadcast that fails leaves the server's half waiting,
        // so its answer is awaited only for a grace period.
        let aborter = group.aborter();
        let broadcast_failed = std::sync::Arc::new(tokio::sync::Notify::new());
        let post = async {
            let answered = tokio::select! {
                r = self.post_with("/update_weights_from_distributed", &body, TIMEOUT, false) => r,
                _ = async {
                    broadcast_failed.notified().await;
                    tokio::time::sleep(BROADCAST_FAILED_GRACE).await;
                } => Err(EngineError::Stopped(format!(
                    "/update_weights_from_distributed: no answer {} s after the broadcast failed",
                    BROADCAST_FAILED_GRACE.as_secs()
                ))),
            };
            let verdict = answered.and_then(|(status, answer)| {
                success(
                    "/update_weights_from_distributed",
                    &self.opts.name,
                    status,
                    &answer,
                )
            });
            if verdict.is_err() {
                if let Err(e) = aborter.abort() {
                    warn!(engine = %self.opts.name, error = %e, "aborting the weight update group failed");
                }
            }
            verdict
        };
        let failed = broadcast_failed.clone();
        let send = tokio::task::spawn_blocking(move || {
            let sent = group.broadcast(&tensors, 0);
            if sent.is_err() {
                failed.notify_one();
            }
            (group, sent)
        });
        let (posted, sent) = tokio::join!(post, send);
        let (group, sent) =
            sent.map_err(|e| EngineError::Weights(format!("broadcast panicked: {e}")))?;
        // The server's answer says more than the aborted broadcast; either way the group
        // is aborted and dropped (a failed collective leaves it unusable; an aborted one is
        // freed without waiting on its peer) and the next update joins a new one.
        if posted.is_err() || sent.is_err() {
            let _ = group.aborter().abort();
        }
        posted?;
        sent.map_err(|e| EngineError::Weights(format!("{}: {e}", self.opts.name)))?;
        *self.nccl_feed.lock().unwrap_or_else(|p| p.into_inner()) = Some(Feed {
            group,
            generation: feed.generation,
        });
        // The server holds weights no file has: a restart cannot load them back.
        *self.last_weights.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.nccl_fed.store(true, Ordering::Relaxed);
        self.version.store(version, Ordering::Relaxed);
        self.flush_after_update().await;
        Ok(())
    }

    /// After a restart: weights sent over NCCL died with the old process.
    pub(super) fn forget_nccl_weights(&self) {
        if self.nccl_fed.swap(false, Ordering::Relaxed) {
            warn!(engine = %self.opts.name, "the restarted engine lost the weights sent over NCCL: it serves its model directory's weights (version 0) until the weight sync sends the current version again");
            self.version.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_has_a_rank_per_tensor_parallel_gpu() {
        let argv = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(
            tensor_parallel(&argv("python3 -m sglang.launch_server")).unwrap(),
            1
        );
        assert_eq!(
            tensor_parallel(&argv("x --tp-size 4 --base-gpu-id 2")).unwrap(),
            4
        );
        assert_eq!(
            tensor_parallel(&argv("x --tensor-parallel-size=2")).unwrap(),
            2
        );
        assert!(tensor_parallel(&argv("x --tp-size zero")).is_err());
        assert!(tensor_parallel(&argv("x --tp-size 0")).is_err());
    }

    #[test]
    fn dtypes_have_their_torch_names() {
        assert_eq!(dtype_name(Kind::BFloat16).unwrap(), "bfloat16");
        assert_eq!(dtype_name(Kind::Float).unwrap(), "float32");
        assert!(dtype_name(Kind::ComplexFloat).is_err());
    }
}

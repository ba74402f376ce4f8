//! One NCCL group for every engine in this process: the trainer is rank 0 and
//! broadcasts each tensor once; every engine receives it straight into its parameters
//! at its own rank (SGLang's `/update_weights_from_distributed` protocol, with the
//! engines as threads of this process). Used when the trainer and the engines sit on
//! different GPUs: the trainer's memory is read once for all engines, where peer copies
//! read it once per engine.

use std::collections::HashMap;
use std::time::Duration;

use manta_cuda::process_group::GroupSpec;
use manta_cuda::weight_group::{unique_name, Backend, WeightGroup};
use manta_engine::{BroadcastFeed, NamedTensors, PauseMode, WeightShape};

use crate::sync::TrainerParts;
use manta_rollout::{IncomingWeights, RolloutMsg};
use ractor::{call, ActorRef};
use tch::{Device, Kind};
use tracing::info;

/// Bounds the store's waits and each broadcast: an engine that never joins fails the
/// update instead of hanging it.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Rank 0 of a weight-update group in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BroadcastRoot {
    /// The trainer's CUDA device, every engine on another GPU: NCCL.
    Cuda(usize),
    /// Trainer and engines on the CPU: broadcasts through a `TCPStore` (for tests of the
    /// group protocol; copies are faster in one process).
    Cpu,
}

/// Why a broadcast did not deliver a version.
#[derive(Debug, thiserror::Error)]
pub enum BroadcastError {
    /// These weights or engines cannot take part (another device, dtype or shape):
    /// broadcasting is given up for the run.
    #[error("{0}")]
    Unusable(String),
    /// This update failed (an engine or the group); the group is left and the next
    /// update builds a new one.
    #[error("{0}")]
    Failed(String),
}

/// Rank 0's side of the run's weight-update group.
pub struct BroadcastGroup {
    root: BroadcastRoot,
    group: Option<WeightGroup>,
    /// The engines' parameters were found to match the trainer's.
    checked: bool,
}

impl BroadcastGroup {
    pub fn new(root: BroadcastRoot) -> Self {
        Self {
            root,
            group: None,
            checked: false,
        }
    }

    /// Where the trainer's tensors must be, and how the group moves them.
    fn placement(&self) -> (Device, Backend, usize) {
        match self.root {
            BroadcastRoot::Cuda(gpu) => (Device::Cuda(gpu), Backend::Nccl, gpu),
            BroadcastRoot::Cpu => (Device::Cpu, Backend::Store, 0),
        }
    }

    /// Broadcasts `weights` into every engine as `version`; each engine pauses as
    /// `pause` says. Returns the longest pause → resume.
    pub async fn publish(
        &mut self,
        weights: NamedTensors,
        engines: &[ActorRef<RolloutMsg>],
        version: u64,
        pause: PauseMode,
    ) -> Result<Duration, BroadcastError> {
        // Tensors are not `Sync`: nothing below holds a reference to them across an await.
        let (device, backend, index) = self.placement();
        let shapes = shapes_on(&weights, device)?;
        self.check(&shapes, engines).await?;
        let mut group = match self.group.take() {
            Some(group) => group,
            None => make_group(index, backend, engines.len()).await?,
        };
        let names: Vec<String> = shapes.into_iter().map(|(n, _, _)| n).collect();
        let receivers = receive_in(&group, engines, &names, &[], backend, version, pause);
        let aborter = group.aborter();
        let root = tokio::task::spawn_blocking(move || {
            let sent = group.broadcast(&weights, 0);
            (group, sent)
        });
        let (longest, failed) = wait_for(receivers, &aborter).await;
        let (group, sent) = root
            .await
            .map_err(|e| BroadcastError::Failed(format!("the broadcast task: {e}")))?;
        if failed.is_some() || sent.is_err() {
            // Freed below without waiting on peers that will not come.
            let _ = group.aborter().abort();
        }
        if let Some(e) = failed {
            return Err(BroadcastError::Failed(e));
        }
        sent.map_err(|e| BroadcastError::Failed(e.to_string()))?;
        self.group = Some(group);
        Ok(longest)
    }

    /// Broadcasts the trainer's weights as they come in `parts` (ZeRO-3: one round per
    /// shard group, the group gathered only once the previous round was sent), into
    /// every engine as `version`. The engines learn every round's names up front
    /// (`parts.layout`). On an error the parts still unsent are taken and answered, so
    /// the trainer's ranks finish their gathers; the parts come back only when nothing
    /// was taken yet (the caller then copies them instead).
    pub async fn publish_parts(
        &mut self,
        parts: TrainerParts,
        engines: &[ActorRef<RolloutMsg>],
        version: u64,
        pause: PauseMode,
    ) -> Result<Duration, (BroadcastError, Option<TrainerParts>)> {
        let (device, backend, index) = self.placement();
        let shapes: Vec<WeightShape> = parts.layout.iter().flatten().cloned().collect();
        if let Err(e) = self.check(&shapes, engines).await {
            return Err((e, Some(parts)));
        }
        let mut group = match self.group.take() {
            Some(group) => group,
            None => match make_group(index, backend, engines.len()).await {
                Ok(group) => group,
                Err(e) => return Err((e, Some(parts))),
            },
        };
        let names: Vec<String> = shapes.into_iter().map(|(n, _, _)| n).collect();
        let rounds: Vec<usize> = parts.layout.iter().map(Vec::len).collect();
        let receivers = receive_in(&group, engines, &names, &rounds, backend, version, pause);
        let aborter = group.aborter();
        let TrainerParts {
            layout,
            parts: mut incoming,
            finished,
        } = parts;
        let root = tokio::task::spawn_blocking(move || {
            let mut sent: Result<(), BroadcastError> = Ok(());
            let mut round = 0;
            while let Some(part) = incoming.blocking_recv() {
                let (tensors, copied) = part.into_parts();
                if sent.is_ok() {
                    sent = send_round(&mut group, &tensors, layout.get(round), device, round);
                    if sent.is_err() {
                        // The engines wait in this round: release them.
                        let _ = group.aborter().abort();
                    }
                }
                round += 1;
                drop(tensors);
                copied.done();
            }
            if sent.is_ok() && round != layout.len() {
                let _ = group.aborter().abort();
                sent = Err(BroadcastError::Failed(format!(
                    "the trainer sent {round} of {} weight groups",
                    layout.len()
                )));
            }
            (group, sent)
        });
        let (longest, failed) = wait_for(receivers, &aborter).await;
        let (group, sent) = root.await.map_err(|e| {
            (
                BroadcastError::Failed(format!("the broadcast task: {e}")),
                None,
            )
        })?;
        let trainer = finished
            .await
            .map_err(|e| format!("the task reading the trainer's weights: {e}"))
            .and_then(|r| r.map_err(|e| e.to_string()));
        if failed.is_some() || sent.is_err() || trainer.is_err() {
            let _ = group.aborter().abort();
        }
        if let Some(e) = failed {
            return Err((BroadcastError::Failed(e), None));
        }
        sent.map_err(|e| (e, None))?;
        trainer.map_err(|e| (BroadcastError::Failed(e), None))?;
        self.group = Some(group);
        Ok(longest)
    }

    /// Once per run: every engine holds a parameter of each name, shape and dtype the
    /// trainer sends (a broadcast cannot convert).
    async fn check(
        &mut self,
        sent: &[WeightShape],
        engines: &[ActorRef<RolloutMsg>],
    ) -> Result<(), BroadcastError> {
        if self.checked {
            return Ok(());
        }
        for (i, engine) in engines.iter().enumerate() {
            let shapes = call!(engine, RolloutMsg::WeightShapes)
                .map_err(|e| BroadcastError::Unusable(format!("engine {i}: {e}")))?
                .map_err(|e| BroadcastError::Unusable(format!("engine {i}: {e}")))?;
            if let Some(why) = mismatch(sent, &shapes) {
                return Err(BroadcastError::Unusable(format!("engine {i}: {why}")));
            }
        }
        self.checked = true;
        Ok(())
    }
}

/// Sends one round: `tensors` must be the `round`-th group of the layout, dense on the
/// group's device.
fn send_round(
    group: &mut WeightGroup,
    tensors: &NamedTensors,
    expected: Option<&Vec<WeightShape>>,
    device: Device,
    round: usize,
) -> Result<(), BroadcastError> {
    let got = shapes_on(tensors, device)?;
    if expected != Some(&got) {
        return Err(BroadcastError::Failed(format!(
            "weight group {round} is not the one the layout announced"
        )));
    }
    group
        .broadcast(tensors, 0)
        .map_err(|e| BroadcastError::Failed(e.to_string()))
}

/// Every engine's `ApplyWeights` with a feed of `group` (`names` in `rounds`), started.
fn receive_in(
    group: &WeightGroup,
    engines: &[ActorRef<RolloutMsg>],
    names: &[String],
    rounds: &[usize],
    backend: Backend,
    version: u64,
    pause: PauseMode,
) -> tokio::task::JoinSet<Result<Duration, String>> {
    let port = group.store_port();
    let mut receivers = tokio::task::JoinSet::new();
    for (i, engine) in engines.iter().enumerate() {
        let spec = group.spec();
        let feed = BroadcastFeed {
            backend,
            master_address: spec.master_address.clone(),
            master_port: port,
            rank: i + 1,
            world_size: spec.world_size,
            group_name: spec.group_name.clone(),
            timeout: spec.timeout,
            names: names.to_vec(),
            rounds: rounds.to_vec(),
            on_receive: None,
        };
        let engine = engine.clone();
        receivers.spawn(async move {
            call!(
                engine,
                RolloutMsg::ApplyWeights,
                IncomingWeights::Broadcast(feed),
                version,
                pause
            )
            .map_err(|e| format!("engine {i}: {e}"))?
            .map_err(|e| format!("engine {i}: {e}"))
        });
    }
    receivers
}

/// The engines' answers: the longest pause, and the first failure (which aborts the
/// group, so the root stops waiting for a rank that is gone).
async fn wait_for(
    mut receivers: tokio::task::JoinSet<Result<Duration, String>>,
    aborter: &manta_cuda::weight_group::GroupAborter,
) -> (Duration, Option<String>) {
    let mut longest = Duration::ZERO;
    let mut failed: Option<String> = None;
    while let Some(joined) = receivers.join_next().await {
        match joined {
            Ok(Ok(paused)) => longest = longest.max(paused),
            Ok(Err(e)) => {
                let _ = aborter.abort();
                failed.get_or_insert(e);
            }
            Err(e) => {
                let _ = aborter.abort();
                failed.get_or_insert(format!("an engine's receive task: {e}"));
            }
        }
    }
    (longest, failed)
}

/// Joins a new group as rank 0 (hosting its store) for the trainer and `engines`.
async fn make_group(
    device: usize,
    backend: Backend,
    engines: usize,
) -> Result<WeightGroup, BroadcastError> {
    let spec = GroupSpec {
        master_address: "127.0.0.1".into(),
        master_port: 0,
        rank: 0,
        world_size: 1 + engines,
        group_name: unique_name("manta-weights"),
        device,
        timeout: TIMEOUT,
    };
    let group = tokio::task::spawn_blocking(move || WeightGroup::join(spec, backend))
        .await
        .map_err(|e| BroadcastError::Failed(format!("joining the group: {e}")))?
        .map_err(|e| BroadcastError::Failed(e.to_string()))?;
    info!(
        group = %group.spec().group_name,
        ranks = 1 + engines,
        device = device,
        backend = ?backend,
        "weight-update group made: the trainer broadcasts to every engine at once"
    );
    Ok(group)
}

/// Each tensor's name, shape and dtype, in order; refused unless every one is dense and
/// on `device` (NCCL sends device memory as it lies).
fn shapes_on(weights: &NamedTensors, device: Device) -> Result<Vec<WeightShape>, BroadcastError> {
    weights
        .iter()
        .map(|(name, t)| {
            if t.device() != device || !t.is_contiguous() {
                return Err(BroadcastError::Unusable(format!(
                    "trainer tensor {name} is not a dense tensor on {device:?}"
                )));
            }
            Ok((name.clone(), t.size(), t.kind()))
        })
        .collect()
}

/// The first way `engine` (an engine's parameters) differs from `sent`, named.
fn mismatch(sent: &[WeightShape], engine: &[WeightShape]) -> Option<String> {
    if sent.len() != engine.len() {
        return Some(format!(
            "{} parameters, the trainer sends {}",
            engine.len(),
            sent.len()
        ));
    }
    let by_name: HashMap<&str, (&Vec<i64>, Kind)> = engine
        .iter()
        .map(|(n, s, k)| (n.as_str(), (s, *k)))
        .collect();
    sent.iter()
        .find_map(|(name, size, k)| match by_name.get(name.as_str()) {
            None => Some(format!("no parameter {name}")),
            Some((shape, kind)) if *shape != size || kind != k => Some(format!(
                "{name} is {kind:?} {shape:?}, the trainer's is {k:?} {size:?}"
            )),
            Some(_) => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn trainer_tensors_must_be_dense_on_the_groups_device() {
        let weights: NamedTensors = vec![(
            "w".into(),
            Tensor::zeros([2, 3], (Kind::BFloat16, Device::Cpu)),
        )];
        let shapes = shapes_on(&weights, Device::Cpu).unwrap();
        assert_eq!(shapes, vec![("w".to_string(), vec![2, 3], Kind::BFloat16)]);
        let why = shapes_on(&weights, Device::Cuda(0))
            .unwrap_err()
            .to_string();
        assert!(why.contains("tensor w"), "{why}");
        let strided: NamedTensors = vec![("t".into(), weights[0].1.tr())];
        assert!(shapes_on(&strided, Device::Cpu).is_err());
    }

    #[test]
    fn engines_must_hold_every_tensor_by_name_shape_and_dtype() {
        let weights = vec![
            ("a".to_string(), vec![2, 3], Kind::BFloat16),
            ("b".to_string(), vec![4], Kind::BFloat16),
        ];
        let same = vec![
            ("a".to_string(), vec![2, 3], Kind::BFloat16),
            ("b".to_string(), vec![4], Kind::BFloat16),
        ];
        assert_eq!(mismatch(&weights, &same), None);
        let mut other_dtype = same.clone();
        other_dtype[1].2 = Kind::Float;
        let why = mismatch(&weights, &other_dtype).unwrap();
        assert!(why.contains("b is Float"), "{why}");
        let mut other_shape = same.clone();
        other_shape[0].1 = vec![3, 2];
        assert!(mismatch(&weights, &other_shape).unwrap().contains("a is"));
        let missing = vec![same[0].clone(), ("c".to_string(), vec![4], Kind::BFloat16)];
        assert_eq!(mismatch(&weights, &missing).unwrap(), "no parameter b");
        assert!(mismatch(&weights, &same[..1])
            .unwrap()
            .contains("1 parameters"));
    }
}

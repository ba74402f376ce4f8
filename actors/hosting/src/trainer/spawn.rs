//! A trainer's spawn config (the JSON the driver sends in `SpawnActor`) and starting
//! the trainer actor from it.

use std::path::PathBuf;

use anyhow::Context;
use manta_trainer::batch::MicroBatchLayout;
use manta_trainer::data_parallel::zero::DEFAULT_BUCKET_NUMEL;
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{
    AlgoOptions, RankGroupKind, TrainerActor, TrainerMsg, TrainerOptions, TrainerRankActor,
    TrainerRankArgs,
};
use ractor::{Actor, ActorRef};
use serde::{Deserialize, Serialize};

use super::rank_group::{RankAborter, RankGroups, RankSpawn};

/// A trainer's arguments as they travel in `SpawnActorRequest.config_json`: the
/// driver's `TrainerOptions` without the device, which the worker picks from the
/// request's GPUs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainerSpawnConfig {
    /// Hugging Face model directory, as the worker sees it.
    pub model_dir: PathBuf,
    pub seed: u64,
    pub lr: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub weight_decay: f64,
    pub eps_clip: f64,
    pub eps_clip_high: f64,
    pub clip_grad: f64,
    pub temperature: f64,
    pub max_tokens_per_gpu: usize,
    /// Packed sequences or padded rows (packed when absent).
    #[serde(default)]
    pub layout: MicroBatchLayout,
    /// bf16 with fp32 masters; absent: bf16 on CUDA, fp32 on the CPU.
    #[serde(default)]
    pub bf16: Option<bool>,
    pub use_rollout_logprobs: bool,
    pub logprob_chunk: i64,
    /// Every layer recomputed (what older drivers send); `recompute` wins when present.
    pub gradient_checkpointing: bool,
    /// Megatron's `--recompute-method`/`--recompute-num-layers`; `None` with
    /// `gradient_checkpointing = false` keeps every activation.
    #[serde(default)]
    pub recompute: Option<manta_trainer::Recompute>,
    /// slime's loss options, LR schedule, updates per rollout and reference model, so a
    /// trainer on a worker trains exactly as an in-process one.
    #[serde(default)]
    pub algo: AlgoOptions,
    /// A rank of a data-parallel group (`[trainer] ranks`): its rank, the group's link
    /// and whether it owns its node's checkpoint directory. Absent: a trainer alone (and
    /// left out of the JSON then, so workers built before ranks existed still take it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<RankSpawn>,
}

impl TrainerSpawnConfig {
    /// Parses `config_json`, naming the problem.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            format!(
                "trainer spawn config_json: key `{}`: {}",
                e.path(),
                e.inner()
            )
        })
    }

    pub fn from_options(o: &TrainerOptions) -> Self {
        Self {
            model_dir: o.model_dir.clone(),
            seed: o.seed,
            lr: o.adam.lr,
            adam_beta1: o.adam.beta1,
            adam_beta2: o.adam.beta2,
            adam_eps: o.adam.eps,
            weight_decay: o.adam.weight_decay,
            eps_clip: o.clip.eps_clip,
            eps_clip_high: o.clip.eps_clip_high,
            clip_grad: o.clip_grad,
            temperature: o.temperature,
            max_tokens_per_gpu: o.max_tokens_per_gpu,
            layout: o.layout,
            bf16: o.bf16,
            use_rollout_logprobs: o.use_rollout_logprobs,
            logprob_chunk: o.logprob_chunk,
            gradient_checkpointing: o.recompute.is_some(),
            recompute: o.recompute,
            algo: o.algo.clone(),
            rank: None,
        }
    }

    /// The trainer's options on this worker: the first of `gpus` when any are named
    /// (an error when this worker has no CUDA), else the CPU.
    pub fn into_options(self, gpus: &[u32]) -> Result<TrainerOptions, String> {
        let device = match gpus.first() {
            None => tch::Device::Cpu,
            Some(&g) if tch::Cuda::is_available() && (g as i64) < tch::Cuda::device_count() => {
                tch::Device::Cuda(g as usize)
            }
            Some(g) => {
                return Err(format!(
                    "the trainer was placed on GPU {g}, but this worker sees {} CUDA devices",
                    tch::Cuda::device_count()
                ))
            }
        };
        Ok(TrainerOptions {
            model_dir: self.model_dir,
            seed: self.seed,
            device,
            adam: AdamWConfig {
                lr: self.lr,
                beta1: self.adam_beta1,
                beta2: self.adam_beta2,
                eps: self.adam_eps,
                weight_decay: self.weight_decay,
            },
            clip: ClipRange {
                eps_clip: self.eps_clip,
                eps_clip_high: self.eps_clip_high,
            },
            clip_grad: self.clip_grad,
            temperature: self.temperature,
            max_tokens_per_gpu: self.max_tokens_per_gpu,
            layout: self.layout,
            bf16: self.bf16,
            use_rollout_logprobs: self.use_rollout_logprobs,
            logprob_chunk: self.logprob_chunk,
            recompute: self.recompute.or(self
                .gradient_checkpointing
                .then_some(manta_trainer::Recompute::EVERY_LAYER)),
            algo: self.algo,
        })
    }
}

/// Starts a trainer actor (on the caller's runtime, which must be multi-threaded:
/// the trainer computes in `block_in_place`).
pub async fn spawn_trainer(
    name: &str,
    options: TrainerOptions,
) -> anyhow::Result<ActorRef<TrainerMsg>> {
    let (actor, _) = Actor::spawn(Some(name.to_string()), TrainerActor, options)
        .await
        .with_context(|| format!("starting trainer {name}"))?;
    Ok(actor)
}

/// Starts rank `rank.rank` of a data-parallel group (ZeRO-2): joins the group's
/// collective on the rank's device (NCCL on its GPU, or the store on the CPU), then
/// builds the rank, which waits in its first collective until every rank has joined.
/// Also returns what ends the rank's collective waits (the store's or NCCL's), for its
/// worker to call when the rank is stopped.
pub async fn spawn_rank(
    name: &str,
    options: TrainerOptions,
    rank: RankSpawn,
    groups: &RankGroups,
) -> anyhow::Result<(ActorRef<TrainerMsg>, RankAborter)> {
    let gpu = match options.device {
        tch::Device::Cuda(i) => Some(i),
        _ => None,
    };
    let (groups, spawn) = (groups.clone(), rank.clone());
    let joined = tokio::task::spawn_blocking(move || groups.collective(&spawn, gpu))
        .await
        .context("joining the rank group")?
        .map_err(anyhow::Error::msg)?;
    let args = TrainerRankArgs {
        options,
        comm: joined.comm,
        bucket_numel: DEFAULT_BUCKET_NUMEL,
        kind: RankGroupKind::Zero2,
        checkpoint_owner: Some(rank.checkpoint_owner),
    };
    let (actor, _) = Actor::spawn(Some(name.to_string()), TrainerRankActor, args)
        .await
        .with_context(|| format!("starting trainer rank {} of {}", rank.rank, rank.world))?;
    Ok((actor, joined.aborter))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// slime's loss options survive the trip to a worker: a remote trainer trains with
    /// the same algorithm as a local one.
    #[test]
    fn loss_options_reach_a_remote_trainer() {
        let mut json = serde_json::json!({
            "model_dir": "/m", "seed": 1, "lr": 1e-5, "adam_beta1": 0.9, "adam_beta2": 0.999,
            "adam_eps": 1e-8, "weight_decay": 0.0, "eps_clip": 0.2, "eps_clip_high": 0.28,
            "clip_grad": 1.0, "temperature": 1.0, "max_tokens_per_gpu": 8192,
            "use_rollout_logprobs": false, "logprob_chunk": 1024, "gradient_checkpointing": true
        });
        // Older drivers send no `algo`: plain GRPO.
        let plain = TrainerSpawnConfig::from_json(&json.to_string()).unwrap();
        assert_eq!(plain.algo, AlgoOptions::default());
        let mut opts = plain.into_options(&[]).unwrap();
        // Older drivers' gradient_checkpointing = true: every layer recomputed.
        assert_eq!(opts.recompute, Some(manta_trainer::Recompute::EVERY_LAYER));
        opts.recompute = Some(manta_trainer::Recompute {
            method: manta_trainer::RecomputeMethod::Block,
            num_layers: 30,
        });
        opts.algo.loss.use_kl_loss = true;
        opts.algo.loss.kl_loss_coef = 0.1;
        opts.algo.num_steps_per_rollout = 2;
        let sent = serde_json::to_string(&TrainerSpawnConfig::from_options(&opts)).unwrap();
        let got = TrainerSpawnConfig::from_json(&sent)
            .unwrap()
            .into_options(&[])
            .unwrap();
        assert_eq!(got.algo, opts.algo);
        assert_eq!(got.recompute, opts.recompute);
        json["algo"] = serde_json::json!("nonsense");
        let err = TrainerSpawnConfig::from_json(&json.to_string()).unwrap_err();
        assert!(err.contains("algo"), "{err}");
    }
}

//! Building actors on a worker from the JSON the driver sends in `SpawnActor`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use manta_config::TrainConfig;
use manta_rollout::actor::RolloutArgs;
use manta_rollout::chat::ChatFormat;
use manta_rollout::engine::{Engine, NativeEngine, NativeEngineOptions};
use manta_rollout::ors::{OrsClient, OrsClientOptions};
use manta_rollout::{EnvironmentHandle, EpisodeContext, RolloutActor, RolloutMsg};
use manta_tokenizer::Tokenizer;
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{TrainerActor, TrainerMsg, TrainerOptions};
use ractor::{Actor, ActorRef};
use serde::{Deserialize, Serialize};

/// The value of an environment's `url` that means "Manta's built-in server".
pub const BUILTIN_URL: &str = "builtin";
/// Where environments live when train_config.yaml names no `url`.
pub const DEFAULT_SESSION_URL: &str = "https://sessions.openreward.ai";

/// A rollout actor's arguments as they travel in `SpawnActorRequest.config_json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpawnConfig {
    /// Hugging Face model directory, as the worker sees it.
    pub model_dir: PathBuf,
    pub seed: u64,
    /// train_config.yaml, as the worker sees it (environments, prompt, thinking).
    pub train_config: PathBuf,
    pub max_concurrent_episodes: usize,
    pub max_batch_size: usize,
}

impl RolloutSpawnConfig {
    /// Parses `config_json`, naming the problem.
    pub fn from_json(text: &str) -> Result<Self, String> {
        serde_json::from_str(text).map_err(|e| format!("rollout spawn config_json: {e}"))
    }

    /// Whether any environment needs Manta's built-in server.
    pub fn needs_builtin(train: &TrainConfig) -> bool {
        train
            .environments
            .values()
            .any(|e| e.url.as_deref() == Some(BUILTIN_URL))
    }
}

/// Resolves each environment's server URL and builds one ORS client for it.
pub fn environment_clients(
    train: &TrainConfig,
    builtin_url: Option<&str>,
) -> anyhow::Result<BTreeMap<String, OrsClient>> {
    let mut out = BTreeMap::new();
    for (name, env) in &train.environments {
        let builtin = env.url.as_deref() == Some(BUILTIN_URL);
        let base_url = match env.url.as_deref() {
            Some(BUILTIN_URL) => builtin_url
                .context("the built-in environment server is not running")?
                .to_string(),
            Some(url) => url.to_string(),
            None => std::env::var("OPENREWARD_SESSION_URL")
                .unwrap_or_else(|_| DEFAULT_SESSION_URL.to_string()),
        };
        let options = OrsClientOptions {
            base_url,
            api_key: std::env::var("OPENREWARD_API_KEY").ok(),
            deployment: (!builtin).then(|| name.clone()),
            variant: env.variant.clone(),
            secrets: train.resolved_secrets(name),
            request_timeout: Duration::from_secs(120),
            ..OrsClientOptions::new(String::new())
        };
        let client = OrsClient::new(options).with_context(|| format!("environment {name}"))?;
        out.insert(name.clone(), client);
    }
    Ok(out)
}

/// Token ids that end a generate call: the end of a turn, the end of a tool call, EOS.
pub fn stop_token_ids(tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = ["<|im_end|>", "</tool_call>", "<|endoftext|>"]
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .chain(tokenizer.eos_token_id())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Starts a rollout actor with a native CPU engine and its own ORS clients.
pub async fn spawn_rollout(
    name: &str,
    cfg: &RolloutSpawnConfig,
    train: &TrainConfig,
    builtin_url: Option<&str>,
) -> anyhow::Result<ActorRef<RolloutMsg>> {
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&cfg.model_dir)
            .with_context(|| format!("loading the tokenizer from {}", cfg.model_dir.display()))?,
    );
    let engine: Arc<dyn Engine> = NativeEngine::start(NativeEngineOptions {
        model_dir: cfg.model_dir.clone(),
        seed: cfg.seed,
        device: tch::Device::Cpu,
        max_batch_size: cfg.max_batch_size.max(1),
    })
    .with_context(|| format!("starting the native engine on {}", cfg.model_dir.display()))?;
    let environments = environment_clients(train, builtin_url)?
        .into_iter()
        .map(|(name, client)| {
            let config = train.environments[&name].clone();
            (
                name.clone(),
                EnvironmentHandle {
                    name,
                    client,
                    config,
                },
            )
        })
        .collect();
    let context = EpisodeContext {
        engine,
        chat: ChatFormat::new(tokenizer.clone(), train.thinking),
        system_prompt_template: train.system_prompt_template.clone(),
        stop_token_ids: stop_token_ids(&tokenizer),
        upload: None,
    };
    let args = RolloutArgs {
        context,
        environments,
        max_concurrent_episodes: cfg.max_concurrent_episodes.max(1),
    };
    let (actor, _) = Actor::spawn(Some(name.to_string()), RolloutActor, args)
        .await
        .with_context(|| format!("starting rollout actor {name}"))?;
    Ok(actor)
}

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
    pub use_rollout_logprobs: bool,
    pub logprob_chunk: i64,
    pub gradient_checkpointing: bool,
}

impl TrainerSpawnConfig {
    /// Parses `config_json`, naming the problem.
    pub fn from_json(text: &str) -> Result<Self, String> {
        serde_json::from_str(text).map_err(|e| format!("trainer spawn config_json: {e}"))
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
            use_rollout_logprobs: o.use_rollout_logprobs,
            logprob_chunk: o.logprob_chunk,
            gradient_checkpointing: o.gradient_checkpointing,
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
            use_rollout_logprobs: self.use_rollout_logprobs,
            logprob_chunk: self.logprob_chunk,
            gradient_checkpointing: self.gradient_checkpointing,
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

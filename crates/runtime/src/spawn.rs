//! Building actors on a worker from the JSON the driver sends in `SpawnActor`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use manta_config::TrainConfig;
use manta_rollout::actor::RolloutArgs;
use manta_rollout::chat::ChatFormat;
use manta_rollout::engine::{
    Engine, NativeEngine, NativeEngineOptions, SglangEngine, SglangOptions,
};
use manta_rollout::ors::{OrsClient, OrsClientOptions};
use manta_rollout::{
    EnvironmentHandle, EpisodeContext, RolloutActor, RolloutMsg, UploadConfig, Uploader,
};
use manta_tokenizer::Tokenizer;
use manta_trainer::batch::MicroBatchLayout;
use manta_trainer::loss::ClipRange;
use manta_trainer::optimizer::AdamWConfig;
use manta_trainer::{AlgoOptions, TrainerActor, TrainerMsg, TrainerOptions};
use ractor::{Actor, ActorRef};
use serde::{Deserialize, Serialize};
use tracing::info;

/// The value of an environment's `url` that means "Manta's built-in server".
pub const BUILTIN_URL: &str = "builtin";
/// Where environments live when train_config.yaml names no `url`.
pub const DEFAULT_SESSION_URL: &str = "https://sessions.openreward.ai";

/// A rollout actor's arguments as they travel in `SpawnActorRequest.config_json`.
/// Everything but the model comes from the driver, so a worker needs no copy of the
/// run's files and nothing in its environment.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpawnConfig {
    /// Hugging Face model directory, as the worker sees it.
    pub model_dir: PathBuf,
    pub seed: u64,
    /// train_config.yaml (environments, prompt, thinking), shipped as text.
    pub train_config: ShippedTrainConfig,
    pub max_concurrent_episodes: usize,
    pub max_batch_size: usize,
    /// OpenReward access (API key, session URL, trajectory upload), from the driver.
    #[serde(default)]
    pub openreward: OpenRewardAccess,
    /// `[rollout] engine = "sglang"`: the worker's rollout actors launch engine servers
    /// (the native engine when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sglang: Option<SglangSpawn>,
}

/// cluster.toml's SGLang keys as shipped to workers, plus each engine's GPUs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SglangSpawn {
    pub command: Option<Vec<String>>,
    pub mem_fraction_static: Option<f64>,
    pub extra_args: Vec<String>,
    pub health_timeout_s: u64,
    pub health_interval_ms: u64,
    pub max_restarts: u32,
    /// GPUs of each rollout actor by name (`rollout-<node>-<k>`), from placement.
    pub gpus: BTreeMap<String, Vec<u32>>,
    /// Engine logs go to `runs/<run_name>/engines/<actor>.log` under the worker's folder.
    pub run_name: String,
}

impl SglangSpawn {
    /// The `[rollout]` section the engine is built from on the worker.
    fn section(&self, max_batch_size: usize) -> manta_config::RolloutSection {
        manta_config::RolloutSection {
            engine: manta_config::EngineKind::Sglang,
            max_batch_size,
            command: self.command.clone(),
            mem_fraction_static: self.mem_fraction_static,
            extra_args: self.extra_args.clone(),
            health_timeout_s: self.health_timeout_s,
            health_interval_ms: self.health_interval_ms,
            max_restarts: self.max_restarts,
            ..Default::default()
        }
    }
}

/// train_config.yaml's text; `path` only names it in messages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShippedTrainConfig {
    pub path: PathBuf,
    pub yaml: String,
}

impl ShippedTrainConfig {
    /// Reads the driver's file.
    pub fn read(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            path: path.to_path_buf(),
            yaml: std::fs::read_to_string(path)?,
        })
    }

    /// Parses the text as the driver did, naming the driver's path in errors.
    pub fn parse(&self) -> Result<TrainConfig, manta_config::ConfigError> {
        TrainConfig::from_yaml_str(&self.yaml, &self.path)
    }
}

/// What rollouts need to reach OpenReward: resolved once where the run starts (the
/// driver's environment) and handed to every rollout actor, wherever it runs.
#[derive(Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OpenRewardAccess {
    /// `OPENREWARD_API_KEY`: sent to environment servers and the upload API.
    pub api_key: Option<String>,
    /// `OPENREWARD_SESSION_URL`: environments without a `url` run there.
    pub session_url: Option<String>,
    /// Trajectory upload, when on (see [`UploadConfig::from_env`]).
    pub upload: Option<UploadTarget>,
}

/// Where trajectories go; the key is [`OpenRewardAccess::api_key`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UploadTarget {
    pub api_url: String,
    pub run_name: String,
}

/// Never prints the key.
impl std::fmt::Debug for OpenRewardAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenRewardAccess")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("session_url", &self.session_url)
            .field("upload", &self.upload)
            .finish()
    }
}

impl OpenRewardAccess {
    /// From this process's environment and train_config's `openreward_run_name`.
    pub fn from_env(train: &TrainConfig) -> Self {
        let upload = UploadConfig::from_env(train.openreward_run_name.as_deref());
        Self {
            api_key: upload
                .as_ref()
                .map(|u| u.api_key.clone())
                .or_else(|| std::env::var("OPENREWARD_API_KEY").ok()),
            session_url: std::env::var("OPENREWARD_SESSION_URL").ok(),
            upload: upload.map(|u| UploadTarget {
                api_url: u.api_url,
                run_name: u.run_name,
            }),
        }
    }

    /// Starts the trajectory uploader when upload is on (needs a tokio runtime).
    pub fn start_uploader(&self) -> anyhow::Result<Option<Uploader>> {
        let (Some(target), Some(key)) = (&self.upload, &self.api_key) else {
            return Ok(None);
        };
        let config = UploadConfig::new(&target.api_url, key, &target.run_name);
        info!(run = %target.run_name, api = %target.api_url, "uploading trajectories to OpenReward");
        let uploader = Uploader::start(config).context("starting the trajectory uploader")?;
        Ok(Some(uploader))
    }
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
    access: &OpenRewardAccess,
) -> anyhow::Result<BTreeMap<String, OrsClient>> {
    let mut out = BTreeMap::new();
    for (name, env) in &train.environments {
        let builtin = env.url.as_deref() == Some(BUILTIN_URL);
        let base_url = match env.url.as_deref() {
            Some(BUILTIN_URL) => builtin_url
                .context("the built-in environment server is not running")?
                .to_string(),
            Some(url) => url.to_string(),
            None => access
                .session_url
                .clone()
                .unwrap_or_else(|| DEFAULT_SESSION_URL.to_string()),
        };
        let options = OrsClientOptions {
            base_url,
            api_key: access.api_key.clone(),
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

/// Starts a rollout actor with a native CPU engine, its own ORS clients and, when
/// upload is on, its own trajectory uploader (returned for flushing at stop).
pub async fn spawn_rollout(
    name: &str,
    cfg: &RolloutSpawnConfig,
    train: &TrainConfig,
    builtin_url: Option<&str>,
) -> anyhow::Result<(ActorRef<RolloutMsg>, Option<Uploader>)> {
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&cfg.model_dir)
            .with_context(|| format!("loading the tokenizer from {}", cfg.model_dir.display()))?,
    );
    let engine: Arc<dyn Engine> = match &cfg.sglang {
        None => NativeEngine::start(NativeEngineOptions {
            seed: cfg.seed,
            max_running_requests: cfg.max_batch_size.max(1),
            ..NativeEngineOptions::new(&cfg.model_dir, tch::Device::Cpu)
        })
        .with_context(|| format!("starting the native engine on {}", cfg.model_dir.display()))?,
        Some(sglang) => {
            let gpus = sglang.gpus.get(name).cloned().unwrap_or_default();
            let log = Path::new("runs")
                .join(&sglang.run_name)
                .join("engines")
                .join(format!("{name}.log"));
            let opts = SglangOptions::from_cluster(
                &sglang.section(cfg.max_batch_size.max(1)),
                name,
                &cfg.model_dir,
                &gpus,
                cfg.seed,
                log,
            );
            SglangEngine::launch(opts)
                .await
                .with_context(|| format!("{name}: starting its SGLang engine"))?
        }
    };
    let upload = cfg.openreward.start_uploader()?;
    let environments = environment_clients(train, builtin_url, &cfg.openreward)?
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
        upload: upload.clone(),
    };
    let args = RolloutArgs {
        context,
        environments,
        max_concurrent_episodes: cfg.max_concurrent_episodes.max(1),
    };
    let (actor, _) = Actor::spawn(Some(name.to_string()), RolloutActor, args)
        .await
        .with_context(|| format!("starting rollout actor {name}"))?;
    Ok((actor, upload))
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
            // Remote trainers do not receive slime's loss flags yet: plain GRPO.
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

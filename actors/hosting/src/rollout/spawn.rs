//! A rollout actor's spawn config (the JSON the driver sends in `SpawnActor`) and
//! building the actor from it: engine, ORS clients, trajectory uploader.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use manta_config::TrainConfig;
use manta_engine::{Engine, NativeEngine, NativeEngineOptions, SglangEngine, SglangOptions};
use manta_rollout::actor::RolloutArgs;
use manta_rollout::chat::ChatFormat;
use manta_rollout::ors::{OrsClient, OrsClientOptions};
use manta_rollout::{
    EnvironmentHandle, EpisodeContext, RolloutActor, RolloutMsg, UploadConfig, Uploader,
};
use manta_tokenizer::Tokenizer;
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
    /// The GPUs of each rollout actor by name (`rollout-<node>-<k>`), from placement.
    /// An actor with none runs its native engine on the CPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub engine_gpus: BTreeMap<String, Vec<u32>>,
    /// `rollout.mem_fraction_static` for native engines (the engine's default if unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_fraction_static: Option<f64>,
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
    /// Engine logs go to `runs/<run_name>/engines/<actor>.log` under the worker's folder.
    pub run_name: String,
}

impl SglangSpawn {
    /// The server settings the engine is launched with on the worker.
    fn server(&self, max_running_requests: usize) -> manta_engine::SglangServer {
        manta_engine::SglangServer {
            command: self.command.clone(),
            max_running_requests,
            mem_fraction_static: self.mem_fraction_static,
            extra_args: self.extra_args.clone(),
            health_timeout_s: self.health_timeout_s,
            health_interval_ms: self.health_interval_ms,
            max_restarts: self.max_restarts,
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
            request_timeout: manta_knobs::env_request_timeout(),
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

/// Starts a rollout actor with its engine — native, on the GPU placement gave it (the
/// CPU without one), or an SGLang server on those GPUs — its own ORS clients and, when
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
    let gpus = cfg.engine_gpus.get(name).cloned().unwrap_or_default();
    let engine: Arc<dyn Engine> = match &cfg.sglang {
        None => {
            let device = match gpus.as_slice() {
                [] => tch::Device::Cpu,
                [gpu] => tch::Device::Cuda(*gpu as usize),
                more => anyhow::bail!(
                    "{name}: a native engine runs on one GPU, placement gave it {more:?} \
                     (rollout.gpus_per_engine)"
                ),
            };
            let defaults = NativeEngineOptions::new(&cfg.model_dir, device);
            NativeEngine::start(NativeEngineOptions {
                seed: cfg.seed,
                max_running_requests: cfg.max_batch_size.max(1),
                mem_fraction_static: cfg
                    .mem_fraction_static
                    .unwrap_or(defaults.mem_fraction_static),
                ..defaults
            })
            .with_context(|| {
                format!(
                    "{name}: starting the native engine on {device:?} from {}",
                    cfg.model_dir.display()
                )
            })?
        }
        Some(sglang) => {
            let log = Path::new("runs")
                .join(&sglang.run_name)
                .join("engines")
                .join(format!("{name}.log"));
            let opts = SglangOptions::new(
                &sglang.server(cfg.max_batch_size.max(1)),
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
    let clients = environment_clients(train, builtin_url, &cfg.openreward)?;
    let actor = start_rollout_actor(
        name,
        engine,
        &tokenizer,
        train,
        clients,
        upload.clone(),
        cfg.max_concurrent_episodes,
    )
    .await?;
    Ok((actor, upload))
}

/// Starts rollout actor `name` generating on `engine`, with one environment per ORS
/// client in `clients`, the model's chat format and stop tokens, and `upload`. Every
/// rollout actor is built here, in the driver (local mode) or on a worker.
pub async fn start_rollout_actor(
    name: &str,
    engine: Arc<dyn Engine>,
    tokenizer: &Arc<Tokenizer>,
    train: &TrainConfig,
    clients: BTreeMap<String, OrsClient>,
    upload: Option<Uploader>,
    max_concurrent_episodes: usize,
) -> anyhow::Result<ActorRef<RolloutMsg>> {
    let environments = clients
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
        stop_token_ids: stop_token_ids(tokenizer),
        upload,
    };
    let args = RolloutArgs {
        context,
        environments,
        max_concurrent_episodes: max_concurrent_episodes.max(1),
    };
    let (actor, _) = Actor::spawn(Some(name.to_string()), RolloutActor, args)
        .await
        .with_context(|| format!("starting rollout actor {name}"))?;
    Ok(actor)
}

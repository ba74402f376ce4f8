//! The native engine: Manta's own model code (shared with the trainer) behind a
//! continuous-batching loop on a dedicated thread, with a paged KV cache and prefix reuse.
//!
//! - [`scheduler`]: who runs in the next step (decode, chunked prefill, admission, preemption).
//! - [`block_pool`] / [`prefix_cache`]: KV blocks and the radix cache of computed prefixes.
//! - [`sampler`]: temperature, top-k, top-p, min-p and per-request seeds on the device.
//! - [`stop`]: stop ids, stop strings, length limits.
//! - [`event_loop`]: the engine thread (receive, schedule, launch, process).
//! - [`model_runner`]: the device side of a step (inputs, decode graphs, sampling, weights).
//! - [`decode_graphs`]: CUDA graphs of decode steps.

mod block_pool;
mod decode_graphs;
mod event_loop;
mod model_runner;
mod prefix_cache;
mod routed_experts;
mod sampler;
mod scheduler;
mod sequence;
mod stats;
mod stop;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use async_trait::async_trait;
use manta_model::{CausalLm, ModelConfig, PagedKvCache};
use manta_tokenizer::Tokenizer;
use tch::{nn, Device, Kind};
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::{
    BroadcastFeed, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, NamedTensors,
    PauseMode, WeightShape,
};
use event_loop::{Command, EngineLoop, WeightSource, WeightUpdate};
use model_runner::ModelRunner;
use scheduler::Scheduler;
use sequence::Sequence;
pub use stats::EngineStats;
use stop::StopCheck;

/// How to start a native engine. `NativeEngineOptions::new` gives the defaults.
#[derive(Debug, Clone)]
pub struct NativeEngineOptions {
    pub model_dir: PathBuf,
    /// Seeds random init (when the directory has no weights) and requests without a seed.
    pub seed: u64,
    pub device: Device,
    /// Weights and KV dtype; default bf16 on CUDA, fp32 on the CPU.
    pub kind: Option<Kind>,
    /// Most requests decoding together (SGLang's `--max-running-requests`).
    pub max_running_requests: usize,
    /// KV cache size in tokens (SGLang's `--max-total-tokens`); default: see `mem_fraction_static`.
    pub max_total_tokens: Option<usize>,
    /// On CUDA, the share of the GPU's memory for weights + KV cache when
    /// `max_total_tokens` is not set (SGLang's `--mem-fraction-static`).
    pub mem_fraction_static: f64,
    /// Tokens per KV block (prefix reuse works in whole blocks).
    pub block_size: usize,
    /// Most tokens one step computes: long prompts are prefilled in chunks of this size.
    pub chunked_prefill_size: usize,
    /// Longest sequence (prompt + output); default the model's `max_position_embeddings`.
    pub context_length: Option<usize>,
    /// True on-policy mode (Miles' `--true-on-policy-mode`): the trainer's layer ops with
    /// attention through the batch-invariant kernel, so log-probs equal a trainer in the
    /// same mode. CUDA bf16 only; decoding is slower (no fused decode kernels).
    pub true_on_policy: bool,
    /// Turn off overlapped decode steps (SGLang's `--disable-overlap-schedule`). By default
    /// a CUDA decode step is launched before the host has read the step before it, so the
    /// host's turn (reading tokens, stop checks, the next step's inputs) overlaps the GPU's.
    pub disable_overlap_schedule: bool,
    /// SGLang's `--enable-return-routed-experts`: record the experts every token was
    /// routed to, so requests can ask for them (`return_routed_experts`; rollout routing
    /// replay). Mixture-of-experts models only; steps then run without decode graphs.
    pub enable_return_routed_experts: bool,
}

impl NativeEngineOptions {
    pub fn new(model_dir: impl Into<PathBuf>, device: Device) -> Self {
        Self {
            model_dir: model_dir.into(),
            seed: 0,
            device,
            kind: None,
            max_running_requests: 256,
            max_total_tokens: None,
            mem_fraction_static: 0.85,
            block_size: 16,
            chunked_prefill_size: if device.is_cuda() { 8192 } else { 2048 },
            context_length: None,
            true_on_policy: false,
            disable_overlap_schedule: false,
            enable_return_routed_experts: false,
        }
    }
}

/// Handle to the engine thread; cheap to share.
pub struct NativeEngine {
    commands: mpsc::Sender<Command>,
    /// Joined on drop, so the engine's CUDA memory (pinned host buffers included) is freed
    /// before the process can exit: freeing it during CUDA's own shutdown aborts.
    thread: Option<std::thread::JoinHandle<()>>,
    version: Arc<AtomicU64>,
    stats: Arc<EngineStats>,
    info: EngineInfo,
    eos_ids: Vec<u32>,
    has_tokenizer: bool,
    seed: u64,
    requests: AtomicU64,
    /// Started with `enable_return_routed_experts`.
    records_routing: bool,
}

/// KV budget when none is given: on the CPU up to 2 GiB (or what the running requests
/// could use at full context); on CUDA a share of the device's memory after the weights.
fn default_kv_tokens(
    opts: &NativeEngineOptions,
    cfg: &ModelConfig,
    kind: Kind,
    ctx: usize,
) -> usize {
    let per_token = PagedKvCache::bytes_per_block(cfg, 1, kind).max(1);
    let want = opts.max_running_requests.saturating_mul(ctx);
    let cap_bytes: usize = match opts.device {
        // As SGLang: the memory fraction holds weights and KV cache; the rest is left for
        // activations, CUDA graphs and other processes.
        Device::Cuda(i) => match manta_cuda::total_memory(i) {
            Ok(total) => {
                let weights = weight_count(cfg) * kind.elt_size_in_bytes();
                (total as f64 * opts.mem_fraction_static - weights as f64).max(0.0) as usize
            }
            Err(_) => 16 << 30,
        },
        _ => 2 << 30,
    };
    want.min(cap_bytes / per_token).max(opts.block_size * 4)
}

/// Parameters of a decoder with this config (to budget memory before loading it).
fn weight_count(cfg: &ModelConfig) -> usize {
    let (h, i, l) = (
        cfg.hidden_size as usize,
        cfg.intermediate_size as usize,
        cfg.num_hidden_layers as usize,
    );
    let hd = cfg.head_dim() as usize;
    let (nh, nkv) = (
        cfg.num_attention_heads as usize,
        cfg.num_key_value_heads as usize,
    );
    let layer = 2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * i;
    let emb = cfg.vocab_size as usize * h;
    l * layer + emb * if cfg.tie_word_embeddings { 1 } else { 2 }
}

impl NativeEngine {
    /// Loads the model on a new thread and starts serving.
    pub fn start(opts: NativeEngineOptions) -> Result<Arc<Self>, EngineError> {
        let cfg = ModelConfig::from_file(&opts.model_dir.join("config.json"))?;
        if opts.enable_return_routed_experts && cfg.moe().is_none() {
            return Err(EngineError::Unsupported(format!(
                "--enable-return-routed-experts: {} is a dense model ({}), it routes no experts",
                opts.model_dir.display(),
                cfg.model_type
            )));
        }
        let kind = opts.kind.unwrap_or(if opts.device.is_cuda() {
            Kind::BFloat16
        } else {
            Kind::Float
        });
        let context_length = opts
            .context_length
            .unwrap_or(cfg.max_position_embeddings.max(1) as usize);
        let tokenizer = Tokenizer::from_dir(&opts.model_dir).ok().map(Arc::new);
        let eos_ids: Vec<u32> = cfg
            .eos_token_ids()
            .iter()
            .filter_map(|&e| u32::try_from(e).ok())
            .collect();
        let kv_tokens = opts
            .max_total_tokens
            .unwrap_or_else(|| default_kv_tokens(&opts, &cfg, kind, context_length));
        let num_blocks = kv_tokens.div_ceil(opts.block_size).max(1);
        let info = EngineInfo {
            model_path: opts.model_dir.clone(),
            device: format!("{:?}", opts.device),
            dtype: format!("{kind:?}"),
            context_length,
            max_running_requests: opts.max_running_requests,
            max_total_tokens: num_blocks * opts.block_size,
            block_size: opts.block_size,
            vocab_size: cfg.vocab_size as usize,
        };
        let (tx, rx) = mpsc::channel::<Command>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), EngineError>>();
        let version = Arc::new(AtomicU64::new(0));
        let stats = Arc::new(EngineStats::default());
        let (thread_version, thread_stats) = (version.clone(), stats.clone());
        let thread_tokenizer = tokenizer.clone();
        let thread_opts = opts.clone();
        let thread = std::thread::Builder::new()
            .name("manta-native-engine".into())
            .spawn(move || {
                let built = (|| -> Result<EngineLoop, EngineError> {
                    // Everything this thread launches (kernels, cuBLASLt, graphs, events)
                    // goes to the engine's GPU, not to whichever device is current by
                    // default (GPU 0, where a trainer may sit).
                    if let Device::Cuda(gpu) = thread_opts.device {
                        manta_cuda::set_device(gpu).map_err(|e| {
                            EngineError::Stopped(format!("making cuda:{gpu} current: {e}"))
                        })?;
                    }
                    tch::manual_seed(thread_opts.seed as i64);
                    let mut vs = nn::VarStore::new(thread_opts.device);
                    let mut model = CausalLm::new(&vs.root(), &cfg);
                    let dir = &thread_opts.model_dir;
                    if dir.join("model.safetensors").exists()
                        || dir.join("model.safetensors.index.json").exists()
                    {
                        manta_model::load_weights(&mut vs, dir)?;
                    }
                    vs.set_kind(kind);
                    vs.freeze();
                    if thread_opts.true_on_policy {
                        enable_true_on_policy(&mut model)?;
                    } else {
                        enable_decode_kernels(&mut model, thread_opts.device, kind);
                    }
                    // One extra block: the scratch block padding rows of CUDA graphs use.
                    let kv = PagedKvCache::new(
                        &cfg,
                        num_blocks + 1,
                        thread_opts.block_size,
                        kind,
                        thread_opts.device,
                    );
                    let sched = Scheduler::new(
                        num_blocks,
                        thread_opts.block_size,
                        thread_opts.max_running_requests,
                        thread_opts.chunked_prefill_size,
                    );
                    // A sequence alone must always fit the pool, so preemption can
                    // always make progress.
                    let context_length = context_length.min(sched.capacity_tokens());
                    let runner = ModelRunner::new(
                        vs,
                        model,
                        kv,
                        thread_opts.device,
                        thread_opts.block_size,
                        sched.max_running(),
                        context_length,
                    );
                    let mut runner = runner;
                    if thread_opts.enable_return_routed_experts {
                        runner.record_routed_experts();
                    }
                    Ok(EngineLoop::new(
                        runner,
                        sched,
                        thread_tokenizer,
                        context_length,
                        thread_version,
                        thread_stats,
                    )
                    .overlap_schedule(!thread_opts.disable_overlap_schedule))
                })();
                match built {
                    Ok(engine_loop) => {
                        let _ = ready_tx.send(Ok(()));
                        engine_loop.serve(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| EngineError::Stopped(format!("cannot start engine thread: {e}")))?;
        ready_rx
            .recv()
            .map_err(|_| EngineError::Stopped("engine thread exited during start".into()))??;
        info!(
            model = %opts.model_dir.display(),
            device = ?opts.device,
            kv_tokens = num_blocks * opts.block_size,
            "native engine ready"
        );
        Ok(Arc::new(Self {
            commands: tx,
            thread: Some(thread),
            version,
            stats,
            info,
            eos_ids,
            has_tokenizer: tokenizer.is_some(),
            seed: opts.seed,
            requests: AtomicU64::new(0),
            records_routing: opts.enable_return_routed_experts,
        }))
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Every parameter's name, shape and dtype, sorted by name: what a weight update must
    /// match, known without copying any weights.
    pub async fn weight_shapes(&self) -> Result<Vec<(String, Vec<i64>, Kind)>, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::WeightShapes { reply: tx })?;
        answer(rx).await
    }

    /// Like [`Engine::update_weights`] for some of the parameters (SGLang updates weights
    /// in buckets): the others keep their values; the version becomes `version`.
    pub async fn update_some_weights(
        &self,
        weights: NamedTensors,
        version: u64,
    ) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::UpdateWeights(WeightUpdate {
            source: WeightSource::Some(weights),
            version,
            reply: tx,
        }))?;
        answer(rx).await?
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.commands
            .send(cmd)
            .map_err(|_| EngineError::Stopped("engine thread has exited".into()))
    }

    /// Checks a request against this engine; messages name the field.
    fn validate(&self, request: &GenerateRequest) -> Result<(), EngineError> {
        if request.input_ids.is_empty() {
            return Err(EngineError::BadRequest("input_ids: empty".into()));
        }
        let vocab = self.info.vocab_size;
        if let Some(bad) = request.input_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadRequest(format!(
                "input_ids: token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        request.params.validate()?;
        if request.return_routed_experts && !self.records_routing {
            return Err(EngineError::BadRequest(
                "return_routed_experts: the engine was not started with \
                 --enable-return-routed-experts (a mixture-of-experts model)"
                    .into(),
            ));
        }
        if !request.params.stop.is_empty() && !self.has_tokenizer {
            return Err(EngineError::BadRequest(
                "sampling_params.stop: stop strings need a tokenizer, and the model directory has none"
                    .into(),
            ));
        }
        Ok(())
    }
}

async fn answer<T>(rx: oneshot::Receiver<T>) -> Result<T, EngineError> {
    rx.await
        .map_err(|_| EngineError::Stopped("engine thread dropped the request".into()))
}

impl Drop for NativeEngine {
    /// Aborts what is still running, closes the command channel and waits for the engine
    /// thread to free the model, the KV cache and its CUDA graphs.
    fn drop(&mut self) {
        let (reply, _) = oneshot::channel();
        let _ = self.commands.send(Command::Abort { rid: None, reply });
        drop(std::mem::replace(&mut self.commands, mpsc::channel().0));
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                warn!("the native engine thread panicked");
            }
        }
    }
}

#[async_trait]
impl Engine for NativeEngine {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.validate(&request)?;
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let seed = request
            .params
            .seed
            .unwrap_or_else(|| self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n);
        let (tx, rx) = oneshot::channel();
        let prompt_len = request.input_ids.len();
        let stop = StopCheck::new(&request.params, &self.eos_ids);
        let mut seq = Sequence::new(
            request.rid.clone().unwrap_or_else(|| format!("native-{n}")),
            request.input_ids,
            request.params,
            stop,
            seed,
            self.version.load(Ordering::SeqCst),
            Some(tx),
        );
        seq.return_routed_experts = request.return_routed_experts;
        if seq.params.max_new_tokens == 0 {
            return Ok(GenerateOutput {
                prompt_tokens: prompt_len,
                weight_version: seq.weight_version,
                ..GenerateOutput::default()
            });
        }
        self.send(Command::Generate(Box::new(seq)))?;
        answer(rx).await?
    }

    async fn update_weights_broadcast(
        &self,
        feed: BroadcastFeed,
        version: u64,
    ) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::UpdateWeights(WeightUpdate {
            source: WeightSource::Broadcast(feed),
            version,
            reply: tx,
        }))?;
        answer(rx).await?
    }

    async fn weight_shapes(&self) -> Result<Vec<WeightShape>, EngineError> {
        NativeEngine::weight_shapes(self).await
    }

    async fn update_weights_in_parts(
        &self,
        parts: crate::WeightParts,
        version: u64,
    ) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::UpdateWeights(WeightUpdate {
            source: WeightSource::Parts(parts),
            version,
            reply: tx,
        }))?;
        answer(rx).await?
    }

    async fn update_weights(&self, weights: NamedTensors, version: u64) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::UpdateWeights(WeightUpdate {
            source: WeightSource::All(weights),
            version,
            reply: tx,
        }))?;
        answer(rx).await?
    }

    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    async fn update_weights_from_disk(
        &self,
        dir: PathBuf,
        version: u64,
    ) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::UpdateWeights(WeightUpdate {
            source: WeightSource::Disk(dir),
            version,
            reply: tx,
        }))?;
        answer(rx).await?
    }

    async fn abort(&self, rid: Option<String>) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Abort { rid, reply: tx })?;
        answer(rx).await
    }

    async fn pause(&self, mode: PauseMode) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Pause { mode, reply: tx })?;
        answer(rx).await
    }

    async fn resume(&self) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Resume { reply: tx })?;
        answer(rx).await
    }

    async fn flush_cache(&self) -> Result<bool, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Flush { reply: tx })?;
        answer(rx).await
    }

    async fn release_memory_occupation(&self) -> Result<bool, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::ReleaseMemory { reply: tx })?;
        answer(rx).await
    }

    async fn resume_memory_occupation(&self) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::ResumeMemory { reply: tx })?;
        answer(rx).await
    }

    async fn read_weights(&self) -> Result<NamedTensors, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::ReadWeights { reply: tx })?;
        answer(rx).await
    }
}

/// True on-policy mode: the trainer's own layer code (separate projections on cuBLAS,
/// libtorch's norms and rotary) with attention through the batch-invariant kernel, so
/// every op rounds as in the trainer's forward. Instead of the decode kernels, whose fused
/// norms and projections round differently.
fn enable_true_on_policy(model: &mut CausalLm) -> Result<(), EngineError> {
    model
        .set_invariant_attention(true)
        .map_err(|e| EngineError::Unsupported(format!("true on-policy mode: {e}")))?;
    tracing::info!("true on-policy mode: the trainer's layer ops, batch-invariant attention");
    Ok(())
}

/// The CUDA decode kernels for bf16 models on a GPU, unless `MANTA_DECODE_KERNELS=0`; the
/// composite tensor ops otherwise, or when the kernels cannot be built here (logged).
fn enable_decode_kernels(model: &mut CausalLm, device: tch::Device, kind: tch::Kind) {
    if !device.is_cuda() || kind != tch::Kind::BFloat16 {
        return;
    }
    if !manta_knobs::decode_kernels() {
        tracing::info!("decode kernels off (MANTA_DECODE_KERNELS=0)");
        return;
    }
    match model.enable_decode_kernels() {
        Ok(()) => tracing::info!("decode kernels on (paged attention, fused norms and rotary)"),
        Err(e) => tracing::warn!(error = %e, "decode kernels unavailable; using tensor ops"),
    }
}

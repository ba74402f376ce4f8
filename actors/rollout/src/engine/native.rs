//! The native engine: Manta's own model code (shared with the trainer) behind a
//! batching loop on a dedicated thread. Concurrent requests that arrive while a batch
//! runs are decoded together in the next batch (left-padded, with a KV cache).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use async_trait::async_trait;
use manta_model::{Attention, CausalLm, KvCache, ModelConfig};
use tch::{nn, Device, Kind, Tensor};
use tokio::sync::oneshot;
use tracing::debug;

use super::{Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest, NamedTensors};

#[derive(Debug, Clone)]
pub struct NativeEngineOptions {
    pub model_dir: PathBuf,
    /// Seeds random init (when the directory has no weights) and sampling.
    pub seed: u64,
    pub device: Device,
    /// Most requests decoded together.
    pub max_batch_size: usize,
}

enum Command {
    Generate(
        GenerateRequest,
        oneshot::Sender<Result<GenerateOutput, EngineError>>,
    ),
    UpdateWeights(NamedTensors, u64, oneshot::Sender<Result<(), EngineError>>),
}

/// Handle to the engine thread; cheap to share.
pub struct NativeEngine {
    commands: mpsc::Sender<Command>,
    version: Arc<AtomicU64>,
    vocab_size: usize,
}

impl NativeEngine {
    /// Loads the model on a new thread and starts serving.
    pub fn start(opts: NativeEngineOptions) -> Result<Arc<Self>, EngineError> {
        let cfg = ModelConfig::from_file(&opts.model_dir.join("config.json"))?;
        let vocab_size = cfg.vocab_size as usize;
        let (tx, rx) = mpsc::channel::<Command>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), EngineError>>();
        let version = Arc::new(AtomicU64::new(0));
        let thread_version = version.clone();
        std::thread::Builder::new()
            .name("manta-native-engine".into())
            .spawn(move || match Worker::new(&opts, &cfg) {
                Ok(worker) => {
                    let _ = ready_tx.send(Ok(()));
                    worker.serve(rx, thread_version, opts.max_batch_size.max(1));
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| EngineError::Stopped(format!("cannot start engine thread: {e}")))?;
        ready_rx
            .recv()
            .map_err(|_| EngineError::Stopped("engine thread exited during start".into()))??;
        Ok(Arc::new(Self {
            commands: tx,
            version,
            vocab_size,
        }))
    }
}

#[async_trait]
impl Engine for NativeEngine {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        if request.input_ids.is_empty() {
            return Err(EngineError::BadRequest("input_ids is empty".into()));
        }
        if let Some(bad) = request
            .input_ids
            .iter()
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(EngineError::BadRequest(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.vocab_size
            )));
        }
        if !(request.params.temperature >= 0.0 && request.params.temperature.is_finite()) {
            return Err(EngineError::BadRequest(format!(
                "temperature {} must be a finite number >= 0",
                request.params.temperature
            )));
        }
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::Generate(request, tx))
            .map_err(|_| EngineError::Stopped("engine thread has exited".into()))?;
        rx.await
            .map_err(|_| EngineError::Stopped("engine thread dropped the request".into()))?
    }

    async fn update_weights(&self, weights: NamedTensors, version: u64) -> Result<(), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::UpdateWeights(weights, version, tx))
            .map_err(|_| EngineError::Stopped("engine thread has exited".into()))?;
        rx.await
            .map_err(|_| EngineError::Stopped("engine thread dropped the update".into()))?
    }

    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }
}

/// Owns the model on the engine thread.
struct Worker {
    vs: nn::VarStore,
    model: CausalLm,
    device: Device,
}

impl Worker {
    fn new(opts: &NativeEngineOptions, cfg: &ModelConfig) -> Result<Self, EngineError> {
        tch::manual_seed(opts.seed as i64);
        let mut vs = nn::VarStore::new(opts.device);
        let model = CausalLm::new(&vs.root(), cfg);
        let dir = &opts.model_dir;
        if dir.join("model.safetensors").exists()
            || dir.join("model.safetensors.index.json").exists()
        {
            manta_model::load_weights(&mut vs, dir)?;
        }
        vs.freeze();
        // Sampling draws from its own stream so it does not depend on init order.
        tch::manual_seed(opts.seed as i64 ^ 0x5eed);
        Ok(Self {
            vs,
            model,
            device: opts.device,
        })
    }

    fn serve(mut self, rx: mpsc::Receiver<Command>, version: Arc<AtomicU64>, max_batch: usize) {
        let _guard = tch::no_grad_guard();
        while let Ok(first) = rx.recv() {
            let mut batch = Vec::new();
            let mut pending = Some(first);
            // Take what is queued now: generate requests batch together; a weight update
            // is a barrier (requests before it run on the old weights).
            while let Some(cmd) = pending.take() {
                match cmd {
                    Command::Generate(req, reply) => {
                        batch.push((req, reply));
                        if batch.len() < max_batch {
                            pending = rx.try_recv().ok();
                        }
                    }
                    Command::UpdateWeights(weights, v, reply) => {
                        self.run_batch(std::mem::take(&mut batch), version.load(Ordering::SeqCst));
                        let result = self.load(weights);
                        if result.is_ok() {
                            version.store(v, Ordering::SeqCst);
                            debug!(version = v, "native engine weights updated");
                        }
                        let _ = reply.send(result);
                        pending = rx.try_recv().ok();
                    }
                }
            }
            self.run_batch(batch, version.load(Ordering::SeqCst));
        }
        debug!("native engine thread exiting");
    }

    fn load(&mut self, weights: NamedTensors) -> Result<(), EngineError> {
        let mut vars = self.vs.variables();
        if weights.len() != vars.len() {
            return Err(EngineError::Weights(format!(
                "got {} tensors, the engine's model has {}",
                weights.len(),
                vars.len()
            )));
        }
        for (name, src) in &weights {
            let dst = vars
                .get(name)
                .ok_or_else(|| EngineError::Weights(format!("unknown tensor {name}")))?;
            if dst.size() != src.size() {
                return Err(EngineError::Weights(format!(
                    "tensor {name} has shape {:?}, the engine expects {:?}",
                    src.size(),
                    dst.size()
                )));
            }
        }
        for (name, src) in weights {
            if let Some(dst) = vars.get_mut(&name) {
                dst.copy_(&src.to_device(self.device).to_kind(dst.kind()));
            }
        }
        Ok(())
    }

    fn run_batch(
        &self,
        batch: Vec<(
            GenerateRequest,
            oneshot::Sender<Result<GenerateOutput, EngineError>>,
        )>,
        version: u64,
    ) {
        if batch.is_empty() {
            return;
        }
        let (requests, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        match self.generate_batch(&requests, version) {
            Ok(outputs) => {
                for (reply, out) in replies.into_iter().zip(outputs) {
                    let _ = reply.send(Ok(out));
                }
            }
            Err(e) => {
                let message = e.to_string();
                for reply in replies {
                    let _ = reply.send(Err(EngineError::Stopped(format!(
                        "batch failed: {message}"
                    ))));
                }
            }
        }
    }

    /// Left-pads the prompts, prefills them together, then decodes one token per row per
    /// step until every row has stopped or reached its own `max_new_tokens`.
    fn generate_batch(
        &self,
        requests: &[GenerateRequest],
        version: u64,
    ) -> Result<Vec<GenerateOutput>, EngineError> {
        let rows = requests.len() as i64;
        let width = requests
            .iter()
            .map(|r| r.input_ids.len())
            .max()
            .unwrap_or(0) as i64;
        let mut ids = vec![0i64; (rows * width) as usize];
        let mut mask = vec![0i64; (rows * width) as usize];
        for (b, r) in requests.iter().enumerate() {
            let pad = width as usize - r.input_ids.len();
            for (j, &t) in r.input_ids.iter().enumerate() {
                ids[b * width as usize + pad + j] = t as i64;
                mask[b * width as usize + pad + j] = 1;
            }
        }
        let input = Tensor::from_slice(&ids).view([rows, width]).to(self.device);
        let mut key_mask = Tensor::from_slice(&mask)
            .view([rows, width])
            .to(self.device);
        // Positions count real tokens only, so a left-padded row sees the same positions as alone.
        let mut positions = (key_mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
        // Greedy rows report log-probs of the unscaled distribution (temperature 1).
        let temps: Vec<f32> = requests
            .iter()
            .map(|r| {
                if r.params.temperature == 0.0 {
                    1.0
                } else {
                    r.params.temperature as f32
                }
            })
            .collect();
        let greedy: Vec<bool> = requests
            .iter()
            .map(|r| r.params.temperature == 0.0)
            .collect();
        let temp_t = Tensor::from_slice(&temps)
            .to(self.device)
            .clamp_min(1e-6)
            .unsqueeze(1);
        let max_new: Vec<usize> = requests.iter().map(|r| r.params.max_new_tokens).collect();
        let steps = max_new.iter().copied().max().unwrap_or(0);
        let mut outputs: Vec<GenerateOutput> = requests
            .iter()
            .map(|_| GenerateOutput {
                output_ids: Vec::new(),
                logprobs: Vec::new(),
                finish: FinishReason::Length,
                weight_version: version,
            })
            .collect();
        let mut done: Vec<bool> = max_new.iter().map(|&m| m == 0).collect();
        let mut cache = KvCache::new(self.model.config().num_hidden_layers as usize);
        let mut step_input = input;
        for _ in 0..steps {
            if done.iter().all(|&d| d) {
                break;
            }
            let logits = self.model.forward(
                &step_input,
                &positions,
                &Attention::Causal {
                    key_mask: Some(&key_mask),
                },
                Some(&mut cache),
            );
            let last = logits.select(1, -1).to_kind(Kind::Float);
            let logp = (last / &temp_t).log_softmax(-1, Kind::Float);
            let sampled = logp.exp().multinomial(1, true).squeeze_dim(1);
            let argmax = logp.argmax(-1, false);
            let greedy_t = Tensor::from_slice(&greedy).to(self.device);
            let next = argmax.where_self(&greedy_t, &sampled);
            let next_logp = logp.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
            let next_v: Vec<i64> = Vec::try_from(&next.to(Device::Cpu))?;
            let logp_v: Vec<f32> = Vec::try_from(&next_logp.to(Device::Cpu))?;
            for (b, out) in outputs.iter_mut().enumerate() {
                if done[b] {
                    continue;
                }
                let tok = next_v[b] as u32;
                out.output_ids.push(tok);
                out.logprobs.push(logp_v[b]);
                if requests[b].params.stop_token_ids.contains(&tok) {
                    out.finish = FinishReason::Stop;
                    done[b] = true;
                } else if out.output_ids.len() >= max_new[b] {
                    done[b] = true;
                }
            }
            step_input = next.unsqueeze(1);
            positions = positions.select(1, -1).unsqueeze(1) + 1;
            key_mask = Tensor::cat(
                &[
                    key_mask,
                    Tensor::ones([rows, 1], (Kind::Int64, self.device)),
                ],
                1,
            );
        }
        Ok(outputs)
    }
}

//! The trainer: model + optimizer + the GRPO step, independent of actor plumbing so
//! it can be driven directly in tests and benchmarks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use manta_core::Sample;
use manta_model::{Attention, CausalLm, ModelConfig, ModelError};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};
use tracing::info;

use crate::batch::micro_batches;
use crate::loss::{clipped_policy_loss, sample_mean_weights, ClipRange};
use crate::optimizer::{AdamW, AdamWConfig};

/// Weights by HF name, as handed to weight sync.
pub type NamedTensors = Vec<(String, Tensor)>;

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("invalid training batch: {0}")]
    Batch(String),
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Everything the trainer needs to start.
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    /// HF model directory (config.json; weights optional).
    pub model_dir: PathBuf,
    /// Seeds random init when the directory has no weights.
    pub seed: u64,
    pub device: Device,
    pub adam: AdamWConfig,
    pub clip: ClipRange,
    pub clip_grad: f64,
    /// Rollout temperature: log-probs are computed under logits / temperature, as the engine samples.
    pub temperature: f64,
    /// Padded tokens per micro-batch.
    pub max_tokens_per_gpu: usize,
    /// Use the engine's log-probs as old_logp (else the current weights', i.e. ratio 1).
    pub use_rollout_logprobs: bool,
    /// Rows per chunk when computing token log-probs.
    pub logprob_chunk: i64,
    /// Recompute each layer in the backward pass instead of keeping its activations
    /// (the cookbook always trains this way).
    pub gradient_checkpointing: bool,
}

/// One step's data for this rank.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    pub samples: Vec<Sample>,
    /// One advantage per sample.
    pub advantages: Vec<f64>,
    /// Samples across all ranks, for the per-sample mean.
    pub global_samples: usize,
}

/// What a checkpoint records besides weights and optimizer moments.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub step: u64,
    pub optimizer_steps: u64,
}

/// Model, optimizer and step counter of one trainer rank.
pub struct Trainer {
    vs: nn::VarStore,
    model: CausalLm,
    optimizer: AdamW,
    opts: TrainerOptions,
}

impl Trainer {
    /// Builds the model from `model_dir/config.json` and loads its weights, or draws
    /// random ones from `seed` when the directory has none.
    pub fn new(opts: TrainerOptions) -> Result<Self, TrainerError> {
        let cfg = ModelConfig::from_file(&opts.model_dir.join("config.json"))?;
        tch::manual_seed(opts.seed as i64);
        let mut vs = nn::VarStore::new(opts.device);
        let mut model = CausalLm::new(&vs.root(), &cfg);
        model.set_gradient_checkpointing(opts.gradient_checkpointing);
        if has_weights(&opts.model_dir) {
            manta_model::load_weights(&mut vs, &opts.model_dir)?;
            info!(dir = %opts.model_dir.display(), "trainer loaded weights");
        } else {
            info!(dir = %opts.model_dir.display(), seed = opts.seed, "no weights in model directory: random init");
        }
        let params: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        let optimizer = AdamW::new(params, opts.adam);
        Ok(Self {
            vs,
            model,
            optimizer,
            opts,
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Handles to the current weights by HF name. They alias the trainer's parameters:
    /// read them before the next step (weight sync runs between steps).
    pub fn export_weights(&self) -> NamedTensors {
        let mut named: NamedTensors = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.detach()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }

    /// One GRPO step: forward each micro-batch, accumulate the clipped policy loss
    /// gradients, clip the global norm, AdamW. Returns `train/*` metrics.
    pub fn train_step(
        &mut self,
        batch: &TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerError> {
        if batch.samples.len() != batch.advantages.len() {
            return Err(TrainerError::Batch(format!(
                "{} samples but {} advantages",
                batch.samples.len(),
                batch.advantages.len()
            )));
        }
        for s in &batch.samples {
            s.validate().map_err(TrainerError::Batch)?;
            if s.prompt_length() == 0 {
                return Err(TrainerError::Batch(format!(
                    "sample {} has no prompt tokens",
                    s.id
                )));
            }
            let vocab = self.model.config().vocab_size as u32;
            if let Some(bad) = s.tokens.iter().find(|&&t| t >= vocab) {
                return Err(TrainerError::Batch(format!(
                    "sample {}: token id {bad} is outside the vocabulary ({vocab})",
                    s.id
                )));
            }
        }
        self.optimizer.zero_grad();
        let mut acc = Accumulator::default();
        let lengths: Vec<usize> = batch.samples.iter().map(|s| s.tokens.len()).collect();
        for range in micro_batches(&lengths, self.opts.max_tokens_per_gpu) {
            self.micro_step(
                &batch.samples[range.clone()],
                &batch.advantages[range],
                batch.global_samples,
                &mut acc,
            )?;
        }
        let grad_norm = self.optimizer.clip_grad_norm(self.opts.clip_grad);
        self.optimizer.step();
        self.optimizer.zero_grad();
        let mut m = BTreeMap::new();
        m.insert("train/loss".into(), acc.loss);
        m.insert("train/pg_loss".into(), acc.loss);
        m.insert("train/pg_clipfrac".into(), acc.clipfrac);
        m.insert("train/ppo_kl".into(), acc.kl);
        m.insert("train/entropy_loss".into(), acc.entropy);
        m.insert("train/grad_norm".into(), grad_norm);
        m.insert("train/lr".into(), self.opts.adam.lr);
        if acc.tokens > 0 {
            m.insert(
                "train/train_rollout_logprob_abs_diff".into(),
                acc.abs_diff_sum / acc.tokens as f64,
            );
        }
        m.insert("train/tokens".into(), acc.tokens as f64);
        Ok(m)
    }

    fn micro_step(
        &mut self,
        samples: &[Sample],
        advantages: &[f64],
        global_samples: usize,
        acc: &mut Accumulator,
    ) -> Result<(), TrainerError> {
        let device = self.opts.device;
        let rows = samples.len() as i64;
        let width = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0) as i64;
        let mut ids = vec![0i64; (rows * width) as usize];
        let mut key_mask = vec![0i64; (rows * width) as usize];
        // Trained tokens: flat index of the hidden state that predicts them, target id,
        // per-token weight, advantage and rollout log-prob.
        let (mut gather, mut targets, mut adv, mut rollout_lp) = (vec![], vec![], vec![], vec![]);
        let mut masks = Vec::with_capacity(samples.len());
        for (b, (s, &a)) in samples.iter().zip(advantages).enumerate() {
            let base = b * width as usize;
            for (j, &t) in s.tokens.iter().enumerate() {
                ids[base + j] = t as i64;
                key_mask[base + j] = 1;
            }
            let prompt = s.prompt_length();
            let mut mask = Vec::new();
            for (k, &m) in s.loss_mask.iter().enumerate() {
                if m == 1 {
                    let pos = prompt + k;
                    gather.push((base + pos - 1) as i64);
                    targets.push(s.tokens[pos] as i64);
                    adv.push(a as f32);
                    rollout_lp.push(s.rollout_log_probs[k]);
                    mask.push(1.0f32);
                }
            }
            masks.push(mask);
        }
        let weights = sample_mean_weights(&masks, global_samples);
        if gather.is_empty() {
            return Ok(());
        }
        let input = Tensor::from_slice(&ids).view([rows, width]).to(device);
        let key_mask = Tensor::from_slice(&key_mask).view([rows, width]).to(device);
        let positions = Tensor::arange(width, (Kind::Int64, device))
            .unsqueeze(0)
            .expand([rows, width], false);
        let gather = Tensor::from_slice(&gather).to(device);
        let targets = Tensor::from_slice(&targets).to(device);
        let rollout_lp = Tensor::from_slice(&rollout_lp).to(device);
        let adv = Tensor::from_slice(&adv).to(device);
        let w = Tensor::from_slice(&weights).to(device);
        let (model, opts) = (&self.model, &self.opts);
        // forward_backward recomputes each layer in backward when gradient checkpointing
        // is on; the loss closure also collects the step's metrics.
        // The loss value is already accumulated inside the closure.
        let _ = self.model.forward_backward(
            &input,
            &positions,
            &Attention::Causal {
                key_mask: Some(&key_mask),
            },
            |hidden| {
                let selected = hidden.view([rows * width, -1]).index_select(0, &gather);
                let (logp, entropy) = manta_model::token_logprobs(
                    model,
                    &selected,
                    &targets,
                    opts.temperature,
                    opts.logprob_chunk,
                );
                let logp = logp.to_kind(Kind::Float);
                let old = if opts.use_rollout_logprobs {
                    rollout_lp.shallow_clone()
                } else {
                    logp.detach()
                };
                let (loss_tok, clipfrac) = clipped_policy_loss(&logp, &old, &adv, opts.clip);
                let loss = (&loss_tok * &w).sum(Kind::Float);
                tch::no_grad(|| {
                    acc.loss += loss.double_value(&[]);
                    acc.clipfrac += (&clipfrac * &w).sum(Kind::Double).double_value(&[]);
                    acc.kl += ((&old - &logp) * &w).sum(Kind::Double).double_value(&[]);
                    acc.entropy += (entropy.to_kind(Kind::Float) * &w)
                        .sum(Kind::Double)
                        .double_value(&[]);
                    acc.abs_diff_sum += (&logp - &rollout_lp)
                        .abs()
                        .sum(Kind::Double)
                        .double_value(&[]);
                });
                loss
            },
        );
        acc.tokens += targets.size()[0] as usize;
        Ok(())
    }

    /// Writes `dir/` with HF weights (config.json, model.safetensors), optimizer moments
    /// and trainer_state.json. Written to `dir.tmp` first and renamed, so an interrupted
    /// save never leaves a half checkpoint under the final name.
    pub fn save_checkpoint(&self, dir: &Path, step: u64) -> Result<(), TrainerError> {
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let tmp = dir.with_extension("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| err(e.to_string()))?;
        manta_model::save_pretrained(&self.vs, self.model.config(), &tmp)?;
        self.optimizer.save(&tmp)?;
        let state = TrainerState {
            step,
            optimizer_steps: self.optimizer.step_count(),
        };
        let json = serde_json::to_string_pretty(&state).map_err(|e| err(e.to_string()))?;
        std::fs::write(tmp.join("trainer_state.json"), json).map_err(|e| err(e.to_string()))?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| err(e.to_string()))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// Restores weights, optimizer and step from a directory written by
    /// [`Trainer::save_checkpoint`]. Returns the step it was saved at.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64, TrainerError> {
        let err = |message: String| TrainerError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
        let state_path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_path)
            .map_err(|e| err(format!("trainer_state.json: {e}")))?;
        let state: TrainerState =
            serde_json::from_str(&text).map_err(|e| err(format!("trainer_state.json: {e}")))?;
        manta_model::load_weights(&mut self.vs, dir)?;
        self.optimizer
            .load(dir, state.optimizer_steps)
            .map_err(err)?;
        Ok(state.step)
    }
}

/// Whether `dir` holds HF weights (single file or sharded).
pub fn has_weights(dir: &Path) -> bool {
    dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists()
}

#[derive(Default)]
struct Accumulator {
    loss: f64,
    clipfrac: f64,
    kl: f64,
    entropy: f64,
    abs_diff_sum: f64,
    tokens: usize,
}

//! One optimizer step: the batch checked, old log-probs, gradients, the update.

use std::collections::BTreeMap;

use manta_model::NoHooks;
use tch::{Device, Tensor};

use crate::batch::{micro_batches, MicroBatchLayout};
use crate::data_parallel::zero::OUTER_BUCKET;
use crate::data_parallel::CollectiveError;
use crate::profile::{self, Phase, StepProfile};
use crate::torch_trace::StepTrace;

use super::accumulator::Accumulator;
use super::checkpoint::agree;
use super::packing::{infallible, Packed};
use super::*;

impl Trainer {
    /// Rejects batches the model cannot train on, naming the sample and field.
    pub(super) fn check_batch(&self, batch: &TrainBatch) -> Result<(), TrainerError> {
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
            self.check_routing(std::slice::from_ref(s))?;
            let vocab = self.model.config().vocab_size as u32;
            if let Some(bad) = s.tokens.iter().find(|&&t| t >= vocab) {
                return Err(TrainerError::Batch(format!(
                    "sample {}: token id {bad} is outside the vocabulary ({vocab})",
                    s.id
                )));
            }
        }
        Ok(())
    }

    /// The loss gradient at the current weights (every micro-batch, one chunk, no
    /// optimizer step), by HF name, with the step's `train/*` loss metrics. For
    /// checking the gradient against finite differences of `train/loss`. In data
    /// parallel these are this rank's own (unreduced) share.
    pub fn gradients(
        &mut self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, f64>, NamedTensors), TrainerError> {
        if self.optimizer.zero3().is_some() {
            return Err(TrainerError::Config(
                "--zero-stage 3: per-parameter gradients are reduce-scattered as each layer's \
                 backward ends, so Trainer::gradients has none to return"
                    .into(),
            ));
        }
        self.check_batch(batch)?;
        self.optimizer.zero_grad();
        let lengths: Vec<usize> = batch.samples.iter().map(|s| s.tokens.len()).collect();
        let tokens: usize = batch.samples.iter().map(|s| s.generated_tokens()).sum();
        let mut acc = Accumulator::default();
        let ranges = micro_batches(&lengths, self.opts.max_tokens_per_gpu, self.opts.layout);
        self.scale_aux_loss(ranges.len());
        let skipped =
            self.run_micro_batches(batch, ranges, None, batch.global_samples, tokens, &mut acc)?;
        acc.oom_skipped += skipped;
        let mut grads: NamedTensors = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| {
                let g = t.grad();
                let g = if g.defined() {
                    g.copy()
                } else {
                    t.zeros_like()
                };
                (k, g)
            })
            .collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        self.optimizer.zero_grad();
        let routing_mismatch = acc.routing_mismatch();
        let mut metrics: BTreeMap<String, f64> = acc
            .metrics
            .into_iter()
            .map(|(k, v)| (format!("train/{k}"), v))
            .collect();
        metrics.insert("train/oom_skipped".into(), acc.oom_skipped as f64);
        metrics.insert("train/oom_splits".into(), acc.oom_splits as f64);
        if let Some(mismatch) = routing_mismatch {
            metrics.insert("train/routing_mismatch".into(), mismatch);
        }
        Ok((metrics, grads))
    }

    /// Megatron's scale of the load-balancing loss: each micro-batch's loss weighs
    /// 1 / (micro-batches of the update), summed over data-parallel ranks as the
    /// gradients are, so the update sees the mean over its micro-batches.
    fn scale_aux_loss(&self, micro_batches: usize) {
        let coeff = self.opts.algo.moe_aux_loss_coeff;
        if coeff == 0.0 {
            return;
        }
        let ranks = match self.optimizer.collective() {
            Some(comm) if !self.context_parallel => comm.world_size(),
            _ => 1,
        };
        self.model
            .set_moe_aux_loss_coeff(coeff / (micro_batches.max(1) * ranks) as f64);
    }

    /// One GRPO step: forward each micro-batch, accumulate the clipped policy loss
    /// gradients, clip the global norm, AdamW. Returns `train/*` metrics, and with
    /// `MANTA_TRAINER_PROFILE` on this rank's seconds per phase (crate::profile). With
    /// `MANTA_TORCH_PROFILE` one step is traced (crate::torch_trace).
    pub fn train_step(
        &mut self,
        batch: &TrainBatch,
    ) -> Result<BTreeMap<String, f64>, TrainerError> {
        self.steps_begun += 1;
        let trace = StepTrace::start(
            self.steps_begun,
            self.data_parallel_rank().0,
            self.opts.device,
        );
        let profile = StepProfile::start(self.opts.device);
        let steps = self.opts.algo.num_steps_per_rollout.max(1);
        let checked = self.check_batch(batch).and_then(|()| {
            if steps > batch.samples.len() {
                return Err(TrainerError::Batch(format!(
                    "--num-steps-per-rollout {steps} is more than the {} samples of the step",
                    batch.samples.len()
                )));
            }
            Ok(())
        });
        match self.optimizer.collective() {
            // Every rank learns whether any rank rejected its share, so they all stop
            // here instead of the others waiting in the step's collectives.
            Some(comm) => agree(comm, checked, || {
                TrainerError::Batch(
                    "another data-parallel rank rejected its share of the batch".into(),
                )
            })?,
            None => checked?,
        }
        let lengths: Vec<usize> = batch.samples.iter().map(|s| s.tokens.len()).collect();
        let budget = self.opts.max_tokens_per_gpu;
        // π_old: the weights before this rollout's first update. With one update per
        // rollout the current weights are those, so no extra pass is needed.
        let old = if steps > 1 {
            Some(profile::scoped(Phase::OldLogprobs, || {
                self.old_logprobs(batch, &lengths, budget)
            })?)
        } else {
            None
        };
        let n = batch.samples.len();
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut lr = self.opts.adam.lr;
        for k in 0..steps {
            // slime: global batch = samples / num_steps_per_rollout, in order.
            let chunk = (k * n / steps)..((k + 1) * n / steps);
            let mut chunk_global = batch.global_samples * chunk.len() / n.max(1);
            let mut chunk_tokens: usize = batch.samples[chunk.clone()]
                .iter()
                .map(|s| s.loss_mask.iter().filter(|&&m| m == 1).count())
                .sum();
            if let Some(comm) = self
                .optimizer
                .collective()
                .filter(|_| !self.context_parallel)
            {
                // Data parallel: the loss divides by the counts over every rank's chunk
                // (context-parallel ranks all hold the same chunk).
                let mut counts = [chunk.len() as f64, chunk_tokens as f64];
                comm.all_reduce_f64(&mut counts, crate::data_parallel::ReduceOp::Sum)?;
                (chunk_global, chunk_tokens) = (counts[0] as usize, counts[1] as usize);
            }
            self.optimizer.zero_grad();
            let mut acc = Accumulator::default();
            let base = chunk.start;
            let ranges: Vec<_> = micro_batches(&lengths[chunk.clone()], budget, self.opts.layout)
                .into_iter()
                .map(|r| (base + r.start)..(base + r.end))
                .collect();
            self.scale_aux_loss(ranges.len());
            let skipped = self.run_micro_batches(
                batch,
                ranges,
                old.as_deref(),
                chunk_global,
                chunk_tokens,
                &mut acc,
            )?;
            acc.oom_skipped += skipped;
            if let Some(comm) = self.optimizer.collective() {
                acc.all_reduce(comm)?;
            }
            if let Some(schedule) = &self.opts.algo.lr_schedule {
                self.optimizer
                    .set_lr(schedule.lr_at(self.optimizer.step_count()));
            }
            lr = self.optimizer.config().lr;
            let (clip_grad, optimizer) = (self.opts.clip_grad, &mut self.optimizer);
            let grad_norm = profile::scoped(Phase::Optimizer, || {
                let norm = optimizer.clip_grad_norm(clip_grad)?;
                optimizer.step()?;
                Ok::<f64, CollectiveError>(norm)
            })?;
            self.optimizer.zero_grad();
            *sums.entry("train/grad_norm".into()).or_default() += grad_norm;
            *sums.entry("train/tokens".into()).or_default() += acc.tokens as f64;
            *sums.entry("train/oom_skipped".into()).or_default() += acc.oom_skipped as f64;
            *sums.entry("train/oom_splits".into()).or_default() += acc.oom_splits as f64;
            if let Some(mismatch) = acc.routing_mismatch() {
                *sums.entry("train/routing_mismatch".into()).or_default() += mismatch;
            }
            for (name, v) in acc.metrics {
                *sums.entry(format!("train/{name}")).or_default() += v;
            }
        }
        // Several updates per rollout: each metric is the mean over the updates.
        let mut m: BTreeMap<String, f64> = sums
            .into_iter()
            .map(|(k, v)| {
                let v = if matches!(
                    k.as_str(),
                    "train/tokens" | "train/oom_skipped" | "train/oom_splits"
                ) {
                    v
                } else {
                    v / steps as f64
                };
                (k, v)
            })
            .collect();
        m.insert("train/lr".into(), lr);
        // The step ends when its update is on the device: otherwise the optimizer's
        // queued kernels run inside whatever comes next (a weight sync timed them as
        // ~half its 8B broadcast, and held the engines paused for them).
        if let Device::Cuda(i) = self.opts.device {
            tch::Cuda::synchronize(i as i64);
        }
        if let Some(profile) = profile {
            m.extend(profile.finish());
        }
        if let Some(trace) = trace {
            trace.finish();
        }
        Ok(m)
    }

    /// π_old's log-probs of every sample's trained tokens, one tensor per sample. ZeRO-3
    /// gathers the layers as the passes reach them and pads this rank's passes to the
    /// ranks' most with two-token ones.
    pub(super) fn old_logprobs(
        &mut self,
        batch: &TrainBatch,
        lengths: &[usize],
        budget: usize,
    ) -> Result<Vec<Tensor>, TrainerError> {
        let ranges = micro_batches(lengths, budget, self.opts.layout);
        let pack = self.opts.layout == MicroBatchLayout::Packed;
        let (device, temperature, chunk) = (
            self.opts.device,
            self.opts.temperature,
            self.opts.logprob_chunk,
        );
        let fillers = self.zero3_fillers(ranges.len())?;
        let mut out = Vec::new();
        for r in ranges {
            let packed = Packed::new(&batch.samples[r.clone()], device, pack);
            let routing = self.begin_routing(&batch.samples[r], &packed);
            let cp = self.cp_local(&packed)?;
            let lp = match (cp, self.optimizer.collective()) {
                (Some(cp), Some(comm)) => {
                    cp.logprobs(&self.model, &packed.targets, comm, temperature, chunk)?
                }
                _ => match self.optimizer.zero3_mut() {
                    None => {
                        infallible(packed.logprobs(&self.model, &mut NoHooks, temperature, chunk))
                    }
                    Some(zero) => {
                        zero.gather_bucket(OUTER_BUCKET)?;
                        let mut pass = zero.layer_pass();
                        let lp = packed.logprobs(&self.model, &mut pass, temperature, chunk);
                        let ended = pass.finish();
                        zero.release_bucket(OUTER_BUCKET);
                        let lp = lp?;
                        ended?;
                        lp
                    }
                },
            };
            let _ = self.end_routing(routing);
            let sizes: Vec<i64> = packed.masks.iter().map(|m| m.len() as i64).collect();
            out.extend(lp.split_with_sizes(&sizes, 0));
        }
        for _ in 0..fillers {
            self.zero3_filler_pass(false)?;
        }
        Ok(out)
    }
}

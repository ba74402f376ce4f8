//! The micro-batch loop, and the split of a micro-batch that ran out of memory.

use manta_core::Sample;
use manta_model::{DeferredLogprobs, NoHooks};
use tch::{Kind, Tensor};

use crate::batch::MicroBatchLayout;
use crate::context_parallel::CpComm;
use crate::data_parallel::zero::OUTER_BUCKET;
use crate::loss::{policy_objective, sample_mean_weights, token_mean_weights, TokenBatch};
use crate::profile::{self, Phase};

use super::accumulator::Accumulator;
use super::packing::{infallible, Packed};
use super::*;

impl Trainer {
    /// Runs the micro-batches `ranges` (indices into `batch`). A micro-batch that runs
    /// out of memory is split in halves and retried; a single sample that still does not
    /// fit is skipped (it adds nothing to the loss) and counted. Returns the count.
    ///
    /// A micro-batch's metrics count only when it succeeds. Its gradients are added in
    /// one backward pass, so an out-of-memory error raised inside that pass can leave part
    /// of them accumulated (in practice OOM strikes in the forward pass, whose activations
    /// dominate).
    pub(super) fn run_micro_batches(
        &mut self,
        batch: &TrainBatch,
        ranges: Vec<std::ops::Range<usize>>,
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<usize, TrainerError> {
        if self.optimizer.zero3().is_some() || self.context_parallel {
            return self.run_zero3_micro_batches(
                batch,
                ranges,
                old,
                global_samples,
                global_tokens,
                acc,
            );
        }
        let mut queue: std::collections::VecDeque<_> = ranges.into();
        let mut skipped = 0;
        while let Some(r) = queue.pop_front() {
            let mut local = Accumulator::default();
            let result = self.try_micro_step(
                &batch.samples[r.clone()],
                &batch.advantages[r.clone()],
                old.map(|o| &o[r.clone()]),
                global_samples,
                global_tokens,
                &mut local,
            );
            match result {
                Ok(()) => acc.merge(local),
                Err(TrainerError::OutOfMemory(msg)) if r.len() > 1 => {
                    acc.oom_splits += 1;
                    let mid = r.start + r.len() / 2;
                    tracing::warn!(samples = r.len(), %msg, "micro-batch out of memory: splitting it in halves");
                    queue.push_front(mid..r.end);
                    queue.push_front(r.start..mid);
                }
                Err(TrainerError::OutOfMemory(msg)) => {
                    tracing::warn!(sample = batch.samples[r.start].id, %msg, "a single sample does not fit in memory: skipped");
                    skipped += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(skipped)
    }

    /// [`Trainer::run_micro_batches`] of a ZeRO-3 or context-parallel rank (the latter's
    /// ranks all run the same micro-batches, no fillers): every rank runs as many passes
    /// (fillers after its own), each pass's layers gathered and reduced in the same
    /// order. A micro-batch out of memory is not split (the other ranks are already in
    /// its collectives): the step fails.
    pub(super) fn run_zero3_micro_batches(
        &mut self,
        batch: &TrainBatch,
        ranges: Vec<std::ops::Range<usize>>,
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<usize, TrainerError> {
        let fillers = self.zero3_fillers(ranges.len())?;
        for r in ranges {
            let mut local = Accumulator::default();
            match self.try_micro_step(
                &batch.samples[r.clone()],
                &batch.advantages[r.clone()],
                old.map(|o| &o[r.clone()]),
                global_samples,
                global_tokens,
                &mut local,
            ) {
                Ok(()) => acc.merge(local),
                Err(TrainerError::OutOfMemory(msg)) => {
                    return Err(TrainerError::OutOfMemory(format!(
                        "{msg} (--zero-stage 3 and --context-parallel-size cannot split a \
                         micro-batch: lower --max-tokens-per-gpu)"
                    )))
                }
                Err(e) => return Err(e),
            }
        }
        for _ in 0..fillers {
            self.zero3_filler_pass(true)?;
        }
        Ok(0)
    }

    /// [`Trainer::micro_step`], with libtorch's out-of-memory panics turned into
    /// [`TrainerError::OutOfMemory`]. `MANTA_INJECT_OOM_TOKENS=N` (tests) makes every
    /// micro-batch whose laid-out size exceeds N tokens fail that way, from inside a
    /// no-grad region as a real one can.
    pub(super) fn try_micro_step(
        &mut self,
        samples: &[Sample],
        advantages: &[f64],
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<(), TrainerError> {
        let inject = self.inject_oom_tokens.and_then(|limit| {
            let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
            let laid_out = self.opts.layout.cost(&lengths);
            (laid_out > limit).then(|| {
                format!("CUDA out of memory (injected: {laid_out} laid-out tokens > MANTA_INJECT_OOM_TOKENS={limit})")
            })
        });
        // tch::no_grad is not unwind-safe: a panic inside one (an out-of-memory error in a
        // log-prob pass) leaves autograd off for this thread, and the retry would build no
        // graph. The guard puts the mode back as it was on entry whatever happens inside;
        // the step itself runs with autograd on.
        let _restore_grad_mode = tch::no_grad_guard();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tch::with_grad(|| {
                if let Some(msg) = &inject {
                    tch::no_grad(|| panic!("{msg}"));
                }
                // Starts as the micro-batch's layout; micro_step moves on through the
                // passes, and the phase around it resumes when it returns.
                profile::scoped(Phase::Prepare, || {
                    self.micro_step(samples, advantages, old, global_samples, global_tokens, acc)
                })
            })
        }));
        match run {
            Ok(result) => result,
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                if msg.contains("out of memory") {
                    Err(TrainerError::OutOfMemory(msg))
                } else {
                    std::panic::resume_unwind(payload)
                }
            }
        }
    }

    pub(super) fn micro_step(
        &mut self,
        samples: &[Sample],
        advantages: &[f64],
        old: Option<&[Tensor]>,
        global_samples: usize,
        global_tokens: usize,
        acc: &mut Accumulator,
    ) -> Result<(), TrainerError> {
        let device = self.opts.device;
        let packed = Packed::new(
            samples,
            device,
            self.opts.layout == MicroBatchLayout::Packed,
        );
        if packed.tokens() == 0 {
            // ZeRO-3: the other ranks still expect this pass's collectives.
            return self.zero3_filler_pass(true);
        }
        let loss_opts = self.opts.algo.loss;
        let weights = if loss_opts.calculate_per_token_loss {
            token_mean_weights(&packed.masks, global_tokens)
        } else {
            sample_mean_weights(&packed.masks, global_samples)
        };
        let mut adv = Vec::new();
        let mut rollout_lp = Vec::new();
        for (s, &a) in samples.iter().zip(advantages) {
            for (k, &m) in s.loss_mask.iter().enumerate() {
                if m == 1 {
                    adv.push(a as f32);
                    rollout_lp.push(s.rollout_log_probs[k]);
                }
            }
        }
        let rollout_lp = Tensor::from_slice(&rollout_lp).to(device);
        let adv = Tensor::from_slice(&adv).to(device);
        let w = Tensor::from_slice(&weights).to(device);
        let old = old.map(|o| Tensor::cat(o, 0).to(device));
        let cp = self.cp_local(&packed)?;
        let comm = self.optimizer.collective();
        if self.reference.is_some() {
            profile::enter(Phase::RefLogprobs);
        }
        let ref_logp = match (&self.reference, &cp, comm) {
            (Some((_, model)), Some(cp), Some(comm)) => Some(cp.logprobs(
                model,
                &packed.targets,
                comm,
                self.opts.temperature,
                self.opts.logprob_chunk,
            )?),
            (Some((_, model)), _, _) => Some(infallible(packed.logprobs(
                model,
                &mut NoHooks,
                self.opts.temperature,
                self.opts.logprob_chunk,
            ))),
            (None, _, _) => None,
        };
        // The reference policy routes by itself (as Miles' does); the policy replays.
        let routing = self.begin_routing(samples, &packed);
        let (model, opts) = (&self.model, &self.opts);
        let (rows, width) = (packed.rows, packed.width);
        // Context parallel: every rank computes the same loss; rank 0 alone reports it.
        let report = cp.is_none() || comm.is_some_and(|c| c.rank() == 0);
        // The LM head's backward is deferred and chunked (DeferredLogprobs): the loss
        // path holds one chunk's softmax at a time, the entropy bonus's gradient included.
        let token_terms = |selected: &Tensor, targets: &Tensor| {
            DeferredLogprobs::new(
                model,
                selected,
                targets,
                opts.temperature,
                opts.logprob_chunk,
                loss_opts.entropy_coef != 0.0,
            )
        };
        // forward_backward recomputes each layer in backward when gradient checkpointing
        // is on; the loss also collects the step's metrics.
        let mut objective = |logp: Tensor, entropy: Tensor| {
            let train_logp = old
                .as_ref()
                .map_or_else(|| logp.detach(), |o| o.shallow_clone());
            let old_logp = if opts.use_rollout_logprobs {
                rollout_lp.shallow_clone()
            } else {
                train_logp.shallow_clone()
            };
            let terms = policy_objective(
                &TokenBatch {
                    logp: &logp,
                    entropy: &entropy,
                    old_logp: &old_logp,
                    train_logp: &train_logp,
                    rollout_logp: &rollout_lp,
                    ref_logp: ref_logp.as_ref(),
                    advantages: &adv,
                    weights: &w,
                    segment: &packed.segment,
                    counts: &packed.counts,
                    use_rollout_logprobs: opts.use_rollout_logprobs,
                },
                opts.clip,
                &loss_opts,
            );
            if report {
                for (name, v) in terms.metrics {
                    *acc.metrics.entry(name).or_default() += v;
                }
            }
            // The loss ends the forward pass: what runs after it is the backward.
            profile::enter(Phase::Backward);
            terms.loss
        };
        profile::enter(Phase::Forward);
        if let (Some(cp), Some(comm)) = (&cp, comm) {
            let group = CpComm(comm);
            let _ = self.model.forward_backward_cp(
                &cp.input,
                &cp.positions,
                &cp.row,
                &group,
                |hidden| {
                    if cp.owns_none() {
                        let none = Tensor::zeros([0], (Kind::Float, device));
                        return Ok(objective(cp.full(&none, comm)?, cp.full(&none, comm)?));
                    }
                    let selected = hidden
                        .view([cp.row.local_len(), -1])
                        .index_select(0, &cp.own_at);
                    let terms = token_terms(&selected, &packed.targets.index_select(0, &cp.own));
                    // `full` passes the loss's gradient to this rank's own tokens only.
                    let loss = objective(
                        cp.full(terms.logp(), comm)?,
                        cp.full(terms.entropy(), comm)?,
                    );
                    Ok(terms.backward(&loss))
                },
            )?;
            if report {
                acc.tokens += packed.tokens() as usize;
            }
            let _ = self.end_routing(routing);
            return Ok(());
        }
        let loss_fn = |hidden: &Tensor| {
            let selected = hidden
                .view([rows * width, -1])
                .index_select(0, &packed.gather);
            let terms = token_terms(&selected, &packed.targets);
            let loss = objective(
                terms.logp().shallow_clone(),
                terms.entropy().shallow_clone(),
            );
            terms.backward(&loss)
        };
        let attention = packed.attention();
        match self.optimizer.zero3_mut() {
            None => {
                let _ = self.model.forward_backward(
                    &packed.input,
                    &packed.positions,
                    &attention,
                    loss_fn,
                );
            }
            Some(zero) => {
                zero.gather_bucket(OUTER_BUCKET)?;
                let mut pass = zero.layer_pass();
                let ran = self.model.forward_backward_hooked(
                    &packed.input,
                    &packed.positions,
                    &attention,
                    &mut pass,
                    loss_fn,
                );
                let ended = pass.finish();
                let _ = ran?;
                ended?;
                zero.reduce_bucket(OUTER_BUCKET)?;
            }
        }
        acc.tokens += packed.tokens() as usize;
        let (mismatched, pairs) = self.end_routing(routing);
        acc.routing_mismatched += mismatched;
        acc.routing_pairs += pairs;
        Ok(())
    }
}

//! The memory pre-check a GPU rank runs before it allocates anything.

use manta_model::ModelConfig;
use tch::Device;
use tracing::info;

use crate::memory_plan;

use super::*;

/// On a GPU: logs what a rank will hold and refuses, before anything is allocated, a
/// run whose weights and optimizer state alone exceed the GPU (crate::memory_plan).
pub(super) fn check_memory(
    cfg: &ModelConfig,
    opts: &TrainerOptions,
    bf16: bool,
    ranks: usize,
    zero_stage: u8,
) -> Result<(), TrainerError> {
    let Device::Cuda(index) = opts.device else {
        return Ok(());
    };
    let inputs = memory_plan::MemoryInputs {
        tokens_per_gpu: opts.max_tokens_per_gpu,
        data_parallel: ranks,
        zero_stage,
        bf16,
        grad_reduce_in_bf16: opts.algo.grad_reduce_in_bf16,
        recompute: opts.recompute,
        reference: opts.algo.loss.use_kl_loss,
        logprob_chunk: opts.logprob_chunk.max(1) as usize,
    };
    let plan = memory_plan::plan(cfg, &inputs);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    info!(
        device = index,
        static_gib = gib(plan.static_bytes()),
        build_gib = gib(plan.build_bytes()),
        activations_gib = gib(plan.activations + plan.logits),
        peak_gib = gib(plan.peak()),
        zero_stage,
        grad_reduce_in_bf16 = inputs.grad_reduce_in_bf16,
        "trainer memory plan per GPU"
    );
    let Ok(capacity) = manta_cuda::total_memory(index) else {
        return Ok(());
    };
    memory_plan::check(&plan, &inputs, capacity as u64)?;
    if plan.peak() > capacity as u64 {
        tracing::warn!(
            peak_gib = gib(plan.peak()),
            capacity_gib = gib(capacity as u64),
            "the planned peak exceeds the GPU: micro-batches that run out of memory are split \
             (slower); lower --max-tokens-per-gpu or recompute more layers (--recompute-num-layers)"
        );
    }
    Ok(())
}

//! Tuning knobs: the `MANTA_*` environment variables that switch kernels and code paths,
//! for A/B runs and benchmarks. Defaults are what production runs; a knob only ever
//! turns a faster path off or pins a kernel parameter.
//!
//! Every knob is in [`KNOBS`] (docs/knobs.md is generated from the same entries). The
//! environment is read once, on first use; on/off knobs take one spelling rule
//! (`1`/`true`/`on`/`yes`, `0`/`false`/`off`/`no`, any case) and counts must be one of
//! the values the kernel supports. A value outside that is an error naming the variable
//! ([`check`], which the binaries call at start); until then the knob keeps its default.
//! Benchmarks that compare settings in one process change knobs through [`set_override`].
//! The CUDA shim reads the kernel knobs through `manta_cuda`, never `getenv`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};

/// What values a knob takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// On or off.
    Flag,
    /// One of these counts.
    OneOf(&'static [i64]),
    /// A positive byte count (its user checks the range).
    Bytes,
    /// A count from 1 up.
    Positive,
    /// A directory to write into (its user reads the text, [`raw_value`]).
    Dir,
}

/// One documented knob.
#[derive(Debug, Clone, Copy)]
pub struct Knob {
    pub name: &'static str,
    pub values: Values,
    /// The default, in words (some defaults depend on the GPU or the shape).
    pub default: &'static str,
    /// What it is for.
    pub what: &'static str,
}

/// Digest every engine's weights after each sync (tests set it for a child process).
pub const VERIFY_WEIGHT_SYNC: &str = "MANTA_VERIFY_WEIGHT_SYNC";
/// Bytes per chunk of weights over gRPC.
pub const WEIGHT_CHUNK_BYTES: &str = "MANTA_WEIGHT_CHUNK_BYTES";
/// Where Kineto traces go ([`torch_profile`]).
pub const TORCH_PROFILE: &str = "MANTA_TORCH_PROFILE";
/// Which trainer step [`TORCH_PROFILE`] traces.
pub const TORCH_PROFILE_STEP: &str = "MANTA_TORCH_PROFILE_STEP";

/// Deadline of one ORS request ([`env_request_timeout`]).
pub const ENV_REQUEST_TIMEOUT_S: &str = "MANTA_ENV_REQUEST_TIMEOUT_S";

/// Every tuning knob.
pub const KNOBS: &[Knob] = &[
    Knob { name: "MANTA_DISABLE_CUDA_GRAPHS", values: Values::Flag, default: "off", what: "native engine: run decode steps eagerly instead of replaying CUDA graphs" },
    Knob { name: "MANTA_DECODE_KERNELS", values: Values::Flag, default: "on", what: "native engine: fused paged-attention, norm and rotary kernels for bf16 decode (off: tensor ops)" },
    Knob { name: "MANTA_SAMPLING_KERNEL", values: Values::Flag, default: "on", what: "native engine: sample on the GPU with the fused kernel (off: tensor ops)" },
    Knob { name: "MANTA_GRAPH_SAMPLING", values: Values::Flag, default: "on", what: "native engine: capture sampling inside the decode graph" },
    Knob { name: "MANTA_ENGINE_PROFILE", values: Values::Flag, default: "off", what: "native engine: log per-step timings of the engine thread" },
    Knob { name: "MANTA_DISABLE_OVERLAP_SCHEDULE", values: Values::Flag, default: "off", what: "bench engine_decode: schedule each step after the host read the last one" },
    Knob { name: "MANTA_PREFILL_VARLEN", values: Values::Flag, default: "on", what: "native engine: prefill through one variable-length flash call (off: one SDPA per sequence)" },
    Knob { name: "MANTA_PREFILL_CUDNN", values: Values::Flag, default: "on", what: "native engine: that varlen prefill attention through cuDNN's fused flash attention where cuDNN takes the shape (off: libtorch's FlashAttention-2)" },
    Knob { name: "MANTA_DECODE_GEMV", values: Values::Flag, default: "on", what: "native engine: decode projections through the GEMV kernel where it applies (off: cuBLAS)" },
    Knob { name: "MANTA_LOGITS_GEMV", values: Values::Flag, default: "on", what: "native engine: the LM head through the GEMV kernel for small batches" },
    Knob { name: "MANTA_FUSED_ADAMW", values: Values::Flag, default: "on", what: "trainer: the fused AdamW kernel over fp32 masters (off: tensor ops)" },
    Knob { name: "MANTA_FUSED_ADAMW_BF16_GRAD", values: Values::Flag, default: "on", what: "trainer: ZeRO with a bf16 gradient shard on a GPU updates it in one kernel that reads the bf16 gradient and applies the clip scale itself (off: widen each bucket to fp32, scale, then the fused AdamW; same bits)" },
    Knob { name: "MANTA_GRAD_NORM_KERNEL", values: Values::Flag, default: "on", what: "trainer: ZeRO's gradient norm on a GPU sums the shard's squares in fp64 in one kernel, in a fixed order (off: fp64 copies of 64 Mi-element slices, ATen's sum)" },
    Knob { name: "MANTA_ZERO3_PREFETCH", values: Values::Flag, default: "on", what: "trainer: ZeRO-3 all-gathers the next decoder layer on a side stream while the current one computes (off: each gather when its layer is reached)" },
    Knob { name: "MANTA_TRAINER_PROFILE", values: Values::Flag, default: "off", what: "trainer: synchronize the GPU between a step's phases and return their seconds as `perf/trainer/<phase>_s` (slows the step)" },
    Knob { name: TORCH_PROFILE, values: Values::Dir, default: "off", what: "trainer and bench engine_decode: write a Chrome trace (libtorch's Kineto profiler: aten ops, and on CUDA every kernel) of one train step to `DIR/trainer_step{N}_rank{R}.json` and of one prefill per batch size to `DIR/engine_prefill_{shape}_b{B}.json` (and a prefill with 32 decode steps to `DIR/engine_decode_{shape}_b{B}.json`); `bench/py/kernel_summary.py` sums a trace by kernel" },
    Knob { name: ENV_REQUEST_TIMEOUT_S, values: Values::Positive, default: "120", what: "rollouts and task listing: seconds an environment (ORS) server has to answer one request (SSE streams: to start answering) before the attempt counts as timed out; retried like other transient failures, the log naming the call" },
    Knob { name: TORCH_PROFILE_STEP, values: Values::Positive, default: "2", what: "trainer: which step (counting from 1 in this process) `MANTA_TORCH_PROFILE` traces; the first is warm-up" },
    Knob { name: "MANTA_FUSED_LOGPROBS", values: Values::Flag, default: "on", what: "trainer: per-token log-probs, entropies and their LM-head backward through fused kernels on CUDA in bf16/fp16 (off: tensor ops and autograd)" },
    Knob { name: "MANTA_FUSED_ROPE", values: Values::Flag, default: "on", what: "decoder (trainer and the engine's tensor-op path): the rotary embedding of q and k and its backward through one kernel each on CUDA in bf16/fp16, bit-identical forward (off: tensor ops and autograd)" },
    Knob { name: "MANTA_FUSED_RMSNORM", values: Values::Flag, default: "on", what: "decoder (trainer and the engine's tensor-op path): RMSNorm with Hugging Face's rounding and its backward through one kernel forward and two backward on CUDA in bf16/fp16, forward equal to the tensor ops but where their sums of squares round apart (off: tensor ops and autograd)" },
    Knob { name: "MANTA_FUSED_SWIGLU", values: Values::Flag, default: "on", what: "decoder (trainer and the engine's tensor-op path): the MLP's `silu(gate) * up` and its backward through one kernel each on CUDA in bf16/fp16, bit-identical forward (off: tensor ops and autograd)" },
    Knob { name: VERIFY_WEIGHT_SYNC, values: Values::Flag, default: "off", what: "driver: digest every engine's weights after each sync and check them against the trainer's" },
    Knob { name: WEIGHT_CHUNK_BYTES, values: Values::Bytes, default: "1 MiB", what: "weights over gRPC: bytes per chunk message" },
    Knob { name: "MANTA_PDL", values: Values::Flag, default: "on (sm_90+)", what: "CUDA kernels: programmatic dependent launch" },
    Knob { name: "MANTA_PAGED_CTAS_PER_SM", values: Values::OneOf(&[1, 2, 3, 4, 6, 8, 12, 16]), default: "2 or 4 by batch", what: "paged attention: CTAs per SM the context is split to reach" },
    Knob { name: "MANTA_PAGED_LANES", values: Values::OneOf(&[8, 16, 32]), default: "head_dim / 8", what: "paged attention: lanes per token" },
    Knob { name: "MANTA_PAGED_TT", values: Values::OneOf(&[1, 2, 4, 8]), default: "4 or 2 by lanes", what: "paged attention: tokens per lane group per step" },
    Knob { name: "MANTA_PAGED_WARPS", values: Values::OneOf(&[2, 4, 8]), default: "as many as shared memory allows", what: "paged attention: warps per CTA" },
    Knob { name: "MANTA_PAGED_MMA", values: Values::Flag, default: "on", what: "paged attention: the tensor-core kernel where it applies" },
    Knob { name: "MANTA_PAGED_PDL", values: Values::Flag, default: "off for the tensor-core kernel, else on", what: "paged attention: launch as a programmatic dependent" },
    Knob { name: "MANTA_SMALL_VEC", values: Values::Flag, default: "on", what: "small fused kernels: 8 bf16 per access where aligned" },
    Knob { name: "MANTA_DECODE_LT", values: Values::Flag, default: "on", what: "decode projections through cuBLASLt" },
    Knob { name: "MANTA_GEMV_KSPLIT", values: Values::OneOf(&[1, 2, 4]), default: "4", what: "GEMV kernel, bf16 products without a fused norm (o and down projections): warps sharing a row, each taking that part of the inner dimension" },
    Knob { name: "MANTA_GEMV_NORM_KSPLIT", values: Values::OneOf(&[1, 2, 4]), default: "4 up to 2,048 outputs, else 1", what: "GEMV kernel, bf16 products with a fused norm (qkv and gate/up projections): warps sharing a row (8B b1 decode step: 1 as fast as the default, 2 and 4 slower)" },
    Knob { name: "MANTA_GEMV_ROWS", values: Values::OneOf(&[1, 2, 4]), default: "4", what: "GEMV kernel, bf16 products without SiLU or a fused norm (o and down projections): output rows per warp" },
    Knob { name: "MANTA_GEMV_NORM_ROWS", values: Values::OneOf(&[1, 2, 4]), default: "by shape", what: "GEMV kernel, bf16 products with a fused norm and no SiLU (the qkv projection): output rows per warp" },
    Knob { name: "MANTA_GEMV_SILU_ROWS", values: Values::OneOf(&[1, 2, 4]), default: "1", what: "GEMV kernel, the gate/up product with SiLU: output rows per warp (each a gate and an up row)" },
    Knob { name: "MANTA_GEMV_DEPTH", values: Values::OneOf(&[8, 16, 24, 32]), default: "8", what: "GEMV kernel: 16-byte weight loads in flight per lane" },
    Knob { name: "MANTA_GEMV_WARPS", values: Values::OneOf(&[2, 4, 8]), default: "4", what: "GEMV kernel: warps per CTA" },
    Knob { name: "MANTA_GEMV_NORM_WARPS", values: Values::OneOf(&[2, 4, 8, 16]), default: "8", what: "GEMV kernel with a fused norm: warps per CTA" },
];

/// The knobs the CUDA shim reads, in the order of its `KnobId` (crates/cuda/src/shim.cpp).
pub const KERNEL_KNOBS: [&str; 17] = [
    "MANTA_PDL",
    "MANTA_PAGED_CTAS_PER_SM",
    "MANTA_PAGED_LANES",
    "MANTA_PAGED_TT",
    "MANTA_PAGED_WARPS",
    "MANTA_PAGED_MMA",
    "MANTA_PAGED_PDL",
    "MANTA_SMALL_VEC",
    "MANTA_DECODE_LT",
    "MANTA_GEMV_KSPLIT",
    "MANTA_GEMV_WARPS",
    "MANTA_GEMV_NORM_WARPS",
    "MANTA_GEMV_ROWS",
    "MANTA_GEMV_NORM_KSPLIT",
    "MANTA_GEMV_NORM_ROWS",
    "MANTA_GEMV_SILU_ROWS",
    "MANTA_GEMV_DEPTH",
];

/// [`KERNEL_KNOBS`]' values now, -1 where unset (the kernel's default applies).
pub fn kernel_values() -> [i64; 17] {
    KERNEL_KNOBS.map(|name| value(name).unwrap_or(-1))
}

/// A knob's value that is not one it takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?}: {expected}")]
pub struct KnobError {
    pub name: String,
    pub value: String,
    pub expected: String,
}

/// The entry of `name`, if it is a knob.
pub fn knob(name: &str) -> Option<&'static Knob> {
    KNOBS.iter().find(|k| k.name == name)
}

/// Parses `raw` as a value of `knob` (flags as 0 or 1).
pub fn parse(knob: &Knob, raw: &str) -> Result<i64, KnobError> {
    let error = |expected: String| KnobError {
        name: knob.name.to_string(),
        value: raw.to_string(),
        expected,
    };
    let v = raw.trim();
    match knob.values {
        Values::Flag => match v.to_ascii_lowercase().as_str() {
            "1" | "true" | "on" | "yes" => Ok(1),
            "0" | "false" | "off" | "no" => Ok(0),
            _ => Err(error(
                "expected 1, true, on, yes or 0, false, off, no".into(),
            )),
        },
        Values::OneOf(allowed) => match v.parse::<i64>() {
            Ok(n) if allowed.contains(&n) => Ok(n),
            _ => Err(error(format!("expected one of {allowed:?}"))),
        },
        Values::Bytes => match v.parse::<i64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(error("expected a positive number of bytes".into())),
        },
        Values::Positive => match v.parse::<i64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(error("expected a whole number from 1 up".into())),
        },
        // Set: the text itself is the value.
        Values::Dir if !v.is_empty() => Ok(1),
        Values::Dir => Err(error("expected a directory path".into())),
    }
}

/// The knobs set in an environment, parsed, and the values that could not be.
#[derive(Debug, Default, Clone)]
pub struct Settings {
    values: BTreeMap<&'static str, i64>,
    /// The text of every value that parsed (a [`Values::Dir`] knob's value is its text).
    raw: BTreeMap<&'static str, String>,
    errors: Vec<KnobError>,
}

impl Settings {
    /// Reads every knob through `lookup` (the process environment in [`settings`]).
    pub fn read(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let mut s = Settings::default();
        for k in KNOBS {
            if let Some(raw) = lookup(k.name) {
                match parse(k, &raw) {
                    Ok(v) => {
                        s.values.insert(k.name, v);
                        s.raw.insert(k.name, raw.trim().to_string());
                    }
                    Err(e) => s.errors.push(e),
                }
            }
        }
        s
    }

    /// The value set for `name`, if any (flags as 0 or 1).
    pub fn get(&self, name: &str) -> Option<i64> {
        self.values.get(name).copied()
    }

    /// The text set for `name`, if it parsed.
    pub fn raw(&self, name: &str) -> Option<&str> {
        self.raw.get(name).map(String::as_str)
    }

    /// Values that were set but are not ones their knob takes.
    pub fn errors(&self) -> &[KnobError] {
        &self.errors
    }

    /// The first error of `name`'s value, if it had one.
    fn error_of(&self, name: &str) -> Option<&KnobError> {
        self.errors.iter().find(|e| e.name == name)
    }
}

/// This process's knobs, read from its environment on first use.
pub fn settings() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| Settings::read(|name| std::env::var(name).ok()))
}

/// Bumped by every override change, so a cached view of the knobs (the CUDA shim's)
/// knows when to refresh.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Changes each time [`set_override`] or [`clear_overrides`] runs.
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Each overridden knob's parsed value and its text.
type Overrides = BTreeMap<&'static str, (i64, String)>;

fn overrides() -> &'static RwLock<Overrides> {
    static OVERRIDES: OnceLock<RwLock<Overrides>> = OnceLock::new();
    OVERRIDES.get_or_init(Default::default)
}

/// Sets `name` to `raw` for the rest of the process (or until [`clear_overrides`]),
/// over the environment: benchmarks comparing settings in one process. Kernel knobs apply
/// to kernels compiled and launched afterwards.
pub fn set_override(name: &str, raw: &str) -> Result<(), KnobError> {
    let k = knob(name).ok_or_else(|| KnobError {
        name: name.to_string(),
        value: raw.to_string(),
        expected: "not a knob (see manta_knobs::KNOBS)".into(),
    })?;
    let v = parse(k, raw)?;
    overrides()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(k.name, (v, raw.trim().to_string()));
    GENERATION.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// Drops every override: the environment's values apply again.
pub fn clear_overrides() {
    overrides()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// The value of `name`: an override, else the environment's, else `None` (the default).
pub fn value(name: &str) -> Option<i64> {
    let over = overrides()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(name)
        .map(|(v, _)| *v);
    over.or_else(|| settings().get(name))
}

/// The text of `name`'s value: an override's, else the environment's (when it parsed).
pub fn raw_value(name: &str) -> Option<String> {
    let over = overrides()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(name)
        .map(|(_, raw)| raw.clone());
    over.or_else(|| settings().raw(name).map(str::to_string))
}

/// Whether the flag `name` is on, `default` when it is not set.
pub fn flag(name: &str, default: bool) -> bool {
    debug_assert!(
        knob(name).is_some_and(|k| k.values == Values::Flag),
        "{name} is not a flag knob"
    );
    value(name).map_or(default, |v| v != 0)
}

/// How long an environment server has to answer one request ([`ENV_REQUEST_TIMEOUT_S`]).
pub fn env_request_timeout() -> std::time::Duration {
    let secs = value(ENV_REQUEST_TIMEOUT_S).unwrap_or(120).max(1) as u64;
    std::time::Duration::from_secs(secs)
}

/// Native engine: replay decode steps from CUDA graphs.
pub fn cuda_graphs() -> bool {
    !flag("MANTA_DISABLE_CUDA_GRAPHS", false)
}

/// Native engine: the fused decode kernels.
pub fn decode_kernels() -> bool {
    flag("MANTA_DECODE_KERNELS", true)
}

/// Native engine: the sampling kernel.
pub fn sampling_kernel() -> bool {
    flag("MANTA_SAMPLING_KERNEL", true)
}

/// Native engine: sampling captured in the decode graph.
pub fn graph_sampling() -> bool {
    flag("MANTA_GRAPH_SAMPLING", true)
}

/// Native engine: per-step timing logs.
pub fn engine_profile() -> bool {
    flag("MANTA_ENGINE_PROFILE", false)
}

/// engine_decode bench: schedule each step before the host read the previous one.
pub fn overlap_schedule() -> bool {
    !flag("MANTA_DISABLE_OVERLAP_SCHEDULE", false)
}

/// Native engine: prefill through one variable-length flash call.
pub fn prefill_varlen() -> bool {
    flag("MANTA_PREFILL_VARLEN", true)
}

/// Native engine: the varlen prefill attention through cuDNN where it takes the shape.
pub fn prefill_cudnn() -> bool {
    flag("MANTA_PREFILL_CUDNN", true)
}

/// Native engine: decode projections through the GEMV kernel.
pub fn decode_gemv() -> bool {
    flag("MANTA_DECODE_GEMV", true)
}

/// Native engine: the LM head through the GEMV kernel.
pub fn logits_gemv() -> bool {
    flag("MANTA_LOGITS_GEMV", true)
}

/// Trainer: the fused AdamW kernel.
pub fn fused_adamw() -> bool {
    flag("MANTA_FUSED_ADAMW", true)
}

/// Trainer: ZeRO's AdamW reads a bf16 gradient shard straight into the fused update
/// (on a GPU, with [`fused_adamw`] on).
pub fn fused_adamw_bf16_grad() -> bool {
    flag("MANTA_FUSED_ADAMW_BF16_GRAD", true)
}

/// Trainer: ZeRO's gradient norm through the one-pass fp64 sum-of-squares kernel (on a GPU).
pub fn grad_norm_kernel() -> bool {
    flag("MANTA_GRAD_NORM_KERNEL", true)
}

/// Trainer: ZeRO-3 prefetches the next layer's parameters (read when the optimizer is
/// built).
pub fn zero3_prefetch() -> bool {
    flag("MANTA_ZERO3_PREFETCH", true)
}

/// Trainer: per-phase step timings, with a device sync at each phase boundary.
pub fn trainer_profile() -> bool {
    flag("MANTA_TRAINER_PROFILE", false)
}

/// Trainer: log-probs and their backward through the fused CUDA kernels.
pub fn fused_logprobs() -> bool {
    flag("MANTA_FUSED_LOGPROBS", true)
}

/// Decoder: the rotary embedding of q and k through the fused CUDA kernels.
pub fn fused_rope() -> bool {
    flag("MANTA_FUSED_ROPE", true)
}

/// Decoder: RMSNorm through the fused CUDA kernels.
pub fn fused_rms_norm() -> bool {
    flag("MANTA_FUSED_RMSNORM", true)
}

/// Decoder: the MLP's gated activation through the fused CUDA kernels.
pub fn fused_swiglu() -> bool {
    flag("MANTA_FUSED_SWIGLU", true)
}

/// Driver: verify every weight sync.
pub fn verify_weight_sync() -> bool {
    flag(VERIFY_WEIGHT_SYNC, false)
}

/// Bytes per gRPC weight chunk when set; an unusable value is an error.
pub fn weight_chunk_bytes() -> Result<Option<i64>, KnobError> {
    if let Some(e) = settings().error_of(WEIGHT_CHUNK_BYTES) {
        return Err(e.clone());
    }
    Ok(value(WEIGHT_CHUNK_BYTES))
}

/// Where and when [`TORCH_PROFILE`] asks for Kineto traces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchProfileAt {
    /// The folder the traces are written into.
    pub dir: PathBuf,
    /// The trainer step to trace, counting from 1 ([`TORCH_PROFILE_STEP`]; default 2, so
    /// the first step's warm-up — allocator growth, kernel selection — is not in it).
    pub step: u64,
}

/// The trainer step [`TORCH_PROFILE`] traces unless [`TORCH_PROFILE_STEP`] says.
pub const TORCH_PROFILE_DEFAULT_STEP: u64 = 2;

/// [`TORCH_PROFILE`] as `settings` and `raw` (a knob's text) give it: `None` when unset;
/// a value either knob does not take is an error naming it, even when the other is unset,
/// so a mistyped step is never silently replaced by the default.
fn torch_profile_in(
    settings: &Settings,
    raw: impl Fn(&str) -> Option<String>,
) -> Result<Option<TorchProfileAt>, KnobError> {
    for name in [TORCH_PROFILE, TORCH_PROFILE_STEP] {
        if let Some(e) = settings.error_of(name) {
            return Err(e.clone());
        }
    }
    let Some(dir) = raw(TORCH_PROFILE) else {
        return Ok(None);
    };
    let step = match raw(TORCH_PROFILE_STEP) {
        None => TORCH_PROFILE_DEFAULT_STEP,
        Some(text) => {
            let k = knob(TORCH_PROFILE_STEP).expect("TORCH_PROFILE_STEP is in KNOBS");
            parse(k, &text)? as u64
        }
    };
    Ok(Some(TorchProfileAt {
        dir: PathBuf::from(dir),
        step,
    }))
}

/// Kineto traces asked for by [`TORCH_PROFILE`] (with [`TORCH_PROFILE_STEP`]), if any; a
/// value they do not take is an error.
pub fn torch_profile() -> Result<Option<TorchProfileAt>, KnobError> {
    torch_profile_in(settings(), raw_value)
}

/// The first knob set to a value it does not take: the binaries refuse to start on it.
pub fn check() -> Result<(), KnobError> {
    settings().errors().first().cloned().map_or(Ok(()), Err)
}

/// docs/knobs.md's table.
pub fn markdown_table() -> String {
    let mut out =
        String::from("| variable | values | default | what it is for |\n|---|---|---|---|\n");
    for k in KNOBS {
        let values = match k.values {
            Values::Flag => "on/off".to_string(),
            Values::OneOf(v) => v.iter().map(i64::to_string).collect::<Vec<_>>().join(", "),
            Values::Bytes => "bytes > 0".to_string(),
            Values::Positive => "integer >= 1".to_string(),
            Values::Dir => "a directory".to_string(),
        };
        out += &format!(
            "| `{}` | {} | {} | {} |\n",
            k.name, values, k.default, k.what
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_take_one_spelling_rule() {
        let k = knob("MANTA_PDL").unwrap();
        for on in ["1", "true", "ON", " yes "] {
            assert_eq!(parse(k, on), Ok(1), "{on}");
        }
        for off in ["0", "False", "off", "NO"] {
            assert_eq!(parse(k, off), Ok(0), "{off}");
        }
        let e = parse(k, "maybe").unwrap_err();
        assert_eq!(e.name, "MANTA_PDL");
        assert!(e.to_string().contains("\"maybe\""), "{e}");
    }

    #[test]
    fn counts_must_be_supported_values() {
        let k = knob("MANTA_PAGED_LANES").unwrap();
        assert_eq!(parse(k, "16"), Ok(16));
        let e = parse(k, "12").unwrap_err().to_string();
        assert!(
            e.contains("MANTA_PAGED_LANES") && e.contains("[8, 16, 32]"),
            "{e}"
        );
        assert!(parse(knob("MANTA_WEIGHT_CHUNK_BYTES").unwrap(), "0").is_err());
    }

    #[test]
    fn an_environment_is_read_once_with_its_errors_kept() {
        let env = |name: &str| match name {
            "MANTA_DECODE_KERNELS" => Some("0".to_string()),
            "MANTA_GEMV_KSPLIT" => Some("3".to_string()),
            "MANTA_NOT_A_KNOB" => Some("1".to_string()),
            _ => None,
        };
        let s = Settings::read(env);
        assert_eq!(s.get("MANTA_DECODE_KERNELS"), Some(0));
        assert_eq!(
            s.get("MANTA_GEMV_KSPLIT"),
            None,
            "a bad value keeps the default"
        );
        assert_eq!(s.errors().len(), 1);
        assert_eq!(s.errors()[0].name, "MANTA_GEMV_KSPLIT");
    }

    /// Overrides are process-wide: tests that set and clear them take turns.
    static OVERRIDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn overrides_win_and_are_checked() {
        let _turn = OVERRIDING.lock().unwrap_or_else(|p| p.into_inner());
        assert!(set_override("MANTA_PAGED_TT", "5").is_err());
        assert!(set_override("MANTA_NOPE", "1").is_err());
        set_override("MANTA_PAGED_TT", "8").unwrap();
        assert_eq!(value("MANTA_PAGED_TT"), Some(8));
        clear_overrides();
        assert_eq!(value("MANTA_PAGED_TT"), settings().get("MANTA_PAGED_TT"));
    }

    #[test]
    fn torch_profile_takes_a_directory_and_a_step() {
        let read = |env: &[(&str, &str)]| {
            let s = Settings::read(|name| {
                env.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            });
            let raw = |name: &str| s.raw(name).map(str::to_string);
            torch_profile_in(&s, raw)
        };
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(
            read(&[(TORCH_PROFILE, "/tmp/prof")]),
            Ok(Some(TorchProfileAt {
                dir: PathBuf::from("/tmp/prof"),
                step: 2
            }))
        );
        assert_eq!(
            read(&[(TORCH_PROFILE, "/tmp/prof"), (TORCH_PROFILE_STEP, " 5 ")]),
            Ok(Some(TorchProfileAt {
                dir: PathBuf::from("/tmp/prof"),
                step: 5
            }))
        );
        for bad in ["two", "0", "-1", "1.5", ""] {
            let e = read(&[(TORCH_PROFILE, "/tmp/prof"), (TORCH_PROFILE_STEP, bad)])
                .expect_err(bad)
                .to_string();
            assert!(
                e.contains(TORCH_PROFILE_STEP) && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        // A bad step is an error even before the directory is set.
        assert!(read(&[(TORCH_PROFILE_STEP, "x")]).is_err());
        let e = read(&[(TORCH_PROFILE, "  ")]).unwrap_err();
        assert_eq!(e.name, TORCH_PROFILE);
    }

    #[test]
    fn a_directory_override_keeps_its_text() {
        let _turn = OVERRIDING.lock().unwrap_or_else(|p| p.into_inner());
        set_override(TORCH_PROFILE, "/tmp/over").unwrap();
        assert_eq!(raw_value(TORCH_PROFILE).as_deref(), Some("/tmp/over"));
        assert!(set_override(TORCH_PROFILE_STEP, "0").is_err());
        clear_overrides();
    }

    #[test]
    fn kernel_knobs_are_knobs() {
        for name in KERNEL_KNOBS {
            assert!(knob(name).is_some(), "{name} is not in KNOBS");
        }
    }

    #[test]
    fn every_knob_is_documented_once() {
        let mut names: Vec<_> = KNOBS.iter().map(|k| k.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a knob is listed twice");
        assert!(KNOBS
            .iter()
            .all(|k| k.name.starts_with("MANTA_") && !k.what.is_empty()));
    }
}

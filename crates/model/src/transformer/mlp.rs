//! The dense feed-forward part of a decoder layer (SwiGLU), and the choice between it and
//! a mixture of experts.

use tch::nn::Path;
use tch::Tensor;

use super::{linear_rows, matrix};
use crate::config::ModelConfig;
use crate::kernel_check::{Fused, FusedOp};
use crate::moe::SparseMoe;

pub(super) struct Mlp {
    pub(super) gate: Tensor,
    pub(super) up: Tensor,
    pub(super) down: Tensor,
    /// Projections run on at least this many rows (true on-policy mode; 0 otherwise).
    pub(super) min_rows: i64,
}

impl Mlp {
    pub(super) fn new(p: Path, cfg: &ModelConfig) -> Self {
        let (h, i, std) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.initializer_range,
        );
        Mlp {
            gate: matrix(&(&p / "gate_proj"), "weight", i, h, std),
            up: matrix(&(&p / "up_proj"), "weight", i, h, std),
            down: matrix(&(&p / "down_proj"), "weight", h, i, std),
            min_rows: 0,
        }
    }

    pub(super) fn forward(&self, x: &Tensor) -> Tensor {
        let proj = |x: &Tensor, w: &Tensor| linear_rows(x, w, None, self.min_rows);
        let (gate, up) = (proj(x, &self.gate), proj(x, &self.up));
        let act = fused_swiglu(&gate, &up).unwrap_or_else(|| gate.silu() * up);
        proj(&act, &self.down)
    }
}

/// `gate.silu() * up` through one CUDA kernel each way (`manta_cuda::swiglu`) instead of
/// two forward and three backward: the same bits forward, differentiable w.r.t. both.
/// `None` where it does not apply, and the caller takes the tensor ops: off CUDA, outside
/// bf16/fp16, mismatched inputs, `MANTA_FUSED_SWIGLU=0`, or kernels that do not compile
/// on this GPU.
fn fused_swiglu(gate: &Tensor, up: &Tensor) -> Option<Tensor> {
    const OP: FusedOp = FusedOp {
        op: Fused::Swiglu,
        name: "fused gated activation",
        instead: "activating through tensor ops",
        enabled: manta_knobs::fused_swiglu,
        compile: manta_cuda::swiglu::compile_check,
    };
    if up.kind() != gate.kind()
        || up.device() != gate.device()
        || up.size() != gate.size()
        || !OP.applies_to(gate)
    {
        return None;
    }
    OP.output(manta_cuda::swiglu::swiglu(gate, up))
}

/// A decoder layer's feed-forward part: the dense SwiGLU, or routed experts
/// (`qwen3_moe` layers that `MoeConfig::is_sparse` picks).
pub(super) enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    pub(super) fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Sparse(moe) => moe.forward(x),
        }
    }

    /// The dense MLP, for paths that only run dense layers (the CUDA decode kernels).
    pub(super) fn dense_mut(&mut self) -> Option<&mut Mlp> {
        match self {
            FeedForward::Dense(mlp) => Some(mlp),
            FeedForward::Sparse(_) => None,
        }
    }

    /// True on-policy mode's minimum projection rows (dense layers only: expert GEMMs
    /// take the rows routed to them).
    pub(super) fn set_min_rows(&mut self, rows: i64) {
        if let FeedForward::Dense(mlp) = self {
            mlp.min_rows = rows;
        }
    }
}

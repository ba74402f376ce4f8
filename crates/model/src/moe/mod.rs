//! Mixture-of-experts feed-forward layers (Qwen3-MoE): an fp32-softmax router picks k of E
//! SwiGLU experts per token, and the token's output is the weighted sum of theirs.
//!
//! Expert weights are stacked per layer ([E, I, H] gate and up, [E, H, I] down) and the
//! tokens of a call are grouped by expert before the expert GEMMs, so a grouped-GEMM
//! kernel can take one layer's experts in one launch and an expert-parallel rank can own
//! a contiguous slice of E. Checkpoints keep the hub's per-expert names
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`); `crate::checkpoint` maps them to rows
//! of the stacked tensors.
//!
//! The routing of every sparse layer can be recorded (the engine returns it per token)
//! and replayed (rollout routing replay: the trainer takes the rollout's expert ids while
//! the gate weights come from its own router logits, so the router keeps its gradient);
//! see [`Routing`].

mod config;
mod routing;

use std::sync::{Arc, Mutex, MutexGuard};

use tch::nn::{Init, Path};
use tch::{Kind, Tensor};

pub use config::MoeConfig;
pub use routing::{decode_routed_experts, encode_routed_experts, routing_mismatch, Routing};

/// Suffixes of the stacked expert variables under a sparse layer's `mlp`, and the hub's
/// per-expert projection each one holds rows of.
pub(crate) const STACKED: [(&str, &str); 3] = [
    ("experts.gate_proj", "gate_proj"),
    ("experts.up_proj", "up_proj"),
    ("experts.down_proj", "down_proj"),
];

/// One sparse layer's router and experts.
pub(crate) struct SparseMoe {
    /// Router weight [E, H] (hub name `mlp.gate.weight`).
    router: Tensor,
    /// [E, I, H].
    gate: Tensor,
    /// [E, I, H].
    up: Tensor,
    /// [E, H, I].
    down: Tensor,
    top_k: i64,
    norm_topk_prob: bool,
    /// This layer's position among the model's sparse layers (its column of a routing record).
    slot: i64,
    routing: Arc<Mutex<Routing>>,
}

impl SparseMoe {
    pub(crate) fn new(
        p: Path,
        hidden: i64,
        moe: &MoeConfig,
        std: f64,
        slot: i64,
        routing: Arc<Mutex<Routing>>,
    ) -> Self {
        let (e, i) = (moe.num_experts, moe.moe_intermediate_size);
        let init = Init::Randn {
            mean: 0.0,
            stdev: std,
        };
        let experts = &p / "experts";
        SparseMoe {
            router: (&p / "gate").var("weight", &[e, hidden], init),
            gate: experts.var("gate_proj", &[e, i, hidden], init),
            up: experts.var("up_proj", &[e, i, hidden], init),
            down: experts.var("down_proj", &[e, hidden, i], init),
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            slot,
            routing,
        }
    }

    fn routing(&self) -> MutexGuard<'_, Routing> {
        // A panic elsewhere while holding the lock leaves plain data behind; keep using it.
        self.routing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// x [.., H] -> [.., H].
    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let shape = x.size();
        let hidden = *shape.last().unwrap_or(&0);
        let flat = x.reshape([-1, hidden]);
        let n = flat.size()[0];
        // Router logits in the model's dtype, softmax in fp32 (as transformers and
        // Megatron's `--moe-router-dtype fp32` compute them).
        let logits = flat.linear(&self.router, None::<Tensor>);
        let probs = logits.softmax(-1, Kind::Float);
        let replayed = self.routing().replay_for(self.slot, n, self.top_k);
        let (mut top_p, top_i) = match replayed {
            Some(ids) => {
                // A row of -1 (a token the rollout did not record) takes this router's
                // own top-k.
                let ids = ids.to_device(x.device());
                let recorded = ids.ge(0).all_dim(-1, true);
                let own = probs.topk(self.top_k, -1, true, true).1;
                let ids = ids.where_self(&recorded, &own);
                (probs.gather(1, &ids, false), ids)
            }
            None => probs.topk(self.top_k, -1, true, true),
        };
        if self.norm_topk_prob {
            top_p = &top_p / top_p.sum_dim_intlist(-1, true, Kind::Float);
        }
        let weights = top_p.to_kind(x.kind());
        {
            let mut routing = self.routing();
            routing.record(self.slot, &top_i);
            let coeff = routing.aux_loss_coeff();
            if probs.requires_grad() && coeff > 0.0 {
                routing.push_aux(load_balancing_loss(&probs, &top_i, self.top_k) * coeff);
            }
        }
        let out = self.experts(&flat, &top_i, &weights);
        out.view(shape.as_slice())
    }

    /// The weighted sum of each token's k experts: rows are sorted by expert, each
    /// expert's rows run through its SwiGLU, and the weighted outputs are added back
    /// into their tokens.
    fn experts(&self, flat: &Tensor, top_i: &Tensor, weights: &Tensor) -> Tensor {
        let (n, hidden) = (flat.size()[0], flat.size()[1]);
        let num_experts = self.router.size()[0];
        let assignments = top_i.reshape([-1]);
        let order = assignments.argsort_stable(true, 0, false);
        let token_of = order.floor_divide_scalar(self.top_k);
        let counts: Vec<i64> = Vec::try_from(
            assignments
                .bincount(None::<Tensor>, num_experts)
                .to_device(tch::Device::Cpu),
        )
        .unwrap_or_default();
        let rows = flat.index_select(0, &token_of);
        let mut outs = Vec::with_capacity(counts.len());
        let mut start = 0;
        for (e, &count) in counts.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let e = e as i64;
            let x = rows.narrow(0, start, count);
            let gate = x.linear(&self.gate.get(e), None::<Tensor>);
            let up = x.linear(&self.up.get(e), None::<Tensor>);
            outs.push((gate.silu() * up).linear(&self.down.get(e), None::<Tensor>));
            start += count;
        }
        let out = flat.zeros_like();
        if outs.is_empty() {
            return out;
        }
        let expert_out = Tensor::cat(&outs, 0);
        let w = weights.reshape([-1]).index_select(0, &order).unsqueeze(1);
        debug_assert_eq!(expert_out.size(), [n * self.top_k, hidden]);
        out.index_add(0, &token_of, &(expert_out * w))
    }
}

/// Megatron's switch load-balancing loss of one layer (`moe_router_load_balancing_type
/// aux_loss`): E / (N² k) · Σ_e (Σ_tokens p_e) · (tokens routed to e), from fp32
/// probabilities [N, E] and the chosen ids [N, k]; gradients reach the router through
/// the probabilities only.
fn load_balancing_loss(probs: &Tensor, top_i: &Tensor, top_k: i64) -> Tensor {
    let (n, e) = (probs.size()[0], probs.size()[1]);
    let counts = top_i
        .reshape([-1])
        .bincount(None::<Tensor>, e)
        .to_kind(Kind::Float);
    let scale = e as f64 / ((n * n * top_k).max(1) as f64);
    (probs.sum_dim_intlist(0, false, Kind::Float) * counts).sum(Kind::Float) * scale
}

/// The hub's per-expert tensors behind one variable: a stacked expert variable
/// `….mlp.experts.gate_proj` [E, ..] becomes `….mlp.experts.{e}.gate_proj.weight` views
/// for every e (writing into a view writes the stacked variable); any other variable is
/// itself.
pub fn hub_tensors(name: &str, tensor: &Tensor) -> Vec<(String, Tensor)> {
    let stacked = STACKED.iter().find_map(|(suffix, proj)| {
        let prefix = name.strip_suffix(suffix)?;
        (prefix.ends_with(".mlp.") && tensor.dim() == 3).then_some((prefix, *proj))
    });
    match stacked {
        Some((prefix, proj)) => (0..tensor.size()[0])
            .map(|e| (format!("{prefix}experts.{e}.{proj}.weight"), tensor.get(e)))
            .collect(),
        None => vec![(name.to_string(), tensor.shallow_clone())],
    }
}

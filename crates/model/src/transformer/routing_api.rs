//! [`CausalLm`]'s mixture-of-experts controls: routing replay and records, and the
//! load-balancing loss. They do nothing on dense models.

use std::sync::MutexGuard;

use tch::Tensor;

use super::CausalLm;
use crate::moe::Routing;

impl CausalLm {
    pub(super) fn routing_lock(&self) -> MutexGuard<'_, Routing> {
        // The data stays consistent if a holder panicked; keep using it.
        self.routing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The number of sparse (expert) layers: the middle dimension of routing records.
    pub fn num_sparse_layers(&self) -> usize {
        self.cfg
            .moe()
            .map_or(0, |m| m.sparse_layers(self.cfg.num_hidden_layers).len())
    }

    /// Experts per token (`num_experts_per_tok`), for a mixture-of-experts model.
    pub fn experts_per_token(&self) -> Option<i64> {
        self.cfg.moe().map(|m| m.top_k)
    }

    /// Rollout routing replay: until cleared, every forward routes its N flattened tokens
    /// (row-major over [B, T], or a paged call's tokens in order) to the experts in `ids`
    /// [N, sparse layers, k], with gate weights from this model's own router
    /// probabilities at those ids (so the router still gets a gradient). Recomputed
    /// layers replay the same ids; a token whose row holds -1 takes this model's own
    /// top-k. `None` routes by this model's own top-k again.
    pub fn set_routing_replay(&self, ids: Option<Tensor>) {
        self.routing_lock().set_replay(ids);
    }

    /// Whether forwards record the experts each token was routed to
    /// ([`CausalLm::take_routed_experts`]).
    pub fn record_routing(&self, on: bool) {
        self.routing_lock().set_record(on);
    }

    /// The expert ids [N, sparse layers, k] (i64, CPU) of the last recorded forward's
    /// tokens; `None` on dense models, when recording is off, or when taken already.
    pub fn take_routed_experts(&self) -> Option<Tensor> {
        self.routing_lock().take_recorded()
    }

    /// Megatron's `--moe-aux-loss-coeff`: [`CausalLm::forward_backward`] adds this times
    /// the sum over sparse layers of each layer's switch load-balancing loss to the
    /// loss it back-propagates (0, the default, adds nothing).
    pub fn set_moe_aux_loss_coeff(&self, coeff: f64) {
        self.routing_lock().set_aux_loss_coeff(coeff);
    }

    /// The scaled load-balancing losses the sparse layers produced since the last call.
    pub(super) fn take_aux_loss(&self) -> Option<Tensor> {
        self.routing_lock().drain_aux()
    }
}

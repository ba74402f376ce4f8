//! Rollout routing replay (R3, Miles' `--use-rollout-routing-replay`) on the trainer's
//! side: the experts the rollout engine chose, laid out as one micro-batch's forward
//! sees its tokens, and the routing drift between rollout and training.

use manta_core::Sample;
use tch::{Device, Kind, Tensor};

use super::packing::Packed;
use super::{Trainer, TrainerError};

/// The rollout's expert ids of one micro-batch, [laid-out tokens, sparse layers, k]
/// i64 in the order the forward flattens its [rows, width] input; -1 rows are tokens
/// with no record (padding, each sample's last token, samples without routing).
pub(super) struct RolloutRouting {
    ids: Tensor,
    /// Rows holding a record.
    recorded: Tensor,
}

impl RolloutRouting {
    /// `None` when no sample of the micro-batch carries routed experts.
    pub(super) fn new(
        samples: &[Sample],
        packed: &Packed,
        layers: usize,
        k: usize,
    ) -> Option<Self> {
        if samples.iter().all(|s| s.routed_experts.is_none()) {
            return None;
        }
        let per_row = layers * k;
        let slots = (packed.rows * packed.width) as usize;
        let mut ids = vec![-1i64; slots * per_row];
        let mut offset = 0;
        for (b, s) in samples.iter().enumerate() {
            let base = if packed.key_mask.is_none() {
                offset
            } else {
                b * packed.width as usize
            };
            offset += s.tokens.len();
            if let Some(r) = &s.routed_experts {
                let at = base * per_row;
                for (dst, &src) in ids[at..at + r.ids.len()].iter_mut().zip(&r.ids) {
                    *dst = i64::from(src);
                }
            }
        }
        let ids = Tensor::from_slice(&ids).view([slots as i64, layers as i64, k as i64]);
        let recorded = ids.ge(0).all_dim(-1, false).all_dim(-1, false);
        Some(Self { ids, recorded })
    }

    /// What the model replays: the recorded rows, -1 (own routing) elsewhere.
    pub(super) fn replay(&self, device: Device) -> Tensor {
        self.ids.to_device(device)
    }

    /// (token-layer pairs whose expert set differs from the rollout's, pairs compared)
    /// between the rollout's record and the experts the trainer's forward used.
    pub(super) fn mismatch(&self, used: &Tensor) -> (f64, f64) {
        let rows = self.recorded.nonzero().squeeze_dim(-1);
        if rows.numel() == 0 || used.size() != self.ids.size() {
            return (0.0, 0.0);
        }
        let sort = |t: &Tensor| t.index_select(0, &rows).sort(-1, false).0;
        let rollout = sort(&self.ids);
        let trainer = sort(&used.to_device(Device::Cpu).to_kind(Kind::Int64));
        let differs = rollout.ne_tensor(&trainer).any_dim(-1, false);
        (
            differs.sum(Kind::Double).double_value(&[]),
            differs.numel() as f64,
        )
    }
}

impl Trainer {
    /// Refuses routed experts the model cannot replay, naming the sample; with replay on,
    /// refuses samples without them too (the trainer would silently route them itself).
    pub(super) fn check_routing(&self, samples: &[Sample]) -> Result<(), TrainerError> {
        let replay = self.opts.algo.use_rollout_routing_replay;
        if replay && self.context_parallel {
            return Err(TrainerError::Config(
                "--use-rollout-routing-replay with --context-parallel-size > 1 is not supported \
                 (each rank sees a slice of the tokens); drop one of them"
                    .into(),
            ));
        }
        let layers = self.model.num_sparse_layers();
        let k = self.model.experts_per_token().unwrap_or(0);
        let experts = self.model.config().moe().map_or(0, |m| m.num_experts);
        for s in samples {
            match &s.routed_experts {
                None if replay => {
                    return Err(TrainerError::Batch(format!(
                        "sample {}: no routed experts, but --use-rollout-routing-replay is on \
                         (the rollout must return them: native engines and SGLang started \
                         with --enable-return-routed-experts)",
                        s.id
                    )))
                }
                None => {}
                Some(r) => {
                    if r.layers as usize != layers || i64::from(r.top_k) != k {
                        return Err(TrainerError::Batch(format!(
                            "sample {}: routed experts of {} layers x top-{}, the model has {layers} \
                             sparse layers x top-{k}",
                            s.id, r.layers, r.top_k
                        )));
                    }
                    if let Some(bad) = r.ids.iter().find(|&&e| i64::from(e) >= experts) {
                        return Err(TrainerError::Batch(format!(
                            "sample {}: routed expert id {bad} is outside the model's {experts} experts",
                            s.id
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The rollout routing of a micro-batch, when its samples carry one; with replay on
    /// the model is set to replay it (and every forward records its experts for the
    /// drift metric). [`Trainer::end_routing`] undoes both.
    pub(super) fn begin_routing(
        &self,
        samples: &[Sample],
        packed: &Packed,
    ) -> Option<RolloutRouting> {
        // Whatever an earlier pass left behind (one that failed half-way) goes first.
        self.model.set_routing_replay(None);
        self.model.record_routing(false);
        let k = self.model.experts_per_token()? as usize;
        let routing = RolloutRouting::new(samples, packed, self.model.num_sparse_layers(), k)?;
        if self.opts.algo.use_rollout_routing_replay {
            self.model
                .set_routing_replay(Some(routing.replay(self.opts.device)));
        }
        self.model.record_routing(true);
        Some(routing)
    }

    /// Ends [`Trainer::begin_routing`]: the drift of the last forward, replay and records off.
    pub(super) fn end_routing(&self, routing: Option<RolloutRouting>) -> (f64, f64) {
        let Some(routing) = routing else {
            return (0.0, 0.0);
        };
        let used = self.model.take_routed_experts();
        self.model.set_routing_replay(None);
        self.model.record_routing(false);
        used.map_or((0.0, 0.0), |u| routing.mismatch(&u))
    }
}

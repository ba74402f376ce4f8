//! Routing records and replay: which experts each token of a forward went to, per sparse
//! layer, and the wire form SGLang uses for them (`meta_info.routed_experts`).

use base64::Engine as _;
use tch::{Device, Kind, Tensor};

/// The routing side channel of one model: what its sparse layers replay and record, and
/// the load-balancing losses they produce. Shared by the model and its sparse layers;
/// set through `CausalLm`'s routing methods.
#[derive(Default)]
pub struct Routing {
    /// [N, sparse layers, k] i64: expert ids the next forwards must use, in the order of
    /// their flattened tokens.
    replay: Option<Tensor>,
    record: bool,
    /// Per sparse layer, the [N, k] ids of the last forward that reached it.
    recorded: Vec<Option<Tensor>>,
    aux_loss_coeff: f64,
    /// Load-balancing losses (already scaled by the coefficient) since the last drain.
    aux: Vec<Tensor>,
}

impl Routing {
    pub(crate) fn new(sparse_layers: usize) -> Self {
        Routing {
            recorded: (0..sparse_layers).map(|_| None).collect(),
            ..Routing::default()
        }
    }

    pub(crate) fn set_replay(&mut self, ids: Option<Tensor>) {
        self.replay = ids.map(|t| t.to_kind(Kind::Int64));
    }

    pub(crate) fn set_record(&mut self, on: bool) {
        self.record = on;
        if !on {
            self.recorded.iter_mut().for_each(|r| *r = None);
        }
    }

    pub(crate) fn set_aux_loss_coeff(&mut self, coeff: f64) {
        self.aux_loss_coeff = coeff;
    }

    pub(crate) fn aux_loss_coeff(&self) -> f64 {
        self.aux_loss_coeff
    }

    /// The replayed ids of sparse layer `slot` for a forward of `n` tokens; panics when
    /// the replay was made for another token count (a caller's bookkeeping error that
    /// would otherwise route tokens with another token's experts).
    pub(crate) fn replay_for(&self, slot: i64, n: i64, k: i64) -> Option<Tensor> {
        let replay = self.replay.as_ref()?;
        let size = replay.size();
        assert!(
            size.len() == 3 && size[0] == n && size[1] > slot && size[2] == k,
            "routing replay of shape {size:?} does not fit a forward of {n} tokens \
             (sparse layer {slot}, top-{k})"
        );
        Some(replay.select(1, slot))
    }

    pub(crate) fn record(&mut self, slot: i64, ids: &Tensor) {
        if self.record {
            if let Some(entry) = self.recorded.get_mut(slot as usize) {
                *entry = Some(ids.detach());
            }
        }
    }

    pub(crate) fn push_aux(&mut self, loss: Tensor) {
        self.aux.push(loss);
    }

    /// The sum of the load-balancing losses pushed since the last call (with their graph).
    pub(crate) fn drain_aux(&mut self) -> Option<Tensor> {
        let mut losses = std::mem::take(&mut self.aux).into_iter();
        let first = losses.next()?;
        Some(losses.fold(first, |acc, l| acc + l))
    }

    pub(crate) fn clear_aux(&mut self) {
        self.aux.clear();
    }

    /// [N, sparse layers, k] i64 on the CPU: the last recorded forward's expert ids.
    pub(crate) fn take_recorded(&mut self) -> Option<Tensor> {
        let layers: Vec<Tensor> = self
            .recorded
            .iter_mut()
            .map(Option::take)
            .collect::<Option<Vec<_>>>()?;
        if layers.is_empty() {
            return None;
        }
        Some(Tensor::stack(&layers, 1).to_device(Device::Cpu))
    }
}

/// SGLang's wire form of routed experts: base64 of little-endian int32 in row-major
/// [tokens, layers, k] order. `ids` is any integer tensor of that shape.
pub fn encode_routed_experts(ids: &Tensor) -> String {
    let flat: Vec<i32> = Vec::try_from(
        ids.to_device(Device::Cpu)
            .to_kind(Kind::Int)
            .contiguous()
            .view([-1]),
    )
    .unwrap_or_default();
    let bytes: Vec<u8> = flat.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Decodes [`encode_routed_experts`]'s string into `[tokens, layers, k]` ids (i32 values
/// widened to i64). Errors name what is wrong with the string.
pub fn decode_routed_experts(text: &str, layers: usize, k: usize) -> Result<Vec<i64>, String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| format!("routed_experts is not base64: {e}"))?;
    let row = 4 * layers * k;
    if row == 0 || bytes.len() % row != 0 {
        return Err(format!(
            "routed_experts holds {} bytes, not a whole number of [{layers}, {k}] int32 rows",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect())
}

/// The fraction of (token, sparse layer) pairs whose expert sets differ between two
/// routing records [N, layers, k] (order within a token's k does not matter): the
/// routing drift between rollout and training.
pub fn routing_mismatch(a: &Tensor, b: &Tensor) -> f64 {
    if a.size() != b.size() || a.numel() == 0 {
        return if a.numel() == 0 && b.numel() == 0 {
            0.0
        } else {
            1.0
        };
    }
    let sort = |t: &Tensor| {
        t.to_device(Device::Cpu)
            .to_kind(Kind::Int64)
            .sort(-1, false)
            .0
    };
    let differs = sort(a).ne_tensor(&sort(b)).any_dim(-1, false);
    differs
        .to_kind(Kind::Double)
        .mean(Kind::Double)
        .double_value(&[])
}

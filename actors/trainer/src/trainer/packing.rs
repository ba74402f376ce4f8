//! A micro-batch laid out for one forward pass, and the filler input of ZeRO-3's empty passes.

use manta_core::Sample;
use manta_model::{Attention, CausalLm, LayerHooks};
use tch::{Device, Kind, Tensor};

/// A micro-batch laid out for one forward pass: only loss-mask-1 tokens are gathered.
///
/// Packed (the default): the samples are concatenated into one row [1, sum of lengths]
/// with positions restarting at each sample and attention kept inside each sample
/// ([`Attention::Segments`]), so no padding is computed. Padded: one row per sample,
/// right-padded to the longest, with a key mask.
pub(super) struct Packed {
    pub(super) rows: i64,
    pub(super) width: i64,
    pub(super) input: Tensor,
    /// Padded layout: [rows, width], 1 on real tokens.
    pub(super) key_mask: Option<Tensor>,
    /// Packed layout: each sample's length, in row order.
    pub(super) lengths: Vec<i64>,
    pub(super) positions: Tensor,
    /// Flat index of the hidden state predicting each trained token.
    pub(super) gather: Tensor,
    pub(super) targets: Tensor,
    /// Trained tokens per sample.
    pub(super) masks: Vec<Vec<f32>>,
    pub(super) segment: Tensor,
    pub(super) counts: Tensor,
}

impl Packed {
    pub(super) fn new(samples: &[Sample], device: Device, pack: bool) -> Self {
        let total: usize = samples.iter().map(|s| s.tokens.len()).sum();
        let longest = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
        let (rows, width) = if pack {
            (1, total)
        } else {
            (samples.len(), longest)
        };
        let mut ids = vec![0i64; rows * width];
        let mut key_mask = vec![0i64; rows * width];
        let mut positions = vec![0i64; rows * width];
        let (mut gather, mut targets, mut segment, mut counts) = (vec![], vec![], vec![], vec![]);
        let mut masks = Vec::with_capacity(samples.len());
        let mut offset = 0;
        for (b, s) in samples.iter().enumerate() {
            let base = if pack { offset } else { b * width };
            offset += s.tokens.len();
            for (j, &t) in s.tokens.iter().enumerate() {
                ids[base + j] = t as i64;
                key_mask[base + j] = 1;
                positions[base + j] = j as i64;
            }
            let prompt = s.prompt_length();
            let mut mask = Vec::new();
            for (k, &m) in s.loss_mask.iter().enumerate() {
                if m == 1 {
                    let pos = prompt + k;
                    gather.push((base + pos - 1) as i64);
                    targets.push(s.tokens[pos] as i64);
                    segment.push(b as i64);
                    mask.push(1.0f32);
                }
            }
            counts.push(mask.len() as f32);
            masks.push(mask);
        }
        let (rows, width) = (rows as i64, width as i64);
        let key_mask =
            (!pack).then(|| Tensor::from_slice(&key_mask).view([rows, width]).to(device));
        let positions = if pack {
            Tensor::from_slice(&positions)
                .view([rows, width])
                .to(device)
        } else {
            // Padding positions keep counting, as they always did (they are masked out).
            Tensor::arange(width, (Kind::Int64, device))
                .unsqueeze(0)
                .expand([rows, width], false)
        };
        Self {
            rows,
            width,
            input: Tensor::from_slice(&ids).view([rows, width]).to(device),
            key_mask,
            lengths: if pack {
                samples.iter().map(|s| s.tokens.len() as i64).collect()
            } else {
                Vec::new()
            },
            positions,
            gather: Tensor::from_slice(&gather).to(device),
            targets: Tensor::from_slice(&targets).to(device),
            masks,
            segment: Tensor::from_slice(&segment).to(device),
            counts: Tensor::from_slice(&counts).to(device),
        }
    }

    /// How the rows attend: within each sample of the packed row, or causally with the
    /// padding masked.
    pub(super) fn attention(&self) -> Attention<'_> {
        match &self.key_mask {
            Some(key_mask) => Attention::Causal {
                key_mask: Some(key_mask),
            },
            None => Attention::Segments {
                lengths: &self.lengths,
            },
        }
    }

    pub(super) fn tokens(&self) -> i64 {
        self.targets.size()[0]
    }

    /// Log-probs of the trained tokens under `model`, without autograd; `hooks` gather
    /// ZeRO-3's layers ([`NoHooks`] otherwise).
    pub(super) fn logprobs<H: LayerHooks>(
        &self,
        model: &CausalLm,
        hooks: &mut H,
        temperature: f64,
        chunk: i64,
    ) -> Result<Tensor, H::Error> {
        tch::no_grad(|| {
            let hidden = model.forward_hidden_hooked(
                &self.input,
                &self.positions,
                &self.attention(),
                hooks,
            )?;
            let selected = hidden
                .view([self.rows * self.width, -1])
                .index_select(0, &self.gather);
            Ok(
                manta_model::token_logprobs(model, &selected, &self.targets, temperature, chunk)
                    .0
                    .to_kind(Kind::Float),
            )
        })
    }
}

/// Never fails: the unhooked passes' result.
pub(super) fn infallible<T>(r: Result<T, std::convert::Infallible>) -> T {
    match r {
        Ok(t) => t,
        Err(never) => match never {},
    }
}

/// A one-row, two-token input for ZeRO-3's filler passes.
pub(super) fn filler_input(device: Device) -> (Tensor, Tensor) {
    let ids = Tensor::zeros([1, 2], (Kind::Int64, device));
    let positions = Tensor::arange(2, (Kind::Int64, device)).unsqueeze(0);
    (ids, positions)
}

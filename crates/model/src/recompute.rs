//! Which decoder layers recompute their activations in the backward pass instead of
//! keeping them, with Megatron's meaning of the flags slime users pass:
//! `--recompute-granularity full --recompute-method uniform|block --recompute-num-layers N`.
//!
//! - `uniform`: the stack is cut into groups of N consecutive layers (the last group may
//!   be shorter); only each group's input is kept, and the whole group is recomputed in
//!   the backward pass. N = 1 recomputes every layer on its own (the most memory saved).
//! - `block`: the first N layers are recomputed one at a time; the remaining layers keep
//!   their activations (no recomputation). N = number of layers recomputes every layer;
//!   fewer trades memory for speed (the fewest that fit is the fastest).

use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How recomputed layers are chosen (`--recompute-method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecomputeMethod {
    /// Groups of `num_layers` layers, each recomputed as a unit; every layer recomputed.
    Uniform,
    /// The first `num_layers` layers recomputed, the rest keep their activations.
    Block,
}

impl FromStr for RecomputeMethod {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uniform" => Ok(Self::Uniform),
            "block" => Ok(Self::Block),
            other => Err(format!(
                "--recompute-method {other:?}: expected uniform or block"
            )),
        }
    }
}

/// Megatron's full-granularity activation recompute: a method and its layer count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recompute {
    pub method: RecomputeMethod,
    /// `--recompute-num-layers`: the group size (uniform) or how many of the first
    /// layers are recomputed (block); between 1 and the model's layer count.
    pub num_layers: usize,
}

/// A recompute setting the model cannot apply, naming the flag and its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecomputeError {
    #[error(
        "--recompute-num-layers (recompute_num_layers) = {value}: must be between 1 and the \
         model's {layers} layers"
    )]
    NumLayers { value: usize, layers: usize },
}

impl Recompute {
    /// Every layer recomputed on its own (the former `gradient_checkpointing = true`).
    pub const EVERY_LAYER: Recompute = Recompute {
        method: RecomputeMethod::Uniform,
        num_layers: 1,
    };

    /// Checks `num_layers` against a model of `layers` decoder layers.
    pub fn check(&self, layers: usize) -> Result<(), RecomputeError> {
        if self.num_layers == 0 || self.num_layers > layers {
            return Err(RecomputeError::NumLayers {
                value: self.num_layers,
                layers,
            });
        }
        Ok(())
    }

    /// How many of `layers` layers run twice (forward again in the backward pass).
    pub fn recomputed_layers(&self, layers: usize) -> usize {
        match self.method {
            RecomputeMethod::Uniform => layers,
            RecomputeMethod::Block => self.num_layers.min(layers),
        }
    }

    /// The stack of `layers` layers cut into consecutive units, each either recomputed
    /// (only its input kept) or not (its activations kept), in layer order.
    pub fn units(&self, layers: usize) -> Vec<(Range<usize>, bool)> {
        let n = self.num_layers.clamp(1, layers.max(1));
        match self.method {
            RecomputeMethod::Uniform => (0..layers)
                .step_by(n)
                .map(|s| (s..(s + n).min(layers), true))
                .collect(),
            RecomputeMethod::Block => {
                let mut units: Vec<_> = (0..n.min(layers)).map(|i| (i..i + 1, true)).collect();
                if n < layers {
                    units.push((n..layers, false));
                }
                units
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_groups_cover_every_layer_and_block_keeps_the_tail() {
        let uniform = Recompute {
            method: RecomputeMethod::Uniform,
            num_layers: 2,
        };
        assert_eq!(
            uniform.units(5),
            vec![(0..2, true), (2..4, true), (4..5, true)]
        );
        let block = Recompute {
            method: RecomputeMethod::Block,
            num_layers: 2,
        };
        assert_eq!(
            block.units(5),
            vec![(0..1, true), (1..2, true), (2..5, false)]
        );
        assert_eq!(block.recomputed_layers(5), 2);
        let all = Recompute {
            method: RecomputeMethod::Block,
            num_layers: 5,
        };
        assert_eq!(all.units(5), Recompute::EVERY_LAYER.units(5));
    }

    #[test]
    fn layer_counts_outside_the_model_are_rejected_by_name() {
        let r = Recompute {
            method: RecomputeMethod::Block,
            num_layers: 7,
        };
        let err = r.check(4).unwrap_err().to_string();
        assert!(
            err.contains("--recompute-num-layers") && err.contains("7") && err.contains("4 layers"),
            "{err}"
        );
        assert!(Recompute { num_layers: 0, ..r }.check(4).is_err());
        assert!(Recompute { num_layers: 4, ..r }.check(4).is_ok());
        let err = "blocks".parse::<RecomputeMethod>().unwrap_err();
        assert!(
            err.contains("--recompute-method") && err.contains("blocks"),
            "{err}"
        );
    }
}

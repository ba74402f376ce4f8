//! The enumerated choices of slime's loss and schedule flags. Each is defined once here
//! and used as it is by the settings (the flag's values through clap, the `[train]` key's
//! through serde: slime's names, e.g. `reinforce_plus_plus`), the trainer and the
//! messages that carry them to workers. The variant names (`Grpo`) are read too: the
//! spelling earlier builds wrote in those messages and states.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// `--advantage-estimator`: how rewards become advantages, and the policy loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    #[default]
    #[serde(alias = "Grpo")]
    Grpo,
    /// GSPO's sequence-level ratio.
    #[serde(alias = "Gspo")]
    Gspo,
    #[serde(alias = "Cispo")]
    Cispo,
    #[serde(alias = "ReinforcePlusPlus")]
    ReinforcePlusPlus,
    #[serde(alias = "ReinforcePlusPlusBaseline")]
    ReinforcePlusPlusBaseline,
}

/// `--kl-loss-type`: the estimator of the KL to the reference model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum KlType {
    #[default]
    #[serde(alias = "K1")]
    K1,
    #[serde(alias = "K2")]
    K2,
    #[serde(alias = "K3")]
    K3,
    #[serde(alias = "LowVarKl")]
    LowVarKl,
}

/// `--tis-mode`: what truncated importance sampling does outside its band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum TisMode {
    /// Clamp the weight into the band.
    #[default]
    #[serde(alias = "Truncate")]
    Truncate,
    /// Zero the tokens outside it (slime's icepop).
    #[serde(alias = "Mask")]
    Mask,
}

/// `--lr-decay-style`: the learning rate's decay after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum DecayStyle {
    #[default]
    #[serde(alias = "Constant")]
    Constant,
    #[serde(alias = "Linear")]
    Linear,
    #[serde(alias = "Cosine")]
    Cosine,
}

/// The name a choice has on the command line and in `[train]`.
fn name_of<T: ValueEnum>(value: &T) -> String {
    value
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default()
}

/// Every name of `T`, comma-separated (for errors).
fn names<T: ValueEnum>() -> String {
    T::value_variants()
        .iter()
        .map(name_of)
        .collect::<Vec<_>>()
        .join(", ")
}

macro_rules! named_choice {
    ($ty:ty, $what:literal) => {
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&name_of(self))
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                <$ty as ValueEnum>::from_str(s, false).map_err(|_| {
                    format!(
                        concat!("unknown ", $what, " {:?}: expected one of {}"),
                        s,
                        names::<$ty>()
                    )
                })
            }
        }
    };
}

named_choice!(AdvantageEstimator, "advantage estimator");
named_choice!(KlType, "KL loss type");
named_choice!(TisMode, "TIS mode");
named_choice!(DecayStyle, "LR decay style");

#[cfg(test)]
mod tests {
    use super::*;

    /// The flag's values, the `[train]` key's and the displayed names are slime's, alike.
    #[test]
    fn names_are_slimes_in_every_form() {
        for (value, name) in [
            (
                AdvantageEstimator::ReinforcePlusPlusBaseline,
                "reinforce_plus_plus_baseline",
            ),
            (AdvantageEstimator::Grpo, "grpo"),
        ] {
            assert_eq!(value.to_string(), name);
            assert_eq!(name.parse::<AdvantageEstimator>(), Ok(value));
            assert_eq!(
                serde_json::to_value(value).unwrap(),
                serde_json::json!(name)
            );
        }
        assert_eq!(KlType::LowVarKl.to_string(), "low_var_kl");
        assert_eq!("mask".parse::<TisMode>(), Ok(TisMode::Mask));
        assert_eq!(
            serde_json::from_str::<DecayStyle>("\"cosine\"").unwrap(),
            DecayStyle::Cosine
        );
        let err = "ppo".parse::<AdvantageEstimator>().unwrap_err();
        assert!(err.contains("\"ppo\"") && err.contains("cispo"), "{err}");
    }
}

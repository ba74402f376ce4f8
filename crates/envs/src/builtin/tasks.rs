//! Deterministic task generation shared by the built-in environments.

use crate::env::{EnvError, Split};

/// Split sizes of a built-in environment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SplitSizes {
    pub train: u64,
    pub test: u64,
}

impl SplitSizes {
    pub(crate) fn splits(&self) -> Vec<Split> {
        vec![Split::named("train"), Split::named("test")]
    }

    pub(crate) fn len(&self, split: &str) -> Result<u64, EnvError> {
        match split {
            "train" => Ok(self.train),
            "test" => Ok(self.test),
            other => Err(EnvError::UnknownSplit(other.to_string())),
        }
    }

    /// Checks `index` and returns a seed unique to (`salt`, `split`, `index`).
    pub(crate) fn seed(&self, salt: u64, split: &str, index: u64) -> Result<u64, EnvError> {
        let len = self.len(split)?;
        if index >= len {
            return Err(EnvError::IndexOutOfRange {
                split: split.to_string(),
                index,
                len,
            });
        }
        let split_salt: u64 = if split == "train" {
            0x5452_4149_4e00
        } else {
            0x5445_5354_0000
        };
        Ok(mix(salt ^ split_salt ^ mix(index)))
    }
}

/// SplitMix64 finaliser: a fixed, well-spread hash so tasks never change between runs.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

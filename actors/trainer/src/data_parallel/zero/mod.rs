//! ZeRO-2 and ZeRO-3 AdamW over the data-parallel ranks ([`ZeroAdamW`]): the optimizer
//! and its ZeRO-2 step ([`optimizer`]), ZeRO-3's per-layer gathers and reductions
//! ([`stage3`]) with their collectives in flight ([`in_flight`]), the shard files
//! ([`checkpoint`]), the free functions under them ([`flat`]), and the optimizer a rank
//! steps in any setting ([`rank`]).

mod checkpoint;
mod flat;
mod in_flight;
mod optimizer;
mod rank;
mod stage3;
#[cfg(test)]
mod tests;

pub use checkpoint::shard_file_name;
pub use flat::{stage3_groups, OUTER_BUCKET};
pub use optimizer::{
    ShardBytes, ZeroAdamW, BUCKET_NUMEL_KEY, DEFAULT_BUCKET_NUMEL, ZERO_STAGE_KEY,
};
pub use rank::RankOptimizer;
pub use stage3::Zero3Pass;

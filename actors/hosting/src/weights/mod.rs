//! Weights between processes over gRPC, with no shared disk: the chunked wire format
//! ([`wire`]), the worker's `WeightSync` service ([`worker`]) and the driver's calls
//! ([`client`]); rank 0 of a weight-update group on the trainer's worker ([`root`]), and
//! the engines receiving a broadcast, for aborting them ([`aborts`]).

pub mod aborts;
pub mod client;
pub mod root;
pub mod wire;
pub mod worker;

pub use client::WeightSyncCalls;
pub use manta_proto::weight_sync::PauseMode;
pub use wire::{
    chunk_bytes, digest_tensors, tensor_bytes, Assembler, TensorBytes, WeightChunk, WeightSet,
    WeightsError, CHUNK_ENV, DEFAULT_CHUNK_BYTES, MAX_WEIGHT_MESSAGE,
};

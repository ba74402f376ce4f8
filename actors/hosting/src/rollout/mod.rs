//! Rollout actors on workers: their spawn config ([`spawn`]), what a worker runs for
//! them ([`worker`]: the actor host and the `Rollout` service), the driver's calls
//! ([`client`]), episode requests on the wire ([`convert`]) and the driver's pool of
//! them across nodes ([`pool`]) with rank 0 of its weight-update group ([`rank0`]).

pub mod client;
pub mod convert;
pub mod pool;
pub mod rank0;
pub mod spawn;
pub mod worker;

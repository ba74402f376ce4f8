//! A trainer on a worker: its spawn config ([`spawn`]), what the worker runs for it
//! ([`worker`]: the actor host and the `Trainer` service), the driver's calls
//! ([`client`]) and the driver's handle with its heartbeat and restart ([`remote`]);
//! ranks of a data-parallel group on several workers ([`rank_group`]).

pub mod client;
pub mod rank_group;
pub mod remote;
pub mod spawn;
pub mod worker;

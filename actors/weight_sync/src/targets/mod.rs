//! Where the engines a sync feeds live: in this process ([`in_process`]) or on worker
//! daemons ([`workers`]).

pub mod in_process;
pub mod workers;

pub use in_process::InProcessEngines;
pub use workers::WorkerEngines;

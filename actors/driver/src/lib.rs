//! The driver: configuration, placement, the step loop, checkpoints and metrics.
//! `main.rs` is the `driver` binary; everything else is here so tests can drive it.

pub mod cli;
pub mod debug_data;
pub mod driver_actor;
pub mod export;
pub mod generate;
pub mod hf_cache;
pub mod load_dir;
pub mod local;
pub mod placement;
pub mod prepare_tasks;
pub mod py_random;
pub mod remote;
pub mod remote_ranks;
pub mod rollouts;
pub mod run;
pub mod run_dir;
pub mod sampling;
pub mod shutdown;
pub mod slime_args;
pub mod step;
pub mod tasks;
pub mod trainer_handle;

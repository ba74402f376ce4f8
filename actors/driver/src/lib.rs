//! The driver: configuration, placement, the step loop, checkpoints and metrics.
//! `main.rs` is the `driver` binary; everything else is here so tests can drive it.

pub mod checkpoint_manifest;
pub mod cli;
pub mod debug_data;
pub mod driver_actor;
pub mod error_report;
pub mod eval;
pub mod export;
pub mod failure_budget;
pub mod generate;
pub mod guard_flags;
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
pub mod run_lock;
pub mod sampling;
pub mod save_dir;
pub mod settings_report;
pub mod shutdown;
pub mod signals;
pub mod slime_args;
pub mod status;
pub mod status_cmd;
pub mod status_server;
pub mod step;
pub mod tasks;
pub mod trainer_handle;
pub mod worker_metrics;

//! The driver's tests against its real binaries (`driver`, `worker`), one test binary:
//! each module is one subject (a command, a mode, a failure). They share `common` (the
//! workspace, checked runs, workers, SDK servers) and the Python peers in tests/py. The
//! GPU-only tests (serve_weights_nccl, sglang_real) are test binaries of their own, which
//! the GPU scripts run whole.

mod common;

mod bare_env;
mod cli_reference;
mod cluster_e2e;
mod context_parallel_local;
mod crash_mid_save;
mod data_parallel_local;
mod data_parallel_workers;
mod debug_rollout_pytorch;
mod debug_rollout_save;
mod eval_during_training;
mod generate_parity;
mod hf_export;
mod integrity;
mod load_fresh;
mod local_e2e;
mod loop_sampling;
mod moe_generate;
mod otel_e2e;
mod prepare_tasks;
mod resume_exact;
mod serve_http;
mod sglang_engine;
mod stop_signals;
mod wandb_e2e;
mod weight_sync_e2e;
mod zero3_local;
mod zero3_weight_parts;

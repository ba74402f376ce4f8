//! `driver`: trains an LLM with GRPO on OpenReward environments.

use std::process::ExitCode;

use clap::Parser;
use manta_driver::cli::{Cli, Command};

fn main() -> ExitCode {
    // Before any thread: NCCL reads its environment once, and every rank must agree.
    let nccl_env = manta_cuda::process_group::align_nccl_env();
    if let Err(e) = manta_knobs::check() {
        eprintln!("error: {e} (docs/knobs.md lists the knobs)");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // slime's and Miles' flags: ignored ones dropped, all refused ones named at once.
    let translated = match manta_driver::slime_args::translate(std::env::args_os()) {
        Ok(t) => t,
        Err(refused) => {
            eprintln!("error: {refused}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(async {
        let cli = Cli::parse_from(&translated.args);
        let _telemetry = manta_telemetry::init_logging("manta-driver");
        if let Some(warning) = translated.warning() {
            tracing::warn!("{warning}");
        }
        tracing::debug!(nccl_env, "NCCL environment");
        let spellings = manta_driver::settings_report::spellings(&translated.args);
        let code = run(cli, spellings).await;
        // Export the last spans while the runtime (which runs the OTLP connection) is up.
        manta_telemetry::shutdown_tracing();
        code
    })
}

async fn run(cli: Cli, spellings: std::collections::BTreeMap<String, String>) -> ExitCode {
    let mut args = match cli.command {
        Some(Command::Train(args)) => args,
        Some(Command::Generate(args)) => {
            return match manta_driver::generate::generate(&args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {}", manta_driver::error_report::render(&e));
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::Serve(args)) => {
            return match manta_serve::serve(&args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {}", manta_driver::error_report::render(&e));
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::Export(args)) => {
            return match manta_driver::export::run(&args).await {
                Ok(exported) => {
                    println!("{}", manta_driver::export::summary(&exported));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {}", manta_driver::error_report::render(&e));
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::PrepareTasks(args)) => {
            return match manta_driver::prepare_tasks::prepare_tasks(&args).await {
                Ok(summary) => {
                    println!("wrote {} tasks to {}", summary.tasks, args.output.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {}", manta_driver::error_report::render(&e));
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::Status(args)) => {
            return match manta_driver::status_cmd::status(&args).await {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        None => cli.train,
    };
    args.spellings = spellings;
    // SIGINT or SIGTERM: end the run (manta_driver::signals); a second: exit now (130).
    let stop = manta_driver::signals::StopRequest::new(args.on_stop);
    if let Err(e) = manta_driver::signals::watch(stop.clone()) {
        eprintln!("error: watching SIGINT and SIGTERM: {e}");
        return ExitCode::FAILURE;
    }
    match manta_driver::run::train(&args, stop).await {
        Ok(summary) => {
            println!(
                "done: {} steps, metrics in {}",
                summary.steps_done,
                summary.run_dir.join("metrics.jsonl").display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", manta_driver::error_report::render(&e));
            ExitCode::FAILURE
        }
    }
}

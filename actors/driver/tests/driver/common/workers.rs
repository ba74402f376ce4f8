//! `worker` daemons for remote-mode tests: each a real process in a working directory of
//! its own (as on separate nodes, nothing shared but the paths the driver sends), killed
//! and reaped when the test lets go of it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::Worker;

/// A worker listening on `127.0.0.1:port` with the cluster token `token`, its working
/// directory `cwd` (created) and its log in `cwd.log`; returns once it listens.
pub fn start_worker_in(cwd: &Path, port: u16, token: &str) -> Worker {
    let mut cmd = worker_command(cwd, port, token);
    let log = std::fs::File::create(log_of(cwd)).unwrap();
    cmd.stdout(log.try_clone().unwrap()).stderr(log);
    spawn_listening(&mut cmd, port)
}

/// The `worker` command listening on `127.0.0.1:port` with the cluster token `token`
/// (no token file), in working directory `cwd` (created), with no OpenReward settings
/// in its environment and RUST_LOG=info; [`spawn_listening`] starts it.
pub fn worker_command(cwd: &Path, port: u16, token: &str) -> Command {
    std::fs::create_dir_all(cwd).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.current_dir(cwd)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("MANTA_CLUSTER_TOKEN", token)
        .env_remove("MANTA_CLUSTER_TOKEN_FILE")
        .env_remove("OPENREWARD_API_KEY")
        .env_remove("OPENREWARD_API_URL")
        .env_remove("OPENREWARD_SESSION_URL")
        .env("RUST_LOG", "info");
    cmd
}

/// Starts `cmd`, a [`worker_command`] for `port`, and returns once it listens.
pub fn spawn_listening(cmd: &mut Command, port: u16) -> Worker {
    let child = cmd.spawn().expect("worker starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "worker on {port} never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    Worker(child)
}

/// `path` opened for appending (created if missing): a log that a restarted worker
/// writes on after its predecessor's lines.
pub fn appending(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap()
}

/// Where [`start_worker_in`] logs for working directory `cwd`.
pub fn log_of(cwd: &Path) -> PathBuf {
    cwd.with_extension("log")
}

//! What the driver's integration tests share: where the workspace is (they run the
//! `driver` binary from it, so `cluster.toml` and `assets/` resolve), and a checked run.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `driver ARGS` from the workspace (RUST_LOG=warn) and fails the test, with both
/// output streams, if it does not succeed.
pub fn driver_ok(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("driver runs");
    assert!(
        out.status.success(),
        "driver {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A free TCP port on the loopback interface (for a worker to listen on).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("its address")
        .port()
}

/// A `worker` process, killed and reaped when the test lets go of it.
pub struct Worker(pub std::process::Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

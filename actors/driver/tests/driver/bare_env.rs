//! `driver` and `worker` start on a machine where nothing points at libtorch: no
//! LD_LIBRARY_PATH, no venv on PATH (the run path set by build.rs finds it).

use std::process::Command;

/// Runs `bin --help` with an empty environment except a minimal PATH.
fn help_in_bare_env(bin: &str) -> (bool, String, String) {
    let out = Command::new(bin)
        .arg("--help")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn driver_help_runs_without_ld_library_path() {
    let (ok, stdout, stderr) = help_in_bare_env(env!("CARGO_BIN_EXE_driver"));
    assert!(
        ok,
        "driver --help failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("Usage: driver"), "{stdout}");
    assert!(stdout.contains("--cluster"), "{stdout}");
}

#[test]
fn worker_help_runs_without_ld_library_path() {
    let (ok, stdout, stderr) = help_in_bare_env(env!("CARGO_BIN_EXE_worker"));
    assert!(
        ok,
        "worker --help failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("Usage: worker"), "{stdout}");
    assert!(stdout.contains("--listen"), "{stdout}");
}

//! The bench binaries start without LD_LIBRARY_PATH: each reaches its own `main` (its
//! usage message) instead of failing in the dynamic loader.

use std::process::Command;

/// Runs `bin` without arguments in an empty environment except a minimal PATH.
fn stderr_in_bare_env(bin: &str) -> String {
    let out = Command::new(bin)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bench_binaries_start_without_ld_library_path() {
    let control_plane = stderr_in_bare_env(env!("CARGO_BIN_EXE_control_plane"));
    assert!(
        control_plane.contains("usage: control_plane"),
        "{control_plane}"
    );
    let ors_load = stderr_in_bare_env(env!("CARGO_BIN_EXE_ors_load"));
    assert!(ors_load.contains("usage: ors_load"), "{ors_load}");
}

//! Helpers shared by the integration tests: locating the workspace, the Python interpreter and the
//! shipped assets, and running the Python reference scripts.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The shipped tiny model directory.
pub fn tiny_assets_dir() -> PathBuf {
    workspace_root().join("assets/tiny-qwen3")
}

/// The Python with transformers: `$MANTA_PYTHON`, else `<workspace>/.venv/bin/python`.
pub fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// Runs `tests/py/<script>` with `args` and parses its stdout as JSON; panics with stderr on failure.
pub fn run_python_json(script: &str, args: &[&Path]) -> serde_json::Value {
    let script_path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/py")
        .join(script);
    let output = Command::new(python())
        .arg(&script_path)
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {} (set MANTA_PYTHON): {e}",
                python().display()
            )
        });
    assert!(
        output.status.success(),
        "{script} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed invalid JSON ({e}):\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

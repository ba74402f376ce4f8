//! bench/run_decode_step.sh refuses clearly before it needs a GPU: without its arguments it
//! prints its usage, and without the binary it names the build command.

use std::path::Path;
use std::process::Command;

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("run_decode_step.sh")
}

#[test]
fn the_decode_step_script_explains_what_it_needs() {
    let usage = Command::new("bash")
        .arg(script())
        .output()
        .expect("run bash");
    assert_eq!(usage.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&usage.stderr);
    assert!(
        stderr.contains("usage: bash bench/run_decode_step.sh SHAPE BATCH CONTEXT"),
        "{stderr}"
    );

    let dir = std::env::temp_dir().join(format!("manta-decode-step-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = Command::new("bash")
        .arg(script())
        .args(["8b", "1", "640", "k1:MANTA_GEMV_KSPLIT=1"])
        .current_dir(&dir)
        .output()
        .expect("run bash");
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(missing.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("bin/decode_step missing")
            && stderr.contains("cargo build --release -p manta-bench --bin decode_step"),
        "{stderr}"
    );
}

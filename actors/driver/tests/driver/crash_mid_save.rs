//! A crash in the middle of saving a checkpoint (injected with `MANTA_CRASH_MID_SAVE`:
//! the weights file is torn in half, then the process aborts) leaves the previous
//! checkpoint as `latest`, loadable, and the run resumes from it.

use crate::common;

use common::{debug_data, debug_train_args, workspace};
use std::path::Path;
use std::process::{Command, Output};

fn driver(data: &Path, save: &Path, runs: &Path, extra: &[&str], crash_at: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_driver"));
    cmd.current_dir(workspace())
        .env("RUST_LOG", "warn")
        .args(debug_train_args(data, 3, save, 1, runs, "r"))
        .args(["--lr", "0.01"]);
    cmd.args(extra);
    match crash_at {
        Some(step) => cmd.env("MANTA_CRASH_MID_SAVE", step),
        None => cmd.env_remove("MANTA_CRASH_MID_SAVE"),
    };
    cmd.output().expect("driver runs")
}

#[test]
fn crash_mid_save_leaves_the_previous_checkpoint_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let data = debug_data(dir.path(), 3, 2);
    let (save, runs) = (dir.path().join("ckpt"), dir.path().join("runs"));

    let out = driver(&data, &save, &runs, &[], Some("2"));
    assert!(!out.status.success(), "the injected crash did not happen");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("MANTA_CRASH_MID_SAVE=2"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The torn save never became a checkpoint; latest still names step 1.
    assert!(!save.join("step_000002").exists());
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step_000001");

    let load = save.to_str().unwrap().to_string();
    let out = driver(&data, &save, &runs, &["--load", &load], None);
    assert!(
        out.status.success(),
        "resume failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step_000003");
    let w = tch::Tensor::read_safetensors(save.join("step_000003/model.safetensors"));
    assert!(w.is_ok(), "{w:?}");
}

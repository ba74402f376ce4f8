//! `--load DIR` as Miles reads it: resume from the latest checkpoint in DIR when it
//! holds one, start fresh when it holds none yet (run.sh passes the same directory to
//! `--save` and `--load`, so the first launch always finds it empty or missing).

use std::path::{Path, PathBuf};

use crate::driver_actor::latest_checkpoint;

/// The checkpoint a run with `--load dir` resumes from, or `None` when `dir` holds no
/// checkpoint: it does not exist, or it has no `latest` file. A `latest` file that
/// names a missing checkpoint, or a `dir` that is a file, is an error naming it.
pub fn checkpoint_to_resume(dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    if dir.exists() && !dir.is_dir() {
        anyhow::bail!(
            "--load {}: not a directory (give the --save directory of a run)",
            dir.display()
        );
    }
    if !dir.join("latest").exists() {
        return Ok(None);
    }
    latest_checkpoint(dir).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_or_empty_directories_start_fresh() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(
            checkpoint_to_resume(&tmp.path().join("none")).unwrap(),
            None
        );
        assert_eq!(checkpoint_to_resume(tmp.path()).unwrap(), None);
        std::fs::write(tmp.path().join("notes.txt"), "x").unwrap();
        assert_eq!(checkpoint_to_resume(tmp.path()).unwrap(), None);
    }

    #[test]
    fn latest_is_followed_and_a_dangling_one_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("latest"), "step_000002\n").unwrap();
        let err = checkpoint_to_resume(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("step_000002"), "{err}");
        std::fs::create_dir(tmp.path().join("step_000002")).unwrap();
        assert_eq!(
            checkpoint_to_resume(tmp.path()).unwrap(),
            Some(tmp.path().join("step_000002"))
        );
        let file = tmp.path().join("notes.txt");
        std::fs::write(&file, "x").unwrap();
        let err = checkpoint_to_resume(&file).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}

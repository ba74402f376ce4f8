//! What the driver keeps in a `--save` directory besides the checkpoints: which run
//! they belong to (`manta_run.json`: the run directory and run id, so `--load DIR`
//! continues that run's directory without repeating `--runs-dir`/`--run-name`), the
//! removal of `step_N.tmp/` directories that failed saves left, and `--keep-last N`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::checkpoint_manifest::step_of_dir;

/// The record's name in a `--save` directory.
pub const RECORD: &str = "manta_run.json";

/// The run a `--save` directory's checkpoints belong to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveRecord {
    /// The run directory (absolute) whose metrics go with these checkpoints.
    pub run_dir: PathBuf,
    /// Stays the same across resumes; recorded in every checkpoint's manifest.
    pub run_id: String,
}

/// `save/manta_run.json`, when there is one.
pub fn read_record(save: &Path) -> anyhow::Result<Option<SaveRecord>> {
    let path = save.join(RECORD);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let record = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a Manta run record", path.display()))?;
    Ok(Some(record))
}

/// Writes `save/manta_run.json` (through a temporary file and a rename).
pub fn write_record(save: &Path, record: &SaveRecord) -> anyhow::Result<()> {
    let path = save.join(RECORD);
    let tmp = save.join(format!("{RECORD}.tmp"));
    std::fs::write(&tmp, serde_json::to_string_pretty(record)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))
}

/// A run id for a run that starts from scratch: its name, the time and the pid.
pub fn new_run_id(run_name: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{run_name}-{secs}-{}", std::process::id())
}

/// Removes the `step_N.tmp/` directories failed saves left in `save`; returns them.
pub fn remove_failed_saves(save: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(save) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e).with_context(|| format!("reading {}", save.display())),
    };
    for entry in entries {
        let path = entry
            .with_context(|| format!("reading {}", save.display()))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("step_") && name.ends_with(".tmp") && path.is_dir() {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("removing the failed save {}", path.display()))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// `--keep-last N`: deletes the oldest `step_NNNNNN/` directories of `save` beyond the
/// newest `keep`, never `latest`'s; returns the deleted ones.
pub fn keep_last(save: &Path, keep: usize, latest: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(save)
        .with_context(|| format!("reading {}", save.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .filter_map(|p| step_of_dir(&p).map(|s| (s, p)))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    let mut deleted = Vec::new();
    for (_, path) in steps.into_iter().take(excess) {
        if path.file_name() == latest.file_name() {
            continue;
        }
        std::fs::remove_dir_all(&path)
            .with_context(|| format!("--keep-last: removing {}", path.display()))?;
        deleted.push(path);
    }
    Ok(deleted)
}

/// A rough size of one checkpoint of the model in `model_dir`: its weights files again,
/// plus fp32 AdamW moments and masters (12 bytes a parameter, the weights read as
/// 2-byte values). `None` for a model without weights files (random init).
pub fn checkpoint_estimate(model_dir: &Path) -> Option<u64> {
    let weights: u64 = std::fs::read_dir(model_dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    (weights > 0).then(|| weights + weights / 2 * 12)
}

/// Bytes free to this process on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is a plain C struct of integers, for which all-zero bytes are valid.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `stat` is a valid out-pointer for the call.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut stat) };
    (rc == 0).then(|| stat.f_bavail as u64 * stat.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_last_deletes_the_oldest_steps_and_failed_saves_go() {
        let tmp = tempfile::tempdir().unwrap();
        for s in [1u64, 2, 3, 10] {
            std::fs::create_dir_all(tmp.path().join(format!("step_{s:06}"))).unwrap();
        }
        std::fs::create_dir_all(tmp.path().join("step_000011.tmp")).unwrap();
        let removed = remove_failed_saves(tmp.path()).unwrap();
        assert_eq!(removed, vec![tmp.path().join("step_000011.tmp")]);
        let latest = tmp.path().join("step_000010");
        let deleted = keep_last(tmp.path(), 2, &latest).unwrap();
        assert_eq!(
            deleted,
            vec![
                tmp.path().join("step_000001"),
                tmp.path().join("step_000002")
            ]
        );
        assert!(tmp.path().join("step_000003").is_dir() && latest.is_dir());
    }

    #[test]
    fn a_checkpoint_is_estimated_from_the_weights_and_free_space_read() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(checkpoint_estimate(tmp.path()), None);
        std::fs::write(tmp.path().join("model.safetensors"), vec![0u8; 1000]).unwrap();
        assert_eq!(checkpoint_estimate(tmp.path()), Some(1000 + 500 * 12));
        assert!(free_bytes(tmp.path()).is_some_and(|b| b > 0));
    }

    #[test]
    fn the_record_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(read_record(tmp.path()).unwrap(), None);
        let r = SaveRecord {
            run_dir: tmp.path().join("runs/a"),
            run_id: new_run_id("a"),
        };
        write_record(tmp.path(), &r).unwrap();
        assert_eq!(read_record(tmp.path()).unwrap(), Some(r));
    }
}

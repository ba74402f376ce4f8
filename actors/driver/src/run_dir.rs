//! Which directory under `--runs-dir` a run writes to, so a new run never appends to an
//! earlier run's metrics.jsonl / trained_ids.jsonl (two `make run`s in a row would
//! otherwise mix in one file and one plot).
//!
//! - `runs/<run>` when it holds no earlier run (no metrics.jsonl, no trained_ids.jsonl);
//! - with `--load DIR`, `runs/<run>` when the run recorded there saved to or resumed from
//!   DIR: the resumed run continues it, after dropping records of steps past the
//!   checkpoint (they are trained again);
//! - otherwise the first `runs/<run>-N` (N = 2, 3, …) that holds no earlier run.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use manta_config::TrainSettings;

use crate::run_lock::{DirLock, LockError};

/// Files whose presence marks a directory as holding a run.
const RUN_RECORDS: &[&str] = &["metrics.jsonl", "trained_ids.jsonl"];

/// The directory chosen for a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDir {
    /// The run's name: the requested one, or it with a `-N` suffix.
    pub name: String,
    pub path: PathBuf,
    /// The directory holds the records of the run this one resumes.
    pub continues: bool,
}

/// A run name is one directory name: refused when empty, `.`, `..`, or holding a path
/// separator (`--run-name ../x` would write outside `--runs-dir`).
pub fn check_name(name: &str) -> anyhow::Result<()> {
    let bad = if name.is_empty() {
        Some("is empty")
    } else if name == "." || name == ".." {
        Some("is not a directory name")
    } else if name.contains(['/', '\\']) {
        Some("holds a path separator")
    } else if name.contains('\0') {
        Some("holds a NUL byte")
    } else {
        None
    };
    match bad {
        Some(why) => anyhow::bail!(
            "--run-name {name:?} {why}: a run name is one directory name under --runs-dir \
             (use --runs-dir to choose where runs go)"
        ),
        None => Ok(()),
    }
}

/// [`choose`], then the chosen directory locked for this process: the requested
/// directory held by a running run is refused (naming it) rather than skipped, so the
/// same command started twice never runs twice.
pub fn choose_locked(
    runs_dir: &Path,
    name: &str,
    load: Option<&Path>,
) -> anyhow::Result<(RunDir, DirLock)> {
    check_name(name)?;
    let requested = DirLock::acquire(&runs_dir.join(name), "run directory")?;
    let run = choose(runs_dir, name, load)?;
    if run.name == name {
        return Ok((run, requested));
    }
    drop(requested);
    // A numbered directory another run took meanwhile is skipped, as one holding a run.
    let mut run = run;
    loop {
        match DirLock::acquire(&run.path, "run directory") {
            Ok(lock) if !holds_run(&run.path) => return Ok((run, lock)),
            Ok(_) | Err(LockError::Held { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let n: u32 = run
            .name
            .rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        let numbered = format!("{name}-{}", n + 1);
        run = RunDir {
            path: runs_dir.join(&numbered),
            name: numbered,
            continues: false,
        };
    }
}

/// Picks the directory for run `name` under `runs_dir` (see the module comment).
pub fn choose(runs_dir: &Path, name: &str, load: Option<&Path>) -> anyhow::Result<RunDir> {
    let path = runs_dir.join(name);
    if !holds_run(&path) {
        return Ok(RunDir {
            name: name.to_string(),
            path,
            continues: false,
        });
    }
    if let Some(load) = load {
        if resumes_from(&path, load)? {
            return Ok(RunDir {
                name: name.to_string(),
                path,
                continues: true,
            });
        }
    }
    let mut n = 2u32;
    loop {
        let numbered = format!("{name}-{n}");
        let path = runs_dir.join(&numbered);
        if !holds_run(&path) {
            return Ok(RunDir {
                name: numbered,
                path,
                continues: false,
            });
        }
        n += 1;
    }
}

/// Whether `dir` holds the records of a run (metrics.jsonl or trained_ids.jsonl).
pub fn holds_run(dir: &Path) -> bool {
    RUN_RECORDS.iter().any(|f| dir.join(f).exists())
}

/// Whether the settings.json in `dir` names `load` as the run's `save` or `load`.
fn resumes_from(dir: &Path, load: &Path) -> anyhow::Result<bool> {
    let path = dir.join("settings.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let settings: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    let wanted = canonical(load);
    Ok(["save", "load"]
        .iter()
        .filter_map(|key| settings.get(*key).and_then(|v| v.as_str()))
        .any(|recorded| canonical(Path::new(recorded)) == wanted))
}

fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Drops the records of steps after `last` from the run's JSONL files, so a resumed
/// run that trains them again leaves each step once.
pub fn rewind(dir: &Path, last: u64) -> anyhow::Result<()> {
    for file in RUN_RECORDS {
        let path = dir.join(file);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let kept: String = text
            .lines()
            .filter(|line| step_of(line).is_some_and(|s| s <= last))
            .map(|line| format!("{line}\n"))
            .collect();
        if kept.len() == text.len() {
            continue;
        }
        let tmp = dir.join(format!("{file}.tmp"));
        std::fs::write(&tmp, kept).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("replacing {}", path.display()))?;
    }
    Ok(())
}

/// The `step` of one JSONL record; `None` for a torn or foreign line.
fn step_of(line: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()?
        .get("step")?
        .as_u64()
}

/// `run-<unix seconds>`: the run name when none is given.
pub fn default_run_name() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("run-{secs}")
}

/// Where weight-sync verification records go (`MANTA_VERIFY_WEIGHT_SYNC`).
pub fn verify_log(settings: &TrainSettings) -> PathBuf {
    settings
        .runs_dir
        .join(settings.run_name.clone().unwrap_or_default())
        .join("weight_sync.jsonl")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record_run(dir: &Path, save: &str, steps: u64) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("settings.json"),
            serde_json::json!({"save": save, "load": null}).to_string(),
        )
        .unwrap();
        let lines: String = (1..=steps)
            .map(|s| format!("{{\"step\":{s},\"rollout/raw_reward\":0.5}}\n"))
            .collect();
        std::fs::write(dir.join("metrics.jsonl"), &lines).unwrap();
        std::fs::write(dir.join("trained_ids.jsonl"), &lines).unwrap();
    }

    #[test]
    fn a_new_run_never_reuses_a_directory_holding_a_run() {
        let tmp = tempfile::tempdir().unwrap();
        let runs = tmp.path();
        assert_eq!(
            choose(runs, "local", None).unwrap().path,
            runs.join("local")
        );
        // An empty or settings-only directory (a run that failed at start) is reused.
        std::fs::create_dir_all(runs.join("local/weights")).unwrap();
        assert_eq!(choose(runs, "local", None).unwrap().name, "local");
        record_run(&runs.join("local"), "ckpt", 2);
        assert_eq!(choose(runs, "local", None).unwrap().name, "local-2");
        record_run(&runs.join("local-2"), "other", 2);
        let third = choose(runs, "local", None).unwrap();
        assert_eq!((third.name.as_str(), third.continues), ("local-3", false));
    }

    #[test]
    fn a_resume_continues_the_run_that_saved_its_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let runs = tmp.path().join("runs");
        let ckpt = tmp.path().join("ckpt");
        std::fs::create_dir_all(&ckpt).unwrap();
        record_run(&runs.join("local"), ckpt.to_str().unwrap(), 3);
        let resumed = choose(&runs, "local", Some(&ckpt)).unwrap();
        assert_eq!((resumed.name.as_str(), resumed.continues), ("local", true));
        // A checkpoint of another run does not continue this one.
        let other = tmp.path().join("other");
        std::fs::create_dir_all(&other).unwrap();
        assert_eq!(
            choose(&runs, "local", Some(&other)).unwrap().name,
            "local-2"
        );
    }

    #[test]
    fn run_names_are_one_directory_name() {
        for bad in ["../x", "a/b", "..", ".", "", "a\\b"] {
            let err = check_name(bad).unwrap_err().to_string();
            assert!(err.contains("--run-name"), "{bad:?}: {err}");
        }
        check_name("local-2.v1").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        assert!(choose_locked(tmp.path(), "../escape", None).is_err());
        assert!(!tmp.path().parent().unwrap().join("escape").exists());
    }

    #[test]
    fn a_held_run_directory_is_refused_and_a_numbered_one_locked() {
        let tmp = tempfile::tempdir().unwrap();
        let (first, _lock) = choose_locked(tmp.path(), "local", None).unwrap();
        assert_eq!(first.name, "local");
        let err = choose_locked(tmp.path(), "local", None).unwrap_err();
        assert!(
            format!("{err:#}").contains("in use by another run"),
            "{err:#}"
        );
        record_run(&tmp.path().join("other"), "ckpt", 1);
        let (next, _l2) = choose_locked(tmp.path(), "other", None).unwrap();
        assert_eq!(next.name, "other-2");
    }

    #[test]
    fn rewind_keeps_steps_up_to_the_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        record_run(tmp.path(), "ckpt", 4);
        rewind(tmp.path(), 2).unwrap();
        for file in RUN_RECORDS {
            let text = std::fs::read_to_string(tmp.path().join(file)).unwrap();
            let steps: Vec<u64> = text.lines().filter_map(step_of).collect();
            assert_eq!(steps, [1, 2], "{file}");
        }
    }

    #[test]
    fn unreadable_settings_are_an_error_naming_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("local");
        record_run(&dir, "ckpt", 1);
        std::fs::write(dir.join("settings.json"), "{not json").unwrap();
        let err = choose(tmp.path(), "local", Some(Path::new("ckpt"))).unwrap_err();
        assert!(format!("{err:#}").contains("settings.json"), "{err:#}");
    }
}

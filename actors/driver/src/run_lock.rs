//! One process per run directory and per `--save` directory: an advisory lock
//! (`flock`) on `DIR/.manta.lock`, with the holder's pid, host and start time written in
//! it, so a second run of the same command is refused with a message naming the first
//! instead of appending to its metrics and overwriting its checkpoints.
//!
//! The kernel drops a `flock` when its process dies, however it dies, so the lock of a
//! crashed run is free at once; its file still names the dead holder, and taking it over
//! is said in the log. A file naming a live process on another host whose lock is free
//! (a file system that does not share locks between hosts) is refused too: that run may
//! still be writing.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tracing::info;

/// The lock file's name inside a locked directory.
pub const LOCK_FILE: &str = ".manta.lock";

/// Who holds a directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// Unix seconds when the holder took the lock.
    pub since: u64,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} on host {} (since unix time {})",
            self.pid, self.host, self.since
        )
    }
}

/// Why a directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{what} {dir} is in use by another run: {holder}; wait for it to end, or give this \
         run another directory"
    )]
    Held {
        what: &'static str,
        dir: PathBuf,
        holder: String,
    },
    #[error(
        "{what} {dir} is recorded as in use by {holder}, which this host cannot check; if \
         that run has ended, delete {lock}"
    )]
    ElsewhereUnchecked {
        what: &'static str,
        dir: PathBuf,
        holder: Holder,
        lock: PathBuf,
    },
    #[error("{what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        /// In the message, not the source chain: printed once.
        error: std::io::Error,
    },
}

/// What a run writes before it starts (the lock, the log, the status address): a
/// directory holding only these saw no run, and goes with the lock.
const STARTUP_FILES: [&str; 3] = [LOCK_FILE, "driver.log", "status_addr"];

/// A held directory; the lock is released (and the holder record cleared) on drop. A
/// directory the lock created and nothing else wrote to is removed again, so a run that
/// stops before it starts (a placement refused) leaves no empty run directory behind.
#[derive(Debug)]
pub struct DirLock {
    file: File,
    dir: PathBuf,
    created: bool,
}

impl DirLock {
    /// Locks `dir` (created if missing) for this process. `what` names the directory in
    /// messages (`run directory`, `--save directory`).
    pub fn acquire(dir: &Path, what: &'static str) -> Result<DirLock, LockError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| LockError::Io { what, path, error }
        };
        let created = !dir.exists();
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io(&path))?;
        let previous = read_holder(&mut file);
        if !try_flock(&file).map_err(io(&path))? {
            let holder = previous
                .map(|h| h.to_string())
                .unwrap_or_else(|| "a process that has not written its pid yet".into());
            return Err(LockError::Held {
                what,
                dir: dir.to_path_buf(),
                holder,
            });
        }
        let me = Holder {
            pid: std::process::id(),
            host: host_name(),
            since: unix_now(),
        };
        if let Some(old) = previous.filter(|h| h.pid != me.pid || h.host != me.host) {
            if old.host != me.host {
                return Err(LockError::ElsewhereUnchecked {
                    what,
                    dir: dir.to_path_buf(),
                    holder: old,
                    lock: path,
                });
            }
            info!(
                dir = %dir.display(),
                "{what}: taking over the lock of {old}, which is no longer running"
            );
        }
        write_holder(&mut file, Some(&me)).map_err(io(&path))?;
        Ok(DirLock {
            file,
            dir: dir.to_path_buf(),
            created,
        })
    }

    /// The locked directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Cleared while still locked; closing the file releases the lock.
        let _ = write_holder(&mut self.file, None);
        let only_the_lock = std::fs::read_dir(&self.dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .all(|e| STARTUP_FILES.contains(&e.file_name().to_str().unwrap_or_default()))
            })
            .unwrap_or(false);
        if self.created && only_the_lock {
            for file in STARTUP_FILES {
                let _ = std::fs::remove_file(self.dir.join(file));
            }
            // Fails, harmlessly, if another run wrote into it meanwhile.
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// `flock(LOCK_EX | LOCK_NB)`: true when taken, false when another process holds it.
fn try_flock(file: &File) -> std::io::Result<bool> {
    // SAFETY: flock on a file descriptor this `File` owns for the call's duration.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(false);
    }
    Err(err)
}

/// The holder recorded in the lock file; `None` when empty or unreadable.
fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.trim()).ok()
}

fn write_holder(file: &mut File, holder: Option<&Holder>) -> std::io::Result<()> {
    let text = match holder {
        Some(h) => serde_json::to_string(h).map_err(std::io::Error::other)? + "\n",
        None => String::new(),
    };
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(text.as_bytes())?;
    file.sync_data()
}

/// This machine's host name (`unknown` if the kernel will not say).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let first = DirLock::acquire(&dir, "run directory").unwrap();
        // A second open file description in this process conflicts like another process.
        let err = DirLock::acquire(&dir, "run directory")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())) && err.contains("in use"),
            "{err}"
        );
        std::fs::write(dir.join("metrics.jsonl"), "").unwrap();
        drop(first);
        assert_eq!(
            std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap(),
            "",
            "a released lock names no holder"
        );
        DirLock::acquire(&dir, "run directory").unwrap();
        // A directory the lock made and nothing wrote to goes with the lock.
        let unused = tmp.path().join("unused");
        drop(DirLock::acquire(&unused, "run directory").unwrap());
        assert!(!unused.exists());
    }

    #[test]
    fn a_dead_holder_on_this_host_is_taken_over_and_another_host_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dead = Holder {
            pid: u32::MAX - 1,
            host: host_name(),
            since: 1,
        };
        std::fs::write(
            tmp.path().join(LOCK_FILE),
            serde_json::to_string(&dead).unwrap(),
        )
        .unwrap();
        let lock = DirLock::acquire(tmp.path(), "--save directory").unwrap();
        let text = std::fs::read_to_string(tmp.path().join(LOCK_FILE)).unwrap();
        let now: Holder = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(now.pid, std::process::id());
        drop(lock);

        let other = Holder {
            host: format!("{}-elsewhere", host_name()),
            ..dead
        };
        std::fs::write(
            tmp.path().join(LOCK_FILE),
            serde_json::to_string(&other).unwrap(),
        )
        .unwrap();
        let err = DirLock::acquire(tmp.path(), "--save directory")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("-elsewhere") && err.contains(LOCK_FILE),
            "{err}"
        );
    }
}

//! Checkpoints that prove what they hold: each `step_NNNNNN/` directory gets a
//! `manifest.json` with its step, the run id and the size and sha256 of every file in
//! it, written after the save and before `latest` points at it. `--load`, `driver
//! export` and `--save-hf` verify it and name the file that does not match, so an
//! optimizer file of step 2 copied into step 4's directory is refused, not trained on.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest's name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// What a checkpoint directory holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub step: u64,
    /// The run that wrote it (kept across resumes of one run: `SAVE/manta_run.json`).
    pub run_id: String,
    /// Path relative to the checkpoint directory (`/`-separated) → size and digest.
    pub files: BTreeMap<String, FileDigest>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub bytes: u64,
    pub sha256: String,
}

/// A checkpoint that does not match its manifest, or a manifest that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{path}: {message}")]
    Mismatch { path: PathBuf, message: String },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        /// In the message, not the source chain: printed once.
        error: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ManifestError + '_ {
    move |error| ManifestError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// Digests every file under `dir` (the manifest itself left out) and writes
/// `dir/manifest.json` (through a temporary file and a rename).
pub fn write(dir: &Path, step: u64, run_id: &str) -> Result<Manifest, ManifestError> {
    let manifest = Manifest {
        step,
        run_id: run_id.to_string(),
        files: digest_dir(dir)?,
    };
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| ManifestError::Mismatch {
        path: dir.join(MANIFEST),
        message: e.to_string(),
    })?;
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    let path = dir.join(MANIFEST);
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(manifest)
}

/// Checks `dir` against its manifest: every listed file present with its size and
/// sha256, no file unlisted. `Ok(None)` for a checkpoint written before manifests.
pub fn verify(dir: &Path) -> Result<Option<Manifest>, ManifestError> {
    let path = dir.join(MANIFEST);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path)(e)),
    };
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| ManifestError::Mismatch {
        path: path.clone(),
        message: format!("not a checkpoint manifest: {e}"),
    })?;
    let whose = format!("step {} of run {}", manifest.step, manifest.run_id);
    let found = digest_dir(dir)?;
    for (name, want) in &manifest.files {
        let file = dir.join(name);
        let Some(got) = found.get(name) else {
            return Err(ManifestError::Mismatch {
                path: file,
                message: format!("missing: {MANIFEST} ({whose}) lists it"),
            });
        };
        if got != want {
            let what = if got.bytes != want.bytes {
                format!(
                    "{} bytes where {MANIFEST} records {}",
                    got.bytes, want.bytes
                )
            } else {
                format!(
                    "sha256 {} where {MANIFEST} records {}",
                    got.sha256, want.sha256
                )
            };
            return Err(ManifestError::Mismatch {
                path: file,
                message: format!(
                    "{what} ({whose}): the file was changed or copied from another checkpoint"
                ),
            });
        }
    }
    if let Some(extra) = found.keys().find(|k| !manifest.files.contains_key(*k)) {
        return Err(ManifestError::Mismatch {
            path: dir.join(extra),
            message: format!("not in {MANIFEST} ({whose}): added after the checkpoint was saved"),
        });
    }
    if let Some(named) = step_of_dir(dir).filter(|s| *s != manifest.step) {
        return Err(ManifestError::Mismatch {
            path: path.clone(),
            message: format!(
                "records step {} but the directory is step {named}",
                manifest.step
            ),
        });
    }
    Ok(Some(manifest))
}

/// The step a `step_NNNNNN` directory name says.
pub fn step_of_dir(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step_")?
        .parse()
        .ok()
}

/// Size and sha256 of every regular file under `dir` but the manifest, one thread per
/// file (a checkpoint holds a few large files).
fn digest_dir(dir: &Path) -> Result<BTreeMap<String, FileDigest>, ManifestError> {
    let mut files = Vec::new();
    list_files(dir, dir, &mut files)?;
    files.retain(|(name, _)| name != MANIFEST && name != &format!("{MANIFEST}.tmp"));
    let digests: Vec<Result<(String, FileDigest), ManifestError>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .iter()
            .map(|(name, path)| s.spawn(move || digest_file(path).map(|d| (name.clone(), d))))
            .collect();
        handles
            .into_iter()
            .zip(&files)
            .map(|(h, (_, path))| {
                h.join().unwrap_or_else(|_| {
                    Err(ManifestError::Mismatch {
                        path: path.clone(),
                        message: "hashing the file panicked".into(),
                    })
                })
            })
            .collect()
    });
    digests.into_iter().collect()
}

fn list_files(
    root: &Path,
    dir: &Path,
    out: &mut Vec<(String, PathBuf)>,
) -> Result<(), ManifestError> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io(&path))?;
        if kind.is_dir() {
            list_files(root, &path, out)?;
        } else if kind.is_file() {
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((rel, path));
        }
    }
    Ok(())
}

fn digest_file(path: &Path) -> Result<FileDigest, ManifestError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileDigest {
        bytes,
        sha256: hex::encode(hasher.finalize()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(root: &Path, step: u64, optimizer: &[u8]) -> PathBuf {
        let dir = root.join(format!("step_{step:06}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.safetensors"), format!("weights {step}")).unwrap();
        std::fs::write(dir.join("optimizer.safetensors"), optimizer).unwrap();
        write(&dir, step, "run-a").unwrap();
        dir
    }

    #[test]
    fn a_file_of_another_step_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let two = checkpoint(tmp.path(), 2, b"moments of step 2");
        let four = checkpoint(tmp.path(), 4, b"moments of step 4");
        assert_eq!(verify(&four).unwrap().unwrap().step, 4);
        std::fs::copy(
            two.join("optimizer.safetensors"),
            four.join("optimizer.safetensors"),
        )
        .unwrap();
        let err = verify(&four).unwrap_err().to_string();
        assert!(
            err.contains("step_000004/optimizer.safetensors")
                && err.contains("step 4 of run run-a"),
            "{err}"
        );
    }

    #[test]
    fn missing_extra_and_misnamed_files_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = checkpoint(tmp.path(), 3, b"m");
        std::fs::write(dir.join("stray.bin"), b"x").unwrap();
        let err = verify(&dir).unwrap_err().to_string();
        assert!(err.contains("stray.bin") && err.contains("not in"), "{err}");
        std::fs::remove_file(dir.join("stray.bin")).unwrap();
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        let err = verify(&dir).unwrap_err().to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("missing"),
            "{err}"
        );
        let moved = tmp.path().join("step_000005");
        std::fs::create_dir_all(&moved).unwrap();
        std::fs::write(moved.join("a"), b"a").unwrap();
        write(&moved, 3, "run-a").unwrap();
        let err = verify(&moved).unwrap_err().to_string();
        assert!(err.contains("records step 3"), "{err}");
        // A checkpoint from before manifests verifies as unknown, not as an error.
        let old = tmp.path().join("old");
        std::fs::create_dir_all(&old).unwrap();
        assert_eq!(verify(&old).unwrap(), None);
    }
}

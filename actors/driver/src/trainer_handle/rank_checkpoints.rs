//! Where the ranks of a data-parallel group write and read a checkpoint.
//!
//! - [`RankCheckpoints::Shared`] (ranks in the driver): every rank sees the driver's
//!   `--save` directory; rank 0 writes the weights and state, each rank its optimizer
//!   shard, and loading checks first that every rank's shard is there.
//! - [`RankCheckpoints::OnWorkers`] (`[trainer] ranks`): workers share no disk with the
//!   driver or each other, so each node keeps its own ranks' part. Every rank is told
//!   the same relative path, `manta-checkpoints/<run>/step_NNNNNN`, which its worker
//!   resolves against its own working directory; the first rank on each node writes the
//!   weights and trainer_state.json there (every node can then resume its ranks), each
//!   rank its optimizer shard. The driver's `--save` directory keeps `latest` and, per
//!   checkpoint, `ranks.json`: that path and the node of every rank. `--load` reads it,
//!   refuses a placement that would look for a shard on another node (naming the rank,
//!   the node it was saved on and the one it would load on), and sends each rank the
//!   path to load its own node's copy from. Nothing is copied between nodes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where a rank group's checkpoints live.
#[derive(Debug, Clone)]
pub enum RankCheckpoints {
    /// One directory every rank sees (ranks in the driver process).
    Shared,
    /// Each worker's own disk (ranks on workers).
    OnWorkers(WorkerCheckpoints),
}

/// Ranks on workers: the run's name and the address of each rank's node, in rank order.
#[derive(Debug, Clone)]
pub struct WorkerCheckpoints {
    pub run: String,
    pub nodes: Vec<String>,
}

/// The driver's record of a checkpoint its ranks keep on their workers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RanksManifest {
    pub step: u64,
    /// Relative to each worker's working directory.
    pub worker_dir: PathBuf,
    /// The node address of each rank, in rank order.
    pub nodes: Vec<String>,
}

/// The manifest's file name in the driver's checkpoint directory.
pub const MANIFEST: &str = "ranks.json";

impl RankCheckpoints {
    /// The directory each rank saves checkpoint `dir` into.
    pub fn save_target(&self, dir: &Path) -> PathBuf {
        match self {
            Self::Shared => dir.to_path_buf(),
            Self::OnWorkers(w) => w.worker_dir(dir),
        }
    }

    /// After every rank saved: on workers, records in `dir` where the ranks' parts are.
    pub fn after_save(&self, dir: &Path, step: u64) -> Result<(), String> {
        let Self::OnWorkers(w) = self else {
            return Ok(());
        };
        let manifest = RanksManifest {
            step,
            worker_dir: w.worker_dir(dir),
            nodes: w.nodes.clone(),
        };
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let text = serde_json::to_string_pretty(&manifest).map_err(|e| e.to_string())?;
        let path = dir.join(MANIFEST);
        let tmp = dir.join(format!("{MANIFEST}.tmp"));
        std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// The directory each of `world` ranks loads checkpoint `dir` from, once it is
    /// known to hold every rank's part for this placement.
    pub fn load_target(&self, dir: &Path, world: usize) -> Result<PathBuf, String> {
        match self {
            Self::Shared => check_shards(dir, world).map(|()| dir.to_path_buf()),
            Self::OnWorkers(w) => w.check_manifest(dir),
        }
    }
}

impl WorkerCheckpoints {
    /// `manta-checkpoints/<run>/<dir's last component>`, relative: each worker puts it
    /// under its own working directory.
    fn worker_dir(&self, dir: &Path) -> PathBuf {
        let name = dir
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("checkpoint"));
        Path::new("manta-checkpoints").join(&self.run).join(name)
    }

    fn check_manifest(&self, dir: &Path) -> Result<PathBuf, String> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            format!(
                "checkpoint {} has no {MANIFEST} ({e}): it was not saved by trainer ranks on \
                 workers ([trainer] ranks), whose parts stay on their nodes",
                dir.display()
            )
        })?;
        let manifest: RanksManifest =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let (saved, now) = (manifest.nodes.len(), self.nodes.len());
        if saved != now {
            return Err(format!(
                "checkpoint {} was saved by {saved} data-parallel ranks, this run has {now} \
                 ranks ([trainer] ranks): resume with the same count",
                dir.display()
            ));
        }
        for (rank, (was, is)) in manifest.nodes.iter().zip(&self.nodes).enumerate() {
            if was != is {
                return Err(format!(
                    "checkpoint {}: rank {rank} saved its part on the worker at {was}, but \
                     [trainer] ranks now puts it on {is}; workers share no disk, so place \
                     every rank on the node it was saved on",
                    dir.display()
                ));
            }
        }
        Ok(manifest.worker_dir)
    }
}

/// Checks that checkpoint `dir` holds an optimizer shard for each of `world` ranks
/// (`optimizer.rank<r>-of-<world>.safetensors`, as every rank saved it) before any rank
/// starts loading, so a checkpoint of another rank count is refused with its count
/// instead of some ranks loading while others fail.
fn check_shards(dir: &Path, world: usize) -> Result<(), String> {
    let missing: Vec<String> = (0..world)
        .map(|r| format!("optimizer.rank{r}-of-{world}.safetensors"))
        .filter(|name| !dir.join(name).is_file())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let saved_by = std::fs::read_dir(dir)
        .map_err(|e| format!("reading checkpoint {}: {e}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix("optimizer.rank")?;
            let (_, of) = rest.split_once("-of-")?;
            of.strip_suffix(".safetensors")?.parse::<usize>().ok()
        })
        .max();
    let saved_by = match saved_by {
        Some(n) => format!("{n} data-parallel ranks"),
        None => "one trainer (no per-rank optimizer shards)".into(),
    };
    Err(format!(
        "checkpoint {} was saved by {saved_by}, this run has {world} ranks \
         ([trainer] data_parallel_ranks / gpus): resume with the same count (missing {})",
        dir.display(),
        missing.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_workers_resume_only_where_they_saved() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("step_000002");
        let placed = |nodes: &[&str]| {
            RankCheckpoints::OnWorkers(WorkerCheckpoints {
                run: "r".into(),
                nodes: nodes.iter().map(|s| s.to_string()).collect(),
            })
        };
        let two = placed(&["a:1", "b:1"]);
        assert_eq!(
            two.save_target(&ckpt),
            Path::new("manta-checkpoints/r/step_000002")
        );
        let err = two.load_target(&ckpt, 2).unwrap_err();
        assert!(err.contains("no ranks.json"), "{err}");
        two.after_save(&ckpt, 2).unwrap();
        assert_eq!(
            two.load_target(&ckpt, 2).unwrap(),
            Path::new("manta-checkpoints/r/step_000002")
        );
        let err = placed(&["b:1", "a:1"]).load_target(&ckpt, 2).unwrap_err();
        assert!(
            err.contains("rank 0") && err.contains("a:1") && err.contains("b:1"),
            "{err}"
        );
        let err = placed(&["a:1"]).load_target(&ckpt, 1).unwrap_err();
        assert!(err.contains("saved by 2") && err.contains("has 1"), "{err}");
    }
}

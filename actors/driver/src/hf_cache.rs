//! `--model ORG/NAME` resolved from the local Hugging Face hub cache, offline, as
//! transformers' `from_pretrained` finds a cached model: the cache root is
//! `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`; the model lives
//! in `models--ORG--NAME`, whose `refs/main` names the snapshot in `snapshots/<rev>`.

use std::path::{Path, PathBuf};

/// The cache roots to look in, in transformers' order (the first set variable wins).
pub fn cache_root() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("HF_HUB_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(home) = var("HF_HOME") {
        return Some(PathBuf::from(home).join("hub"));
    }
    var("HOME").map(|home| PathBuf::from(home).join(".cache/huggingface/hub"))
}

/// Whether `text` reads as a hub name (`ORG/NAME`) rather than a path.
fn hub_name(text: &str) -> Option<(&str, &str)> {
    if text.starts_with(['.', '/', '~']) {
        return None;
    }
    let (org, name) = text.split_once('/')?;
    let plain = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (plain(org) && plain(name)).then_some((org, name))
}

/// `model` itself when it is a directory (or not a hub name); otherwise the cached
/// snapshot of the hub model it names. A hub name that is not cached is an error
/// naming every path tried.
pub fn resolve_model(model: &Path) -> anyhow::Result<PathBuf> {
    if model.is_dir() {
        return Ok(model.to_path_buf());
    }
    let Some((org, name)) = model.to_str().and_then(hub_name) else {
        return Ok(model.to_path_buf());
    };
    let Some(root) = cache_root() else {
        anyhow::bail!(
            "--model {}: no such directory, and no Hugging Face cache to look in \
             (HF_HUB_CACHE, HF_HOME and HOME are unset)",
            model.display()
        );
    };
    resolve_in(&root, org, name).map_err(|tried| {
        anyhow::anyhow!(
            "--model {}: no such directory and not in the Hugging Face cache (looked for \
             {}); download it first (e.g. `huggingface-cli download {org}/{name}`) or pass \
             its directory",
            model.display(),
            tried
        )
    })
}

/// The snapshot of ORG/NAME under `root`; `Err` holds what was tried.
pub fn resolve_in(root: &Path, org: &str, name: &str) -> Result<PathBuf, String> {
    let repo = root.join(format!("models--{org}--{name}"));
    let refs = repo.join("refs/main");
    let revision = std::fs::read_to_string(&refs).map_err(|_| format!("{}", refs.display()))?;
    let snapshot = repo.join("snapshots").join(revision.trim());
    if snapshot.join("config.json").is_file() {
        Ok(snapshot)
    } else {
        Err(format!(
            "{} (from {}), which holds no config.json",
            snapshot.join("config.json").display(),
            refs.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_names_and_paths_are_told_apart() {
        assert_eq!(hub_name("Qwen/Qwen3-4B"), Some(("Qwen", "Qwen3-4B")));
        assert_eq!(hub_name("./Qwen/Qwen3-4B"), None);
        assert_eq!(hub_name("/models/Qwen3-4B"), None);
        assert_eq!(hub_name("a/b/c"), None);
        assert_eq!(hub_name("assets"), None);
    }

    #[test]
    fn a_cached_snapshot_is_found_and_a_missing_one_names_the_paths() {
        let root = tempfile::tempdir().unwrap();
        let repo = root.path().join("models--Qwen--Qwen3-4B");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        let err = resolve_in(root.path(), "Qwen", "Qwen3-4B").unwrap_err();
        assert!(err.contains("snapshots/abc123/config.json"), "{err}");
        let snapshot = repo.join("snapshots/abc123");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::write(snapshot.join("config.json"), "{}").unwrap();
        assert_eq!(
            resolve_in(root.path(), "Qwen", "Qwen3-4B").unwrap(),
            snapshot
        );
        let err = resolve_in(root.path(), "Qwen", "Qwen3-8B").unwrap_err();
        assert!(err.contains("models--Qwen--Qwen3-8B/refs/main"), "{err}");
    }
}

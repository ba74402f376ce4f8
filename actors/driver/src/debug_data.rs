//! slime's debug rollout data: `--save-debug-rollout-data PATH` writes each step's
//! samples to `PATH` with `{rollout_id}` replaced by the step (from 0), one JSON object
//! per line, group after group; `--load-debug-rollout-data PATH` trains from such files
//! instead of rollouts. As slime's, `group_index` and `index` count across the whole run
//! (each group and each sample takes the next number), and a loader reads samples by
//! their position in the file, not by those numbers.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;
use manta_core::{EpisodeMetadata, Sample, SampleStatus};
use serde::{Deserialize, Serialize};

/// One line of a debug file: the fields slime writes for training.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    group_index: u32,
    index: u32,
    tokens: Vec<u32>,
    response_length: usize,
    loss_mask: Vec<u8>,
    rollout_log_probs: Vec<f32>,
    reward: f64,
    status: SampleStatus,
    /// The weight versions the sample was generated with (slime's `weight_versions`;
    /// Manta records the oldest, which an episode reports when its turns span updates).
    #[serde(default)]
    weight_versions: Vec<String>,
}

/// The file of rollout `rollout_id` (0-based) for a path template.
pub fn path_for(template: &str, rollout_id: u64) -> PathBuf {
    PathBuf::from(template.replace("{rollout_id}", &rollout_id.to_string()))
}

/// Writes `samples` as rollout `rollout_id`'s debug file (replaced atomically), with
/// slime's run-wide `index`: group `g`'s sample `i` is number `g × n_samples + i`.
pub fn save(
    template: &str,
    rollout_id: u64,
    samples: &[Sample],
    n_samples: usize,
) -> anyhow::Result<PathBuf> {
    let path = path_for(template, rollout_id);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("tmp");
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    for s in samples {
        let record = Record {
            group_index: s.group_index,
            index: run_wide_index(s.group_index, s.index, n_samples),
            tokens: s.tokens.clone(),
            response_length: s.response_length,
            loss_mask: s.loss_mask.clone(),
            rollout_log_probs: s.rollout_log_probs.clone(),
            reward: s.reward,
            status: s.status,
            weight_versions: vec![s.weight_version.to_string()],
        };
        serde_json::to_writer(&mut out, &record)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("writing {}", tmp.display()))?;
    drop(out);
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(path)
}

/// slime's sample counter for group `group`'s sample `index` when every group holds
/// `n_samples`.
fn run_wide_index(group: u32, index: u32, n_samples: usize) -> u32 {
    let n = u32::try_from(n_samples).unwrap_or(u32::MAX);
    group.saturating_mul(n).saturating_add(index)
}

/// Reads rollout `rollout_id`'s samples in file order (their numbers as written); ids are numbered from `first_id` in file order.
/// Errors name the file and line.
pub fn load(template: &str, rollout_id: u64, first_id: u64) -> anyhow::Result<Vec<Sample>> {
    let path = path_for(template, rollout_id);
    let file = std::fs::File::open(&path).with_context(|| {
        format!(
            "--load-debug-rollout-data: cannot open {} (rollout {rollout_id})",
            path.display()
        )
    })?;
    let mut samples = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Record = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a debug rollout sample", path.display(), n + 1))?;
        let sample = Sample {
            id: first_id + samples.len() as u64,
            group_index: r.group_index,
            index: r.index,
            tokens: r.tokens,
            response_length: r.response_length,
            loss_mask: r.loss_mask,
            rollout_log_probs: r.rollout_log_probs,
            reward: r.reward,
            status: r.status,
            weight_version: rollout_id,
            metadata: EpisodeMetadata::default(),
            routed_experts: None,
        };
        sample
            .validate()
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), n + 1))?;
        samples.push(sample);
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_samples_load_back_with_slime_field_names() {
        let dir = tempfile::tempdir().unwrap();
        let template = dir.path().join("debug_{rollout_id}.jsonl");
        let template = template.to_str().unwrap();
        let s = Sample {
            id: 7,
            group_index: 1,
            index: 2,
            tokens: vec![5, 6, 7],
            response_length: 2,
            loss_mask: vec![1, 0],
            rollout_log_probs: vec![-0.5, 0.0],
            reward: 0.25,
            status: SampleStatus::Truncated,
            weight_version: 4,
            metadata: EpisodeMetadata::default(),
            routed_experts: None,
        };
        let path = save(template, 3, std::slice::from_ref(&s), 4).unwrap();
        assert!(path.ends_with("debug_3.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        for key in [
            "group_index",
            "index",
            "tokens",
            "response_length",
            "loss_mask",
            "rollout_log_probs",
            "reward",
            "status",
        ] {
            assert!(v.get(key).is_some(), "{key} missing: {v}");
        }
        assert_eq!(v["status"], "truncated");
        // slime's run-wide numbering: group 1's sample 2 of 4 per group is number 6.
        assert_eq!(
            (v["group_index"].as_u64(), v["index"].as_u64()),
            (Some(1), Some(6))
        );
        assert_eq!(v["weight_versions"], serde_json::json!(["4"]));
        let back = load(template, 3, 100).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(
            (back[0].id, back[0].tokens.clone(), back[0].reward),
            (100, s.tokens, 0.25)
        );
        let err = load(template, 4, 0).unwrap_err().to_string();
        assert!(err.contains("debug_4.jsonl"), "{err}");
    }
}

//! Per-step metrics appended to `runs/<run>/metrics.jsonl`, one JSON object a line,
//! with slime's metric names (REFERENCE.md §5).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// One step's metrics: name → value.
pub type StepMetrics = BTreeMap<String, f64>;

/// Appends one line per step and flushes it, so a crash loses nothing already logged.
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Opens (creating) `path` for appending; parent directories are created.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Keeps only the rows of steps up to `last` (the steps after it are about to be
    /// re-run), so each step appears once. The file is replaced atomically (temp file
    /// + rename); later rows are appended to the new one.
    pub fn discard_after(&mut self, last: u64) -> std::io::Result<()> {
        let text = std::fs::read_to_string(&self.path)?;
        let kept: String = text
            .lines()
            .filter(|line| {
                serde_json::from_str::<serde_json::Value>(line)
                    .ok()
                    .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                    .is_some_and(|s| s <= last)
            })
            .map(|line| format!("{line}\n"))
            .collect();
        crate::replace_file(&self.path, kept.as_bytes())?;
        self.file = OpenOptions::new().append(true).open(&self.path)?;
        Ok(())
    }

    /// Writes `{"step": step, <metrics>}`; non-finite values become `null`.
    pub fn write_step(&mut self, step: u64, metrics: &StepMetrics) -> std::io::Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            let value = serde_json::Number::from_f64(*v)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null);
            obj.insert(k.clone(), value);
        }
        let line = serde_json::Value::Object(obj).to_string();
        writeln!(self.file, "{line}")?;
        self.file.flush()
    }
}

/// Reads a metrics file back as (step, metrics) rows, skipping lines that do not parse
/// (a torn last line after a crash must not hide the rest).
pub fn read_metrics(path: &Path) -> std::io::Result<Vec<(u64, StepMetrics)>> {
    let file = File::open(path)?;
    let mut rows = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        let Ok(serde_json::Value::Object(obj)) = serde_json::from_str::<serde_json::Value>(&line)
        else {
            continue;
        };
        let Some(step) = obj.get("step").and_then(|s| s.as_u64()) else {
            continue;
        };
        let metrics = obj
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| v.as_f64().map(|v| (k.clone(), v)))
            .collect();
        rows.push((step, metrics));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_back_lines_skipping_torn_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r/metrics.jsonl");
        let mut w = MetricsWriter::open(&path).unwrap();
        let mut m = StepMetrics::new();
        m.insert("rollout/raw_reward".into(), 0.25);
        m.insert("train/loss".into(), f64::NAN);
        w.write_step(1, &m).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"step\": 2, \"rollout/raw_")
            .unwrap();
        let rows = read_metrics(&path).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].0, 1);
        assert_eq!(rows[0].1["rollout/raw_reward"], 0.25);
        assert!(!rows[0].1.contains_key("train/loss"));
    }

    #[test]
    fn discard_after_keeps_earlier_steps_and_appends_after_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open(&path).unwrap();
        let m = StepMetrics::from([("train/loss".to_string(), 1.0)]);
        for step in 1..=4 {
            w.write_step(step, &m).unwrap();
        }
        w.discard_after(2).unwrap();
        w.write_step(3, &m).unwrap();
        let steps: Vec<u64> = read_metrics(&path).unwrap().iter().map(|r| r.0).collect();
        assert_eq!(steps, vec![1, 2, 3]);
        assert!(!dir.path().join("metrics.jsonl.tmp").exists());
    }
}

//! Metrics as TensorBoard event files, beside metrics.jsonl, so `tensorboard --logdir
//! runs/` shows the curves. The format is TFRecord framing (length, masked CRC-32C of
//! the length, data, masked CRC-32C of the data) around `Event` protobufs; the message
//! definitions are in proto/tensorboard.proto.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use manta_proto::tensorboard::{event, summary, Event, Summary};
use prost::Message;

use crate::metrics::StepMetrics;

/// Appends scalar summaries to one `events.out.tfevents.*` file.
pub struct TensorBoardWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// TFRecord's CRC: CRC-32C, rotated and offset so CRCs of CRCs stay well distributed.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

impl TensorBoardWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.manta` and writes the version record.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("events.out.tfevents.{}.manta", now() as u64));
        let mut writer = Self {
            out: BufWriter::new(File::create(&path)?),
            path,
        };
        writer.write_event(&Event {
            wall_time: now(),
            step: 0,
            what: Some(event::What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event with every finite metric of the step as a scalar; flushed at once.
    pub fn write_step(&mut self, step: u64, metrics: &StepMetrics) -> std::io::Result<()> {
        let value = metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| summary::Value {
                tag: tag.clone(),
                simple_value: *v as f32,
            })
            .collect();
        self.write_event(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(event::What::Summary(Summary { value })),
        })
    }

    /// Drops the scalar events of steps after `last` (they are about to be re-run), so
    /// TensorBoard shows each step once. The file is replaced atomically; later events
    /// are appended to the new one.
    pub fn discard_after(&mut self, last: u64) -> std::io::Result<()> {
        self.out.flush()?;
        let bytes = std::fs::read(&self.path)?;
        let kept: Vec<u8> = records(&bytes)
            .filter(|(_, event)| {
                !matches!(event.what, Some(event::What::Summary(_))) || event.step <= last as i64
            })
            .flat_map(|(frame, _)| frame.iter().copied())
            .collect();
        crate::replace_file(&self.path, &kept)?;
        let file = std::fs::OpenOptions::new().append(true).open(&self.path)?;
        self.out = BufWriter::new(file);
        Ok(())
    }

    fn write_event(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(&data)?;
        self.out.write_all(&masked_crc(&data).to_le_bytes())?;
        self.out.flush()
    }
}

/// The framed records of an event file with their decoded events, up to the first
/// torn or corrupt one.
fn records(bytes: &[u8]) -> impl Iterator<Item = (&[u8], Event)> {
    let mut pos = 0;
    std::iter::from_fn(move || {
        let rest = bytes.get(pos..)?;
        let len = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?) as usize;
        let frame = rest.get(..len.checked_add(16)?)?;
        let data = &frame[12..12 + len];
        let crc = u32::from_le_bytes(frame[12 + len..].try_into().ok()?);
        if crc != masked_crc(data) {
            return None;
        }
        let event = Event::decode(data).ok()?;
        pos += frame.len();
        Some((frame, event))
    })
}

/// The step of every scalar event in an event file, in file order.
pub fn read_event_steps(path: &Path) -> std::io::Result<Vec<i64>> {
    let bytes = std::fs::read(path)?;
    Ok(records(&bytes)
        .filter(|(_, e)| matches!(e.what, Some(event::What::Summary(_))))
        .map(|(_, e)| e.step)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorboard() {
        // Values from tensorboard's own masked_crc32c (the PyPI package's TF stub).
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        assert_eq!(masked_crc(b"a"), 0x28e4_6e78);
    }

    #[test]
    fn records_are_framed_with_lengths_and_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TensorBoardWriter::create(dir.path()).unwrap();
        let mut m = StepMetrics::new();
        m.insert("rollout/raw_reward".into(), 0.5);
        w.write_step(1, &m).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut pos = 0;
        let mut events = Vec::new();
        while pos < bytes.len() {
            let len = u64::from_le_bytes(bytes[pos..pos + 8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(&bytes[pos..pos + 8]));
            let data = &bytes[pos + 12..pos + 12 + len];
            let data_crc =
                u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap());
            assert_eq!(data_crc, masked_crc(data));
            events.push(Event::decode(data).unwrap());
            pos += 16 + len;
        }
        assert_eq!(events.len(), 2);
        match &events[1].what {
            Some(event::What::Summary(s)) => {
                assert_eq!(s.value[0].tag, "rollout/raw_reward");
                assert_eq!(s.value[0].simple_value, 0.5);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(events[1].step, 1);
    }

    #[test]
    fn discard_after_drops_later_steps_and_keeps_the_version_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TensorBoardWriter::create(dir.path()).unwrap();
        let m = StepMetrics::from([("train/loss".to_string(), 0.5)]);
        for step in 1..=4 {
            w.write_step(step, &m).unwrap();
        }
        w.discard_after(2).unwrap();
        w.write_step(3, &m).unwrap();
        assert_eq!(read_event_steps(w.path()).unwrap(), vec![1, 2, 3]);
        let bytes = std::fs::read(w.path()).unwrap();
        let first = records(&bytes).next().unwrap().1;
        assert!(matches!(first.what, Some(event::What::FileVersion(_))));
    }
}

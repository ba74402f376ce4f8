//! `driver.log` in the run directory: every log event at info level and above (whatever
//! `RUST_LOG` says for the console) plus the step lines, without colour codes, so a run's
//! history stays beside its metrics after the terminal is gone. The file is named once the
//! run directory exists; events before that go to the console only.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use tracing_subscriber::fmt::MakeWriter;

/// The open run log, if any.
static FILE: Mutex<Option<File>> = Mutex::new(None);

/// Appends the log from now on to `path` (created if missing); a second call switches
/// files.
pub fn open(path: &Path) -> std::io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    *FILE.lock().unwrap_or_else(|e| e.into_inner()) = Some(file);
    Ok(())
}

/// Writes `line` (a step line, say) to the run log as it is, with a newline.
pub fn line(line: &str) {
    let mut slot = FILE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(f) = slot.as_mut() {
        let _ = writeln!(f, "{line}");
    }
}

/// Flushes the run log to the operating system (before an exit that runs no destructors).
pub fn flush() {
    if let Some(f) = FILE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        let _ = f.flush();
    }
}

/// The `tracing` writer behind the run log: discards what it gets while no file is open.
#[derive(Clone, Copy, Default)]
pub struct RunLogWriter;

impl Write for RunLogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut slot = FILE.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_mut() {
            Some(f) => f.write_all(buf).map(|()| buf.len()),
            None => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        flush();
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for RunLogWriter {
    type Writer = RunLogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

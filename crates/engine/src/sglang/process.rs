//! The engine server as a child process: launch into its own process group with its
//! output in a log file, wait for `/health_generate`, kill the whole group.
//!
//! Children are spawned from one long-lived thread per engine because
//! `PR_SET_PDEATHSIG` fires when the spawning *thread* exits: a driver or worker that is
//! SIGKILLed takes its engines with it instead of leaving orphans holding GPUs.

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::SglangError;

/// How to start one engine server; `port` is appended by [`Launcher::spawn`].
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Program and arguments, everything but `--port`.
    pub argv: Vec<String>,
    /// stdout and stderr go here (appended across restarts).
    pub log: PathBuf,
    /// Extra environment (e.g. `CUDA_VISIBLE_DEVICES`).
    pub env: Vec<(String, String)>,
}

type SpawnReply = mpsc::Sender<std::io::Result<Child>>;

/// Spawns children from a thread that lives as long as the engine (see module docs).
pub(crate) struct Launcher {
    requests: Option<mpsc::Sender<(Command, SpawnReply)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Launcher {
    pub(crate) fn new(name: &str) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<(Command, SpawnReply)>();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-launcher"))
            .spawn(move || {
                while let Ok((mut command, reply)) = rx.recv() {
                    let _ = reply.send(command.spawn());
                }
            })?;
        Ok(Self {
            requests: Some(tx),
            thread: Some(thread),
        })
    }

    /// Starts `spec` on `port` in a new process group that dies with this process.
    pub(crate) fn spawn(&self, spec: &LaunchSpec, port: u16) -> Result<Child, SglangError> {
        let program = spec
            .argv
            .first()
            .ok_or_else(|| SglangError::Launch("empty engine command".into()))?;
        let log_err = |e: std::io::Error| SglangError::Log(spec.log.clone(), e);
        if let Some(dir) = spec.log.parent() {
            std::fs::create_dir_all(dir).map_err(log_err)?;
        }
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&spec.log)
            .map_err(log_err)?;
        let mut argv = spec.argv[1..].to_vec();
        argv.extend(["--port".into(), port.to_string()]);
        writeln!(log, "--- manta: starting {program} {}", argv.join(" ")).map_err(log_err)?;
        let mut command = Command::new(program);
        command
            .args(&argv)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(log_err)?)
            .stderr(log)
            .process_group(0);
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) run in the child.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died between fork and prctl: nobody would kill us later.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        let sent = self
            .requests
            .as_ref()
            .map(|r| r.send((command, reply_tx)).is_ok())
            .unwrap_or(false);
        if !sent {
            return Err(SglangError::Launch("the launcher thread is gone".into()));
        }
        reply_rx
            .recv()
            .map_err(|_| SglangError::Launch("the launcher thread is gone".into()))?
            .map_err(|e| SglangError::Launch(format!("cannot run {program}: {e}")))
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        self.requests.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Kills the child's whole process group and reaps the child.
pub(crate) fn kill_group(child: &mut Child) {
    let pgid = child.id() as libc::pid_t;
    // SAFETY: plain syscall; a negative pid addresses the group the child leads.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A free TCP port on the loopback interface (the server binds it right after).
pub(crate) fn free_port() -> Result<u16, SglangError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| SglangError::Launch(format!("no free port: {e}")))
}

/// The last `lines` lines of the log, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(16 * 1024);
    let mut text = String::new();
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    text.push_str(&String::from_utf8_lossy(&bytes));
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Polls `/health_generate` until it answers 200, the child exits, or `deadline`.
pub(crate) async fn wait_healthy(
    http: &reqwest::Client,
    base_url: &str,
    child: &mut Child,
    spec: &LaunchSpec,
    timeout: Duration,
) -> Result<(), SglangError> {
    let started = Instant::now();
    let url = format!("{base_url}/health_generate");
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(SglangError::Unhealthy {
                log: spec.log.clone(),
                why: format!("the engine exited ({status}) before it was healthy"),
                tail: log_tail(&spec.log, 30),
            });
        }
        let ok = http
            .get(&url)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false);
        if ok {
            return Ok(());
        }
        if started.elapsed() > timeout {
            return Err(SglangError::Unhealthy {
                log: spec.log.clone(),
                why: format!(
                    "{url} did not answer 200 within {}s (rollout.health_timeout_s)",
                    timeout.as_secs()
                ),
                tail: log_tail(&spec.log, 30),
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

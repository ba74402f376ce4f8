//! An SGLang server (or anything speaking its HTTP API, such as `driver serve`) behind
//! the [`Engine`] interface, owned by its rollout actor: launched as a child process,
//! health-checked, restarted with backoff when it dies (requests in flight are sent again
//! to the new process, so no episode is lost), and killed with its process group when
//! the engine is dropped.
//!
//! - [`client`]: the request and answer JSON.
//! - [`process`]: launch, `/health_generate`, process groups, log tails.
//! - [`nccl`]: weights over NCCL (`/update_weights_from_distributed`), no disk.

pub mod client;
pub mod nccl;
pub mod process;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tracing::{info, warn};

use super::{Engine, EngineError, GenerateOutput, GenerateRequest, NamedTensors, PauseMode};
pub use nccl::NcclTarget;
pub use process::{log_tail, LaunchSpec};

/// What goes wrong launching or talking to the server.
#[derive(Debug, thiserror::Error)]
pub enum SglangError {
    #[error("launching the engine: {0}")]
    Launch(String),
    #[error("engine log {0}: {1}")]
    Log(PathBuf, std::io::Error),
    #[error("engine never became healthy: {why}; last lines of {log}:\n{tail}")]
    Unhealthy {
        log: PathBuf,
        why: String,
        tail: String,
    },
}

impl From<SglangError> for EngineError {
    fn from(e: SglangError) -> Self {
        EngineError::Stopped(e.to_string())
    }
}

/// How to run one engine server.
#[derive(Debug, Clone)]
pub struct SglangOptions {
    /// Names the engine in logs (`engine-0`).
    pub name: String,
    pub launch: LaunchSpec,
    /// The model directory the server was started from (its config.json goes with
    /// in-process weight exports).
    pub model_dir: PathBuf,
    pub health_timeout: Duration,
    pub health_interval: Duration,
    pub max_restarts: u32,
    /// Longest a single `/generate` may take.
    pub request_timeout: Duration,
}

/// The server half of an engine's settings, the same for every engine of a run
/// (cluster.toml's `[rollout]` for SGLang, carried to the workers as it is).
#[derive(Debug, Clone, PartialEq)]
pub struct SglangServer {
    /// The server command; `None`: `python3 -m sglang.launch_server`.
    pub command: Option<Vec<String>>,
    /// SGLang's `--max-running-requests`.
    pub max_running_requests: usize,
    /// SGLang's `--mem-fraction-static`; `None`: the server's default.
    pub mem_fraction_static: Option<f64>,
    /// More flags for the server, after the ones Manta owns.
    pub extra_args: Vec<String>,
    pub health_timeout_s: u64,
    pub health_interval_ms: u64,
    pub max_restarts: u32,
}

impl SglangOptions {
    /// The server command `server` describes (default `python3 -m sglang.launch_server`)
    /// plus the flags Manta owns, then `server.extra_args`. `gpus` are the engine's GPUs
    /// from placement (empty: CPU). `log` receives the server's output; its pid goes next
    /// to it (`<log stem>.pid`).
    pub fn new(
        server: &SglangServer,
        name: &str,
        model_dir: &Path,
        gpus: &[u32],
        seed: u64,
        log: PathBuf,
    ) -> Self {
        let mut argv: Vec<String> = match &server.command {
            Some(c) => c.clone(),
            None => ["python3", "-m", "sglang.launch_server"]
                .map(String::from)
                .to_vec(),
        };
        let model = model_dir.display().to_string();
        argv.extend([
            "--model-path".into(),
            model,
            "--host".into(),
            "127.0.0.1".into(),
            "--random-seed".into(),
            seed.to_string(),
            "--max-running-requests".into(),
            server.max_running_requests.to_string(),
        ]);
        match gpus.first() {
            Some(first) => argv.extend([
                "--tp-size".into(),
                gpus.len().to_string(),
                "--base-gpu-id".into(),
                first.to_string(),
            ]),
            None => argv.extend(["--device".into(), "cpu".into()]),
        }
        if let Some(f) = server.mem_fraction_static {
            argv.extend(["--mem-fraction-static".into(), f.to_string()]);
        }
        argv.extend(server.extra_args.iter().cloned());
        Self {
            name: name.to_string(),
            launch: LaunchSpec {
                argv,
                log,
                env: Vec::new(),
            },
            model_dir: model_dir.to_path_buf(),
            health_timeout: Duration::from_secs(server.health_timeout_s),
            health_interval: Duration::from_millis(server.health_interval_ms.max(100)),
            max_restarts: server.max_restarts,
            request_timeout: Duration::from_secs(3600),
        }
    }
}

/// The process running now.
struct Running {
    child: Option<Child>,
    base_url: String,
    /// Bumped on every (re)start, so concurrent failures restart once.
    generation: u64,
}

struct Inner {
    opts: SglangOptions,
    http: reqwest::Client,
    launcher: process::Launcher,
    running: Mutex<Running>,
    /// Serialises restarts.
    restarting: tokio::sync::Mutex<()>,
    restarts: AtomicU64,
    version: AtomicU64,
    /// The last weights loaded, re-applied after a restart.
    last_weights: Mutex<Option<(PathBuf, u64)>>,
    /// Set once restarts are exhausted.
    failed: Mutex<Option<String>>,
    wake: tokio::sync::Notify,
    /// Where weights come from over NCCL; `None`: through the disk.
    nccl_target: Mutex<Option<NcclTarget>>,
    /// The weight-update group of the running server.
    nccl_feed: Mutex<Option<nccl::Feed>>,
    /// The server holds weights sent over NCCL (lost if it restarts).
    nccl_fed: AtomicBool,
    /// Which `/generate` calls may start (the drain pause is Manta's own).
    admission: Admission,
    /// The server itself was paused (`abort`, `in_place`) and needs `/continue_generation`.
    paused_on_server: AtomicBool,
    /// The model's routed-expert layout (mixture-of-experts models), for
    /// `return_routed_experts`.
    routing: Option<client::RoutingShape>,
}

/// Admission of `/generate` calls, for the drain pause. SGLang has no drain: its
/// `retract` mode puts running requests back in the queue, and a weight update that then
/// flushes the prefix cache fails an assertion and takes the scheduler down (seen with
/// 0.5.17). Manta is the server's only client, so it drains on its side: no new call
/// starts, the running ones finish on the old weights, then the update runs on an idle
/// server.
struct Admission {
    open: tokio::sync::watch::Sender<bool>,
    running: tokio::sync::watch::Sender<usize>,
}

/// One admitted call; leaving lets a drain finish.
struct Admitted<'a>(&'a Admission);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.running.send_modify(|n| *n -= 1);
    }
}

impl Admission {
    fn new() -> Self {
        Self {
            open: tokio::sync::watch::Sender::new(true),
            running: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Waits until calls are admitted. Counted before the gate is read, so a drain that
    /// closes the gate sees every call that got past it.
    async fn enter(&self) -> Admitted<'_> {
        loop {
            self.running.send_modify(|n| *n += 1);
            let admitted = Admitted(self);
            if *self.open.borrow() {
                return admitted;
            }
            drop(admitted);
            let mut open = self.open.subscribe();
            let _ = open.wait_for(|o| *o).await;
        }
    }

    /// Closes the gate and waits (at most `limit`) for the running calls to finish,
    /// saying every 30 s how many are left.
    async fn drain(&self, name: &str, limit: Duration) -> Result<(), EngineError> {
        self.open.send_replace(false);
        let mut running = self.running.subscribe();
        let drained = tokio::time::timeout(limit, async {
            loop {
                let waited = tokio::time::timeout(
                    Duration::from_secs(30),
                    running.wait_for(|n| *n == 0),
                )
                .await;
                match waited {
                    Err(_) => {
                        info!(engine = %name, running = *self.running.borrow(), "drain: waiting for running requests")
                    }
                    Ok(_) => return,
                }
            }
        })
        .await;
        match drained {
            Ok(()) => Ok(()),
            Err(_) => {
                let left = *self.running.borrow();
                self.open.send_replace(true);
                Err(EngineError::Stopped(format!(
                    "drain: {left} requests still running after {} s",
                    limit.as_secs()
                )))
            }
        }
    }

    fn reopen(&self) {
        self.open.send_replace(true);
    }
}

/// An SGLang-compatible server process behind [`Engine`].
pub struct SglangEngine {
    inner: Arc<Inner>,
    supervisor: tokio::task::JoinHandle<()>,
}

impl SglangEngine {
    /// Launches the server and waits until `/health_generate` answers; the error quotes
    /// the log's tail when it does not within `health_timeout`.
    pub async fn launch(opts: SglangOptions) -> Result<Arc<Self>, SglangError> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| SglangError::Launch(format!("HTTP client: {e}")))?;
        let launcher = process::Launcher::new(&opts.name)
            .map_err(|e| SglangError::Launch(format!("launcher thread: {e}")))?;
        let inner = Arc::new(Inner {
            http,
            launcher,
            running: Mutex::new(Running {
                child: None,
                base_url: String::new(),
                generation: 0,
            }),
            restarting: tokio::sync::Mutex::new(()),
            restarts: AtomicU64::new(0),
            version: AtomicU64::new(0),
            last_weights: Mutex::new(None),
            failed: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
            nccl_target: Mutex::new(None),
            nccl_feed: Mutex::new(None),
            nccl_fed: AtomicBool::new(false),
            admission: Admission::new(),
            paused_on_server: AtomicBool::new(false),
            routing: client::RoutingShape::of_model(&opts.model_dir),
            opts,
        });
        inner.start_once().await?;
        let supervisor = tokio::spawn(supervise(inner.clone()));
        Ok(Arc::new(Self { inner, supervisor }))
    }

    /// The running server's address (`http://127.0.0.1:PORT`), for calls Manta does not
    /// make itself (tests, `/weights_checker`).
    pub fn base_url(&self) -> String {
        self.inner.lock_running().base_url.clone()
    }

    /// The pid of the server process running now.
    pub fn pid(&self) -> Option<u32> {
        self.inner.lock_running().child.as_ref().map(|c| c.id())
    }

    /// From now on weights reach this server over NCCL from `target` (this process is
    /// rank 0; see [`nccl`]) instead of through a safetensors file; joins the group now so
    /// a placement that cannot work fails at start.
    pub async fn feed_over_nccl(&self, target: NcclTarget) -> Result<(), EngineError> {
        self.inner.connect_nccl(&target).await?;
        *self
            .inner
            .nccl_target
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(target);
        Ok(())
    }
}

impl Drop for SglangEngine {
    fn drop(&mut self) {
        self.supervisor.abort();
        let mut running = self.inner.lock_running();
        if let Some(mut child) = running.child.take() {
            info!(engine = %self.inner.opts.name, pid = child.id(), "stopping the engine");
            process::kill_group(&mut child);
        }
    }
}

impl Inner {
    fn lock_running(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn current(&self) -> Result<(String, u64), EngineError> {
        if let Some(why) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(EngineError::Stopped(why));
        }
        let r = self.lock_running();
        Ok((r.base_url.clone(), r.generation))
    }

    /// Spawns the server on a free port and waits for health.
    async fn start_once(&self) -> Result<(), SglangError> {
        let port = process::free_port()?;
        let mut child = self.launcher.spawn(&self.opts.launch, port)?;
        let base_url = format!("http://127.0.0.1:{port}");
        info!(engine = %self.opts.name, pid = child.id(), port, log = %self.opts.launch.log.display(), "engine launched");
        let _ = std::fs::write(
            self.opts.launch.log.with_extension("pid"),
            child.id().to_string(),
        );
        let healthy = process::wait_healthy(
            &self.http,
            &base_url,
            &mut child,
            &self.opts.launch,
            self.opts.health_timeout,
        )
        .await;
        if let Err(e) = healthy {
            process::kill_group(&mut child);
            return Err(e);
        }
        let mut r = self.lock_running();
        r.child = Some(child);
        r.base_url = base_url;
        r.generation += 1;
        Ok(())
    }

    /// Whether the server process of `generation` is still alive.
    fn alive(&self, generation: u64) -> bool {
        let mut r = self.lock_running();
        if r.generation != generation {
            return true;
        }
        match r.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Restarts the server of `generation` unless someone already did; `force` restarts
    /// a process that is alive but unresponsive.
    async fn restart(&self, generation: u64, force: bool, why: &str) -> Result<(), EngineError> {
        let _guard = self.restarting.lock().await;
        {
            let r = self.lock_running();
            if r.generation != generation {
                return Ok(());
            }
        }
        if !force && self.alive(generation) {
            return Ok(());
        }
        if let Some(mut child) = self.lock_running().child.take() {
            process::kill_group(&mut child);
        }
        let mut attempt = 0u32;
        loop {
            let n = self.restarts.fetch_add(1, Ordering::Relaxed) + 1;
            if n > u64::from(self.opts.max_restarts) {
                let msg = format!(
                    "{} died {} times (rollout.max_restarts = {}); last lines of {}:\n{}",
                    self.opts.name,
                    n,
                    self.opts.max_restarts,
                    self.opts.launch.log.display(),
                    log_tail(&self.opts.launch.log, 30)
                );
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg.clone());
                return Err(EngineError::Stopped(msg));
            }
            let backoff = Duration::from_millis(500 << attempt.min(6));
            warn!(engine = %self.opts.name, restart = n, why, backoff_ms = backoff.as_millis() as u64, "engine died; restarting");
            tokio::time::sleep(backoff).await;
            attempt += 1;
            match self.start_once().await {
                Ok(()) => break,
                Err(e) => warn!(engine = %self.opts.name, error = %e, "engine restart failed"),
            }
        }
        self.forget_nccl_weights();
        let last = self
            .last_weights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some((dir, version)) = last {
            // No restart from inside a restart: a failure here fails this one.
            Box::pin(self.load_from_disk(&dir, version, false)).await?;
        }
        warn!(engine = %self.opts.name, restarts = self.restarts.load(Ordering::Relaxed), pid = ?self.lock_running().child.as_ref().map(|c| c.id()), "engine restarted");
        Ok(())
    }

    /// POSTs `body` to `path`, sending it again to a restarted server when the
    /// connection fails. Answers with the status and the JSON body (bodies of failures
    /// carry SGLang's message).
    async fn post(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<(u16, Value), EngineError> {
        self.post_with(path, body, timeout, true).await
    }

    /// [`Inner::post`]; without `retry`, a failed connection is an error.
    async fn post_with(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
        retry: bool,
    ) -> Result<(u16, Value), EngineError> {
        loop {
            let (base, generation) = self.current()?;
            let sent = self
                .http
                .post(format!("{base}{path}"))
                .json(body)
                .timeout(timeout)
                .send()
                .await;
            let resp = match sent {
                Ok(r) => r,
                Err(e) if e.is_timeout() => {
                    return Err(EngineError::Stopped(format!("{path}: timed out: {e}")))
                }
                Err(e) if !retry => return Err(EngineError::Stopped(format!("{path}: {e}"))),
                Err(e) => {
                    Box::pin(self.restart(generation, false, &format!("{path}: {e}"))).await?;
                    continue;
                }
            };
            let status = resp.status().as_u16();
            match resp.bytes().await {
                Ok(bytes) => {
                    let value = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                        Value::String(String::from_utf8_lossy(&bytes).into_owned())
                    });
                    return Ok((status, value));
                }
                Err(e) if !retry => return Err(EngineError::Stopped(format!("{path}: {e}"))),
                Err(e) => {
                    Box::pin(self.restart(generation, false, &format!("{path}: {e}"))).await?;
                }
            }
        }
    }

    /// Writes the tensors as a safetensors export next to the engine's log and has the
    /// server load it.
    async fn write_and_load(&self, weights: NamedTensors, version: u64) -> Result<(), EngineError> {
        let log = &self.opts.launch.log;
        let dir = log.with_extension("weights");
        let io = |e: std::io::Error| EngineError::Weights(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(&dir).map_err(io)?;
        let config = self.opts.model_dir.join("config.json");
        std::fs::copy(&config, dir.join("config.json"))
            .map_err(|e| EngineError::Weights(format!("copying {}: {e}", config.display())))?;
        let tmp = dir.join("model.safetensors.tmp");
        {
            let refs: Vec<(&str, &tch::Tensor)> =
                weights.iter().map(|(n, t)| (n.as_str(), t)).collect();
            tch::Tensor::write_safetensors(&refs, &tmp)?;
        }
        drop(weights);
        std::fs::rename(&tmp, dir.join("model.safetensors")).map_err(io)?;
        self.load_from_disk(&dir, version, true).await
    }

    async fn load_from_disk(
        &self,
        dir: &Path,
        version: u64,
        retry: bool,
    ) -> Result<(), EngineError> {
        // The format is named: without it SGLang uses the server's `--load-format`, and a
        // server started with `dummy` (random weights) cannot load files at all. The cache
        // is flushed afterwards, by request (see [`Inner::flush_after_update`]).
        let body = json!({
            "model_path": dir.display().to_string(),
            "load_format": "safetensors",
            "weight_version": version.to_string(),
            "flush_cache": false,
        });
        let (status, answer) = self
            .post_with(
                "/update_weights_from_disk",
                &body,
                Duration::from_secs(600),
                retry,
            )
            .await?;
        let success = answer
            .get("success")
            .and_then(Value::as_bool)
            .unwrap_or(status == 200);
        if !success {
            return Err(EngineError::Weights(format!(
                "{}: /update_weights_from_disk {}: HTTP {status}: {}",
                self.opts.name,
                dir.display(),
                answer.get("message").cloned().unwrap_or(answer.clone())
            )));
        }
        *self.last_weights.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((dir.to_path_buf(), version));
        self.nccl_fed.store(false, Ordering::Relaxed);
        self.version.store(version, Ordering::Relaxed);
        self.flush_after_update().await;
        Ok(())
    }

    /// Drops the prefix cache after a weight update, so no new request reuses keys and
    /// values computed with the old weights. Asked for apart from the update: an update
    /// with `flush_cache: true` on a server that still holds queued requests fails an
    /// assertion inside SGLang and kills its scheduler; `/flush_cache` waits a while for
    /// the queue to empty and otherwise answers 400, which is logged.
    pub(super) async fn flush_after_update(&self) {
        match self
            .post_with(
                "/flush_cache?timeout=30",
                &json!({}),
                Duration::from_secs(60),
                false,
            )
            .await
        {
            Ok((200, _)) => {}
            Ok((status, answer)) => {
                warn!(engine = %self.opts.name, status, answer = %answer, "the prefix cache was not flushed after a weight update: requests queued on the server may reuse keys and values of the old weights")
            }
            Err(e) => {
                warn!(engine = %self.opts.name, error = %e, "flushing the prefix cache after a weight update failed")
            }
        }
    }
}

/// Checks the process every `health_interval` (or when woken) and restarts it when it
/// exited or stopped answering `/health`.
async fn supervise(inner: Arc<Inner>) {
    let mut misses = 0u32;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(inner.opts.health_interval) => {}
            _ = inner.wake.notified() => {}
        }
        let Ok((base, generation)) = inner.current() else {
            return;
        };
        if !inner.alive(generation) {
            misses = 0;
            if let Err(e) = inner.restart(generation, false, "the process exited").await {
                warn!(engine = %inner.opts.name, error = %e, "engine gave up");
                return;
            }
            continue;
        }
        let ok = inner
            .http
            .get(format!("{base}/health"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map(|r| r.status().is_success())
            .unwrap_or(false);
        misses = if ok { 0 } else { misses + 1 };
        if misses >= 3 {
            misses = 0;
            if let Err(e) = inner
                .restart(generation, true, "/health failed 3 times")
                .await
            {
                warn!(engine = %inner.opts.name, error = %e, "engine gave up");
                return;
            }
        }
    }
}

#[async_trait]
impl Engine for SglangEngine {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        request.params.validate()?;
        let rid = request
            .rid
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        let body = client::generate_body(&request, &rid);
        let routing = match (&self.inner.routing, request.return_routed_experts) {
            (_, false) => None,
            (Some(shape), true) => Some((shape, request.input_ids.len())),
            (None, true) => {
                return Err(EngineError::BadRequest(format!(
                    "{}: return_routed_experts: {} is not a mixture-of-experts model",
                    self.inner.opts.name,
                    self.inner.opts.model_dir.display()
                )))
            }
        };
        let _admitted = self.inner.admission.enter().await;
        let (status, answer) = self
            .inner
            .post("/generate", &body, self.inner.opts.request_timeout)
            .await?;
        if status != 200 {
            return Err(EngineError::BadRequest(format!(
                "{}: /generate: HTTP {status}: {answer}",
                self.inner.opts.name
            )));
        }
        client::parse_generate(&answer, self.weight_version(), routing).map_err(|e| {
            EngineError::BadRequest(format!("{}: /generate answer: {e}", self.inner.opts.name))
        })
    }

    /// Over NCCL when the engine was given a group target ([`SglangEngine::feed_over_nccl`]),
    /// else as a safetensors export the server loads. A failed NCCL update falls back to
    /// disk for this version and every later one, and says so.
    async fn update_weights(&self, weights: NamedTensors, version: u64) -> Result<(), EngineError> {
        let nccl = self
            .inner
            .nccl_target
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(target) = nccl else {
            return self.inner.write_and_load(weights, version).await;
        };
        // Shallow copies: the disk fallback needs the tensors the broadcast takes.
        let kept: NamedTensors = weights
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        match self.inner.update_over_nccl(&target, weights, version).await {
            Ok(()) => Ok(()),
            Err(e) => {
                *self
                    .inner
                    .nccl_target
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = None;
                warn!(engine = %self.inner.opts.name, version, error = %e, "weight update over NCCL failed; this engine gets its weights from disk from now on");
                self.inner.write_and_load(kept, version).await
            }
        }
    }

    fn weight_version(&self) -> u64 {
        self.inner.version.load(Ordering::Relaxed)
    }

    fn restarts(&self) -> u64 {
        self.inner.restarts.load(Ordering::Relaxed)
    }

    async fn update_weights_from_disk(
        &self,
        dir: PathBuf,
        version: u64,
    ) -> Result<(), EngineError> {
        self.inner.load_from_disk(&dir, version, true).await
    }

    async fn abort(&self, rid: Option<String>) -> Result<(), EngineError> {
        let body = match rid {
            Some(rid) => json!({ "rid": rid }),
            None => json!({ "abort_all": true }),
        };
        self.inner
            .post("/abort_request", &body, Duration::from_secs(30))
            .await
            .map(|_| ())
    }

    /// Drain is Manta's own (see [`Admission`]); `abort` and `in_place` are the server's.
    async fn pause(&self, mode: PauseMode) -> Result<(), EngineError> {
        let mode = match mode {
            PauseMode::Drain => {
                return self
                    .inner
                    .admission
                    .drain(&self.inner.opts.name, self.inner.opts.request_timeout)
                    .await
            }
            PauseMode::Abort => "abort",
            PauseMode::InPlace => "in_place",
        };
        let (status, answer) = self
            .inner
            .post(
                "/pause_generation",
                &json!({ "mode": mode }),
                Duration::from_secs(600),
            )
            .await?;
        if status != 200 {
            return Err(EngineError::BadRequest(format!(
                "/pause_generation: HTTP {status}: {answer}"
            )));
        }
        self.inner.paused_on_server.store(true, Ordering::SeqCst);
        Ok(())
    }

    async fn resume(&self) -> Result<(), EngineError> {
        self.inner.admission.reopen();
        if !self.inner.paused_on_server.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        self.inner
            .post("/continue_generation", &json!({}), Duration::from_secs(60))
            .await
            .map(|_| ())
    }

    async fn flush_cache(&self) -> Result<bool, EngineError> {
        let (status, _) = self
            .inner
            .post("/flush_cache", &json!({}), Duration::from_secs(60))
            .await?;
        Ok(status == 200)
    }

    /// The KV cache only (SGLang's `kv_cache` tag; the server needs
    /// `--enable-memory-saver`): the weights stay, so the sync after the resume is the
    /// usual one.
    async fn release_memory_occupation(&self) -> Result<bool, EngineError> {
        let (status, _) = self
            .inner
            .post(
                "/release_memory_occupation",
                &json!({ "tags": ["kv_cache"] }),
                Duration::from_secs(120),
            )
            .await?;
        Ok(status == 200)
    }

    async fn resume_memory_occupation(&self) -> Result<(), EngineError> {
        let (status, answer) = self
            .inner
            .post(
                "/resume_memory_occupation",
                &json!({ "tags": ["kv_cache"] }),
                Duration::from_secs(120),
            )
            .await?;
        if status != 200 {
            return Err(EngineError::Stopped(format!(
                "/resume_memory_occupation: HTTP {status}: {answer}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drain waits for the running call, holds a later one at the gate until the
    /// gate reopens, and gives up (reopening) after its limit.
    #[tokio::test]
    async fn a_drain_waits_for_running_calls_and_holds_new_ones() {
        let admission = Arc::new(Admission::new());
        let running = admission.enter().await;
        let drain = {
            let a = admission.clone();
            tokio::spawn(async move { a.drain("engine-0", Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!drain.is_finished(), "the drain waits for the running call");
        let late = {
            let a = admission.clone();
            tokio::spawn(async move {
                let _in = a.enter().await;
            })
        };
        drop(running);
        drain.await.unwrap().expect("drained");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !late.is_finished(),
            "a call after the drain waits at the gate"
        );
        admission.reopen();
        late.await.unwrap();

        let _stuck = admission.enter().await;
        let err = admission
            .drain("engine-0", Duration::from_millis(50))
            .await
            .expect_err("a call that never ends");
        assert!(
            err.to_string().contains("1 requests still running"),
            "{err}"
        );
        assert!(*admission.open.borrow(), "a failed drain reopens the gate");
    }
}

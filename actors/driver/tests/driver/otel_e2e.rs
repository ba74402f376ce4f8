//! OpenTelemetry end to end: the real `driver` binary runs 2 local steps with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an in-process OTLP/gRPC receiver (the
//! official `TraceService` from opentelemetry-proto); the spans it receives must form
//! step → episode → turn → generate/tool_call trees, one trace per step. In remote mode
//! the episodes run in a `worker` process and must still hang off the driver's step.

use crate::common;

use common::{workspace, Worker};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;

const STEPS: usize = 2;
const BATCH: usize = 2;
const N_SAMPLES: usize = 2;

/// A received span, flattened.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    attributes: BTreeMap<String, Value>,
}

impl Span {
    fn attr(&self, key: &str) -> Option<&Value> {
        self.attributes.get(key)
    }
    fn int(&self, key: &str) -> i64 {
        match self.attr(key) {
            Some(Value::IntValue(v)) => *v,
            other => panic!("span {} attribute {key}: {other:?}", self.name),
        }
    }
}

#[derive(Default, Clone)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter()
        .filter_map(|kv| {
            let v = kv.value.as_ref()?.value.clone()?;
            Some((kv.key.clone(), v))
        })
        .collect()
}

#[async_trait::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let resource = rs
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            let service = match resource.get("service.name") {
                Some(Value::StringValue(s)) => s.clone(),
                _ => String::new(),
            };
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(Span {
                        service: service.clone(),
                        name: s.name,
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent: s.parent_span_id,
                        attributes: attributes(&s.attributes),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Serves the OTLP trace service on a free loopback port; returns its endpoint URL.
async fn start_receiver(receiver: &Receiver) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    let handle = tokio::spawn(async move {
        server.await.expect("the OTLP receiver serves");
    });
    (format!("http://127.0.0.1:{port}"), handle)
}

/// Runs the real `driver` for `STEPS` tiny steps with span export to `endpoint`.
async fn run_driver(cluster: &Path, runs: &Path, endpoint: &str, env: &[(&str, &str)]) {
    let (steps, batch, n) = (STEPS.to_string(), BATCH.to_string(), N_SAMPLES.to_string());
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_driver"))
        .current_dir(workspace())
        .args([
            "--cluster",
            cluster.to_str().unwrap(),
            // The tiny local example's settings (below the flags here).
            "--train-settings",
            "configs/local-tiny.toml",
            "--runs-dir",
            runs.to_str().unwrap(),
            "--num-rollout",
            &steps,
            "--rollout-batch-size",
            &batch,
            "--n-samples",
            &n,
            "--run-name",
            "otel",
        ])
        // Console logging stays quiet; span export must not depend on RUST_LOG.
        .env("RUST_LOG", "warn")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .envs(env.iter().copied())
        .output()
        .await
        .expect("driver runs");
    assert!(
        out.status.success(),
        "driver failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_exports_step_episode_turn_spans_over_otlp() {
    let receiver = Receiver::default();
    let (endpoint, server) = start_receiver(&receiver).await;
    let tmp = tempfile::tempdir().unwrap();
    let cluster = workspace().join("cluster.toml");
    run_driver(&cluster, &tmp.path().join("runs"), &endpoint, &[]).await;
    server.abort();
    // The driver flushed before exiting, so every span has arrived.
    let spans = receiver.spans.lock().unwrap().clone();
    check_trees(&spans, "manta-driver");
}

const TOKEN: &str = "otel-e2e-token";

/// Remote mode: episodes run in a `worker` process; their spans (service `manta-worker`)
/// must sit under the driver's `step` span, in its trace, through the gRPC metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_episode_spans_descend_from_the_drivers_step_span() {
    let receiver = Receiver::default();
    let (endpoint, server) = start_receiver(&receiver).await;
    let tmp = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = std::fs::File::create(tmp.path().join("worker.log")).unwrap();
    let _worker = Worker(
        std::process::Command::new(env!("CARGO_BIN_EXE_worker"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("MANTA_CLUSTER_TOKEN", TOKEN)
            .env_remove("MANTA_CLUSTER_TOKEN_FILE")
            .env("RUST_LOG", "warn")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            // The worker is killed, not shut down: export its spans promptly instead.
            .env("OTEL_BSP_SCHEDULE_DELAY", "50")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("worker starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "worker on {port} never listened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ws = workspace();
    let cluster = tmp.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[cluster]\nmode = \"remote\"\ntrain_config = \"{}\"\n\n\
             [rollout]\nengines = 1\nmax_concurrent_episodes = 8\n\n\
             [train]\nmodel = \"{}\"\nseed = 1\nmax_response_len = 8\ncontext_len = 512\n\n\
             [[nodes]]\naddress = \"127.0.0.1:{port}\"\n",
            ws.join("train_config.yaml").display(),
            ws.join("assets/tiny-qwen3").display(),
        ),
    )
    .unwrap();
    run_driver(
        &cluster,
        &tmp.path().join("runs"),
        &endpoint,
        &[("MANTA_CLUSTER_TOKEN", TOKEN)],
    )
    .await;
    // The driver flushed at exit; wait for the worker's batches.
    let expected = STEPS * BATCH * N_SAMPLES;
    let deadline = Instant::now() + Duration::from_secs(10);
    let spans = loop {
        let spans = receiver.spans.lock().unwrap().clone();
        let episodes = spans.iter().filter(|s| s.name == "episode").count();
        if episodes >= expected || Instant::now() > deadline {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    server.abort();
    check_trees(&spans, "manta-worker");
}

/// Checks the span trees; `episode_service` is the process episodes ran in.
fn check_trees(spans: &[Span], episode_service: &str) {
    let by_id: HashMap<&[u8], &Span> = spans.iter().map(|s| (&s.span_id[..], s)).collect();
    let named = |name: &'static str| spans.iter().filter(move |s| s.name == name);
    let ancestors = |s: &Span| {
        let mut chain = Vec::new();
        let mut cur = s;
        while let Some(p) = by_id.get(&cur.parent[..]) {
            chain.push(*p);
            cur = p;
        }
        chain
    };
    let children = |s: &Span, name: &str| -> Vec<&Span> {
        spans
            .iter()
            .filter(|c| c.parent == s.span_id && c.name == name)
            .collect()
    };

    let services = |name: &'static str| {
        let mut v: Vec<&str> = named(name).map(|s| s.service.as_str()).collect();
        v.dedup();
        v
    };
    assert_eq!(services("step"), ["manta-driver"], "service.name of steps");
    for name in ["episode", "turn", "generate"] {
        assert_eq!(services(name), [episode_service], "service.name of {name}");
    }

    // One root `step` span per step, each in its own trace, with its metrics.
    let steps: Vec<&Span> = named("step").collect();
    let mut step_numbers: Vec<i64> = steps.iter().map(|s| s.int("step")).collect();
    step_numbers.sort();
    assert_eq!(step_numbers, (1..=STEPS as i64).collect::<Vec<_>>());
    for s in &steps {
        assert!(s.parent.is_empty(), "a step span is a trace root");
        assert_eq!(s.int("samples"), (BATCH * N_SAMPLES) as i64);
        for key in ["reward", "loss"] {
            assert!(
                matches!(s.attr(key), Some(Value::DoubleValue(v)) if v.is_finite()),
                "step {key}: {:?}",
                s.attr(key)
            );
        }
    }
    let step_traces: Vec<&Vec<u8>> = steps.iter().map(|s| &s.trace_id).collect();
    assert_ne!(step_traces[0], step_traces[1], "one trace per step");

    // Every episode descends from its step's span, in the step's trace.
    let episodes: Vec<&Span> = named("episode").collect();
    assert_eq!(episodes.len(), STEPS * BATCH * N_SAMPLES);
    let mut per_step: HashMap<i64, usize> = HashMap::new();
    for e in &episodes {
        let chain = ancestors(e);
        let step = chain
            .iter()
            .find(|a| a.name == "step")
            .unwrap_or_else(|| panic!("episode {:?} has no step ancestor", e.attributes));
        assert!(chain.last().is_some_and(|root| root.name == "step"));
        assert_eq!(e.trace_id, step.trace_id, "episode in its step's trace");
        *per_step.entry(step.int("step")).or_default() += 1;

        for key in ["env", "task", "stop_reason"] {
            assert!(
                matches!(e.attr(key), Some(Value::StringValue(v)) if !v.is_empty()),
                "episode {key}: {:?}",
                e.attributes
            );
        }
        assert!(matches!(e.attr("reward"), Some(Value::DoubleValue(_))));
        let turns = e.int("turns");
        assert!(e.int("tokens") > 0);

        // episode → turn → generate (one per turn) → tool_call where the turn made one.
        let turn_spans = children(e, "turn");
        assert_eq!(turn_spans.len() as i64, turns, "{:?}", e.attributes);
        let budget_stop =
            matches!(e.attr("stop_reason"), Some(Value::StringValue(r)) if r == "context_budget");
        for t in &turn_spans {
            assert_eq!(t.trace_id, e.trace_id);
            let generates = children(t, "generate").len();
            // Only a turn that found the context budget spent generates nothing.
            let may_skip = budget_stop && t.int("turn") == turns - 1;
            assert!(
                generates == 1 || (may_skip && generates == 0),
                "{generates} generate spans in a turn"
            );
            assert!(children(t, "tool_call").len() <= 1);
        }
        // A terminal episode ended on a tool call, made in its last turn.
        if matches!(e.attr("stop_reason"), Some(Value::StringValue(r)) if r == "terminal") {
            let last = turn_spans
                .iter()
                .find(|t| t.int("turn") == turns - 1)
                .expect("the last turn's span");
            assert_eq!(children(last, "tool_call").len(), 1);
        }
    }
    assert_eq!(
        per_step.values().copied().collect::<Vec<_>>(),
        vec![BATCH * N_SAMPLES; STEPS]
    );
    eprintln!(
        "{} spans: {} turns, {} generate, {} tool_call",
        spans.len(),
        named("turn").count(),
        named("generate").count(),
        named("tool_call").count()
    );
    // Generate and tool calls only ever appear inside a turn.
    for s in named("generate").chain(named("tool_call")) {
        assert_eq!(by_id[&s.parent[..]].name, "turn");
    }
}

//! An OpenTelemetry trace sink for bench runs on machines without a collector:
//! serves the OTLP/gRPC `TraceService` (opentelemetry-proto's) and appends every span it
//! receives to a JSON-lines file, so a run's traces can be read after it ends.
//!
//! usage: otlp_sink ADDR OUT.jsonl   (e.g. 127.0.0.1:4317; runs until killed)

use std::io::Write;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use serde_json::json;

#[derive(Clone)]
struct Sink {
    out: Arc<Mutex<std::io::BufWriter<std::fs::File>>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> serde_json::Map<String, serde_json::Value> {
    kvs.iter()
        .filter_map(|kv| {
            let v = match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => json!(s),
                Value::BoolValue(b) => json!(b),
                Value::IntValue(i) => json!(i),
                Value::DoubleValue(d) => json!(d),
                other => json!(format!("{other:?}")),
            };
            Some((kv.key.clone(), v))
        })
        .collect()
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self
            .out
            .lock()
            .map_err(|_| tonic::Status::internal("sink poisoned"))?;
        for rs in request.into_inner().resource_spans {
            let resource = rs
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or(json!(""));
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let line = json!({
                        "service": service,
                        "name": s.name,
                        "trace_id": hex(&s.trace_id),
                        "span_id": hex(&s.span_id),
                        "parent_span_id": hex(&s.parent_span_id),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "attributes": attributes(&s.attributes),
                    });
                    writeln!(out, "{line}").map_err(|e| tonic::Status::internal(e.to_string()))?;
                }
            }
        }
        out.flush()
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(addr), Some(path)) = (args.get(1), args.get(2)) else {
        anyhow::bail!("usage: otlp_sink ADDR OUT.jsonl");
    };
    let addr: std::net::SocketAddr = addr
        .parse()
        .with_context(|| format!("ADDR {addr:?} is not HOST:PORT"))?;
    let file = std::fs::File::create(path).with_context(|| format!("creating {path}"))?;
    let sink = Sink {
        out: Arc::new(Mutex::new(std::io::BufWriter::new(file))),
    };
    eprintln!("otlp_sink: listening on {addr}, writing {path}");
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(sink))
        .serve(addr)
        .await
        .context("serving OTLP")?;
    Ok(())
}

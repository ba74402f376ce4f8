//! W3C trace context (`traceparent`, `tracestate`) in and out of request headers, so
//! spans a worker process creates for a driver's request join the driver's trace.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The headers that carry `span`'s trace context (`traceparent`, and `tracestate` when
/// set), lower-case names; empty when span export is off or the span is disabled.
pub fn inject_trace_context(span: &tracing::Span) -> Vec<(String, String)> {
    let mut headers = HeaderVec(Vec::new());
    TraceContextPropagator::new().inject_context(&span.context(), &mut headers);
    headers.0
}

/// Makes the trace context in `headers` (as written by [`inject_trace_context`]) the
/// parent of `span`. Call it before the span is first entered. Returns whether a valid
/// remote parent was found and set; missing or malformed headers leave `span` as it was.
pub fn set_parent_from(span: &tracing::Span, headers: &[(String, String)]) -> bool {
    set_parent(span, &HeaderSlice(headers))
}

/// A new info-level span named `remote_request` whose parent is the trace context in
/// `headers`: the root of the work a process does for another process's request.
pub fn span_with_remote_parent(rpc: &str, headers: &[(String, String)]) -> tracing::Span {
    let span = tracing::info_span!("remote_request", rpc = %rpc);
    set_parent_from(&span, headers);
    span
}

/// Writes `span`'s trace context into gRPC request metadata.
pub fn inject_into_metadata(span: &tracing::Span, metadata: &mut MetadataMap) {
    for (key, value) in inject_trace_context(span) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            metadata.insert(key, value);
        }
    }
}

/// [`set_parent_from`] for gRPC request metadata (server side).
pub fn set_parent_from_metadata(span: &tracing::Span, metadata: &MetadataMap) -> bool {
    set_parent(span, &MetadataExtractor(metadata))
}

fn set_parent(span: &tracing::Span, carrier: &dyn Extractor) -> bool {
    use opentelemetry::trace::TraceContextExt;
    let cx = TraceContextPropagator::new().extract(carrier);
    if !cx.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(cx).is_ok()
}

struct HeaderVec(Vec<(String, String)>);

impl Injector for HeaderVec {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_ascii_lowercase(), value));
    }
}

struct HeaderSlice<'a>(&'a [(String, String)]);

impl Extractor for HeaderSlice<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_str()).collect()
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    /// A subscriber with an OpenTelemetry layer (no exporter: ids are all we need).
    fn with_otel<T>(f: impl FnOnce() -> T) -> T {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f)
    }

    #[test]
    fn a_remote_child_joins_the_senders_trace() {
        with_otel(|| {
            let parent = tracing::info_span!("step");
            let headers = inject_trace_context(&parent);
            let traceparent = &headers
                .iter()
                .find(|(k, _)| k == "traceparent")
                .expect("a traceparent header")
                .1;
            let sent = parent.context().span().span_context().clone();
            assert_eq!(
                traceparent,
                &format!("00-{}-{}-01", sent.trace_id(), sent.span_id())
            );

            // Through header pairs.
            let child = tracing::info_span!(parent: None, "episode");
            assert!(set_parent_from(&child, &headers));
            let got = child.context().span().span_context().clone();
            assert_eq!(got.trace_id(), sent.trace_id());
            assert_ne!(got.span_id(), sent.span_id());

            // Through gRPC metadata.
            let mut md = MetadataMap::new();
            inject_into_metadata(&parent, &mut md);
            let child = tracing::info_span!(parent: None, "episode");
            assert!(set_parent_from_metadata(&child, &md));
            assert_eq!(
                child.context().span().span_context().trace_id(),
                sent.trace_id()
            );

            let root = span_with_remote_parent("RunEpisodes", &headers);
            assert_eq!(
                root.context().span().span_context().trace_id(),
                sent.trace_id()
            );
        });
    }

    #[test]
    fn bad_or_missing_headers_leave_the_span_alone() {
        with_otel(|| {
            let span = tracing::info_span!(parent: None, "episode");
            assert!(!set_parent_from(&span, &[]));
            let bad = [("traceparent".to_string(), "00-zz-yy-01".to_string())];
            assert!(!set_parent_from(&span, &bad));
        });
    }

    #[test]
    fn without_export_nothing_is_injected() {
        let span = tracing::info_span!("step");
        assert!(inject_trace_context(&span).is_empty());
    }
}

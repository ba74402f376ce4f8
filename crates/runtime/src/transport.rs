//! A lean HTTP/2 transport for tonic's generated clients, on the `h2` crate directly.
//!
//! tonic's `Channel` sends a call through a tower buffer task and hyper's dispatch
//! task, and hyper pipes the request body from yet another task once the stream has
//! flow-control capacity; a unary call then leaves in two socket writes (headers, then
//! body), so the worker wakes twice per call. Here the caller's task queues headers and
//! body into the connection at once, so a unary call is one write and one wake on each
//! side; bodies past [`EAGER_BYTES`] respect flow control. tonic still does the gRPC
//! framing, codecs and status handling; only the HTTP/2 plumbing changes.
//!
//! A caller that is the only one waiting on the channel also polls for its response
//! for up to [`H2Channel::with_response_spin`] before parking its thread: on virtual
//! machines, waking a parked thread when the reply lands costs tens of microseconds,
//! more than a control-plane reply takes to arrive. Long calls pay one short spin;
//! with several calls in flight the runtime is busy anyway and nobody spins.
//!
//! The connection is opened on first use and re-opened on the next call after it
//! breaks (a worker restarted on the same address), like `Endpoint::connect_lazy`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use http_body::{Body as HttpBody, Frame};
use tokio::net::TcpStream;
use tonic::body::Body;
use tracing::debug;

/// Request-body bytes queued without waiting for flow-control capacity: enough for any
/// control message in one write, small enough to bound what a slow peer makes us buffer.
pub const EAGER_BYTES: usize = 64 * 1024;
/// Default for [`H2Channel::with_response_spin`]: a few control-plane round trips.
pub const DEFAULT_RESPONSE_SPIN: Duration = Duration::from_micros(200);
/// Receive windows, as hyper's defaults (samples stream back in bulk).
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a call could not be carried.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("tcp connect error: {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("tcp connect error: {addr}: timed out after {ms} ms")]
    ConnectTimeout { addr: String, ms: u64 },
    #[error("HTTP/2 handshake with {addr}: {source}")]
    Handshake { addr: String, source: h2::Error },
}

struct Connection {
    send: SendRequest<Bytes>,
    /// Set by the connection task when the connection ends.
    closed: Arc<AtomicBool>,
}

struct Inner {
    addr: String,
    authority: http::uri::Authority,
    connect_timeout: Duration,
    conn: tokio::sync::Mutex<Option<Connection>>,
    response_spin: Duration,
    /// Calls waiting for their response headers (spinning only pays when alone).
    waiting: AtomicUsize,
}

/// One lazily opened HTTP/2 connection to `host:port`, usable as the transport of any
/// tonic client (`WorkerClient::new(channel)`). Cheap to clone; clones share it.
#[derive(Clone)]
pub struct H2Channel {
    inner: Arc<Inner>,
}

impl H2Channel {
    /// A channel to `addr` (`host:port`); nothing connects until the first call.
    pub fn lazy(addr: &str, connect_timeout: Duration) -> Result<Self, http::Error> {
        let authority: http::uri::Authority = addr.parse()?;
        Ok(Self {
            inner: Arc::new(Inner {
                addr: addr.to_string(),
                authority,
                connect_timeout,
                conn: tokio::sync::Mutex::new(None),
                response_spin: DEFAULT_RESPONSE_SPIN,
                waiting: AtomicUsize::new(0),
            }),
        })
    }

    /// How long a lone caller polls for its response before parking (zero: never).
    /// Call before cloning: clones share the setting.
    pub fn with_response_spin(mut self, spin: Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.response_spin = spin;
        }
        self
    }

    /// The peer's `host:port`.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// A ready sender on a live connection, connecting (again) when there is none.
    async fn sender(&self) -> Result<SendRequest<Bytes>, BoxError> {
        let mut guard = self.inner.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            if !c.closed.load(Ordering::Acquire) {
                let send = c.send.clone();
                drop(guard);
                match send.ready().await {
                    Ok(send) => return Ok(send),
                    Err(e) => {
                        debug!(addr = %self.inner.addr, error = %e, "connection unusable; reconnecting");
                        guard = self.inner.conn.lock().await;
                    }
                }
            }
        }
        let conn = self.connect().await?;
        let send = conn.send.clone();
        *guard = Some(conn);
        drop(guard);
        Ok(send.ready().await?)
    }

    async fn connect(&self) -> Result<Connection, BoxError> {
        let addr = &self.inner.addr;
        let limit = self.inner.connect_timeout;
        let tcp = match tokio::time::timeout(limit, TcpStream::connect(addr.as_str())).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(source)) => {
                return Err(TransportError::Connect {
                    addr: addr.clone(),
                    source,
                }
                .into())
            }
            Err(_) => {
                return Err(TransportError::ConnectTimeout {
                    addr: addr.clone(),
                    ms: limit.as_millis() as u64,
                }
                .into())
            }
        };
        // Control messages are small: never hold them back for delayed ACKs.
        tcp.set_nodelay(true)?;
        let (send, connection) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .handshake::<_, Bytes>(tcp)
            .await
            .map_err(|source| TransportError::Handshake {
                addr: addr.clone(),
                source,
            })?;
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        let addr = addr.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                debug!(addr = %addr, error = %e, "HTTP/2 connection ended");
            }
            flag.store(true, Ordering::Release);
        });
        Ok(Connection { send, closed })
    }

    async fn call_inner(
        self,
        request: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let mut send = self.sender().await?;
        let (mut parts, body) = request.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
            .to_string();
        parts.uri = http::Uri::builder()
            .scheme("http")
            .authority(self.inner.authority.clone())
            .path_and_query(path)
            .build()?;
        let head = http::Request::from_parts(parts, ());
        let (response, mut stream) = send.send_request(head, false)?;
        let mut body = std::pin::pin!(body);
        let mut eager = EAGER_BYTES;
        // Queue what the body has ready now (a unary message: all of it) before yielding,
        // so headers and body leave together; then stream the rest under flow control.
        let sending = async {
            while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
                let frame = frame?;
                let frame = match frame.into_data() {
                    Ok(mut data) => {
                        let end = body.is_end_stream();
                        if data.len() <= eager {
                            eager -= data.len();
                            stream.send_data(data, end)?;
                        } else {
                            eager = 0;
                            while !data.is_empty() {
                                stream.reserve_capacity(data.len());
                                let granted = std::future::poll_fn(|cx| stream.poll_capacity(cx))
                                    .await
                                    .ok_or("the HTTP/2 stream closed while sending")??;
                                let chunk = data.split_to(granted.min(data.len()));
                                stream.send_data(chunk, end && data.is_empty())?;
                            }
                        }
                        if end {
                            return Ok::<(), BoxError>(());
                        }
                        continue;
                    }
                    Err(frame) => frame,
                };
                if let Ok(trailers) = frame.into_trailers() {
                    stream.send_trailers(trailers)?;
                    return Ok(());
                }
            }
            stream.send_data(Bytes::new(), true)?;
            Ok(())
        };
        let mut response = std::pin::pin!(response);
        let mut sending = std::pin::pin!(sending);
        // A unary body is queued on the first poll; a longer one streams while the
        // response is awaited. A server may answer before the body ends (a refused
        // token): the stream then closes under the sender, possibly between two of its
        // writes when the connection runs on another thread. Such a send error only
        // matters if no response comes.
        let mut send_error: Option<BoxError> = None;
        let sent = match futures::FutureExt::now_or_never(sending.as_mut()) {
            Some(result) => {
                send_error = result.err();
                true
            }
            None => false,
        };
        // Counted until the response headers arrive.
        let waiting = Waiting::enter(&self.inner.waiting);
        if sent && send_error.is_none() && !self.inner.response_spin.is_zero() {
            let until = Instant::now() + self.inner.response_spin;
            while waiting.alone() && Instant::now() < until {
                if let Some(r) = futures::FutureExt::now_or_never(response.as_mut()) {
                    return finish(r?);
                }
                tokio::task::yield_now().await;
            }
        }
        let response = if sent {
            response.await
        } else {
            let mut sent = false;
            std::future::poll_fn(|cx| {
                if !sent {
                    if let Poll::Ready(r) = sending.as_mut().poll(cx) {
                        sent = true;
                        send_error = r.err();
                    }
                }
                response.as_mut().poll(cx)
            })
            .await
        };
        let response = match (response, send_error) {
            (Ok(response), _) => response,
            (Err(e), Some(send)) => return Err(format!("{send} (then: {e})").into()),
            (Err(e), None) => return Err(e.into()),
        };
        drop(waiting);
        finish(response)
    }
}

/// Counts a call among those waiting for response headers while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count)
    }

    fn alone(&self) -> bool {
        self.0.load(Ordering::Acquire) == 1
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn finish(response: http::Response<h2::RecvStream>) -> Result<http::Response<Body>, BoxError> {
    let (parts, recv) = response.into_parts();
    Ok(http::Response::from_parts(
        parts,
        Body::new(ResponseBody {
            recv,
            data_done: false,
        }),
    ))
}

impl tower_service::Service<http::Request<Body>> for H2Channel {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(self.clone().call_inner(request))
    }
}

/// A response body: data frames (their flow-control capacity released as they are
/// read), then the trailers that carry the gRPC status.
struct ResponseBody {
    recv: h2::RecvStream,
    data_done: bool,
}

impl HttpBody for ResponseBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match self.recv.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => self.data_done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        match self.recv.poll_trailers(cx) {
            Poll::Ready(Ok(Some(t))) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// What a `WorkerClient` talks through: [`H2Channel`] for plaintext, tonic's own
/// `Channel` (rustls) when the cluster uses TLS.
#[derive(Clone)]
pub enum ClusterChannel {
    Lean(H2Channel),
    Tonic(tonic::transport::Channel),
}

impl tower_service::Service<http::Request<Body>> for ClusterChannel {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self {
            ClusterChannel::Lean(c) => c.poll_ready(cx),
            ClusterChannel::Tonic(c) => c.poll_ready(cx).map_err(BoxError::from),
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        match self {
            ClusterChannel::Lean(c) => c.call(request),
            ClusterChannel::Tonic(c) => {
                let response = c.call(request);
                Box::pin(async move { response.await.map_err(BoxError::from) })
            }
        }
    }
}

//! The HTTP front of `serve`: hyper 1 (HTTP/1.1) on a small tokio runtime does all the socket I/O
//! under fixed limits, and synchronous handlers run on a fixed pool of worker threads.
//!
//! - Threads: `limits.workers` handler threads plus two runtime threads (and the caller, blocked
//!   in [`Listener::serve`]), whatever the number of sockets.
//! - Connections: at most `limits.max_connections` open at once; beyond that the listener stops
//!   accepting until one ends (new clients wait in the kernel's backlog, [`BACKLOG`] long).
//! - Head: more than `limits.max_header_bytes` (request line and headers) is answered 431 by hyper
//!   and the connection closed, after reading at most that much; a head not complete within
//!   `limits.header_read_timeout` of its first byte (or of the accept, for a new connection)
//!   closes the connection.
//! - Body: a `Content-Length` over `limits.max_body_bytes` is answered 413 before reading the
//!   body; a chunked body that grows past it is answered 413 once it does; a body not complete
//!   within `limits.body_read_timeout` is answered 408. These three close the connection.
//! - Keep-alive: an idle connection is closed `limits.idle_timeout` after its last response; a
//!   client that takes no response bytes for `limits.write_timeout` is dropped.
//! - Queue: requests wait for a worker in a queue of `limits.queue`; when it is full they are
//!   answered 503 at once.
//!
//! Errors are answered in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`
//! (hyper's own 431 and 400 for unparsable heads have an empty body).
//!
//! This file only uses std, socket2, tokio, hyper, hyper-util and serde_json (no `crate::`
//! paths), so that tests/serve_listener.rs can include it on its own.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener, ToSocketAddrs};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper::body::{Body as _, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc as chunks, oneshot, Semaphore};
use tokio::time::{Instant, Sleep};

/// How many streamed chunks may wait between a handler and a slow client before
/// [`Stream::write`] blocks.
const STREAM_CHANNEL_CHUNKS: usize = 16;

/// The limits that keep the server's memory and threads bounded, whatever the clients do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes of a request's head (request line and headers): over it, 431.
    pub max_header_bytes: usize,
    /// The most bytes of a request's body: over it, 413.
    pub max_body_bytes: usize,
    /// The time for a head to arrive, from its first byte (from the accept on a new
    /// connection); then the connection is closed.
    pub header_read_timeout: Duration,
    /// The time for a whole body to arrive once the head has; then 408.
    pub body_read_timeout: Duration,
    /// How long a keep-alive connection may wait for its next request.
    pub idle_timeout: Duration,
    /// How long a client may take no bytes of its response before the connection is dropped.
    pub write_timeout: Duration,
    /// The most connections open at once; the listener stops accepting at this many.
    pub max_connections: usize,
    /// The handler threads.
    pub workers: usize,
    /// The requests that may wait for a free worker; beyond them, 503.
    pub queue: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: 16 * 1024,
            max_body_bytes: 32 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_connections: 512,
            workers: 64,
            queue: 256,
        }
    }
}

/// A request whose body has been read, within the limits.
#[derive(Debug, Clone)]
pub struct Request {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// What follows `?`, if anything.
    // serve does not use this; tests/serve_listener.rs does.
    #[allow(dead_code)]
    pub query: Option<String>,
    /// The headers in the order sent, names lowercase (values decoded lossily as UTF-8).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first header of this name (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// What a handler answers, sent to the connection's task.
enum Reply {
    Full {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    Stream {
        status: u16,
        headers: Vec<(String, String)>,
        chunks: chunks::Receiver<Bytes>,
    },
}

/// The way to answer one request: [`Responder::send`] a whole body or [`Responder::stream`] one.
/// A responder dropped without either is answered 500.
pub struct Responder {
    reply: oneshot::Sender<Reply>,
    /// Headers every answer carries besides its own (e.g. CORS's).
    extra: Vec<(String, String)>,
}

impl Responder {
    /// This responder, every answer of which also carries `headers`.
    pub fn with_headers(mut self, headers: Vec<(String, String)>) -> Self {
        self.extra.extend(headers);
        self
    }

    /// Answers with a whole body.
    // serve does not use this; tests/serve_listener.rs does.
    #[allow(dead_code)]
    pub fn send(self, status: u16, content_type: &str, body: Vec<u8>) {
        self.send_with_headers(status, content_type, &[], body);
    }

    /// Answers with a whole body and extra headers.
    pub fn send_with_headers(
        self,
        status: u16,
        content_type: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) {
        let mut headers = with_content_type(content_type, headers);
        headers.extend(self.extra);
        // An Err means the client is gone: nothing to answer.
        let _ = self.reply.send(Reply::Full {
            status,
            headers,
            body,
        });
    }

    /// Starts a streamed (chunked) answer; each [`Stream::write`] is sent (and flushed) as it
    /// comes, as Server-Sent Events need.
    // serve does not use this; tests/serve_listener.rs does.
    #[allow(dead_code)]
    pub fn stream(self, status: u16, content_type: &str) -> Stream {
        self.stream_with_headers(status, content_type, &[])
    }

    /// [`Responder::stream`] with extra headers.
    pub fn stream_with_headers(
        self,
        status: u16,
        content_type: &str,
        headers: &[(&str, &str)],
    ) -> Stream {
        let (sender, receiver) = chunks::channel(STREAM_CHANNEL_CHUNKS);
        let mut headers = with_content_type(content_type, headers);
        headers.extend(self.extra);
        // When the client is gone the receiver is dropped here, and every write fails.
        let _ = self.reply.send(Reply::Stream {
            status,
            headers,
            chunks: receiver,
        });
        Stream {
            chunks: Some(sender),
        }
    }

    /// Whether the client has gone (closed its connection) while its request waited or ran.
    pub fn client_gone(&self) -> bool {
        self.reply.is_closed()
    }
}

fn with_content_type(content_type: &str, headers: &[(&str, &str)]) -> Vec<(String, String)> {
    std::iter::once(("content-type", content_type))
        .chain(headers.iter().copied())
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

/// A streamed answer in progress. Dropping it ends the answer, as [`Stream::finish`] does.
pub struct Stream {
    chunks: Option<chunks::Sender<Bytes>>,
}

impl Stream {
    /// Sends one chunk. Blocks while the client is slow to read (at most
    /// [`STREAM_CHANNEL_CHUNKS`] chunks wait); fails once the client is gone (or was dropped for
    /// not reading within the write timeout), so that the work can stop. Must be called off the
    /// tokio runtime (the workers are).
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let gone = || io::Error::new(io::ErrorKind::BrokenPipe, "the client is gone");
        let sender = self.chunks.as_ref().ok_or_else(gone)?;
        if bytes.is_empty() {
            // An empty chunk would end a chunked body; check the client is still there.
            return if sender.is_closed() {
                Err(gone())
            } else {
                Ok(())
            };
        }
        sender
            .blocking_send(Bytes::copy_from_slice(bytes))
            .map_err(|_| gone())
    }

    /// Ends the answer.
    pub fn finish(mut self) {
        self.chunks = None;
    }
}

/// The connections the kernel completes and holds for the accept loop. std's listeners take
/// 128, too few for a burst: connections past a full queue lose their handshake and retry it a
/// second later (4,000 connections opened one after another took 21 s against this listener
/// with 128 on a 2-core host, and the kernel's own limit, `net.core.somaxconn`, caps this).
pub const BACKLOG: i32 = 1024;

/// A socket bound to `addr` and listening, as std binds one (address reuse on Unix) but with
/// [`BACKLOG`].
fn listen_on(addr: SocketAddr) -> io::Result<StdListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    #[cfg(unix)]
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// A request on its way to a worker.
struct Job {
    request: Request,
    responder: Responder,
}

/// A bound listening socket; [`Listener::serve`] answers on it.
pub struct Listener {
    socket: StdListener,
}

impl Listener {
    /// Binds `host:port` now (port 0: any free port), so that errors show at start: the first
    /// of its addresses that binds, listening with a backlog of [`BACKLOG`].
    pub fn bind(host: &str, port: u16) -> io::Result<Listener> {
        let mut last_error = None;
        for addr in (host, port).to_socket_addrs()? {
            match listen_on(addr) {
                Ok(socket) => return Self::from_std(socket),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{host} resolves to no address"))))
    }

    /// Wraps a listening socket bound elsewhere.
    pub fn from_std(socket: StdListener) -> io::Result<Listener> {
        socket.set_nonblocking(true)?;
        Ok(Listener { socket })
    }

    /// The address bound (with the port chosen for port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Answers requests forever: `handler` runs on `limits.workers` threads (it may borrow
    /// data of the caller) and must answer through its [`Responder`]. Returns only on an error
    /// at start.
    pub fn serve(
        self,
        limits: Limits,
        handler: &(dyn Fn(Request, Responder) + Sync),
    ) -> io::Result<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(1)
            .thread_name("serve-io")
            .enable_io()
            .enable_time()
            .build()?;
        let (queue, jobs) = mpsc::sync_channel::<Job>(limits.queue);
        let jobs = Mutex::new(jobs);
        let jobs = &jobs;
        std::thread::scope(|scope| {
            for i in 0..limits.workers.max(1) {
                std::thread::Builder::new()
                    .name(format!("serve-worker-{i}"))
                    .spawn_scoped(scope, move || work(jobs, handler))?;
            }
            let shared = Arc::new(Shared { limits, queue });
            let socket = self.socket;
            let result = runtime.block_on(async move {
                let socket = tokio::net::TcpListener::from_std(socket)?;
                accept(socket, shared).await
            });
            // Drops the connections' tasks, and with them the queue's senders: the workers end
            // once they have finished their requests.
            runtime.shutdown_background();
            result
        })
    }
}

/// One worker: runs the handler on queued requests until the queue closes.
fn work(jobs: &Mutex<mpsc::Receiver<Job>>, handler: &(dyn Fn(Request, Responder) + Sync)) {
    loop {
        let job = jobs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .recv();
        let Ok(Job { request, responder }) = job else {
            return;
        };
        // A panicking handler answers 500 (its responder drops) and keeps its worker.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| handler(request, responder)));
    }
}

/// What every connection's task shares.
struct Shared {
    limits: Limits,
    queue: mpsc::SyncSender<Job>,
}

/// Accepts connections while fewer than `max_connections` are open.
async fn accept(socket: tokio::net::TcpListener, shared: Arc<Shared>) -> io::Result<()> {
    let open = Arc::new(Semaphore::new(shared.limits.max_connections.max(1)));
    let mut last_error: Option<std::time::Instant> = None;
    loop {
        let permit = open
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| io::Error::other("connection semaphore closed"))?;
        let (tcp, _) = match socket.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors or memory, or a connection reset before its accept:
                // wait a little and go on.
                if last_error.is_none_or(|at| at.elapsed() > Duration::from_secs(10)) {
                    eprintln!("serve: accept failed ({error}); retrying");
                    last_error = Some(std::time::Instant::now());
                }
                drop(permit);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            connection(tcp, shared).await;
            drop(permit);
        });
    }
}

/// Serves one connection until it closes, fails or times out.
async fn connection(tcp: tokio::net::TcpStream, shared: Arc<Shared>) {
    let _ = tcp.set_nodelay(true);
    let limits = &shared.limits;
    let state = Arc::new(ConnState::new());
    let io = TokioIo::new(TimedIo {
        tcp,
        state: state.clone(),
        generation: 0,
        head_started: None,
        read_timer: None,
        write_timer: None,
        header_timeout: limits.header_read_timeout,
        idle_timeout: limits.idle_timeout,
        write_timeout: limits.write_timeout,
    });
    let mut builder = http1::Builder::new();
    builder
        .keep_alive(true)
        .half_close(false)
        .max_header_size(limits.max_header_bytes.max(1))
        .max_buf_size(limits.max_header_bytes.max(64 * 1024))
        // The head and idle timeouts are TimedIo's.
        .header_read_timeout(None);
    let service = {
        let shared = shared.clone();
        service_fn(move |request| answer(request, shared.clone(), state.clone()))
    };
    // Errors (a client gone, a timeout, a malformed head) only end this connection.
    let _ = builder.serve_connection(io, service).await;
}

/// Whether a connection is between requests (then the head and idle timeouts run), with the
/// waker of a read to wake when it becomes so.
struct ConnState {
    inner: Mutex<ConnInner>,
}

struct ConnInner {
    busy: bool,
    /// Counts the requests answered, so that the reader knows when a new head begins.
    generation: u64,
    idle_since: Instant,
    reader: Option<Waker>,
}

impl ConnState {
    fn new() -> Self {
        Self {
            inner: Mutex::new(ConnInner {
                busy: false,
                generation: 0,
                idle_since: Instant::now(),
                reader: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ConnInner> {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.lock().busy = true;
        Busy(self.clone())
    }
}

/// Held by a request's answer until its body is sent (or dropped): then the connection is idle.
struct Busy(Arc<ConnState>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.busy = false;
        inner.generation += 1;
        inner.idle_since = Instant::now();
        if let Some(reader) = inner.reader.take() {
            // hyper may wait on a read armed while busy: wake it to arm the idle timer.
            reader.wake();
        }
    }
}

/// The TCP stream with the read timeouts between requests and a write-stall timeout.
struct TimedIo {
    tcp: tokio::net::TcpStream,
    state: Arc<ConnState>,
    generation: u64,
    head_started: Option<Instant>,
    read_timer: Option<Pin<Box<Sleep>>>,
    write_timer: Option<Pin<Box<Sleep>>>,
    header_timeout: Duration,
    idle_timeout: Duration,
    write_timeout: Duration,
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what.to_string())
}

impl TimedIo {
    /// Arms (or moves) the read timer; Ready once it has fired.
    fn read_deadline(&mut self, cx: &mut Context<'_>, deadline: Instant) -> Poll<()> {
        match &mut self.read_timer {
            Some(timer) => {
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
            }
            None => self.read_timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
        }
        self.read_timer.as_mut().expect("armed").as_mut().poll(cx)
    }

    /// Fails a write that has made no progress for the write timeout.
    fn stall<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.write_timer = None;
            return poll;
        }
        let timeout = self.write_timeout;
        let timer = self
            .write_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(timed_out("the client took no bytes in time"))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for TimedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.tcp).poll_read(cx, buf);
        let (idle_since, generation) = {
            let mut inner = this.state.lock();
            if inner.busy {
                // Reading a body (its own timeout) or watching for a client gone mid-answer.
                this.read_timer = None;
                if poll.is_pending() {
                    inner.reader = Some(cx.waker().clone());
                }
                return poll;
            }
            (inner.idle_since, inner.generation)
        };
        if generation != this.generation {
            this.generation = generation;
            this.head_started = None;
        }
        match poll {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.head_started.is_none() {
                    this.head_started = Some(Instant::now());
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let deadline = match this.head_started {
                    Some(start) => start + this.header_timeout,
                    None if generation == 0 => idle_since + this.header_timeout,
                    None => idle_since + this.idle_timeout,
                };
                match this.read_deadline(cx, deadline) {
                    Poll::Ready(()) => Poll::Ready(Err(timed_out(
                        "the client sent no complete request in time",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            error => error,
        }
    }
}

impl AsyncWrite for TimedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.tcp).poll_write(cx, buf);
        this.stall(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        this.stall(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.tcp).poll_flush(cx);
        this.stall(cx, poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// The body of an answer: whole, or the chunks of a [`Stream`]. Holds the connection busy
/// until it is sent.
struct AnswerBody {
    kind: BodyKind,
    _busy: Busy,
}

enum BodyKind {
    Full(Option<Bytes>),
    Chunks(chunks::Receiver<Bytes>),
}

impl hyper::body::Body for AnswerBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().kind {
            BodyKind::Full(body) => Poll::Ready(body.take().map(|bytes| Ok(Frame::data(bytes)))),
            BodyKind::Chunks(chunks) => chunks
                .poll_recv(cx)
                .map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, BodyKind::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Full(body) => {
                SizeHint::with_exact(body.as_ref().map_or(0, |bytes| bytes.len() as u64))
            }
            BodyKind::Chunks(_) => SizeHint::default(),
        }
    }
}

type Answer = hyper::Response<AnswerBody>;

fn response(
    status: u16,
    headers: Vec<(String, String)>,
    kind: BodyKind,
    close: bool,
    busy: Busy,
) -> Answer {
    let mut answer = hyper::Response::new(AnswerBody { kind, _busy: busy });
    *answer.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let map = answer.headers_mut();
    for (name, value) in headers {
        // A handler's malformed header is left out rather than failing the answer.
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            map.append(name, value);
        }
    }
    if close {
        map.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    answer
}

/// An OpenAI-shaped error; `close` ends the connection after it.
fn error(status: u16, message: &str, kind: &str, code: &str, close: bool, busy: Busy) -> Answer {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    });
    let headers = vec![(CONTENT_TYPE.to_string(), "application/json".to_string())];
    let body = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
    response(status, headers, BodyKind::Full(Some(body)), close, busy)
}

enum BodyError {
    TooLarge,
    Broken(hyper::Error),
}

/// Reads a whole body, failing as soon as it grows past `max` bytes.
async fn read_body(
    mut body: Incoming,
    max: usize,
    declared: Option<u64>,
) -> Result<Vec<u8>, BodyError> {
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0).min(1 << 20) as usize);
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        match frame {
            None => return Ok(bytes),
            Some(Err(error)) => return Err(BodyError::Broken(error)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let len = bytes.len() + data.len();
                    if len > max {
                        return Err(BodyError::TooLarge);
                    }
                    // Grow by doubling, but never past `max`: a body at the limit holds at
                    // most `max` bytes, not the next power of two.
                    if len > bytes.capacity() {
                        let target = len.max(bytes.capacity().saturating_mul(2)).min(max);
                        bytes.reserve_exact(target - bytes.len());
                    }
                    bytes.extend_from_slice(&data);
                }
            }
        }
    }
}

/// Reads a request's body, queues it for a worker and waits for the answer.
async fn answer(
    request: hyper::Request<Incoming>,
    shared: Arc<Shared>,
    state: Arc<ConnState>,
) -> Result<Answer, Infallible> {
    let busy = state.begin();
    let limits = &shared.limits;
    let max = limits.max_body_bytes;
    let too_large = format!("The request body is larger than {max} bytes.");
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > max as u64) {
        return Ok(error(
            413,
            &too_large,
            "invalid_request_error",
            "request_too_large",
            true,
            busy,
        ));
    }
    let body = match tokio::time::timeout(limits.body_read_timeout, read_body(body, max, declared))
        .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(BodyError::TooLarge)) => {
            return Ok(error(
                413,
                &too_large,
                "invalid_request_error",
                "request_too_large",
                true,
                busy,
            ))
        }
        Ok(Err(BodyError::Broken(cause))) => {
            let message = format!("Could not read the request body: {cause}.");
            return Ok(error(
                400,
                &message,
                "invalid_request_error",
                "invalid_body",
                true,
                busy,
            ));
        }
        Err(_) => {
            let seconds = limits.body_read_timeout.as_secs_f64();
            let message = format!("The request body did not arrive within {seconds} s.");
            return Ok(error(
                408,
                &message,
                "invalid_request_error",
                "request_timeout",
                true,
                busy,
            ));
        }
    };
    let request = Request {
        method: parts.method.as_str().to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts
            .headers
            .iter()
            .map(|(name, value)| {
                let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                (name.as_str().to_string(), value)
            })
            .collect(),
        body,
    };
    let (reply, replied) = oneshot::channel();
    let job = Job {
        request,
        responder: Responder { reply, extra: Vec::new() },
    };
    if shared.queue.try_send(job).is_err() {
        let message = "The server is busy: too many requests are waiting. Retry later.";
        return Ok(error(
            503,
            message,
            "server_error",
            "server_busy",
            false,
            busy,
        ));
    }
    Ok(match replied.await {
        Ok(Reply::Full {
            status,
            headers,
            body,
        }) => response(
            status,
            headers,
            BodyKind::Full(Some(Bytes::from(body))),
            false,
            busy,
        ),
        Ok(Reply::Stream {
            status,
            headers,
            chunks,
        }) => response(status, headers, BodyKind::Chunks(chunks), false, busy),
        Err(_) => error(
            500,
            "The server failed to answer this request.",
            "server_error",
            "no_response",
            false,
            busy,
        ),
    })
}

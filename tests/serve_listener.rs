//! bin/src/serve/listener.rs on its own, against stub handlers, probed with raw std sockets: the
//! limits on heads, bodies, slow clients, idle connections, open connections, threads and the
//! queue; keep-alive and streaming. The tests run one at a time (they measure the process's
//! memory and threads), with short timeouts.

#[path = "../bin/src/serve/listener.rs"]
#[allow(dead_code)]
mod listener;

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use listener::{Limits, Listener, Request, Responder};
use serde_json::{json, Value};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Short timeouts and a few workers, for tests.
fn test_limits() -> Limits {
    Limits {
        header_read_timeout: Duration::from_secs(2),
        body_read_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(2),
        write_timeout: Duration::from_secs(2),
        workers: 4,
        queue: 16,
        ..Limits::default()
    }
}

/// Starts a server on a free port in its own thread (it never ends; the process does).
fn start(
    limits: Limits,
    handler: impl Fn(Request, Responder) + Send + Sync + 'static,
) -> SocketAddr {
    let listener = Listener::bind("127.0.0.1", 0).expect("bind");
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || listener.serve(limits, &handler).expect("serve"));
    addr
}

/// Answers JSON describing the request.
fn echo(request: Request, responder: Responder) {
    let body = json!({
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "x_test": request.header("X-TEST"),
        "len": request.body.len(),
    });
    responder.send(200, "application/json", body.to_string().into_bytes());
}

fn proc_status(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

fn rss_mib() -> f64 {
    proc_status("VmRSS") as f64 / 1024.0
}

fn threads() -> u64 {
    proc_status("Threads")
}

/// The soft limit on open files.
fn fd_limit() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .and_then(|line| line.split_whitespace().nth(3)?.parse().ok())
        .unwrap_or(1024)
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// The OpenAI error shape, returning its code.
    fn error_code(&self) -> String {
        let body = self.json();
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert!(
            error["type"].is_string() && error["param"].is_null(),
            "{body}"
        );
        error["code"].as_str().unwrap_or_default().to_string()
    }
}

/// A raw HTTP/1.1 client on one connection.
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    fn send(&mut self, raw: &[u8]) -> io::Result<()> {
        self.writer.write_all(raw)
    }

    fn line(&mut self) -> io::Result<String> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(line.trim_end().to_string())
    }

    /// The status and headers of a reply.
    fn head(&mut self) -> io::Result<Reply> {
        let status_line = self.line()?;
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {status_line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let line = self.line()?;
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap();
            headers.push((name.trim().to_string(), value.trim().to_string()));
        }
        Ok(Reply {
            status,
            headers,
            body: Vec::new(),
        })
    }

    /// One chunk of a chunked body (empty at its end).
    fn chunk(&mut self) -> io::Result<Vec<u8>> {
        let size = self.line()?;
        let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16)
            .map_err(|e| io::Error::other(format!("chunk size {size:?}: {e}")))?;
        let mut chunk = vec![0; size];
        self.reader.read_exact(&mut chunk)?;
        self.line()?;
        Ok(chunk)
    }

    fn response(&mut self) -> io::Result<Reply> {
        let mut reply = self.head()?;
        if let Some(length) = reply.header("content-length") {
            let mut body = vec![0; length.parse().unwrap()];
            self.reader.read_exact(&mut body)?;
            reply.body = body;
        } else if reply
            .header("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"))
        {
            loop {
                let chunk = self.chunk()?;
                if chunk.is_empty() {
                    break;
                }
                reply.body.extend(chunk);
            }
        }
        Ok(reply)
    }

    fn request(&mut self, raw: &str) -> Reply {
        self.send(raw.as_bytes()).expect("send");
        self.response().expect("response")
    }

    /// Whether the server has closed the connection (EOF or reset), waiting at most `within`.
    fn closed_within(&mut self, within: Duration) -> bool {
        self.writer.set_read_timeout(Some(within)).unwrap();
        let mut byte = [0u8; 1];
        match self.reader.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
    }
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n")
}

/// One request on a new connection.
fn fetch(addr: SocketAddr, raw: &str) -> Reply {
    Client::connect(addr).request(raw)
}

#[test]
fn keep_alive_close_and_request_fields() {
    let _serial = serial();
    let addr = start(test_limits(), |request, responder| {
        if request.path == "/slow" {
            // Longer than the head and idle timeouts: a busy connection is not idle.
            std::thread::sleep(Duration::from_millis(2500));
        }
        echo(request, responder)
    });
    let mut client = Client::connect(addr);
    let first = client.request("GET /a?x=1&y=2 HTTP/1.1\r\nHost: t\r\nx-Test: yes\r\n\r\n");
    assert_eq!(first.status, 200);
    assert_eq!(
        first.json(),
        json!({"method": "GET", "path": "/a", "query": "x=1&y=2", "x_test": "yes", "len": 0})
    );
    std::thread::sleep(Duration::from_millis(300));
    let second = client.request("POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello");
    assert_eq!(second.status, 200);
    assert_eq!(second.json()["len"], 5);
    assert_eq!(second.json()["query"], Value::Null);
    let slow = client.request(&get("/slow"));
    assert_eq!(slow.status, 200, "a handler longer than the timeouts");
    let chunked = client.request(
        "POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    );
    assert_eq!(chunked.json()["len"], 5);

    // The idle connection is closed after idle_timeout (2 s), not before.
    let idle = Instant::now();
    assert!(
        !client.closed_within(Duration::from_millis(1500)),
        "closed too soon"
    );
    assert!(
        client.closed_within(Duration::from_secs(3)),
        "not closed when idle"
    );
    println!("idle connection closed after {:?}", idle.elapsed());

    // Connection: close is honoured.
    let mut client = Client::connect(addr);
    let reply = client.request("GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    assert_eq!(reply.status, 200);
    assert!(client.closed_within(Duration::from_millis(500)));
}

#[test]
fn endless_header_is_refused_with_bounded_memory() {
    let _serial = serial();
    let addr = start(Limits::default(), echo);
    assert_eq!(fetch(addr, &get("/")).status, 200);
    let before = rss_mib();
    let mut client = Client::connect(addr);
    let line = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    let _ = client.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Endless: ");
    while sent < 64 << 20 {
        match client.writer.write(&line) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    let status = client.head().map(|reply| reply.status);
    let grown = rss_mib() - before;
    println!(
        "endless header: sent {} KiB, got {status:?}, RSS grew {grown:.1} MiB",
        sent >> 10
    );
    assert!(matches!(status, Ok(431) | Err(_)), "{status:?}");
    assert!(grown < 64.0, "RSS grew {grown:.1} MiB");
    assert_eq!(fetch(addr, &get("/")).status, 200, "still serving");
}

#[test]
fn large_bodies_are_refused() {
    let _serial = serial();
    let addr = start(Limits::default(), echo);
    let before = rss_mib();
    // Content-Length over the limit: 413 before the body is sent.
    let mut client = Client::connect(addr);
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 50000000\r\n\r\n";
    let reply = client.request(head);
    assert_eq!(reply.status, 413);
    assert_eq!(reply.error_code(), "request_too_large");
    assert!(client.closed_within(Duration::from_secs(2)));

    // The same 50 MB chunked: 413 once past the limit, or the connection closed.
    let client = Client::connect(addr);
    let mut writer = client.writer.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let chunk = vec![b'x'; 1 << 20];
        let mut sent = 0;
        let _ = writer.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        while sent < 50_000_000 {
            if writer
                .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .is_err()
                || writer.write_all(&chunk).is_err()
                || writer.write_all(b"\r\n").is_err()
            {
                break;
            }
            sent += chunk.len();
        }
        let _ = writer.write_all(b"0\r\n\r\n");
        sent
    });
    let mut client = client;
    let reply = client.response();
    let sent = sender.join().unwrap();
    let status = reply.as_ref().map(|reply| reply.status);
    println!("chunked 50 MB: sent {} MiB, got {status:?}", sent >> 20);
    assert!(matches!(status, Ok(413) | Err(_)), "{status:?}");
    assert!(sent < 50_000_000, "the server read the whole body");
    let grown = rss_mib() - before;
    println!("large bodies: RSS grew {grown:.1} MiB");
    assert!(grown < 100.0, "RSS grew {grown:.1} MiB");
    assert_eq!(fetch(addr, &get("/")).status, 200, "still serving");
}

#[test]
fn slow_body_gets_408() {
    let _serial = serial();
    let limits = Limits {
        body_read_timeout: Duration::from_millis(800),
        ..test_limits()
    };
    let addr = start(limits, echo);
    let client = Client::connect(addr);
    let mut writer = client.writer.try_clone().unwrap();
    let start = Instant::now();
    let trickle = std::thread::spawn(move || {
        let _ = writer.write_all(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n");
        for _ in 0..30 {
            if writer.write_all(b"x").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let mut client = client;
    let reply = client.response().expect("a reply");
    let elapsed = start.elapsed();
    println!("slow body: {} after {elapsed:?}", reply.status);
    assert_eq!(reply.status, 408);
    assert_eq!(reply.error_code(), "request_timeout");
    assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    assert!(client.closed_within(Duration::from_secs(2)));
    trickle.join().unwrap();
}

#[test]
fn slow_head_is_closed() {
    let _serial = serial();
    let limits = Limits {
        header_read_timeout: Duration::from_secs(1),
        ..test_limits()
    };
    let addr = start(limits, echo);
    // A head trickling in, one byte every 100 ms.
    let client = Client::connect(addr);
    let mut writer = client.writer.try_clone().unwrap();
    let start = Instant::now();
    let trickle = std::thread::spawn(move || {
        let _ = writer.write_all(b"GET / HTTP/1.1\r\n");
        for _ in 0..50 {
            if writer.write_all(b"X").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let mut client = client;
    assert!(
        client.closed_within(Duration::from_secs(3)),
        "slow head not closed"
    );
    let elapsed = start.elapsed();
    println!("slow head closed after {elapsed:?}");
    assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_millis(2500));
    trickle.join().unwrap();

    // A connection that sends nothing.
    let start = Instant::now();
    let mut silent = Client::connect(addr);
    assert!(
        silent.closed_within(Duration::from_secs(3)),
        "silent connection not closed"
    );
    println!("silent connection closed after {:?}", start.elapsed());
}

#[test]
fn thousands_of_slow_sockets_keep_threads_bounded() {
    let _serial = serial();
    let limit = fd_limit();
    // Each socket takes a descriptor here and one in the server (the same process).
    let count = 4000.min(limit.saturating_sub(256) / 2) as usize;
    println!("slow sockets: {count} (open files limit {limit})");
    let base_threads = threads();
    let limits = Limits {
        header_read_timeout: Duration::from_secs(30),
        max_connections: count + 16,
        ..test_limits()
    };
    let workers = limits.workers as u64;
    let addr = start(limits, echo);
    assert_eq!(fetch(addr, &get("/")).status, 200);
    let rss_before = rss_mib();
    let mut sockets = Vec::with_capacity(count);
    let started = Instant::now();
    for _ in 0..count {
        let mut socket = TcpStream::connect(addr).expect("connect");
        socket
            .write_all(b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ")
            .unwrap();
        sockets.push(socket);
    }
    std::thread::sleep(Duration::from_millis(500));
    let during = threads() - base_threads;
    let grown = rss_mib() - rss_before;
    println!(
        "{count} slow sockets opened in {:?}: server threads {during}, RSS grew {grown:.1} MiB",
        started.elapsed()
    );
    assert!(during < workers + 32, "{during} threads");
    let start = Instant::now();
    let reply = fetch(addr, &get("/ok"));
    assert_eq!(reply.status, 200);
    println!("a normal request answered in {:?}", start.elapsed());
    drop(sockets);
}

/// Connections made before any is accepted complete their handshakes up to the listener's
/// backlog (half of it is tried, within the kernel's cap); std's 128 would leave the 129th
/// hanging (its SYN dropped and retried a second later, until this test's 10 s connect timeout
/// fails it).
#[test]
fn a_burst_of_connections_waits_in_the_backlog() {
    let _serial = serial();
    // The kernel caps every backlog at `net.core.somaxconn` (4096 by default since Linux 5.4).
    let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(listener::BACKLOG as usize);
    let count = (listener::BACKLOG as usize).min(somaxconn) / 2;
    let count = count.min(fd_limit().saturating_sub(64) as usize);
    println!("backlog {} (net.core.somaxconn {somaxconn})", listener::BACKLOG);
    let listener = Listener::bind("127.0.0.1", 0).expect("bind");
    let addr = listener.local_addr().unwrap();
    let waiting: Vec<TcpStream> = (0..count)
        .map(|i| {
            TcpStream::connect_timeout(&addr, Duration::from_secs(10))
                .unwrap_or_else(|error| panic!("connection {i} of {count} before any accept: {error}"))
        })
        .collect();
    println!("{count} connections completed with none accepted");
    std::thread::spawn(move || listener.serve(test_limits(), &echo).expect("serve"));
    let mut first = waiting.into_iter().next().expect("one connection");
    first.write_all(get("/").as_bytes()).unwrap();
    let mut reply = String::new();
    BufReader::new(first).read_line(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
}

#[test]
fn connections_over_the_limit_wait_for_a_free_one() {
    let _serial = serial();
    let limits = Limits {
        header_read_timeout: Duration::from_secs(1),
        max_connections: 2,
        ..test_limits()
    };
    let addr = start(limits, echo);
    let idle: Vec<_> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let reply = fetch(addr, &get("/"));
    let waited = start.elapsed();
    println!("third connection answered after {waited:?}");
    assert_eq!(reply.status, 200);
    assert!(waited >= Duration::from_millis(600), "{waited:?}");
    drop(idle);
}

#[test]
fn streaming_flushes_chunks_and_notices_a_gone_client() {
    let _serial = serial();
    let (gate, gate_rx) = mpsc::channel::<()>();
    let gate_rx = Mutex::new(gate_rx);
    let (result_tx, result) = mpsc::channel::<(usize, io::Result<()>)>();
    let result_tx = Mutex::new(result_tx);
    let addr = start(test_limits(), move |request, responder| {
        let mut stream = responder.stream(200, "text/event-stream");
        if request.path == "/gated" {
            stream.write(b"data: one\n\n").unwrap();
            gate_rx.lock().unwrap().recv().unwrap();
            stream.write(b"data: two\n\n").unwrap();
            stream.finish();
        } else {
            // Writes until the client is gone.
            let mut written = 0;
            let outcome = loop {
                if let Err(error) = stream.write(b"data: tick\n\n") {
                    break Err(error);
                }
                written += 1;
                if written > 2000 {
                    break Ok(());
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            result_tx.lock().unwrap().send((written, outcome)).unwrap();
        }
    });
    let mut client = Client::connect(addr);
    client.send(get("/gated").as_bytes()).unwrap();
    let head = client.head().unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-type"), Some("text/event-stream"));
    assert_eq!(head.header("transfer-encoding"), Some("chunked"));
    // The first chunk arrives while the handler still waits.
    assert_eq!(client.chunk().unwrap(), b"data: one\n\n");
    gate.send(()).unwrap();
    assert_eq!(client.chunk().unwrap(), b"data: two\n\n");
    assert_eq!(client.chunk().unwrap(), b"");
    // The connection stays usable.
    client.send(get("/gated").as_bytes()).unwrap();
    gate.send(()).unwrap();
    let again = client.response().unwrap();
    assert_eq!(again.body, b"data: one\n\ndata: two\n\n");

    let mut client = Client::connect(addr);
    client.send(get("/ticks").as_bytes()).unwrap();
    assert_eq!(client.head().unwrap().status, 200);
    assert_eq!(client.chunk().unwrap(), b"data: tick\n\n");
    drop(client);
    let (written, outcome) = result
        .recv_timeout(Duration::from_secs(5))
        .expect("the handler noticed nothing");
    println!("client gone after {written} chunks: {outcome:?}");
    assert!(outcome.is_err());
}

#[test]
fn a_full_queue_answers_503_and_failed_handlers_500() {
    let _serial = serial();
    let (started_tx, started) = mpsc::channel::<()>();
    let started_tx = Mutex::new(started_tx);
    let (gate, gate_rx) = mpsc::channel::<()>();
    let gate_rx = Mutex::new(gate_rx);
    let limits = Limits {
        workers: 1,
        queue: 1,
        ..test_limits()
    };
    let addr = start(limits, move |request, responder| {
        match request.path.as_str() {
            "/block" => {
                started_tx.lock().unwrap().send(()).unwrap();
                gate_rx.lock().unwrap().recv().unwrap();
                echo(request, responder)
            }
            "/panic" => panic!("a handler bug"),
            "/drop" => drop(responder),
            _ => echo(request, responder),
        }
    });
    let running = std::thread::spawn(move || fetch(addr, &get("/block")).status);
    started.recv_timeout(Duration::from_secs(5)).unwrap();
    let queued = std::thread::spawn(move || fetch(addr, &get("/block")).status);
    std::thread::sleep(Duration::from_millis(300));
    let refused = fetch(addr, &get("/third"));
    assert_eq!(refused.status, 503);
    assert_eq!(refused.error_code(), "server_busy");
    gate.send(()).unwrap();
    started.recv_timeout(Duration::from_secs(5)).unwrap();
    gate.send(()).unwrap();
    assert_eq!(running.join().unwrap(), 200);
    assert_eq!(queued.join().unwrap(), 200);

    for path in ["/panic", "/drop"] {
        let reply = fetch(addr, &get(path));
        assert_eq!(reply.status, 500, "{path}");
        assert_eq!(reply.error_code(), "no_response");
    }
    assert_eq!(fetch(addr, &get("/")).status, 200, "the worker survived");
}

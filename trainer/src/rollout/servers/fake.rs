//! Test support: a fake rollout worker, a local HTTP/1.1 listener that records every request
//! and answers each as a handler says (a reply, or a dropped connection). The trainer's tests
//! use it; nothing else does.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// One request the fake received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub body: String,
    pub authorization: Option<String>,
}

impl Received {
    /// The body as JSON (`Null` when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// What the fake does with a request.
pub enum Answer {
    /// A reply with this status and JSON body.
    Json(u16, String),
    /// A reply with this status and plain-text body.
    Text(u16, String),
    /// The connection closed without a reply.
    Drop,
}

/// A running fake worker.
pub struct FakeWorker {
    pub url: String,
    received: Arc<Mutex<Vec<Received>>>,
}

impl FakeWorker {
    /// Starts a worker on a free local port; `handler` answers every request (from any thread).
    pub fn start(handler: impl Fn(&Received) -> Answer + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let received = Arc::new(Mutex::new(Vec::new()));
        let handler = Arc::new(handler);
        let log = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (handler, log) = (handler.clone(), log.clone());
                std::thread::spawn(move || serve_one(stream, &*handler, &log));
            }
        });
        Self { url, received }
    }

    /// The requests received so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// The bodies of the requests to `path`.
    pub fn bodies(&self, path: &str) -> Vec<serde_json::Value> {
        self.received().iter().filter(|r| r.path == path).map(Received::json).collect()
    }
}

fn serve_one(stream: TcpStream, handler: &(dyn Fn(&Received) -> Answer + Send + Sync), log: &Mutex<Vec<Received>>) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    let (mut length, mut authorization) = (0usize, None);
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().unwrap_or(0),
                "authorization" => authorization = Some(value.trim().to_string()),
                _ => {}
            }
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let request = Received { method, path, body: String::from_utf8_lossy(&body).into_owned(), authorization };
    let answer = handler(&request);
    log.lock().unwrap().push(request);
    let (status, kind, body) = match answer {
        Answer::Json(status, body) => (status, "application/json", body),
        Answer::Text(status, body) => (status, "text/plain", body),
        Answer::Drop => return,
    };
    let mut stream = reader.into_inner();
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(body.as_bytes()));
}

//! Test helpers: a scripted HTTP server on loopback and chat-completion bodies.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the server does with one request.
#[derive(Clone, Debug)]
pub enum Action {
    /// Send this status, these headers and this body.
    Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// Wait, then close the connection without a reply.
    Stall(Duration),
    /// Close the connection at once without a reply.
    Close,
}

impl Action {
    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Action::Reply {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    pub fn ok(content: &str) -> Self {
        Action::json(200, completion(content, None, "stop"))
    }

    pub fn with_header(self, name: &str, value: &str) -> Self {
        match self {
            Action::Reply {
                status,
                mut headers,
                body,
            } => {
                headers.push((name.to_string(), value.to_string()));
                Action::Reply {
                    status,
                    headers,
                    body,
                }
            }
            other => other,
        }
    }
}

/// A chat-completions reply body.
pub fn completion(content: &str, reasoning: Option<&str>, finish_reason: &str) -> String {
    let mut message = serde_json::json!({"role": "assistant", "content": content});
    if let Some(reasoning) = reasoning {
        message["reasoning_content"] = reasoning.into();
    }
    serde_json::json!({
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    })
    .to_string()
}

/// One request as the server read it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).expect("request body is JSON")
    }
}

type Handler = dyn Fn(&Recorded) -> Action + Send + Sync;

/// An HTTP/1.1 server on 127.0.0.1 (port 0) answering every request with its handler.
pub struct ScriptedServer {
    pub base_url: String,
    requests: Arc<Mutex<Vec<Recorded>>>,
    in_flight: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl ScriptedServer {
    /// Answers the n-th request with `script[n]`, and with HTTP 500 once the script runs out.
    pub fn start(script: Vec<Action>) -> Self {
        let next = AtomicUsize::new(0);
        Self::start_with(move |_| {
            let n = next.fetch_add(1, Ordering::SeqCst);
            script
                .get(n)
                .cloned()
                .unwrap_or_else(|| Action::json(500, r#"{"error":{"message":"script exhausted"}}"#))
        })
    }

    /// Answers every request with `handler`.
    pub fn start_with(handler: impl Fn(&Recorded) -> Action + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let handler: Arc<Handler> = Arc::new(handler);
        let (log, busy, top) = (requests.clone(), in_flight.clone(), peak.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (handler, log, busy, top) =
                    (handler.clone(), log.clone(), busy.clone(), top.clone());
                std::thread::spawn(move || serve(stream, &*handler, &log, &busy, &top));
            }
        });
        Self {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            requests,
            in_flight,
            peak,
        }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }

    /// Most requests the server was handling at once.
    pub fn peak_in_flight(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

fn serve(
    stream: TcpStream,
    handler: &Handler,
    log: &Mutex<Vec<Recorded>>,
    busy: &AtomicUsize,
    top: &AtomicUsize,
) {
    let Some(request) = read_request(&stream) else {
        return;
    };
    let now = busy.fetch_add(1, Ordering::SeqCst) + 1;
    top.fetch_max(now, Ordering::SeqCst);
    log.lock().unwrap().push(request.clone());
    let action = handler(&request);
    if let Action::Stall(wait) = &action {
        std::thread::sleep(*wait);
    }
    busy.fetch_sub(1, Ordering::SeqCst);
    let mut stream = stream;
    if let Action::Reply {
        status,
        headers,
        body,
    } = action
    {
        let mut head = format!(
            "HTTP/1.1 {status} Scripted\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(body.as_bytes());
        let _ = stream.flush();
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn read_request(stream: &TcpStream) -> Option<Recorded> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).ok()?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':')?;
        headers.push((name.trim().to_string(), value.trim().to_string()));
    }
    let length = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Recorded {
        method,
        path,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

//! Test helpers for `prompt-r1 serve`: a tiny model, a server process that is killed when the
//! test ends, and a raw HTTP/1.1 client (chunked bodies and server-sent events included).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// Longest wait for the server to start, and for one reply.
const TIMEOUT: Duration = Duration::from_secs(120);

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_prompt-r1")
}

pub fn prompt_r1(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("run prompt-r1")
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Writes the tiny random model (with its tokenizer and the Qwen3 chat template) to `dir/tiny`.
pub fn tiny_model(dir: &Path) -> PathBuf {
    let out = dir.join("tiny");
    let output = prompt_r1(&[
        "init-model",
        "--preset",
        "tiny",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        output.status.success(),
        "init-model: {}",
        text(&output.stderr)
    );
    out
}

/// [`tiny_model`] with every projection weight (attention and MLP) multiplied by `factor`
/// (written to `dir/tiny-scaled`). At init's scale the residual stream is mostly the input
/// token's embedding, and the tied head makes greedy decoding repeat the prompt's last token;
/// a factor of about 10 makes the greedy text depend on the whole context.
pub fn tiny_model_scaled(dir: &Path, factor: f32) -> PathBuf {
    let tiny = tiny_model(dir);
    let out = dir.join("tiny-scaled");
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(&tiny).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
    }
    model::checkpoint::scale_tensors(&out, |name| name.ends_with("_proj.weight"), factor).unwrap();
    out
}

/// A running `prompt-r1 serve`; killed on drop.
pub struct Server {
    child: Child,
    /// `host:port`.
    pub addr: String,
    /// `http://host:port/v1`.
    pub base_url: String,
}

impl Server {
    /// Starts `serve --model model --port 0 --served-model-name tiny --quiet` plus `extra`, and
    /// waits for the line naming its URL.
    pub fn start(model: &Path, extra: &[&str]) -> Self {
        Self::start_with_env(model, extra, &[])
    }

    /// [`Server::start`] with environment variables set for the server.
    pub fn start_with_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(bin())
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args(["--served-model-name", "tiny", "--quiet"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start prompt-r1 serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let (lines, found) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let line = match found.recv_timeout(TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait();
                panic!("serve printed no URL (exit: {status:?})");
            }
        };
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in {line:?}"))
            .to_string();
        let addr = url
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .to_string();
        Self {
            child,
            addr,
            base_url: url,
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A number field of the server's /proc/PID/status (`VmRSS` in KiB, `Threads`); `None`
    /// where /proc cannot be read (not Linux).
    pub fn proc_status(&self, field: &str) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn get(&self, path: &str) -> Reply {
        request(&self.addr, "GET", path, None)
    }

    pub fn post(&self, path: &str, body: &str) -> Reply {
        request(&self.addr, "POST", path, Some(body))
    }

    pub fn chat(&self, body: &Value) -> Reply {
        self.post("/v1/chat/completions", &body.to_string())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A reply as read off the wire.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("reply is not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent-event body, `[DONE]` included as a string.
    pub fn events(&self) -> Vec<Value> {
        self.body
            .split("\n\n")
            .filter_map(|block| block.trim().strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap_or_else(|_| Value::String(data.into())))
            .collect()
    }
}

/// Sends one request on a fresh connection (`Connection: close`) and reads the whole reply.
pub fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Reply {
    request_with_headers(addr, method, path, body, &[])
}

/// [`request`] with extra header lines, e.g. `("Authorization", "Bearer KEY")`.
pub fn request_with_headers(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Reply {
    let mut stream = connect(addr);
    let body = body.unwrap_or("");
    let extra: String = headers.iter().map(|(name, value)| format!("{name}: {value}\r\n")).collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send the request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read the reply");
    parse_reply(&raw)
}

/// A connection with read and write timeouts.
pub fn connect(addr: &str) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect to serve");
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(TIMEOUT)).unwrap();
    stream
}

fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of headers in {:?}", text(raw)));
    let head = text(&raw[..split]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut reply = Reply {
        status,
        headers,
        body: String::new(),
    };
    let rest = &raw[split + 4..];
    let chunked = reply
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    reply.body = if chunked {
        text(&dechunk(rest))
    } else {
        text(rest)
    };
    reply
}

/// Decodes a chunked body; panics on bad framing or a missing last chunk.
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size_text = text(&rest[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size_text:?}"));
        rest = &rest[line_end + 2..];
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&rest[..size]);
        assert_eq!(&rest[size..size + 2], b"\r\n", "chunk not followed by CRLF");
        rest = &rest[size + 2..];
    }
}

/// Finds `../shared` beside the workspace: `None` (with the reason printed) when it is missing,
/// a failure under `CI=true`.
pub fn shared_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "CI=true but {} is missing",
        dir.display()
    );
    eprintln!("skipped: {} is missing", dir.display());
    None
}

/// Writes a PEFT LoRA adapter for the model in `base` to `out`: rank 4, alpha 8, on every
/// projection, with `lora_A` and `lora_B` uniform in `±scale` from a generator seeded by `seed`
/// (a non-zero `lora_B`, so that the adapter changes the model's output).
pub fn write_adapter(base: &Path, out: &Path, seed: u64, scale: f32) {
    use model::lora::{save_adapter, AdapterWeights, LoraTarget};
    use model::{LoraAdapters, LoraConfig, Qwen3Config};

    let config = Qwen3Config::from_file(&base.join("config.json")).unwrap();
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: LoraTarget::ALL.to_vec(),
    };
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    };
    let device = Default::default();
    let adapters = LoraAdapters::<burn::backend::Flex>::from_weights(&lora, &config, &device, |_, _, (fan_in, fan_out)| {
        let r = lora.rank;
        let a: Vec<f32> = (0..fan_in * r).map(|_| uniform()).collect();
        let b: Vec<f32> = (0..r * fan_out).map(|_| uniform()).collect();
        AdapterWeights {
            lora_A: burn::tensor::TensorData::new(a, [fan_in, r]),
            lora_B: burn::tensor::TensorData::new(b, [r, fan_out]),
        }
    });
    save_adapter(&adapters, out, &base.to_string_lossy()).unwrap();
}

/// The token ids `prompt-r1 generate` samples greedily from `model` (with `adapter`) after
/// `prompt`.
pub fn generate_ids(model: &Path, adapter: Option<&Path>, prompt: &[u64], max_new_tokens: usize) -> Vec<u64> {
    let ids = prompt.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let max = max_new_tokens.to_string();
    let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt-ids", &ids, "--max-new-tokens", &max, "--json"];
    if let Some(adapter) = adapter {
        args.extend(["--adapter", adapter.to_str().unwrap()]);
    }
    let output = prompt_r1(&args);
    assert!(output.status.success(), "generate: {}", text(&output.stderr));
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    json["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

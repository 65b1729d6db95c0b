//! `GET /metrics`: what the worker holds and has done, in Prometheus's text format, under the
//! names vLLM gives its own (`vllm:` becomes `prompt_r1:`), so that a dashboard of vLLM's workers
//! needs only the prefix changed: requests running and waiting, the KV cache's blocks in use
//! and held, tokens prefilled from prompts or taken from the prefix cache, tokens generated,
//! requests ended by reason, preemptions, and, on a GPU, the device's memory pool.
//!
//! The worker writes a [`Snapshot`] after each step (and when its work runs out); the handler
//! threads read the last one. Counters count from the server's start.

use std::fmt::Write;
use std::sync::Mutex;

use trainer::run::DeviceMemory;

/// The metrics' prefix (vLLM's is `vllm:`).
const PREFIX: &str = "prompt_r1:";

/// The worker's state and counts as it last wrote them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Snapshot {
    /// Requests decoding.
    pub running: usize,
    /// Requests not decoding yet: waiting to join the batch (behind `--max-batch`, another
    /// adapter's requests, a change of the policy, or the KV budget; preempted ones among them)
    /// or part-way through a prefill chunked over steps.
    pub waiting: usize,
    /// KV positions (per layer) in blocks the requests in the batch hold, the cache's scratch
    /// block included.
    pub kv_used_tokens: usize,
    /// KV positions (per layer) in blocks only sequences out of the batch hold (the prefix
    /// cache's, or a request's waiting to join): dropped first to make room, so counted as free
    /// by `kv_cache_usage_perc`, as vLLM counts its cached blocks.
    pub kv_cached_tokens: usize,
    /// KV positions (per layer) the pool holds now: used and free blocks (it grows on demand).
    pub kv_pool_tokens: usize,
    /// The most KV positions (per layer) the pool held at once.
    pub kv_pool_peak_tokens: usize,
    /// `--kv-cache-memory` in positions; `None`: no budget.
    pub kv_budget_tokens: Option<usize>,
    /// Bytes of one KV position over every layer.
    pub kv_token_bytes: u64,
    /// Tokens of the prompts of requests that joined.
    pub prompt_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (every prompt's, while it is on).
    pub prefix_cache_queries: u64,
    /// Prompt tokens whose KV came from the prefix cache instead of a prefill.
    pub prefix_cache_hits: u64,
    /// Tokens sampled.
    pub generation_tokens: u64,
    /// Requests that ended at a stop token or string.
    pub finished_stop: u64,
    /// Requests that ended at their token limit.
    pub finished_length: u64,
    /// Requests whose client went away before they ended.
    pub aborted: u64,
    /// Requests that failed in the worker (an error or panic in a step, or their text).
    pub failed: u64,
    /// Running requests whose KV cache was dropped to stay within the budget (prefilled again
    /// when they rejoin).
    pub preemptions: u64,
    /// The device's pool at its last reading (`None` on the CPU).
    pub device_memory: Option<DeviceMemory>,
    /// The most the pool reserved at any reading.
    pub device_memory_reserved_peak: u64,
}

impl Snapshot {
    /// Takes a reading of the device's pool.
    pub fn read_device_memory(&mut self, reading: DeviceMemory) {
        self.device_memory = Some(reading);
        self.device_memory_reserved_peak = self.device_memory_reserved_peak.max(reading.reserved);
    }

    /// The Prometheus text exposition (format 0.0.4) of these figures.
    pub fn render(&self) -> String {
        let mut out = Exposition::default();
        out.gauge("num_requests_running", "Requests decoding.", self.running as f64);
        out.gauge("num_requests_waiting", "Requests waiting to join the batch or part-way through a chunked prefill.", self.waiting as f64);
        out.gauge("kv_cache_used_tokens", "KV positions in blocks the requests in the batch hold (each layer's; the scratch block included).", self.kv_used_tokens as f64);
        out.gauge(
            "kv_cache_cached_tokens",
            "KV positions in blocks only the prefix cache's (or waiting requests') sequences hold, dropped first to make room.",
            self.kv_cached_tokens as f64,
        );
        out.gauge("kv_cache_pool_tokens", "KV positions the paged pool holds now, used and free (it grows and shrinks on demand).", self.kv_pool_tokens as f64);
        out.gauge("kv_cache_pool_peak_tokens", "The most KV positions the paged pool held at once.", self.kv_pool_peak_tokens as f64);
        out.gauge(
            "kv_cache_pool_bytes",
            "Bytes of the paged pool's keys and values over every layer.",
            self.kv_pool_tokens as f64 * self.kv_token_bytes as f64,
        );
        if let Some(budget) = self.kv_budget_tokens {
            out.gauge("kv_cache_budget_tokens", "KV positions the pool may hold (--kv-cache-memory).", budget as f64);
            out.gauge(
                "kv_cache_usage_perc",
                "Fraction of the KV budget in blocks the requests in the batch hold (1 = 100%).",
                self.kv_used_tokens as f64 / budget.max(1) as f64,
            );
        }
        out.counter("prompt_tokens_total", "Prompt tokens of the requests that joined (from the prefix cache or prefilled).", self.prompt_tokens);
        out.counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", self.prefix_cache_queries);
        out.counter("prefix_cache_hits_total", "Prompt tokens whose KV cache came from the prefix cache.", self.prefix_cache_hits);
        out.counter("generation_tokens_total", "Tokens sampled.", self.generation_tokens);
        out.header("request_success_total", "Requests ended, by finish reason (abort: the client went away).", "counter");
        for (reason, count) in [("stop", self.finished_stop), ("length", self.finished_length), ("abort", self.aborted)] {
            out.sample("request_success_total", &format!("{{finished_reason=\"{reason}\"}}"), count as f64);
        }
        out.counter("request_failure_total", "Requests that failed in the worker.", self.failed);
        out.counter("num_preemptions_total", "Running requests whose KV cache was dropped to stay within the budget.", self.preemptions);
        if let Some(memory) = self.device_memory {
            out.gauge("device_memory_in_use_bytes", "Bytes of the device's memory pool in use by tensors (last reading).", memory.in_use as f64);
            out.gauge("device_memory_reserved_bytes", "Bytes the device's memory pool reserved (last reading).", memory.reserved as f64);
            out.gauge(
                "device_memory_reserved_peak_bytes",
                "The most bytes the device's memory pool reserved at any reading.",
                self.device_memory_reserved_peak as f64,
            );
        }
        out.text
    }
}

/// Prometheus's text format, line by line.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.text, "# HELP {PREFIX}{name} {help}");
        let _ = writeln!(self.text, "# TYPE {PREFIX}{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.text, "{PREFIX}{name}{labels} {value}");
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, help, "gauge");
        self.sample(name, "", value);
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.header(name, help, "counter");
        self.sample(name, "", value as f64);
    }
}

/// The snapshot shared by the worker (which writes it) and the handlers (which read it).
#[derive(Debug, Default)]
pub struct ServerMetrics {
    snapshot: Mutex<Snapshot>,
}

impl ServerMetrics {
    /// Starts from `snapshot` (its settings: the KV budget and position size).
    pub fn new(snapshot: Snapshot) -> Self {
        Self { snapshot: Mutex::new(snapshot) }
    }

    /// The last snapshot written.
    pub fn snapshot(&self) -> Snapshot {
        *self.snapshot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Changes the snapshot in place.
    pub fn update(&self, change: impl FnOnce(&mut Snapshot)) {
        change(&mut self.snapshot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every sample line of `text` as (name with labels, value).
    fn samples(text: &str) -> Vec<(String, f64)> {
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .map(|line| {
                let (name, value) = line.rsplit_once(' ').expect("a sample is a name and a value");
                (name.to_string(), value.parse().expect("a number"))
            })
            .collect()
    }

    #[test]
    fn the_exposition_names_each_figure_once_with_its_help_and_type() {
        let mut snapshot = Snapshot {
            running: 3,
            waiting: 2,
            kv_used_tokens: 96,
            kv_pool_tokens: 128,
            kv_budget_tokens: Some(256),
            kv_token_bytes: 1024,
            prompt_tokens: 500,
            prefix_cache_queries: 500,
            prefix_cache_hits: 120,
            generation_tokens: 77,
            finished_stop: 4,
            finished_length: 1,
            aborted: 2,
            failed: 0,
            preemptions: 5,
            ..Snapshot::default()
        };
        snapshot.read_device_memory(DeviceMemory { in_use: 10, reserved: 40 });
        snapshot.read_device_memory(DeviceMemory { in_use: 10, reserved: 8 });
        let text = snapshot.render();
        let got = samples(&text);
        let value = |name: &str| got.iter().find(|(n, _)| n == &format!("{PREFIX}{name}")).map(|(_, v)| *v);
        assert_eq!(value("num_requests_running"), Some(3.0));
        assert_eq!(value("num_requests_waiting"), Some(2.0));
        assert_eq!(value("kv_cache_usage_perc"), Some(0.375));
        assert_eq!(value("kv_cache_pool_bytes"), Some(131_072.0));
        assert_eq!(value("prefix_cache_hits_total"), Some(120.0));
        assert_eq!(value("request_success_total{finished_reason=\"abort\"}"), Some(2.0));
        assert_eq!(value("num_preemptions_total"), Some(5.0));
        assert_eq!(value("device_memory_reserved_bytes"), Some(8.0));
        assert_eq!(value("device_memory_reserved_peak_bytes"), Some(40.0));
        // Each metric has one HELP and one TYPE line, before its samples.
        for (name, _) in &got {
            let family = name.split('{').next().unwrap();
            assert_eq!(text.matches(&format!("# TYPE {family} ")).count(), 1, "{family}");
            assert_eq!(text.matches(&format!("# HELP {family} ")).count(), 1, "{family}");
            assert!(text.find(&format!("# TYPE {family} ")).unwrap() < text.find(&format!("\n{name} ")).unwrap(), "{name}");
        }
    }

    #[test]
    fn without_a_budget_or_a_device_pool_their_figures_are_left_out() {
        let text = Snapshot::default().render();
        for absent in ["kv_cache_usage_perc", "kv_cache_budget_tokens", "device_memory"] {
            assert!(!text.contains(absent), "{absent} in\n{text}");
        }
        assert!(text.contains("prompt_r1:kv_cache_used_tokens 0\n"), "{text}");
    }
}

//! `prompt-r1 serve`: an OpenAI-compatible chat (and text-completion) server over a local Qwen3
//! checkpoint.
//!
//! The HTTP front ([`listener`]: hyper on a small tokio runtime) reads each request within fixed
//! limits (head and body size, timeouts, open connections) and hands it to a fixed pool of
//! handler threads, which parse and check it, render the chat template and tokenize, then queue
//! a [`engine::Job`]; the one worker thread that owns the model runs the queued jobs
//! continuously batched (each joins the running batch at the next decode step and leaves it when
//! it ends) and streams each one's text back over the job's channel.
//!
//! The worker owns the served policy: the base weights and a few named LoRA adapters, which
//! the control routes (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
//! `/update_weights_from_disk`) change at run time, between decode steps (see [`engine`]).

mod completions;
mod control;
mod cors;
mod detokenize;
mod engine;
mod error;
mod http;
mod listener;
mod metrics;
mod policy;
mod prefix_cache;
mod request;
mod stop;

use std::io::Write;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use burn::tensor::backend::Backend;
use model::chat_template::ChatTemplate;
use model::tokenizer::Qwen3Tokenizer;
use model::{LoadOptions, Qwen3ForCausalLM, Sampling};
use trainer::plan::format_size;
use trainer::run::{end_device_phase, DeviceMemory, DeviceMemoryProbe, TrainError};

use engine::{Engine, Work};
use listener::Listener;
pub use listener::Limits;
use metrics::{ServerMetrics, Snapshot};
use policy::{Models, Policy};

/// Server settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub host: String,
    pub port: u16,
    pub model_name: String,
    pub max_batch: usize,
    /// Most tokens a decoder step runs (`--max-num-batched-tokens`).
    pub max_batched_tokens: usize,
    pub default_max_tokens: usize,
    pub enable_thinking: bool,
    /// Sampling used when a request leaves a parameter out (by default OpenAI's: temperature
    /// 1, no truncation). Its seed is not used: a request without one gets a random seed.
    pub defaults: Sampling,
    pub quiet: bool,
    /// The key clients must send as `Authorization: Bearer KEY` on the `/v1` routes (and
    /// `/update_weights_from_disk`).
    pub api_key: Option<String>,
    /// Most LoRA adapters loaded at once.
    pub max_loras: usize,
    /// Serve each adapter merged into a copy of the weights it adapts.
    pub merge_lora: bool,
    /// The HTTP front's limits (sizes, timeouts, connections, handler threads).
    pub limits: Limits,
    /// Bytes of KV cache the prefix cache may hold (0: no prefix cache).
    pub prefix_cache_memory: u64,
    /// Bytes of KV cache the decoder's pool may hold, running requests and the prefix cache's
    /// together (`--kv-cache-memory`); `None`: no limit.
    pub kv_cache_memory: Option<u64>,
    /// Origins whose browser pages may read the replies (`--allowed-origins`; `*` for any).
    pub allowed_origins: Vec<String>,
}

/// The model being served: the worker owns it, and may replace its weights at run time.
pub struct Served<'m, B: Backend> {
    pub model: Qwen3ForCausalLM<B>,
    /// The directory the weights came from, as given (`root` in `GET /v1/models`).
    pub root: String,
    /// Where, and how, new weights are loaded (as the first were).
    pub device: B::Device,
    pub load_options: LoadOptions,
    pub tokenizer: &'m Qwen3Tokenizer,
    pub template: ChatTemplate,
    pub stop_ids: Vec<u32>,
    /// Reads the device's memory pool (`None` on the CPU): after each burst of requests the
    /// server logs what the pool reserved and what it kept.
    pub memory_probe: Option<DeviceMemoryProbe>,
}

/// What every handler thread reads.
pub(crate) struct Shared<'m> {
    model_name: String,
    created: u64,
    tokenizer: &'m Qwen3Tokenizer,
    template: ChatTemplate,
    context_len: usize,
    vocab_size: usize,
    default_max_tokens: usize,
    enable_thinking: bool,
    defaults: Sampling,
    quiet: bool,
    api_key: Option<String>,
    allowed_origins: cors::AllowedOrigins,
    /// The policy's parts as the worker last published them.
    models: Mutex<Models>,
    /// What the worker holds and has done (`GET /metrics`).
    metrics: Arc<ServerMetrics>,
    work: Sender<Work>,
}

impl Shared<'_> {
    /// What `GET /v1/models` shows now.
    fn models(&self) -> Models {
        self.models
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// Gives the device back the memory pages the worker's last requests left unused; with a
/// `probe`, the pool's readings before and after (for `GET /metrics`) and the log line of what it
/// reserved at most (before) and kept (after).
fn give_back_unused_memory<B: Backend>(device: &B::Device, probe: Option<&DeviceMemoryProbe>) -> Result<Option<IdleMemory>, TrainError> {
    let Some(burst) = end_device_phase::<B>(device, probe)? else { return Ok(None) };
    let kept = probe.and_then(|read| read()).unwrap_or_default();
    let line = format!(
        "GPU memory after the requests: {} reserved at most, {} once the unused pages went back ({} in use)",
        format_size(burst.reserved),
        format_size(kept.reserved),
        format_size(kept.in_use)
    );
    Ok(Some(IdleMemory { burst, kept, line }))
}

/// The device's pool as a burst of requests left it, and after its unused pages went back.
struct IdleMemory {
    burst: DeviceMemory,
    kept: DeviceMemory,
    line: String,
}

/// The decoder's KV budget in positions for `bytes` of cache at `per_position` bytes each; an
/// error names `--kv-cache-memory` where it cannot hold the shortest request (a prompt token and
/// a completion token).
fn kv_budget_positions(bytes: u64, per_position: u64) -> Result<usize> {
    let positions = usize::try_from(bytes / per_position.max(1)).unwrap_or(usize::MAX);
    if longest_request(positions) < 2 {
        return Err(anyhow!(
            "--kv-cache-memory {} holds {positions} KV positions of this model ({per_position} bytes each), \
             too few for any request: a request needs at least {} (its block and the cache's scratch block)",
            format_size(bytes),
            model::decode::positions_to_hold(3)
        ));
    }
    Ok(positions)
}

/// The longest request (prompt and completion tokens) a KV budget of `positions` holds alone,
/// as the decoder counts a sequence's blocks (the last sampled token is never fed back).
fn longest_request(positions: usize) -> usize {
    let (mut low, mut high) = (0, positions);
    while low < high {
        let mid = (low + high).div_ceil(2);
        if model::decode::positions_to_hold(mid + 1) <= positions {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}

/// Listens, prints the base URL when ready, and serves until the process is stopped.
pub fn serve<B: Backend>(served: Served<'_, B>, settings: Settings) -> Result<()> {
    let listener = Listener::bind(&settings.host, settings.port).map_err(|err| {
        anyhow!(
            "cannot listen on {}:{}: {err}",
            settings.host,
            settings.port
        )
    })?;
    let addr = listener
        .local_addr()
        .map_err(|err| anyhow!("cannot read the address listened on: {err}"))?;
    let (work, queue) = mpsc::channel();
    // The cache holds keys and values in the dtype of the weights.
    let per_position = trainer::plan::kv_position_bytes(&served.model.config, served.load_options.dtype).max(1);
    let prefix_cache = usize::try_from(settings.prefix_cache_memory / per_position).unwrap_or(usize::MAX);
    let kv_budget = settings.kv_cache_memory.map(|bytes| kv_budget_positions(bytes, per_position)).transpose()?;
    let model_context = served.model.config.max_position_embeddings;
    // A request longer than the budget holds could never run: the budget shortens the context
    // requests may ask for, as vLLM's max_model_len.
    let context_len = kv_budget.map_or(model_context, |positions| longest_request(positions).min(model_context));
    if context_len < model_context {
        eprintln!(
            "note: --kv-cache-memory holds {context_len} tokens of one request (prompt and completion), below the model's context of {model_context}: longer requests are refused"
        );
    }
    let metrics = Arc::new(ServerMetrics::new(Snapshot {
        kv_budget_tokens: kv_budget,
        kv_token_bytes: per_position,
        ..Snapshot::default()
    }));
    let shared = Shared {
        model_name: settings.model_name.clone(),
        created: http::unix_time(),
        tokenizer: served.tokenizer,
        template: served.template,
        context_len,
        vocab_size: served.model.config.vocab_size,
        default_max_tokens: settings.default_max_tokens,
        enable_thinking: settings.enable_thinking,
        defaults: settings.defaults.clone(),
        quiet: settings.quiet,
        api_key: settings.api_key.clone(),
        allowed_origins: cors::AllowedOrigins::new(settings.allowed_origins.clone()),
        models: Mutex::new(Models {
            base_root: served.root.clone(),
            ..Models::default()
        }),
        metrics: Arc::clone(&metrics),
        work,
    };
    // CubeCL's pool keeps a freed page for later tensors of its size class, never giving it
    // back unless asked: after a burst of requests (a step's rollouts on a worker, say) the KV
    // pools and activations it grew through would stay reserved while the GPU's other users
    // (a trainer's update beside the server) run short. The worker thread's own pool.
    let device = served.device.clone();
    let probe = served.memory_probe.clone();
    let quiet = settings.quiet;
    let idle_metrics = Arc::clone(&metrics);
    let on_idle = Box::new(move || match give_back_unused_memory::<B>(&device, probe.as_ref()) {
        Ok(Some(IdleMemory { burst, kept, line })) => {
            idle_metrics.update(|m| {
                m.read_device_memory(burst);
                m.read_device_memory(kept);
            });
            if !quiet {
                eprintln!("{line}");
            }
        }
        Ok(None) => {}
        Err(err) => eprintln!("warning: the device's unused memory could not be given back: {err}"),
    });
    let policy = Policy::new(
        settings.model_name.clone(),
        served.model,
        served.root,
        served.device,
        served.load_options,
        settings.max_loras,
        settings.merge_lora,
    );
    let mut engine = Engine {
        policy,
        tokenizer: served.tokenizer,
        stop_ids: served.stop_ids,
        max_batch: settings.max_batch,
        max_batched_tokens: settings.max_batched_tokens,
        models: &shared.models,
        prefix_cache,
        kv_budget,
        on_idle,
        metrics,
        memory_probe: served.memory_probe,
    };
    if settings.api_key.is_none() && !addr.ip().is_loopback() {
        eprintln!(
            "warning: serving on {addr}, reachable from other machines, without an API key: \
             anyone who can connect may use the model; set PROMPT_R1_API_KEY (or --api-key)"
        );
    }
    println!(
        "serving {} at http://{addr}/v1 (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics; \
         POST /v1/load_lora_adapter, /v1/unload_lora_adapter, /update_weights_from_disk)",
        settings.model_name
    );
    std::io::stdout().flush()?;
    let limits = settings.limits.clone();
    std::thread::scope(|scope| {
        let shared = &shared;
        scope.spawn(move || {
            let handler = move |request, responder| http::handle(request, responder, shared);
            // `serve` returns only when the front cannot start; the worker would wait forever.
            if let Err(err) = listener.serve(limits, &handler) {
                eprintln!("error: the HTTP front stopped: {err}");
                std::process::exit(1);
            }
        });
        engine.run(&queue);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use trainer::run::DeviceMemory;

    use super::*;

    /// The log line reads the pool before its unused pages go back (the burst's most) and after
    /// (what it kept); without a probe (the CPU) there is none.
    #[test]
    fn the_idle_line_gives_the_pool_before_and_after_the_release() {
        const MIB: u64 = 1 << 20;
        let readings = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&readings);
        let probe: DeviceMemoryProbe = Arc::new(move || {
            let reserved = if count.fetch_add(1, Ordering::SeqCst) == 0 { 40 * MIB } else { 8 * MIB };
            Some(DeviceMemory { in_use: 3 * MIB, reserved })
        });
        let device = Default::default();
        let idle = give_back_unused_memory::<burn::backend::Flex>(&device, Some(&probe)).unwrap().unwrap();
        assert_eq!(
            idle.line,
            "GPU memory after the requests: 40 MiB reserved at most, 8 MiB once the unused pages went back (3 MiB in use)"
        );
        assert_eq!((idle.burst.reserved, idle.kept.reserved), (40 * MIB, 8 * MIB));
        assert_eq!(readings.load(Ordering::SeqCst), 2);
        assert!(give_back_unused_memory::<burn::backend::Flex>(&device, None).unwrap().is_none());
    }

    /// The longest request a KV budget holds is the longest whose blocks and the scratch block
    /// fit in it, as the decoder counts them; a budget that holds no request is refused by name.
    #[test]
    fn a_kv_budget_bounds_one_request_and_must_hold_one() {
        use model::decode::positions_to_hold;
        for positions in [32, 33, 47, 48, 100, 256, 4096] {
            let longest = longest_request(positions);
            assert!(positions_to_hold(longest + 1) <= positions, "{positions}: {longest}");
            assert!(positions_to_hold(longest + 2) > positions, "{positions}: {longest} is not the longest");
        }
        assert_eq!(longest_request(256), 239);
        assert_eq!(kv_budget_positions(256 * 1000, 1000).unwrap(), 256);
        let err = kv_budget_positions(20 * 1000, 1000).unwrap_err().to_string();
        assert!(err.contains("--kv-cache-memory") && err.contains("holds 20 KV positions") && err.contains("at least 32"), "{err}");
    }
}

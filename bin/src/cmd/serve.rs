//! `prompt-r1 serve`: an OpenAI-compatible chat server over a local checkpoint.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use burn::tensor::backend::Backend;
use clap::Args as ClapArgs;
use model::{Qwen3Config, Sampling};
use trainer::plan::{auto_serving_kv_budget, format_size, kv_position_bytes, ServingSettings};

use crate::device::{run_on, ComputeArgs, OnBackend};
use crate::model_dir::LoadedModel;
use crate::serve::{serve, Limits, Served, Settings};

/// Serve a model over the OpenAI chat-completions API.
///
/// Serves a Qwen3 checkpoint: the trained agent (for `infer`/`eval --agent-url`), a local
/// large LLM as a zero-cost environment (for `--env-url`), or a rollout worker for the
/// trainer. Routes: POST /v1/chat/completions (streaming and not; temperature, top_p, top_k,
/// max_tokens / max_completion_tokens, seed, stop, stop_token_ids, skip_special_tokens, n = 1,
/// stream_options.include_usage, chat_template_kwargs.enable_thinking), POST /v1/completions (a
/// text prompt or, as vLLM, a prompt of token ids; with logprobs and return_token_ids the reply
/// carries the sampled ids, the ending stop token included, with their log-probs), GET /v1/models,
/// GET /health, GET /metrics (Prometheus; vLLM's metric names with the prefix prompt_r1:). The policy changes at run time: POST /v1/load_lora_adapter {lora_name, lora_path,
/// load_inplace} and /v1/unload_lora_adapter {lora_name} (vLLM's; a request names the adapter as
/// its model) and POST /update_weights_from_disk {model_path} (SGLang's: new base weights of the
/// same config); a change applies once the requests before it have ended. Parameters a request
/// leaves out come from the checkpoint's generation_config.json (else temperature 1). A request
/// without a seed gets a random one. Concurrent requests decode together, at most --max-batch at
/// once; the others join as rows end. Each request's tokens depend only on its own prompt,
/// settings, seed and model. Limits keep memory and threads bounded whatever clients do: a head
/// over 16 KiB is answered 431, a body over 32 MiB 413, a body slower than --request-timeout
/// 408; at most --max-connections are open (1,024 more wait to be accepted), requests run on
/// max(64, 4 x --max-batch) handler threads, and 256 more may wait for one (then 503).
///
/// Prefix cache (as vLLM's automatic prefix caching, per sequence): an ended request's KV cache
/// is kept, within --prefix-cache-memory (least recently used dropped first), and a later request
/// of the same model or adapter whose prompt extends that request's prompt and sampled ids (the
/// next turn of a multi-turn episode) prefills only the rest; the reply's
/// usage.prompt_tokens_details.cached_tokens counts the prompt tokens not prefilled. Any change
/// of the policy drops the cache. Results equal a full prefill's to float rounding.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Model directory in Hugging Face layout (config.json, *.safetensors, tokenizer.json,
    /// tokenizer_config.json with the Qwen3 chat template).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the URL printed at start names it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    #[command(flatten)]
    pub compute: ComputeArgs,
    /// Model name clients ask for (default: the model directory's name).
    #[arg(long, value_name = "NAME", value_parser = non_blank)]
    pub served_model_name: Option<String>,
    /// Most requests decoding at once (the others wait and join as rows end).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_batch: u64,
    /// Most tokens one decoder step runs, the decoding requests' one each first (vLLM's
    /// --max-num-batched-tokens): a longer prompt is prefilled in chunks over the next steps
    /// while the other requests go on decoding, so none waits long for its next token. At least
    /// --max-batch.
    #[arg(long, value_name = "N", default_value_t = trainer::plan::DEFAULT_MAX_NUM_BATCHED_TOKENS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_batched_tokens: u64,
    /// Completion tokens when a request gives no max_tokens (capped by the context length).
    #[arg(long, value_name = "N", default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..))]
    pub default_max_tokens: u64,
    /// Render prompts with thinking off (an empty <think></think> block) unless a request asks
    /// for it with chat_template_kwargs.enable_thinking.
    #[arg(long)]
    pub no_thinking: bool,
    /// Do not log one line per request on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Require this key as `Authorization: Bearer KEY` on the /v1 routes (401 otherwise), as
    /// vLLM's --api-key, and on POST /update_weights_from_disk; /health and /metrics stay open.
    /// Prefer the variable: a flag lands in shell history and process lists. Without a key,
    /// serving on a non-loopback --host prints a warning.
    #[arg(long, value_name = "KEY", env = "PROMPT_R1_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Most LoRA adapters loaded at once through POST /v1/load_lora_adapter (vLLM's
    /// --max-loras).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_loras: u64,
    /// Run each LoRA adapter's requests on a copy of the base with the adapter merged in, made
    /// when it (or new base weights) is loaded: a decoding step then runs one product per
    /// adapted projection instead of three and an addition (37% fewer GPU kernels a token on
    /// the small shape, as the trainer's own rollouts, `rollout.merge_lora`). Each loaded
    /// adapter holds the weights it adapts once more, and its answers move by rounding from
    /// those of the adapter beside the base. For rollout workers.
    #[arg(long)]
    pub merge_lora: bool,
    /// Most client connections open at once; beyond it new ones wait to be accepted.
    #[arg(long, value_name = "N", default_value_t = Limits::default().max_connections as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
    /// Seconds a client has to send a request's body once its head has come (408 after); a
    /// head must come within 10 s, or within this if shorter (else the connection is closed).
    #[arg(long, value_name = "SECS", default_value_t = Limits::default().body_read_timeout.as_secs_f64(), value_parser = positive_seconds)]
    pub request_timeout: f64,
    /// KV-cache memory the prefix cache may hold (e.g. 2GiB, 512MiB, 8GB), counted in the
    /// weights' dtype; 0 turns the prefix cache off. Running requests are not bounded by it.
    #[arg(long, value_name = "SIZE", default_value = "2GiB", value_parser = memory_size)]
    pub prefix_cache_memory: u64,
    /// Most memory the KV cache holds (e.g. 24GiB; vLLM's KV budget, from its
    /// --gpu-memory-utilization), counted in the weights' dtype: running requests' blocks, the
    /// prefix cache's and free ones. Requests wait to join, the newest running ones are preempted
    /// (and prefilled again when they rejoin), and the prefix cache's oldest entries are dropped,
    /// rather than go past it. It also bounds one request's prompt and completion tokens: longer
    /// requests are refused (400, context_length_exceeded). `auto`: what the device's memory (a
    /// CUDA GPU's total, the CPU's RAM) leaves after a margin (10% on a GPU, 20% on the CPU), the
    /// weights, --merge-lora's copies and a decoder step of --max-num-batched-tokens, by the
    /// same arithmetic as `prompt-r1 plan`; printed at start. Default: no limit (the cache grows
    /// with the requests running, up to --max-batch of them at the full context).
    #[arg(long, value_name = "SIZE|auto", value_parser = kv_cache_memory)]
    pub kv_cache_memory: Option<KvCacheMemory>,
    /// Origins whose browser pages may call the server (CORS; vLLM's --allowed-origins), e.g.
    /// http://localhost:3000, comma-separated; `*` allows any site's pages. Default: none, so a
    /// page of another site cannot read the replies (other clients are not concerned).
    #[arg(long, value_name = "ORIGIN,...", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
}

/// `--kv-cache-memory`: a size, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheMemory {
    Size(u64),
    /// What the device leaves the cache ([`trainer::plan::auto_serving_kv_budget`]).
    Auto,
}

fn kv_cache_memory(text: &str) -> Result<KvCacheMemory, String> {
    if text.trim().eq_ignore_ascii_case("auto") {
        return Ok(KvCacheMemory::Auto);
    }
    trainer::plan::parse_size(text).map(KvCacheMemory::Size).map_err(|e| format!("{e}, or auto"))
}

/// A memory size in bytes (`trainer::plan::parse_size`), or 0.
fn memory_size(text: &str) -> Result<u64, model::SettingError> {
    let number = text.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    if number.parse::<f64>() == Ok(0.0) {
        return Ok(0);
    }
    trainer::plan::parse_size(text)
}

/// A number of seconds above 0.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() && secs <= 86_400.0 => Ok(secs),
        _ => Err(format!("expected seconds above 0 (at most 86400), got {text:?}")),
    }
}

/// The HTTP front's limits for these flags: enough handler threads that streaming requests
/// (each holds one while it decodes) cannot starve the others.
fn limits(args: &Args) -> Limits {
    let defaults = Limits::default();
    let request_timeout = Duration::from_secs_f64(args.request_timeout);
    Limits {
        max_connections: args.max_connections as usize,
        body_read_timeout: request_timeout,
        header_read_timeout: defaults.header_read_timeout.min(request_timeout),
        workers: defaults.workers.max((args.max_batch as usize).saturating_mul(4)),
        ..defaults
    }
}

pub fn run(args: Args) -> Result<()> {
    let device = args.compute.device;
    run_on(device, args)
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        if self.max_num_batched_tokens < self.max_batch {
            anyhow::bail!(
                "--max-num-batched-tokens ({}) must be at least --max-batch ({}): each decoding request runs a token a step",
                self.max_num_batched_tokens,
                self.max_batch
            );
        }
        if let (Some(KvCacheMemory::Size(bytes)), Some((memory, source))) = (self.kv_cache_memory, crate::device::total_memory(self.compute.device)) {
            if bytes > memory {
                anyhow::bail!(
                    "--kv-cache-memory {} is more than the {} of {source}: give less, or auto (what the device leaves the cache)",
                    format_size(bytes),
                    format_size(memory)
                );
            }
        }
        let load_options = self.compute.load_options();
        let loaded = LoadedModel::<B>::open(&self.model, &device, load_options)?;
        loaded.require_tokenizer(&self.model, "serve")?;
        let template = crate::model_dir::chat_template(&self.model, "serve")?;
        let mut stop_ids = loaded.stop_ids();
        let LoadedModel { model, tokenizer, .. } = loaded;
        let kv_cache_memory = match self.kv_cache_memory {
            None => None,
            Some(KvCacheMemory::Size(bytes)) => Some(bytes),
            Some(KvCacheMemory::Auto) => Some(self.auto_kv_cache_memory(&model.config, load_options)?),
        };
        let tokenizer = tokenizer.as_ref().expect("checked above");
        stop_ids.push(tokenizer.special().endoftext);
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let settings = Settings {
            host: self.host.clone(),
            port: self.port,
            model_name: self
                .served_model_name
                .clone()
                .unwrap_or_else(|| dir_name(&self.model)),
            max_batch: self.max_batch as usize,
            max_batched_tokens: usize::try_from(self.max_num_batched_tokens).unwrap_or(usize::MAX),
            default_max_tokens: usize::try_from(self.default_max_tokens).unwrap_or(usize::MAX),
            enable_thinking: !self.no_thinking,
            defaults: sampling_defaults(&self.model)?,
            quiet: self.quiet,
            api_key: self.api_key.clone().filter(|key| !key.is_empty()),
            max_loras: self.max_loras as usize,
            merge_lora: self.merge_lora,
            limits: limits(&self),
            prefix_cache_memory: self.prefix_cache_memory,
            kv_cache_memory,
            allowed_origins: self.allowed_origins.clone(),
        };
        let served = Served {
            model,
            root: self.model.display().to_string(),
            device,
            load_options,
            tokenizer,
            template,
            stop_ids,
            memory_probe: crate::device::memory_probe(self.compute.device),
        };
        serve(served, settings)
    }
}

impl Args {
    /// `--kv-cache-memory auto` on this device ([`trainer::plan::auto_serving_kv_budget`]), with a
    /// note of what it came to; an error where the device's memory is unknown (wgpu) or leaves
    /// no room.
    fn auto_kv_cache_memory(&self, model: &Qwen3Config, options: model::LoadOptions) -> Result<u64> {
        let device = self.compute.device;
        let Some((memory, source)) = crate::device::total_memory(device) else {
            anyhow::bail!(
                "--kv-cache-memory auto sizes the cache from the device's memory, which is unknown for {device}: give a size (e.g. 8GiB)"
            );
        };
        let settings = ServingSettings {
            model: model.clone(),
            dtype: options.dtype,
            max_rows: self.max_batch as usize,
            max_batched_tokens: usize::try_from(self.max_num_batched_tokens).unwrap_or(usize::MAX),
            merged_adapters: if self.merge_lora { self.max_loras as usize } else { 0 },
            attention: options.compute.attn_implementation,
            attention_block: options.compute.attention_block_size,
            device: crate::cmd::plan::plan_device(device, &options.compute),
            cuda_memory: crate::cmd::plan::cuda_pages_memory(device, memory),
        };
        let budget = auto_serving_kv_budget(&settings, memory)?;
        eprintln!(
            "note: --kv-cache-memory auto: {} ({} KV positions), what the {} ({source}) leaves the cache after a {:.0}% \
             margin, the weights and a decoder step",
            format_size(budget),
            budget / kv_position_bytes(model, options.dtype).max(1),
            format_size(memory),
            settings.device.margin() * 100.0
        );
        Ok(budget)
    }
}

/// The last component of the model path (after resolving `.` and the like).
pub(crate) fn dir_name(dir: &Path) -> String {
    let resolved = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    resolved
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "prompt-r1".to_string())
}

/// `temperature`, `top_p` and `top_k` of generation_config.json, as vLLM uses them (`top_p` 1
/// and `top_k` 0 or -1 are no truncation); a value of another type or out of transformers'
/// range (a negative temperature, `top_p` outside (0, 1], a `top_k` below -1) is an error
/// naming the file and the key rather than served as if absent.
fn sampling_defaults(dir: &Path) -> Result<Sampling> {
    let path = dir.join("generation_config.json");
    let mut defaults = Sampling::default();
    if !path.is_file() {
        return Ok(defaults);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let bad = |key: &str, what: &str| anyhow!("{}: \"{key}\" must be {what}, got {}", path.display(), config[key]);
    let value = |key: &str| config.get(key).filter(|v| !v.is_null());
    let number = |key: &str| value(key).map(|v| v.as_f64().ok_or_else(|| bad(key, "a number"))).transpose();
    let do_sample = value("do_sample").map(|v| v.as_bool().ok_or_else(|| bad("do_sample", "true or false"))).transpose()?;
    if let Some(t) = number("temperature")? {
        defaults.temperature = t as f32;
    }
    if do_sample == Some(false) {
        defaults.temperature = 0.0;
    }
    match number("top_p")? {
        Some(p) if p > 0.0 && p < 1.0 => defaults.top_p = Some(p as f32),
        Some(p) if p == 1.0 => {}
        Some(_) => return Err(bad("top_p", "above 0 and at most 1")),
        None => {}
    }
    let whole = |v: &serde_json::Value| v.as_i64().or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 1e15).map(|f| f as i64));
    match value("top_k").map(|v| whole(v).ok_or_else(|| bad("top_k", "an integer"))).transpose()? {
        Some(k) if k > 0 => defaults.top_k = Some(k as usize),
        Some(0 | -1) | None => {}
        Some(_) => return Err(bad("top_k", "positive, or 0 or -1 for none")),
    }
    defaults.validate().map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(defaults)
}

/// A name with something in it.
fn non_blank(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Err("the name is empty".into());
    }
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blank model name and a default of no tokens are refused by their flags.
    #[test]
    fn blank_names_and_zero_default_tokens_are_refused() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |extra: &[&str]| {
            let argv = [&["serve", "--model", "m"][..], extra].concat();
            <Cli as clap::Parser>::try_parse_from(argv).map(|cli| cli.args).map_err(|e| e.to_string())
        };
        let args = parse(&[]).unwrap();
        assert_eq!((args.default_max_tokens, args.served_model_name), (2048, None));
        assert!(parse(&["--served-model-name", " "]).unwrap_err().contains("the name is empty"));
        assert!(parse(&["--default-max-tokens", "0"]).unwrap_err().contains("--default-max-tokens"));
    }

    #[test]
    fn prefix_cache_memory_takes_sizes_and_zero() {
        assert_eq!(memory_size("2GiB"), Ok(2 << 30));
        assert_eq!(memory_size("512 MiB"), Ok(512 << 20));
        assert_eq!(memory_size("0"), Ok(0));
        assert_eq!(memory_size("0GiB"), Ok(0));
        assert!(memory_size("lots").is_err());
        assert!(memory_size("-1GB").is_err());
    }

    #[test]
    fn reads_sampling_defaults_from_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            sampling_defaults(dir.path()).unwrap(),
            Sampling::default()
        );
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true}"#,
        )
        .unwrap();
        let d = sampling_defaults(dir.path()).unwrap();
        assert_eq!(
            (d.temperature, d.top_p, d.top_k),
            (0.6, Some(0.95), Some(20))
        );
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"do_sample": false}"#,
        )
        .unwrap();
        assert_eq!(sampling_defaults(dir.path()).unwrap().temperature, 0.0);
        std::fs::write(dir.path().join("generation_config.json"), r#"{"temperature": null, "top_p": 1.0, "top_k": -1}"#).unwrap();
        assert_eq!(sampling_defaults(dir.path()).unwrap(), Sampling::default());
        std::fs::write(dir.path().join("generation_config.json"), r#"{"top_k": 20.0}"#).unwrap();
        assert_eq!(sampling_defaults(dir.path()).unwrap().top_k, Some(20));
    }

    /// A value serve could not use is refused, naming the file and the key, not served as if
    /// absent.
    #[test]
    fn refuses_bad_generation_config_values() {
        let dir = tempfile::tempdir().unwrap();
        for (text, key) in [
            (r#"{"temperature": "hot"}"#, "\"temperature\""),
            (r#"{"temperature": -2}"#, "temperature"),
            (r#"{"top_p": 5}"#, "\"top_p\""),
            (r#"{"top_p": 0}"#, "\"top_p\""),
            (r#"{"top_k": -3}"#, "\"top_k\""),
            (r#"{"top_k": 2.5}"#, "\"top_k\""),
            (r#"{"do_sample": "no"}"#, "\"do_sample\""),
        ] {
            std::fs::write(dir.path().join("generation_config.json"), text).unwrap();
            let err = sampling_defaults(dir.path()).unwrap_err().to_string();
            assert!(err.contains("generation_config.json") && err.contains(key), "{text}: {err}");
        }
    }
}

//! `prompt-r1 serve`: an OpenAI-compatible chat (and text-completion) server over a local Qwen3
//! checkpoint.
//!
//! HTTP handler threads (one per request) parse and check requests, render the chat template
//! and tokenize, then queue a [`engine::Job`]; the one worker thread that owns the model runs
//! the queued jobs continuously batched (each joins the running batch at the next decode step
//! and leaves it when it ends) and streams each one's text back over the job's channel.

mod completions;
mod engine;
mod error;
mod http;
mod request;
mod stop;

use std::io::Write;
use std::sync::mpsc::{self, Sender};

use anyhow::{anyhow, Result};
use burn::tensor::backend::Backend;
use model::chat_template::ChatTemplate;
use model::tokenizer::Qwen3Tokenizer;
use model::{Qwen3ForCausalLM, Sampling};

use engine::{Engine, Job};

/// Server settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub host: String,
    pub port: u16,
    pub model_name: String,
    pub max_batch: usize,
    pub default_max_tokens: usize,
    pub enable_thinking: bool,
    /// Sampling used when a request leaves a parameter out (by default OpenAI's: temperature
    /// 1, no truncation). Its seed is not used: a request without one gets a random seed.
    pub defaults: Sampling,
    pub quiet: bool,
    /// The key clients must send as `Authorization: Bearer KEY` on the `/v1` routes.
    pub api_key: Option<String>,
}

/// The model being served.
pub struct Served<'m, B: Backend> {
    pub model: &'m Qwen3ForCausalLM<B>,
    pub tokenizer: &'m Qwen3Tokenizer,
    pub template: ChatTemplate,
    pub stop_ids: Vec<u32>,
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
    jobs: Sender<Job>,
}

/// Listens, prints the base URL when ready, and serves until the process is stopped.
pub fn serve<B: Backend>(served: Served<'_, B>, settings: Settings) -> Result<()> {
    let server =
        tiny_http::Server::http((settings.host.as_str(), settings.port)).map_err(|err| {
            anyhow!(
                "cannot listen on {}:{}: {err}",
                settings.host,
                settings.port
            )
        })?;
    let addr = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| anyhow!("the server is not listening on an IP address"))?;
    let (jobs, queue) = mpsc::channel();
    let shared = Shared {
        model_name: settings.model_name.clone(),
        created: http::unix_time(),
        tokenizer: served.tokenizer,
        template: served.template,
        context_len: served.model.config.max_position_embeddings,
        vocab_size: served.model.config.vocab_size,
        default_max_tokens: settings.default_max_tokens,
        enable_thinking: settings.enable_thinking,
        defaults: settings.defaults.clone(),
        quiet: settings.quiet,
        api_key: settings.api_key.clone(),
        jobs,
    };
    let engine = Engine {
        model: served.model,
        tokenizer: served.tokenizer,
        stop_ids: served.stop_ids,
        max_batch: settings.max_batch,
    };
    if settings.api_key.is_none() && !addr.ip().is_loopback() {
        eprintln!(
            "warning: serving on {addr}, reachable from other machines, without an API key: \
             anyone who can connect may use the model; set PROMPT_R1_API_KEY (or --api-key)"
        );
    }
    println!(
        "serving {} at http://{addr}/v1 (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health)",
        settings.model_name
    );
    std::io::stdout().flush()?;
    std::thread::scope(|scope| {
        let shared = &shared;
        let server = &server;
        scope.spawn(move || {
            for request in server.incoming_requests() {
                scope.spawn(move || http::handle(request, shared));
            }
        });
        engine.run(&queue);
    });
    Ok(())
}

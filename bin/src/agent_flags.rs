//! The flags `infer` and `eval` share — which agent (a local checkpoint or a served model),
//! which environment (the large LLM), the episode limits — and building each from them.

use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use burn::tensor::{backend::Backend, DType};
use clap::Args as ClapArgs;
use env::{
    Agent, ClientConfig, EpisodeConfig, OpenAiClient, PromptTexts, RemoteAgent, RetryPolicy,
    SamplingParams, DEFAULT_API_KEY_ENV,
};
use trainer::rollout::{AgentSampling, LocalAgent};

use crate::device::{run_on, DeviceChoice, OnBackend};
use crate::model_dir::{parse_dtype, LoadedModel};

/// The variable the served agent's API key is read from unless `--agent-api-key-env` says
/// otherwise (not `OPENAI_API_KEY`, so that the environment's key never goes to the agent's
/// server).
pub const AGENT_API_KEY_ENV: &str = "PROMPT_R1_AGENT_API_KEY";

/// The agent: a local checkpoint (`--agent`) or a model behind an OpenAI-compatible API
/// (`--agent-url` + `--agent-model`).
#[derive(ClapArgs, Debug, Clone)]
pub struct AgentFlags {
    /// Local agent checkpoint (Hugging Face layout with tokenizer.json), run by our burn Qwen3.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "agent_url",
        help_heading = "Agent"
    )]
    pub agent: Option<PathBuf>,
    /// Base URL of an OpenAI-compatible server serving the agent (`prompt-r1 serve`, vLLM), e.g.
    /// http://127.0.0.1:8001/v1.
    #[arg(
        long,
        value_name = "URL",
        requires = "agent_model",
        help_heading = "Agent"
    )]
    pub agent_url: Option<String>,
    /// Model name of the served agent.
    #[arg(
        long,
        value_name = "NAME",
        requires = "agent_url",
        help_heading = "Agent"
    )]
    pub agent_model: Option<String>,
    /// Environment variable holding the agent server's API key (unset: no key is sent).
    #[arg(long, value_name = "VAR", default_value = AGENT_API_KEY_ENV, help_heading = "Agent")]
    pub agent_api_key_env: String,
    /// Agent sampling temperature; 0 = greedy.
    #[arg(long, value_name = "T", default_value_t = 0.0, help_heading = "Agent")]
    pub temperature: f32,
    /// Agent nucleus sampling: keep the most likely tokens whose probabilities add up to P.
    #[arg(long, value_name = "P", help_heading = "Agent")]
    pub top_p: Option<f32>,
    /// Agent sampling among the K most likely tokens (local agent only).
    #[arg(long, value_name = "K", help_heading = "Agent")]
    pub top_k: Option<usize>,
    /// Agent sampling seed: the same seed gives the same episodes.
    #[arg(long, default_value_t = 0, help_heading = "Agent")]
    pub seed: u64,
    /// Compute device of the local agent (and of the SSim model): cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu", help_heading = "Agent")]
    pub device: DeviceChoice,
    /// Weight dtype of the local agent: f32 or bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype, help_heading = "Agent")]
    pub dtype: DType,
}

impl AgentFlags {
    /// Whether an agent was named.
    pub fn is_given(&self) -> bool {
        self.agent.is_some() || self.agent_url.is_some()
    }

    /// Runs `work` with the chosen agent (loading the local checkpoint on the chosen device).
    pub fn with_agent<T>(&self, work: impl FnOnce(&mut dyn Agent) -> Result<T>) -> Result<T> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be a number >= 0");
        }
        match (&self.agent, &self.agent_url, &self.agent_model) {
            (Some(dir), _, _) => run_on(
                self.device,
                LocalRun {
                    dir,
                    dtype: self.dtype,
                    sampling: AgentSampling {
                        temperature: self.temperature,
                        top_k: self.top_k,
                        top_p: self.top_p,
                        seed: self.seed,
                    },
                    work,
                    output: PhantomData,
                },
            ),
            (None, Some(url), Some(model)) => {
                let config = ClientConfig {
                    api_key_env: self.agent_api_key_env.clone(),
                    ..ClientConfig::new(url, model)
                };
                let client =
                    OpenAiClient::new(config).map_err(|err| anyhow!("agent client: {err}"))?;
                let sampling = SamplingParams {
                    temperature: Some(f64::from(self.temperature)),
                    top_p: self.top_p.map(f64::from),
                    seed: Some(self.seed),
                    ..SamplingParams::default()
                };
                work(&mut RemoteAgent::new(client, sampling))
            }
            (None, Some(_), None) => bail!("--agent-url needs --agent-model NAME"),
            (None, None, _) => {
                bail!("name the agent: --agent DIR, or --agent-url URL --agent-model NAME")
            }
        }
    }
}

/// Loading the local agent on the chosen backend and running the work with it.
struct LocalRun<'a, F, T> {
    dir: &'a Path,
    dtype: DType,
    sampling: AgentSampling,
    work: F,
    output: PhantomData<fn() -> T>,
}

impl<F, T> OnBackend for LocalRun<'_, F, T>
where
    F: FnOnce(&mut dyn Agent) -> Result<T>,
{
    type Output = T;

    fn run<B: Backend>(self, device: B::Device) -> Result<T> {
        let loaded = LoadedModel::<B>::open(self.dir, &device, self.dtype)?;
        let tokenizer = loaded.require_tokenizer(self.dir, "the agent")?;
        let mut agent = LocalAgent::new(&loaded.model, tokenizer, self.sampling);
        (self.work)(&mut agent)
    }
}

/// The environment: the large LLM behind an OpenAI-compatible API. Its key is read from
/// `$OPENAI_API_KEY` (or the variable `--api-key-env` names), never from a flag.
#[derive(ClapArgs, Debug, Clone)]
pub struct EnvFlags {
    /// Base URL of the large LLM's API, e.g. https://api.openai.com/v1 or http://127.0.0.1:8000/v1.
    #[arg(long, value_name = "URL", help_heading = "Environment (the large LLM)")]
    pub env_url: Option<String>,
    /// Model name of the large LLM.
    #[arg(
        long,
        value_name = "NAME",
        help_heading = "Environment (the large LLM)"
    )]
    pub env_model: Option<String>,
    /// Environment variable holding the API key.
    #[arg(long, value_name = "VAR", default_value = DEFAULT_API_KEY_ENV, help_heading = "Environment (the large LLM)")]
    pub api_key_env: String,
    /// Sampling temperature sent to the large LLM (default: the server's).
    #[arg(long, value_name = "T", help_heading = "Environment (the large LLM)")]
    pub env_temperature: Option<f64>,
    /// top_p sent to the large LLM (default: the server's).
    #[arg(long, value_name = "P", help_heading = "Environment (the large LLM)")]
    pub env_top_p: Option<f64>,
    /// max_tokens sent to the large LLM (default: the server's).
    #[arg(long, value_name = "N", help_heading = "Environment (the large LLM)")]
    pub env_max_tokens: Option<u32>,
    /// Seed sent to the large LLM, for servers that support it.
    #[arg(long, value_name = "S", help_heading = "Environment (the large LLM)")]
    pub env_seed: Option<u64>,
    /// Seconds to wait for a reply (each attempt).
    #[arg(
        long,
        value_name = "S",
        default_value_t = 300.0,
        help_heading = "Environment (the large LLM)"
    )]
    pub env_timeout: f64,
    /// Attempts per call, the first included (retries back off exponentially).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 6,
        help_heading = "Environment (the large LLM)"
    )]
    pub env_attempts: u32,
    /// Most calls in flight at once.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 32,
        help_heading = "Environment (the large LLM)"
    )]
    pub env_concurrency: usize,
    /// Most requests started per minute (default: no cap).
    #[arg(long, value_name = "N", help_heading = "Environment (the large LLM)")]
    pub env_rpm: Option<u32>,
}

impl EnvFlags {
    /// The client; `what` names the command or mode for the error when the flags are missing.
    pub fn client(&self, what: &str) -> Result<OpenAiClient> {
        let (Some(url), Some(model)) = (&self.env_url, &self.env_model) else {
            bail!("{what} needs the large LLM: --env-url URL --env-model NAME");
        };
        let config = ClientConfig {
            api_key_env: self.api_key_env.clone(),
            connect_timeout_secs: self.env_timeout.min(10.0),
            read_timeout_secs: self.env_timeout,
            retry: RetryPolicy {
                max_attempts: self.env_attempts,
                ..RetryPolicy::default()
            },
            max_concurrency: self.env_concurrency,
            requests_per_minute: self.env_rpm,
            sampling: SamplingParams {
                temperature: self.env_temperature,
                top_p: self.env_top_p,
                max_tokens: self.env_max_tokens,
                seed: self.env_seed,
                stop: Vec::new(),
            },
            ..ClientConfig::new(url, model)
        };
        OpenAiClient::new(config).map_err(|err| anyhow!("environment client: {err}"))
    }

    /// Whether an environment was named.
    pub fn is_given(&self) -> bool {
        self.env_url.is_some() || self.env_model.is_some()
    }
}

/// Limits and texts of an episode (defaults: `EpisodeConfig::inference()`).
#[derive(ClapArgs, Debug, Clone)]
pub struct EpisodeFlags {
    /// Most calls to the large LLM per episode (after the last one the agent gets one more
    /// turn to answer).
    #[arg(long, value_name = "N", default_value_t = 5, help_heading = "Episode")]
    pub max_turns: usize,
    /// Most tokens the agent generates in one turn.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1024,
        help_heading = "Episode"
    )]
    pub max_turn_tokens: usize,
    /// Most tokens after the first prompt (agent and environment together).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 8192,
        help_heading = "Episode"
    )]
    pub max_response_tokens: usize,
    /// Most characters of each reply shown to the agent (as {"results": [...]} JSON text).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 8192,
        help_heading = "Episode"
    )]
    pub reply_chars: usize,
    /// File replacing the agent's reference system message.
    #[arg(long, value_name = "FILE", help_heading = "Episode")]
    pub system_prompt: Option<PathBuf>,
    /// File replacing the reference instruction that follows `Question: ...`.
    #[arg(long, value_name = "FILE", help_heading = "Episode")]
    pub instruction: Option<PathBuf>,
}

impl EpisodeFlags {
    /// The episode settings, with the reference prompt texts unless files replace them.
    pub fn config(&self, env: &EnvFlags) -> Result<EpisodeConfig> {
        self.config_with(env, PromptTexts::default())
    }

    /// The episode settings with `prompts` as the texts the files do not replace.
    pub fn config_with(&self, env: &EnvFlags, prompts: PromptTexts) -> Result<EpisodeConfig> {
        let mut config = EpisodeConfig::inference();
        config.max_turns = self.max_turns;
        config.max_turn_tokens = self.max_turn_tokens;
        config.max_response_tokens = self.max_response_tokens;
        config.reply.max_chars = self.reply_chars;
        config.env_concurrency = env.env_concurrency.max(1);
        let files = PromptTexts::load(self.system_prompt.as_deref(), self.instruction.as_deref())
            .context("reading the prompt files")?;
        config.prompts = PromptTexts {
            system: if self.system_prompt.is_some() {
                files.system
            } else {
                prompts.system
            },
            instruction: if self.instruction.is_some() {
                files.instruction
            } else {
                prompts.instruction
            },
        };
        Ok(config)
    }
}

//! The flags `infer` and `eval` share — which agent (a local checkpoint or a served model),
//! which environment (the large LLM), the episode limits — and building each from them.

use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use burn::tensor::{backend::Backend, DType};
use clap::{Args as ClapArgs, ValueEnum};
use env::{
    Agent, AgentApi, ClientConfig, EpisodeConfig, FailureKind, OpenAiClient, PromptTexts, RemoteAgent, RetryPolicy,
    SamplingParams, DEFAULT_API_KEY_ENV,
};
use model::{LoadOptions, MatmulPrecision, Sampling};
use trainer::rollout::LocalAgent;

use crate::device::{run_on, AttentionArgs, DeviceChoice, OnBackend};
use crate::model_dir::parse_dtype;

/// The variable the served agent's API key is read from unless `--agent-api-key-env` says
/// otherwise (not `OPENAI_API_KEY`, so that the environment's key never goes to the agent's
/// server).
pub const AGENT_API_KEY_ENV: &str = "PROMPT_R1_AGENT_API_KEY";

/// The agent: a local checkpoint (`--agent`) or a model behind an OpenAI-compatible API
/// (`--agent-url` + `--agent-model`).
#[derive(ClapArgs, Debug, Clone)]
pub struct AgentFlags {
    /// Local agent, run by our burn Qwen3: a model directory (Hugging Face layout with
    /// tokenizer.json), LoRA adapters as `export` writes them (merged into the base model their
    /// adapter_config.json names), or a training run's directory (its newest checkpoint).
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
    /// How the served agent is asked: `completions` sends the raw context it was trained on to
    /// /v1/completions (earlier turns whole, their `<think>` included); `chat` sends messages to
    /// /v1/chat/completions, where Qwen3's chat template drops the `<think>` of earlier turns.
    #[arg(
        long,
        value_enum,
        default_value = "completions",
        requires = "agent_url",
        help_heading = "Agent"
    )]
    pub agent_api: AgentApiFlag,
    /// Environment variable holding the agent server's API key (unset: no key is sent).
    #[arg(long, value_name = "VAR", default_value = AGENT_API_KEY_ENV, help_heading = "Agent")]
    pub agent_api_key_env: String,
    /// Agent sampling temperature; 0 = greedy [default: 0, or the --preset's].
    #[arg(long, value_name = "T", help_heading = "Agent")]
    pub temperature: Option<f32>,
    /// Agent nucleus sampling: keep the most likely tokens whose probabilities add up to P
    /// [default: off, or the --preset's].
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
    #[command(flatten, next_help_heading = "Agent")]
    pub attention: AttentionArgs,
}

impl AgentFlags {
    /// Whether an agent was named.
    pub fn is_given(&self) -> bool {
        self.agent.is_some() || self.agent_url.is_some()
    }

    /// Fills the sampling settings left unset with `preset`'s.
    pub fn apply_preset(&mut self, preset: Preset) {
        let settings = preset.settings();
        self.temperature = self.temperature.or(Some(settings.temperature));
        self.top_p = self.top_p.or(settings.top_p);
    }

    /// The sampling temperature (0, greedy, unless set or filled by a preset).
    pub fn temperature(&self) -> f32 {
        self.temperature.unwrap_or(0.0)
    }

    /// Runs `work` with the chosen agent (loading the local checkpoint on the chosen device).
    pub fn with_agent<T>(&self, work: impl FnOnce(&mut dyn Agent) -> Result<T>) -> Result<T> {
        let sampling = Sampling {
            temperature: self.temperature(),
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        };
        sampling.validate().map_err(|e| anyhow!("agent sampling (--temperature, --top-p): {e}"))?;
        match (&self.agent, &self.agent_url, &self.agent_model) {
            (Some(dir), _, _) => run_on(
                self.device,
                LocalRun {
                    dir,
                    options: LoadOptions { dtype: self.dtype, compute: self.attention.compute(MatmulPrecision::F32, self.device) },
                    sampling,
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
                let sampling = SamplingParams::from(&sampling);
                let api = match self.agent_api {
                    AgentApiFlag::Completions => AgentApi::Completions,
                    AgentApiFlag::Chat => AgentApi::Chat,
                };
                work(&mut RemoteAgent::new(client, sampling).with_api(api))
            }
            (None, Some(_), None) => bail!("--agent-url needs --agent-model NAME"),
            (None, None, _) => {
                bail!("name the agent: --agent DIR, or --agent-url URL --agent-model NAME")
            }
        }
    }
}

/// The `--agent-api` values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentApiFlag {
    /// POST /v1/completions with the raw training context.
    Completions,
    /// POST /v1/chat/completions with messages (the server's chat template applies).
    Chat,
}

/// Loading the local agent on the chosen backend and running the work with it.
struct LocalRun<'a, F, T> {
    dir: &'a Path,
    options: LoadOptions,
    sampling: Sampling,
    work: F,
    output: PhantomData<fn() -> T>,
}

impl<F, T> OnBackend for LocalRun<'_, F, T>
where
    F: FnOnce(&mut dyn Agent) -> Result<T>,
{
    type Output = T;

    fn run<B: Backend>(self, device: B::Device) -> Result<T> {
        let loaded = crate::model_dir::load_agent::<B>(self.dir, &device, self.options)?;
        let tokenizer = loaded.require_tokenizer(self.dir, "the agent")?;
        // One model for the whole run: episodes share their prompts' common KV blocks.
        let limits = model::DecoderLimits { share_prefixes: true, ..model::DecoderLimits::default() };
        let mut agent = LocalAgent::new(&loaded.model, tokenizer, self.sampling).with_limits(limits);
        (self.work)(&mut agent)
    }
}

/// The environment: the large LLM behind an OpenAI-compatible API. Its key is read from
/// `$OPENAI_API_KEY` (or the variable `--api-key-env` names), never from a flag.
#[derive(ClapArgs, Debug, Clone)]
pub struct EnvFlags {
    /// Base URL of the large LLM's API, e.g. `https://api.openai.com/v1` or
    /// `http://127.0.0.1:8000/v1`.
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
    #[arg(long, value_name = "T", value_parser = parse_temperature, help_heading = "Environment (the large LLM)")]
    pub env_temperature: Option<f64>,
    /// top_p sent to the large LLM (default: the server's).
    #[arg(long, value_name = "P", value_parser = parse_top_p, help_heading = "Environment (the large LLM)")]
    pub env_top_p: Option<f64>,
    /// max_tokens sent to the large LLM (default: the server's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), help_heading = "Environment (the large LLM)")]
    pub env_max_tokens: Option<u32>,
    /// Seed sent to the large LLM, for servers that support it.
    #[arg(long, value_name = "S", help_heading = "Environment (the large LLM)")]
    pub env_seed: Option<u64>,
    /// Seconds to wait for a reply, each attempt (see --env-call-timeout for the whole call).
    #[arg(
        long,
        value_name = "S",
        default_value_t = 300.0,
        help_heading = "Environment (the large LLM)"
    )]
    pub env_timeout: f64,
    /// Seconds one call may take in all: its attempts, the waits between retries (backoff,
    /// Retry-After) and for the concurrency and rate caps; an attempt is cut at this deadline.
    #[arg(
        long,
        value_name = "S",
        default_value_t = 900.0,
        help_heading = "Environment (the large LLM)"
    )]
    pub env_call_timeout: f64,
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

/// Sends the large LLM of `config` one short request, without retries, and refuses what no
/// retry would mend (no connection, a refused key, an unknown model or route), so that a long
/// run fails in seconds instead of dropping every episode that calls it; a slow, busy or erring
/// server is left to the run's retries.
pub fn probe_environment(config: ClientConfig) -> Result<()> {
    let config = ClientConfig { retry: RetryPolicy::none(), max_concurrency: 1, ..config };
    let client = OpenAiClient::new(config).map_err(|err| anyhow!("environment client: {err}"))?;
    let probe = [env::ChatMessage::user(crate::cmd::env_check::PROBE)];
    match client.chat(&probe, &SamplingParams { max_tokens: Some(8), ..SamplingParams::default() }) {
        Err(err) if matches!(err.kind(), FailureKind::Connection | FailureKind::Unauthorized | FailureKind::NotFound | FailureKind::Config) => {
            bail!("the large LLM ({}) cannot be used, so nothing was run: {err} (`prompt-r1 env-check` tells more)", client.endpoint())
        }
        _ => Ok(()),
    }
}

impl EnvFlags {
    /// The client; `what` names the command or mode for the error when the flags are missing.
    pub fn client(&self, what: &str) -> Result<OpenAiClient> {
        OpenAiClient::new(self.client_config(what)?).map_err(|err| anyhow!("environment client: {err}"))
    }

    /// [`probe_environment`] on the flags' large LLM; `what` names the command or mode for the
    /// error when the flags are missing.
    pub fn probe(&self, what: &str) -> Result<()> {
        probe_environment(self.client_config(what)?)
    }

    fn client_config(&self, what: &str) -> Result<ClientConfig> {
        let (Some(url), Some(model)) = (&self.env_url, &self.env_model) else {
            bail!("{what} needs the large LLM: --env-url URL --env-model NAME");
        };
        let config = ClientConfig {
            api_key_env: self.api_key_env.clone(),
            connect_timeout_secs: self.env_timeout.min(10.0),
            read_timeout_secs: self.env_timeout,
            call_timeout_secs: self.env_call_timeout,
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
        Ok(config)
    }

    /// Whether an environment was named.
    pub fn is_given(&self) -> bool {
        self.env_url.is_some() || self.env_model.is_some()
    }
}

/// Named sets of agent sampling and episode limits; flags given explicitly override them.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Preset {
    /// Greedy agent, 5 turns of at most 1,024 tokens, 8,192 tokens after the prompt, replies
    /// cut at 8,192 characters: the training limits with inference's longer replies.
    #[default]
    Standard,
    /// The reference's batch inference (`batch_inference.py`, whose outputs its
    /// `eval_scores.py` scores): temperature 0.7, top-p 0.8, 10 turns of at most 8,192 tokens,
    /// replies cut at 8,192 characters, and 32,768 tokens after the prompt (it stops an episode
    /// whose context would pass Qwen3's 40,960 tokens).
    ReferenceBatch,
}

/// The values a [`Preset`] stands for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PresetSettings {
    pub temperature: f32,
    pub top_p: Option<f32>,
    pub max_turns: usize,
    pub max_turn_tokens: usize,
    pub max_response_tokens: usize,
    pub reply_chars: usize,
}

impl Preset {
    /// The settings the preset stands for.
    pub fn settings(self) -> PresetSettings {
        match self {
            Self::Standard => PresetSettings {
                temperature: 0.0,
                top_p: None,
                max_turns: 5,
                max_turn_tokens: 1024,
                max_response_tokens: 8192,
                reply_chars: 8192,
            },
            Self::ReferenceBatch => PresetSettings {
                temperature: 0.7,
                top_p: Some(0.8),
                max_turns: 10,
                max_turn_tokens: 8192,
                max_response_tokens: 32768,
                reply_chars: 8192,
            },
        }
    }
}

/// Limits and texts of an episode (defaults: the `--preset`'s).
#[derive(ClapArgs, Debug, Clone)]
pub struct EpisodeFlags {
    /// Settings of the agent's sampling and the episode limits, each overridden by its own flag:
    /// `standard` (greedy, 5 turns of 1,024 tokens) or `reference-batch` (the reference's batch
    /// inference: temperature 0.7, top-p 0.8, 10 turns of 8,192 tokens, replies cut at 8,192
    /// characters).
    #[arg(long, value_enum, default_value = "standard", help_heading = "Episode")]
    pub preset: Preset,
    /// Most agent turns (generation rounds) per episode, as the reference's `max_turns`: 5 fit
    /// 4 calls and an answer; a call in the last round is sent, then the episode ends without
    /// an answer [default: 5, or the --preset's].
    #[arg(long, value_name = "N", value_parser = parse_at_least_one, help_heading = "Episode")]
    pub max_turns: Option<usize>,
    /// Most tokens the agent generates in one turn [default: 1024, or the --preset's].
    #[arg(long, value_name = "N", value_parser = parse_at_least_one, help_heading = "Episode")]
    pub max_turn_tokens: Option<usize>,
    /// Most tokens after the first prompt, agent and environment together [default: 8192, or
    /// the --preset's].
    #[arg(long, value_name = "N", value_parser = parse_at_least_one, help_heading = "Episode")]
    pub max_response_tokens: Option<usize>,
    /// Most characters of each reply shown to the agent, as {"results": [...]} JSON text
    /// [default: 8192].
    #[arg(long, value_name = "N", help_heading = "Episode")]
    pub reply_chars: Option<usize>,
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

    /// The `--preset`'s settings with the episode limits these flags override.
    pub fn settings(&self) -> PresetSettings {
        let preset = self.preset.settings();
        PresetSettings {
            max_turns: self.max_turns.unwrap_or(preset.max_turns),
            max_turn_tokens: self.max_turn_tokens.unwrap_or(preset.max_turn_tokens),
            max_response_tokens: self.max_response_tokens.unwrap_or(preset.max_response_tokens),
            reply_chars: self.reply_chars.unwrap_or(preset.reply_chars),
            ..preset
        }
    }

    /// The episode settings with `prompts` as the texts the files do not replace.
    pub fn config_with(&self, env: &EnvFlags, prompts: PromptTexts) -> Result<EpisodeConfig> {
        let settings = self.settings();
        let mut config = EpisodeConfig::inference();
        config.max_turns = settings.max_turns;
        config.max_turn_tokens = settings.max_turn_tokens;
        config.max_response_tokens = settings.max_response_tokens;
        config.reply.max_chars = settings.reply_chars;
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

/// A temperature for the large LLM: finite and at least 0 (NaN would be sent as `null`).
fn parse_temperature(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("\"{text}\" is not a temperature: a finite number >= 0")),
    }
}

/// A top-p for the large LLM, in (0, 1].
fn parse_top_p(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("\"{text}\" is not a top-p: a number in (0, 1]")),
    }
}

/// A count that must be at least 1 (turns, tokens).
fn parse_at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("\"{text}\" is not a whole number >= 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentFlags,
        #[command(flatten)]
        env: EnvFlags,
        #[command(flatten)]
        episode: EpisodeFlags,
    }

    fn parse(flags: &[&str]) -> (AgentFlags, EpisodeConfig) {
        let mut argv = vec!["x", "--agent-url", "http://a/v1", "--agent-model", "m"];
        argv.extend_from_slice(flags);
        let mut cli = Cli::try_parse_from(argv).unwrap();
        cli.agent.apply_preset(cli.episode.preset);
        let config = cli.episode.config(&cli.env).unwrap();
        (cli.agent, config)
    }

    #[test]
    fn standard_is_greedy_with_the_training_limits() {
        let (agent, config) = parse(&[]);
        assert_eq!((agent.temperature(), agent.top_p), (0.0, None));
        assert_eq!(
            (
                config.max_turns,
                config.max_turn_tokens,
                config.max_response_tokens
            ),
            (5, 1024, 8192)
        );
        assert_eq!(config.reply.max_chars, 8192);
    }

    #[test]
    fn reference_batch_has_the_reference_inference_settings() {
        let (agent, config) = parse(&["--preset", "reference-batch"]);
        assert_eq!((agent.temperature(), agent.top_p), (0.7, Some(0.8)));
        assert_eq!((config.max_turns, config.max_turn_tokens), (10, 8192));
        assert_eq!(config.reply.max_chars, 8192);
        // Flags given explicitly win over the preset.
        let (agent, config) = parse(&[
            "--preset",
            "reference-batch",
            "--temperature",
            "0",
            "--max-turns",
            "3",
        ]);
        assert_eq!((agent.temperature(), agent.top_p), (0.0, Some(0.8)));
        assert_eq!((config.max_turns, config.max_turn_tokens), (3, 8192));
    }

    /// The large LLM's sampling flags and the episode limits are refused out of range (NaN
    /// was sent as `null`, and 0 turns ran episodes of nothing), each naming its flag.
    #[test]
    fn out_of_range_flags_are_refused() {
        for (flag, value) in [
            ("--env-temperature", "nan"),
            ("--env-temperature", "-1"),
            ("--env-top-p", "5"),
            ("--env-top-p", "0"),
            ("--env-max-tokens", "0"),
            ("--max-turns", "0"),
            ("--max-turn-tokens", "0"),
            ("--max-response-tokens", "0"),
        ] {
            let arg = format!("{flag}={value}");
            let argv = ["x", "--agent-url", "http://a/v1", "--agent-model", "m", &arg];
            let err = Cli::try_parse_from(argv).err().unwrap_or_else(|| panic!("{flag} {value} was accepted")).to_string();
            assert!(err.contains(flag), "{err}");
        }
        let (_, config) = parse(&["--env-temperature", "0.5", "--env-top-p", "1", "--env-max-tokens", "7", "--max-turns", "1"]);
        assert_eq!(config.max_turns, 1);
    }
}

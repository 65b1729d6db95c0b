//! The run configuration (`run.toml`): model, data, environment, episode limits, reward, GRPO
//! and optimiser settings. Every section and key has the reference run's default, so a
//! file names only what differs. Unknown keys are errors.

use std::path::{Path, PathBuf};

use burn::tensor::DType;
use env::ClientConfig;
use model::qwen3::compute::DEFAULT_ATTENTION_BLOCK_SIZE;
use model::{AttnImplementation, Compute, DecoderLimits, LoraConfig, Qwen3Config, Sampling};
use rewards::RewardConfig;
use serde::{Deserialize, Serialize};

use super::error::TrainError;
use crate::grpo::{AdvantageMode, LearnConfig};
use crate::rollout::ServerSettings;

/// Everything a run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The initial policy, an HF checkpoint directory with `tokenizer.json`. The frozen
    /// reference policy is this checkpoint too.
    pub model: PathBuf,
    /// The dtype the model's weights are held in: `f32`, or `bf16` for a frozen LoRA base
    /// (only with `[lora]`: full fine-tuning keeps f32 weights).
    #[serde(default)]
    pub model_dtype: ModelDtype,
    /// Attention's implementation for rollouts, scoring and the update (transformers'
    /// `attn_implementation`): `memory_efficient` (the default: blocks of queries and keys, no
    /// `[b, heads, q, k]` tensor, on every backend) or `eager` (HF's formula, the reference). On
    /// the CPU with its kernels on, the fused CPU kernel runs for both.
    #[serde(default)]
    pub attn_implementation: AttnImplementation,
    /// Queries per block of the memory-efficient attention (and the fewest keys per block).
    #[serde(default = "default_attention_block_size")]
    pub attention_block_size: usize,
    /// The CPU kernels the run's models use on burn-flex: not a config key (the default is what
    /// the environment says; commands and tests choose another in code).
    #[serde(skip)]
    pub cpu_kernels: model::cpu_kernels::Kernels,
    /// The kernels a GPU backend lends that the run's models run: not a config key (the binary
    /// chooses them from its flags for the device).
    #[serde(skip)]
    pub device_kernels: model::DeviceKernelChoice,
    /// LoRA: train low-rank adapters beside the frozen model instead of every weight (absent:
    /// full fine-tuning). The KL reference is then the model with the adapters off.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    pub data: DataSection,
    /// The large LLM (an OpenAI-compatible endpoint); the API key comes from the variable
    /// named by `api_key_env`.
    #[serde(default)]
    pub environment: ClientConfig,
    #[serde(default)]
    pub episode: EpisodeSection,
    #[serde(default)]
    pub rollout: RolloutSection,
    #[serde(default)]
    pub reward: RewardConfig,
    #[serde(default)]
    pub grpo: LearnConfig,
    #[serde(default)]
    pub run: RunSection,
}

/// The dtype of the model's weights during a run (see [`TrainConfig::model_dtype`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelDtype {
    #[default]
    F32,
    Bf16,
}

impl ModelDtype {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            ModelDtype::F32 => DType::F32,
            ModelDtype::Bf16 => DType::BF16,
        }
    }
}

impl TrainConfig {
    /// Settings the run leaves unused, as notes for the user: `[rollout.servers]` beside the
    /// local engine.
    pub fn unused_settings(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.rollout.servers.is_some() && self.rollout.engine == RolloutEngineKind::Local {
            notes.push(
                "[rollout.servers] is set but rollout.engine is \"local\": the rollouts run on this machine \
                 (set rollout.engine = \"servers\" to use the workers)"
                    .to_string(),
            );
        }
        notes
    }

    /// How the run's models compute: the attention settings, `grpo.matmul`, the CPU kernels and
    /// the GPU kernels.
    pub fn compute(&self) -> Compute {
        Compute {
            attn_implementation: self.attn_implementation,
            attention_block_size: self.attention_block_size,
            matmul: self.grpo.matmul,
            cpu_kernels: self.cpu_kernels,
            device_kernels: self.device_kernels,
        }
    }
}

/// The default `attention_block_size` (see [`DEFAULT_ATTENTION_BLOCK_SIZE`]).
pub(crate) fn default_attention_block_size() -> usize {
    DEFAULT_ATTENTION_BLOCK_SIZE
}

/// Training and validation data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// CSV, JSONL or parquet files, concatenated.
    pub train: Vec<PathBuf>,
    /// Held-out files for greedy validation (empty: no validation).
    #[serde(default)]
    pub validation: Vec<PathBuf>,
    /// Validate on at most this many held-out questions.
    #[serde(default)]
    pub validation_limit: Option<usize>,
    /// `fail` (default) or `skip` malformed rows.
    #[serde(default = "default_on_bad_row")]
    pub on_bad_row: String,
}

fn default_on_bad_row() -> String {
    "fail".into()
}

/// Limits of one episode (the reference run's: 5 turns of at most 1,024 tokens).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EpisodeSection {
    /// Most agent turns (generation rounds) per episode, as the reference's `max_turns`: 5 fit
    /// 4 calls and an answer; a call in the last round is sent, then the episode ends.
    pub max_turns: usize,
    pub max_turn_tokens: usize,
    pub max_response_tokens: usize,
    /// Replies are cut to this many characters before the agent sees them.
    pub reply_chars: usize,
    /// Most environment calls in flight at once.
    pub env_concurrency: usize,
    /// A file replacing the reference system prompt of the agent.
    pub system_prompt: Option<PathBuf>,
    /// A file replacing the reference instruction after `Question: ...`.
    pub instruction: Option<PathBuf>,
}

impl Default for EpisodeSection {
    fn default() -> Self {
        Self {
            max_turns: 5,
            max_turn_tokens: 1024,
            max_response_tokens: 8192,
            reply_chars: 2048,
            env_concurrency: 32,
            system_prompt: None,
            instruction: None,
        }
    }
}

impl EpisodeSection {
    /// The `env` crate's episode settings (reads the prompt files, if any).
    pub fn episode_config(&self) -> Result<env::EpisodeConfig, TrainError> {
        let mut config = env::EpisodeConfig::training();
        config.prompts = env::PromptTexts::load(self.system_prompt.as_deref(), self.instruction.as_deref())
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
        config.max_turns = self.max_turns;
        config.max_turn_tokens = self.max_turn_tokens;
        config.max_response_tokens = self.max_response_tokens;
        config.reply.max_chars = self.reply_chars;
        config.env_concurrency = self.env_concurrency.max(1);
        Ok(config)
    }
}

/// How episodes are sampled each step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// Questions per step.
    pub batch_size: usize,
    /// Episodes per question (the GRPO group).
    pub n: usize,
    /// Most episodes in flight at once (begun and not ended, each holding its KV cache); when
    /// the next ones begin is `admission`.
    pub generation_batch: usize,
    /// When a step's episodes begin: `batches` (the default: `generation_batch` at a time, the
    /// next batch once all of one have ended) or `continuous` (the next episode as soon as one
    /// ends, so a long episode does not keep the places of finished ones empty). Either way at
    /// most `generation_batch` episodes hold KV blocks, so the cache stays within
    /// `generation_batch` × context (the plan's KV term).
    pub admission: Admission,
    /// Most episodes decoding at once (vLLM's `max_num_seqs`): the others in flight wait and
    /// join as rows come free. The KV memory still follows `generation_batch`: episodes
    /// waiting on the environment keep their caches. Unset: `generation_batch`.
    pub max_num_seqs: Option<usize>,
    /// Most tokens one decoder step runs, the decoding episodes' one each first (vLLM's
    /// `max_num_batched_tokens`): longer prefills run in chunks over the next steps while the
    /// others decode, which bounds the rollouts' activation memory. At least `max_num_seqs`.
    pub max_num_batched_tokens: usize,
    /// Most memory the rollouts' KV cache holds (e.g. "24GiB"): its paged pool, the blocks of
    /// episodes waiting on the environment and free blocks included; episodes wait to join, and the newest are
    /// preempted (and prefilled again later), rather than go past it. It must hold one episode
    /// at the full context. `"auto"`: the most the device leaves the cache, worked out from its
    /// memory and the run's plan when `prompt-r1 train` starts (`trainer::plan::auto_kv_budget`,
    /// as vLLM's `gpu_memory_utilization`); no limit where every episode fits. Unset: no limit.
    pub kv_budget: Option<String>,
    /// Episodes whose contexts begin alike share the KV blocks of their common prefix, computed
    /// and held once (vLLM's automatic prefix caching; the default): the system prompt and, for
    /// a GRPO group's `n` episodes, the whole first prompt. Each episode's tokens and log-probs
    /// are as without it, up to the last bits of the floating-point sums (a prefix's keys and
    /// values come from another episode's pass). `false`: each episode prefills its own.
    pub share_prefixes: bool,
    /// With LoRA, the local engine's rollouts (and validation) sample from a copy of the base
    /// with the adapters merged into its weights (PEFT's `merge_and_unload`: in f32, rounded once
    /// to the base's dtype, then to `dtype`'s; the default): each adapted projection is then one
    /// product instead of three and an addition, a third of a decoding step's GPU kernels. On a
    /// bf16 base an adapter's change smaller than half a bf16 step of a weight rounds away in
    /// the merged copy, as in any merge into bf16 (vLLM's or PEFT's). The update and the old
    /// log-probs keep the adapters apart; the copy holds the adapted weights once more while
    /// the rollouts run. `false`: the rollouts run the adapters beside the base. Not for
    /// `engine = "servers"` (the workers run the adapters beside their base).
    pub merge_lora: bool,
    /// Continuous batching (the default): an episode whose turn ends sends its environment call
    /// at once and rejoins the batch with the reply while the others keep decoding. The rows
    /// that decode side by side then depend on the environment's timing, which moves the last
    /// bits of their logits, so a sampled token near a tie can differ from run to run.
    /// `false`: turn by turn over the episodes in flight (every episode's turn, then all their
    /// calls, waiting for the slowest): the same seed gives the same episodes bit for bit on one
    /// host, whatever the environment's timing. Local engine only.
    pub continuous_batching: bool,
    /// Sampling of the agent during rollouts (validation is greedy); `seed` is the base of
    /// every episode's and turn's stream.
    pub sampling: Sampling,
    /// `grpo` (normalised by the group's std) or `dr-grpo` (mean-only).
    pub advantage: AdvantageMode,
    /// Weights of the inference-only models: the copy of the policy that rollouts and
    /// validation sample from, and the frozen reference. The update and the old log-probs always
    /// use the f32 policy.
    pub dtype: InferenceDtype,
    /// DAPO-style dynamic sampling: leave out of the update the groups whose rewards are all
    /// equal (their advantages are 0). They are counted in `metrics.jsonl` either way
    /// (`batch/groups_no_signal`, `batch/groups_dropped`). Off by default, as the reference.
    pub dynamic_sampling: bool,
    /// What generates the episodes: `local` (the default: the trainer's own model on its own
    /// device) or `servers` (the rollout workers of `[rollout.servers]`, given token-id
    /// prompts; the policy is pushed to them after every optimiser step).
    pub engine: RolloutEngineKind,
    /// The rollout workers of `engine = "servers"` (see [`ServerSettings`]).
    pub servers: Option<ServerSettings>,
}

/// When a step's episodes begin (see [`RolloutSection::admission`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Admission {
    /// `generation_batch` at a time.
    #[default]
    Batches,
    /// The next as soon as one ends, at most `generation_batch` in flight.
    Continuous,
}

impl RolloutSection {
    /// The episode loop's admission of these settings.
    pub fn admission(&self) -> env::Admission {
        match self.admission {
            Admission::Batches => env::Admission::Batches(self.generation_batch.max(1)),
            Admission::Continuous => env::Admission::Continuous(self.generation_batch.max(1)),
        }
    }
}

/// Which engine generates the rollouts (see [`RolloutSection::engine`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutEngineKind {
    /// The trainer's model, decoding on the trainer's device.
    #[default]
    Local,
    /// OpenAI-compatible rollout workers (`prompt-r1 serve`, vLLM).
    Servers,
}

/// The weight precision of the inference-only models (see [`RolloutSection::dtype`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InferenceDtype {
    /// The policy itself, and the reference in f32.
    #[default]
    F32,
    /// A bf16 copy of the policy, made at the start of each step, and the reference loaded in
    /// bf16: half the memory, and faster decoding on GPUs and on CPUs with AVX-512 BF16.
    Bf16,
}

impl RolloutSection {
    /// The limits of the rollouts' decoder for `model` with a KV cache of `cache_dtype`: rows
    /// at once (`max_num_seqs`, else `generation_batch`), prefill positions per pass, and
    /// `kv_budget` in KV positions (bytes / (2 · layers · kv_heads · head_dim · dtype size),
    /// rounded down). An error names the key.
    pub fn decoder_limits(&self, model: &Qwen3Config, cache_dtype: DType) -> Result<DecoderLimits, TrainError> {
        self.validate_limits()?;
        let kv_budget = match &self.kv_budget {
            None => None,
            Some(_) if self.kv_budget_is_auto() => {
                return Err(TrainError::Invalid(format!(
                    "rollout.kv_budget = \"{}\" is worked out from the device's memory when `prompt-r1 train` starts \
                     (`trainer::plan::auto_kv_budget`); set a size such as \"24GiB\" here",
                    crate::plan::AUTO_KV_BUDGET
                )));
            }
            Some(size) => {
                let bytes = crate::plan::parse_size(size).map_err(|e| TrainError::Invalid(format!("rollout.kv_budget: {e}")))?;
                let per_position = crate::plan::kv_position_bytes(model, cache_dtype).max(1);
                let positions = bytes / per_position;
                if positions == 0 {
                    return Err(TrainError::Invalid(format!(
                        "rollout.kv_budget: \"{size}\" holds no KV position of this model ({per_position} bytes each)"
                    )));
                }
                Some(usize::try_from(positions).unwrap_or(usize::MAX))
            }
        };
        Ok(DecoderLimits {
            max_rows: self.max_num_seqs.unwrap_or(self.generation_batch),
            max_batched_tokens: self.max_num_batched_tokens,
            kv_budget,
            share_prefixes: self.share_prefixes,
            ..DecoderLimits::default()
        })
    }

    /// Whether `kv_budget` is `"auto"`, to be settled against the device
    /// ([`crate::plan::auto_kv_budget`]).
    pub fn kv_budget_is_auto(&self) -> bool {
        self.kv_budget.as_deref().is_some_and(|size| size.trim().eq_ignore_ascii_case(crate::plan::AUTO_KV_BUDGET))
    }

    /// Checks `engine` against `[rollout.servers]`; the message names the key.
    fn validate_engine(&self) -> Result<(), model::SettingError> {
        match (self.engine, &self.servers) {
            (RolloutEngineKind::Servers, None) => Err(
                "rollout.engine = \"servers\" needs a [rollout.servers] table with `urls`".into(),
            ),
            (_, Some(servers)) => servers.validate(),
            (RolloutEngineKind::Local, None) => Ok(()),
        }
    }

    /// Checks `max_num_seqs`, `max_num_batched_tokens` and `kv_budget`; the message names the key.
    fn validate_limits(&self) -> Result<(), model::SettingError> {
        if self.max_num_seqs == Some(0) {
            return Err("rollout.max_num_seqs must be at least 1".into());
        }
        if self.max_num_batched_tokens == 0 {
            return Err("rollout.max_num_batched_tokens must be at least 1".into());
        }
        if let Some(rows) = self.max_num_seqs.filter(|&rows| rows > self.max_num_batched_tokens) {
            // As vLLM: a decoding step runs a token a row, all within the step's tokens.
            return Err(format!(
                "rollout.max_num_batched_tokens ({}) must be at least rollout.max_num_seqs ({rows}): each decoding \
                 episode runs a token a step",
                self.max_num_batched_tokens
            ).into());
        }
        if let Some(size) = self.kv_budget.as_deref().filter(|_| !self.kv_budget_is_auto()) {
            crate::plan::parse_size(size).map_err(|e| format!("rollout.kv_budget: {e} or \"{}\"", crate::plan::AUTO_KV_BUDGET))?;
        }
        Ok(())
    }
}

impl InferenceDtype {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            InferenceDtype::F32 => DType::F32,
            InferenceDtype::Bf16 => DType::BF16,
        }
    }
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            batch_size: 128,
            n: 5,
            generation_batch: 64,
            admission: Admission::Batches,
            max_num_seqs: None,
            max_num_batched_tokens: crate::plan::DEFAULT_MAX_NUM_BATCHED_TOKENS,
            kv_budget: None,
            share_prefixes: true,
            merge_lora: true,
            continuous_batching: true,
            sampling: Sampling::default(),
            advantage: AdvantageMode::Grpo,
            dtype: InferenceDtype::F32,
            dynamic_sampling: false,
            engine: RolloutEngineKind::Local,
            servers: None,
        }
    }
}

/// Length, seed, outputs and cadence of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Where checkpoints, `metrics.jsonl` and plots go.
    pub out_dir: PathBuf,
    /// Total GRPO steps.
    pub steps: u64,
    /// Checkpoint every this many steps (and at the end).
    pub save_every: u64,
    /// Greedy validation every this many steps (0: never).
    pub validate_every: u64,
    /// Greedy validation before the first step too, as the reference (`val_before_train`);
    /// its results are the `step` 0 line of `metrics.jsonl`.
    pub validate_before_train: bool,
    /// Seed of the data order (the agent samples from `rollout.sampling.seed`).
    pub seed: u64,
    /// Keep at most this many checkpoints (oldest removed first; 0 keeps all).
    pub keep_checkpoints: usize,
    /// The memory of the device the run trains on (e.g. "80GiB"), for the memory plan that
    /// `train` checks at start; unset: the GPU's total where it can be read, else the RAM.
    pub device_memory: Option<String>,
}

impl Default for RunSection {
    fn default() -> Self {
        Self {
            out_dir: PathBuf::from("runs/train"),
            steps: 100,
            save_every: 10,
            validate_every: 10,
            validate_before_train: true,
            seed: 0,
            keep_checkpoints: 3,
            device_memory: None,
        }
    }
}

/// Reads the TOML configuration `path`; `prepare` resolves its relative paths against the
/// file's folder and validates it. Every error names the file.
pub(crate) fn read_toml_config<T: serde::de::DeserializeOwned>(
    path: &Path,
    prepare: impl FnOnce(&mut T, &Path) -> Result<(), model::SettingError>,
) -> Result<T, TrainError> {
    let config_error = |reason: String| TrainError::Config { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
    let mut config: T = toml::from_str(&text).map_err(|e| config_error(e.to_string()))?;
    // Absolute, so that the same file named as `run.toml` or `./run.toml`, or from another
    // folder, gives the same settings (a resume compares them).
    let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let base = std::path::absolute(folder).unwrap_or_else(|_| folder.to_path_buf());
    prepare(&mut config, &base).map_err(|e| config_error(e.0))?;
    Ok(config)
}

impl TrainConfig {
    /// Reads a TOML file; relative paths inside are taken relative to the file's folder.
    pub fn from_toml_file(path: &Path) -> Result<Self, TrainError> {
        read_toml_config(path, |config: &mut Self, base| {
            config.resolve_paths(base);
            config.validate()
        })
    }

    /// Makes relative paths absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.model);
        self.data.train.iter_mut().for_each(fix);
        self.data.validation.iter_mut().for_each(fix);
        fix(&mut self.run.out_dir);
        if let Some(p) = self.episode.system_prompt.as_mut() {
            fix(p);
        }
        if let Some(p) = self.episode.instruction.as_mut() {
            fix(p);
        }
        if let Some(p) = self.rollout.servers.as_mut().and_then(|s| s.policy_dir.as_mut()) {
            fix(p);
        }
    }

    /// Checks the settings that a run relies on; the message names the key.
    pub fn validate(&self) -> Result<(), model::SettingError> {
        if self.data.train.is_empty() {
            return Err("data.train names no file".into());
        }
        if self.rollout.batch_size == 0 || self.rollout.n == 0 || self.rollout.generation_batch == 0 {
            return Err("rollout.batch_size, rollout.n and rollout.generation_batch must be at least 1".into());
        }
        self.rollout.validate_limits()?;
        self.rollout.validate_engine()?;
        self.compute().validate()?;
        if self.run.save_every == 0 || self.run.steps == 0 {
            return Err("run.steps and run.save_every must be at least 1".into());
        }
        if self.data.validation_limit == Some(0) {
            return Err("data.validation_limit = 0 would validate on nothing: leave data.validation empty to validate never".into());
        }
        if !matches!(self.data.on_bad_row.as_str(), "fail" | "skip") {
            return Err(format!("data.on_bad_row must be \"fail\" or \"skip\", not \"{}\"", self.data.on_bad_row).into());
        }
        let episode = &self.episode;
        for (key, value) in [
            ("max_turns", episode.max_turns),
            ("max_turn_tokens", episode.max_turn_tokens),
            ("max_response_tokens", episode.max_response_tokens),
            ("reply_chars", episode.reply_chars),
            ("env_concurrency", episode.env_concurrency),
        ] {
            if value == 0 {
                return Err(format!("episode.{key} must be at least 1").into());
            }
        }
        self.reward.validate().map_err(|e| format!("[reward] {e}"))?;
        self.rollout.sampling.validate().map_err(|e| format!("rollout.sampling: {e}"))?;
        self.environment.validate_limits().map_err(|e| match e {
            env::EnvError::Config(message) => format!("[environment] {message}"),
            other => format!("[environment] {other}"),
        })?;
        self.grpo.validate().map_err(|e| format!("grpo: {e}"))?;
        match &self.lora {
            Some(lora) if lora.dropout > 0.0 && self.grpo.activation_checkpointing => {
                return Err(crate::grpo::checkpointing::DROPOUT.into())
            }
            Some(lora) => lora.validate()?,
            None if self.model_dtype != ModelDtype::F32 => {
                return Err(
                    "model_dtype = \"bf16\" needs a [lora] section: full fine-tuning keeps f32 weights".into()
                )
            }
            None => {}
        }
        if let Some(size) = &self.run.device_memory {
            crate::plan::parse_device_memory(size).map_err(|e| format!("run.device_memory: {e}"))?;
        }
        Ok(())
    }

    /// The `--on-bad-row` policy of the data files.
    pub fn on_bad_row(&self) -> data::OnBadRow {
        if self.data.on_bad_row == "skip" {
            data::OnBadRow::Skip
        } else {
            data::OnBadRow::Fail
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::MatmulPrecision;

    #[test]
    fn defaults_are_the_reference_run() {
        let config: TrainConfig = toml::from_str("model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n").unwrap();
        assert_eq!(config.rollout.n, 5);
        assert_eq!(config.rollout.sampling.temperature, 1.0);
        assert_eq!(config.episode.max_turns, 5);
        assert_eq!(config.episode.max_turn_tokens, 1024);
        assert_eq!(config.grpo.loss.clip_low, 0.2);
        assert_eq!(config.grpo.loss.dual_clip, 3.0);
        assert_eq!(config.grpo.loss.kl_coef, 0.001);
        assert_eq!(config.grpo.optimizer.lr, 1e-6);
        assert_eq!(config.grpo.optimizer.eps, 1e-8);
        assert_eq!(config.grpo.optimizer.weight_decay, 0.01);
        assert_eq!(config.grpo.optimizer.grad_clip, 1.0);
        assert_eq!(config.compute(), Compute::default());
        assert!(config.validate().is_ok());
    }

    /// The attention keys: the implementation by name, the block size checked.
    #[test]
    fn attention_keys_reach_the_compute_value() {
        let base = "model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n";
        let config: TrainConfig =
            toml::from_str(&format!("attn_implementation = \"eager\"\nattention_block_size = 128\n{base}")).unwrap();
        let compute = config.compute();
        assert_eq!((compute.attn_implementation, compute.attention_block_size), (AttnImplementation::Eager, 128));
        let zero: TrainConfig = toml::from_str(&format!("attention_block_size = 0\n{base}")).unwrap();
        assert!(zero.validate().unwrap_err().0.contains("attention_block_size"));
        let err = toml::from_str::<TrainConfig>(&format!("attn_implementation = \"flash\"\n{base}")).unwrap_err().to_string();
        assert!(err.contains("flash") && err.contains("memory_efficient"), "{err}");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n[rollout]\nn_samples = 3\n").unwrap();
        let err = TrainConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains("n_samples"), "{err}");
        std::fs::write(&path, "model = \"m\"\n[data]\ntrain = []\n").unwrap();
        let err = TrainConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(err.contains("data.train"), "{err}");
        std::fs::write(&path, "model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n[rollout.sampling]\ntop_p = 1.5\n").unwrap();
        let err = TrainConfig::from_toml_file(&path).unwrap_err().to_string();
        assert!(err.contains("rollout.sampling") && err.contains("top_p"), "{err}");
    }

    /// Episode limits of 0 and reward settings `reward --config` refuses are refused here too.
    #[test]
    fn episode_limits_and_reward_settings_are_checked() {
        let parse = |section: &str| {
            toml::from_str::<TrainConfig>(&format!("model = \"m\"\n[data]\ntrain = [\"t\"]\n{section}\n")).unwrap().validate()
        };
        for key in ["max_turns", "max_turn_tokens", "max_response_tokens", "reply_chars", "env_concurrency"] {
            let err = parse(&format!("[episode]\n{key} = 0")).unwrap_err();
            assert!(err.0.contains(&format!("episode.{key}")), "{err}");
        }
        let err = parse("[run]\nsteps = 0").unwrap_err();
        assert!(err.0.contains("run.steps"), "{err}");
        let limit = toml::from_str::<TrainConfig>("model = \"m\"\n[data]\ntrain = [\"t\"]\nvalidation_limit = 0\n").unwrap();
        let err = limit.validate().unwrap_err();
        assert!(err.0.contains("data.validation_limit = 0"), "{err}");
        let err = parse("[environment.sampling]\ntemperature = -3.0").unwrap_err();
        assert!(err.0.starts_with("[environment] sampling: temperature -3"), "{err}");
        let err = parse("[environment]\nread_timeout_secs = 0.0").unwrap_err();
        assert!(err.0.starts_with("[environment] read timeout of 0 s"), "{err}");
        let err = parse("[reward]\ngate = 5.0").unwrap_err();
        assert!(err.0.starts_with("[reward] reward config") && err.0.contains("gate"), "{err}");
        assert!(parse("[episode]\nmax_turns = 1").is_ok());
    }

    #[test]
    fn rollout_dtype_is_f32_or_bf16() {
        let parse = |dtype: &str| {
            toml::from_str::<TrainConfig>(&format!("model = \"m\"\n[data]\ntrain = [\"t\"]\n[rollout]\ndtype = \"{dtype}\"\n"))
        };
        assert_eq!(parse("bf16").unwrap().rollout.dtype, InferenceDtype::Bf16);
        assert_eq!(parse("f32").unwrap().rollout.dtype.dtype(), DType::F32);
        let err = parse("fp16").unwrap_err().to_string();
        assert!(err.contains("fp16") && err.contains("bf16"), "{err}");
    }

    #[test]
    fn grpo_matmul_is_f32_or_bf16() {
        let parse = |matmul: &str| {
            toml::from_str::<TrainConfig>(&format!("model = \"m\"\n[data]\ntrain = [\"t\"]\n[grpo]\nmatmul = \"{matmul}\"\n"))
        };
        assert_eq!(parse("bf16").unwrap().grpo.matmul, MatmulPrecision::Bf16);
        assert_eq!(parse("f32").unwrap().grpo.matmul, MatmulPrecision::F32);
        let err = parse("tf32").unwrap_err().to_string();
        assert!(err.contains("tf32") && err.contains("bf16"), "{err}");
    }

    #[test]
    fn workers_beside_the_local_engine_are_noted() {
        let servers = "[rollout.servers]\nurls = [\"http://127.0.0.1:8000\"]\n";
        let local = parse_rollout(&format!("generation_batch = 8\n{servers}"));
        let notes = local.unused_settings();
        assert!(notes.len() == 1 && notes[0].contains("rollout.engine = \"servers\""), "{notes:?}");
        let on_servers = parse_rollout(&format!("engine = \"servers\"\n{servers}"));
        assert!(on_servers.unused_settings().is_empty());
        assert!(parse_rollout("generation_batch = 8").unused_settings().is_empty());
    }

    #[test]
    fn device_memory_is_a_size() {
        let parse = |size: &str| {
            let text = format!("model = \"m\"\n[data]\ntrain = [\"t\"]\n[run]\ndevice_memory = \"{size}\"\n");
            toml::from_str::<TrainConfig>(&text).unwrap()
        };
        assert_eq!(parse("80GiB").run.device_memory.as_deref(), Some("80GiB"));
        assert!(parse("80GiB").validate().is_ok());
        let err = parse("eighty").validate().unwrap_err();
        assert!(err.0.contains("run.device_memory") && err.0.contains("eighty"), "{err}");
        let err = parse("80").validate().unwrap_err();
        assert!(err.0.contains("run.device_memory") && err.0.contains("80 bytes"), "{err}");
    }

    fn parse_rollout(keys: &str) -> TrainConfig {
        toml::from_str(&format!("model = \"m\"\n[data]\ntrain = [\"t\"]\n[rollout]\n{keys}\n")).unwrap()
    }

    #[test]
    fn decoder_limits_default_to_the_generation_batch_and_no_budget() {
        let config = parse_rollout("generation_batch = 48");
        assert_eq!((config.rollout.max_num_seqs, config.rollout.max_num_batched_tokens), (None, 8192));
        assert_eq!(config.rollout.kv_budget, None);
        assert!(config.rollout.continuous_batching, "continuous batching is the default");
        assert_eq!(config.rollout.admission(), env::Admission::Batches(48), "episodes begin in batches by default");
        // The paged KV cache holds only the blocks of the episodes in flight: continuous
        // admission needs no budget.
        let continuous = parse_rollout("admission = \"continuous\"");
        assert_eq!(continuous.rollout.admission(), env::Admission::Continuous(64));
        assert_eq!(continuous.validate(), Ok(()));
        let servers = parse_rollout("admission = \"continuous\"\nengine = \"servers\"\n[rollout.servers]\nurls = [\"http://localhost:8000\"]");
        assert_eq!(servers.validate(), Ok(()), "the workers hold their own caches");
        assert!(!parse_rollout("continuous_batching = false").rollout.continuous_batching);
        let limits = config.rollout.decoder_limits(&model::Preset::Qwen3_4B.config(1024, vec![]), DType::BF16).unwrap();
        assert_eq!(limits, DecoderLimits { max_rows: 48, max_batched_tokens: 8192, kv_budget: None, share_prefixes: true, ragged_passes: true });
        assert!(!parse_rollout("share_prefixes = false").rollout.decoder_limits(&model::Preset::Qwen3_4B.config(1024, vec![]), DType::BF16).unwrap().share_prefixes);
    }

    #[test]
    fn the_kv_budget_becomes_positions_of_the_models_cache() {
        let config = parse_rollout("max_num_seqs = 32\nmax_num_batched_tokens = 4096\nkv_budget = \"24GiB\"");
        assert!(config.validate().is_ok());
        // Qwen3-4B: 36 layers × (keys + values) × 8 kv heads × 128 = 73,728 values a position.
        let qwen3_4b = model::Preset::Qwen3_4B.config(1024, vec![]);
        let bf16 = config.rollout.decoder_limits(&qwen3_4b, DType::BF16).unwrap();
        assert_eq!(bf16.max_rows, 32);
        assert_eq!(bf16.max_batched_tokens, 4096);
        // 24 GiB / 147,456 bytes = 174,762.67: rounded down.
        assert_eq!(bf16.kv_budget, Some(174_762));
        let f32 = config.rollout.decoder_limits(&qwen3_4b, DType::F32).unwrap();
        assert_eq!(f32.kv_budget, Some(87_381));
        // Less than one position: no decoder can run within it.
        let tiny = parse_rollout("kv_budget = \"1KiB\"");
        let err = tiny.rollout.decoder_limits(&qwen3_4b, DType::BF16).unwrap_err().to_string();
        assert!(err.contains("rollout.kv_budget") && err.contains("147456"), "{err}");
        // "auto" is a valid value, worked out at start against the device: the decoder's limits
        // cannot be made from it before that, and say so.
        let auto = parse_rollout("kv_budget = \"auto\"");
        assert_eq!(auto.validate(), Ok(()));
        let err = auto.rollout.decoder_limits(&qwen3_4b, DType::BF16).unwrap_err().to_string();
        assert!(err.contains("rollout.kv_budget = \"auto\"") && err.contains("prompt-r1 train"), "{err}");
        // In any case, as `serve --kv-cache-memory` takes it.
        let upper = parse_rollout("kv_budget = \"AUTO\"");
        assert_eq!((upper.validate(), upper.rollout.kv_budget_is_auto()), (Ok(()), true));
    }

    #[test]
    fn zero_limits_and_bad_budgets_are_named() {
        for (keys, key) in [
            ("max_num_seqs = 0", "rollout.max_num_seqs"),
            ("max_num_batched_tokens = 0", "rollout.max_num_batched_tokens"),
            ("max_num_seqs = 64\nmax_num_batched_tokens = 32", "rollout.max_num_seqs (64)"),
            ("kv_budget = \"lots\"", "rollout.kv_budget"),
            ("kv_budget = \"0GiB\"", "rollout.kv_budget"),
        ] {
            let config = parse_rollout(keys);
            let err = config.validate().unwrap_err();
            assert!(err.0.contains(key), "{keys}: {err}");
            let model = model::Preset::Tiny.config(64, vec![]);
            let err = config.rollout.decoder_limits(&model, DType::F32).unwrap_err().to_string();
            assert!(err.contains(key), "{keys}: {err}");
        }
    }

    #[test]
    fn the_rollout_engine_is_local_or_servers() {
        let local = parse_rollout("");
        assert_eq!((local.rollout.engine, local.rollout.servers.as_ref()), (RolloutEngineKind::Local, None));
        let servers = parse_rollout(
            "engine = \"servers\"\n[rollout.servers]\nurls = [\"http://w1:8000/v1\", \"http://w2:8000\"]\nrequest_timeout_secs = 60\npolicy_dir = \"shared/policy\"",
        );
        assert!(servers.validate().is_ok());
        let table = servers.rollout.servers.as_ref().unwrap();
        assert_eq!(table.base_urls().unwrap(), ["http://w1:8000", "http://w2:8000"]);
        assert_eq!((table.request_timeout_secs, table.adapter_name.as_str(), table.model_name.as_deref()), (60, "policy", None));
        let mut resolved = servers.clone();
        resolved.resolve_paths(Path::new("/runs"));
        assert_eq!(resolved.rollout.servers.unwrap().policy_dir.unwrap(), Path::new("/runs/shared/policy"));
        // Errors name the key.
        let err = parse_rollout("engine = \"servers\"").validate().unwrap_err();
        assert!(err.0.contains("rollout.engine") && err.0.contains("[rollout.servers]"), "{err}");
        let err = parse_rollout("engine = \"servers\"\n[rollout.servers]\nurls = []").validate().unwrap_err();
        assert!(err.0.contains("rollout.servers.urls"), "{err}");
        let err = parse_rollout("engine = \"servers\"\n[rollout.servers]\nurls = [\"w1:8000\"]").validate().unwrap_err();
        assert!(err.0.contains("rollout.servers.urls") && err.0.contains("w1:8000"), "{err}");
        let bad = |keys: &str| toml::from_str::<TrainConfig>(&format!("model = \"m\"\n[data]\ntrain = [\"t\"]\n[rollout]\n{keys}\n")).unwrap_err().to_string();
        assert!(bad("engine = \"vllm\"").contains("vllm"));
        let err = bad("engine = \"servers\"\n[rollout.servers]\nurls = [\"http://a\"]\nurl = \"http://b\"");
        assert!(err.contains("url") && err.contains("urls"), "{err}");
    }

    #[test]
    fn lora_and_model_dtype() {
        let parse = |extra: &str| {
            toml::from_str::<TrainConfig>(&format!("model = \"m\"\n{extra}\n[data]\ntrain = [\"t\"]\n"))
        };
        let plain = parse("").unwrap();
        assert_eq!((plain.lora.as_ref(), plain.model_dtype), (None, ModelDtype::F32));
        let lora = parse("model_dtype = \"bf16\"\n[lora]\nrank = 16\ntarget_modules = [\"q_proj\", \"v_proj\"]").unwrap();
        let l = lora.lora.as_ref().unwrap();
        assert_eq!((l.rank, l.alpha, l.target_modules.len()), (16, 16.0, 2));
        assert_eq!(lora.model_dtype.dtype(), DType::BF16);
        assert!(lora.validate().is_ok());
        let err = parse("model_dtype = \"bf16\"").unwrap().validate().unwrap_err();
        assert!(err.0.contains("model_dtype") && err.0.contains("[lora]"), "{err}");
        let err = parse("[lora]\ndropout = 0.1\n[grpo]\nactivation_checkpointing = true").unwrap().validate().unwrap_err();
        assert!(err.0.contains("lora.dropout") && err.0.contains("activation_checkpointing"), "{err}");
        let err = parse("[lora]\nrank = 0").unwrap().validate().unwrap_err();
        assert!(err.0.contains("lora.rank"), "{err}");
        assert!(parse("[lora]\nranks = 4").unwrap_err().to_string().contains("ranks"));
        assert!(parse("model_dtype = \"f16\"").is_err());
    }

    #[test]
    fn relative_paths_follow_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, "model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n").unwrap();
        let config = TrainConfig::from_toml_file(&path).unwrap();
        assert_eq!(config.model, dir.path().join("m"));
        assert_eq!(config.data.train[0], dir.path().join("t.csv"));
    }
}

#[cfg(test)]
mod example_file {
    use super::*;

    /// The documented example configuration parses, and its values are the defaults.
    #[test]
    fn the_example_config_is_valid_and_holds_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/run.example.toml");
        let config = TrainConfig::from_toml_file(&path).unwrap();
        let defaults: TrainConfig = toml::from_str("model = \"m\"\n[data]\ntrain = [\"t\"]\n").unwrap();
        assert_eq!(config.episode, defaults.episode);
        assert_eq!(config.rollout, defaults.rollout);
        assert_eq!(config.reward, defaults.reward);
        assert_eq!(config.grpo, defaults.grpo);
        assert_eq!(config.environment.retry, defaults.environment.retry);
        assert_eq!(config.run.steps, defaults.run.steps);
        assert_eq!((config.attn_implementation, config.attention_block_size), (defaults.attn_implementation, defaults.attention_block_size));
    }

    /// The example shows every key a run's settings hold (the optional sections filled in), and
    /// every key it shows commented out exists.
    #[test]
    fn the_example_config_names_every_key() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/run.example.toml");
        let example = std::fs::read_to_string(&path).unwrap();
        let mut settings: TrainConfig = toml::from_str("model = \"m\"\n[data]\ntrain = [\"t\"]\n").unwrap();
        settings.lora = Some(model::LoraConfig::default());
        settings.rollout.servers = Some(crate::rollout::ServerSettings::default());
        let missing = super::example_keys::undocumented(&serde_json::to_value(&settings).unwrap(), &example);
        assert!(missing.is_empty(), "keys that {} does not show: {missing:?}", path.display());
        let all_set: TrainConfig = toml::from_str(&super::example_keys::uncommented(&example)).unwrap();
        assert!(all_set.lora.is_some() && all_set.rollout.servers.is_some() && all_set.environment.sampling.top_p.is_some());
    }
}

/// Checks that an example configuration file documents every key a configuration holds.
#[cfg(test)]
pub(crate) mod example_keys {
    use std::collections::BTreeSet;

    /// What a line of an example sets, whether set or commented out.
    enum Setting<'a> {
        /// A `[section]` header.
        Section(&'a str),
        /// A `key = ...` line.
        Key(&'a str),
    }

    /// The line's setting; `None` for prose.
    fn setting(line: &str) -> Option<Setting<'_>> {
        let line = line.trim_start().trim_start_matches('#').trim_start();
        let before_comment = line.split('#').next().unwrap_or("").trim();
        if let Some(section) = before_comment.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
            return Some(Setting::Section(section));
        }
        let (key, _) = line.split_once('=')?;
        let key = key.trim();
        let is_key = !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        is_key.then_some(Setting::Key(key))
    }

    /// The dotted paths (`rollout.sampling.top_k`) of every setting and section the example
    /// shows, set or commented out.
    fn documented(example: &str) -> BTreeSet<String> {
        let mut paths = BTreeSet::new();
        let mut section = String::new();
        for line in example.lines() {
            match setting(line) {
                Some(Setting::Section(name)) => {
                    section = name.to_string();
                    paths.insert(section.clone());
                }
                Some(Setting::Key(key)) if section.is_empty() => {
                    paths.insert(key.to_string());
                }
                Some(Setting::Key(key)) => {
                    paths.insert(format!("{section}.{key}"));
                }
                None => {}
            }
        }
        paths
    }

    /// The paths of the keys in `settings` (a configuration as serialised) that the example does
    /// not show.
    pub(crate) fn undocumented(settings: &serde_json::Value, example: &str) -> Vec<String> {
        fn walk(value: &serde_json::Value, prefix: &str, documented: &BTreeSet<String>, missing: &mut Vec<String>) {
            let serde_json::Value::Object(map) = value else { return };
            for (key, value) in map {
                let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                if !documented.contains(&path) {
                    missing.push(path.clone());
                }
                walk(value, &path, documented, missing);
            }
        }
        let mut missing = Vec::new();
        walk(settings, "", &documented(example), &mut missing);
        missing
    }

    /// The example with every commented-out setting and section set, so that parsing it checks
    /// that the keys it only mentions exist too.
    pub(crate) fn uncommented(example: &str) -> String {
        example
            .lines()
            .map(|line| match (line.trim_start().starts_with('#'), setting(line)) {
                (true, Some(_)) => line.trim_start().trim_start_matches('#').trim_start(),
                _ => line,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn sections_keys_and_prose_are_told_apart() {
        let example = "model = \"m\"\n# A comment, with = in it.\n[data]\n# [lora]   # off\n# rank = 8   # r\n[rollout.sampling]\ntop_k = 5\n";
        let paths: Vec<_> = documented(example).into_iter().collect();
        assert_eq!(paths, ["data", "lora", "lora.rank", "model", "rollout.sampling", "rollout.sampling.top_k"]);
        let settings = serde_json::json!({"model": "m", "lora": {"rank": 8, "alpha": 16.0}, "data": {}});
        assert_eq!(undocumented(&settings, example), ["lora.alpha"]);
        assert_eq!(uncommented("# [lora]   # off\n# A comment.\n  # rank = 8"), "[lora]   # off\n# A comment.\nrank = 8");
    }
}

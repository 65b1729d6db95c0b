//! Opening a model directory for the commands: weights, and the tokenizer when there is one.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::tensor::{backend::Backend, DType};
use model::chat_template::{ChatTemplate, ChatTemplateError};
use model::checkpoint::StorageDtype;
use model::tokenizer::Qwen3Tokenizer;
use model::lora::{base_model_dir, is_adapter_dir, load_adapter, merge_adapters, read_adapter_config};
use model::{load_pretrained, LoadOptions, LoraAdapters, LoraModel, MatmulPrecision, Preset, Qwen3ForCausalLM};

/// A loaded checkpoint, its optional tokenizer and optional LoRA adapters.
pub struct LoadedModel<B: Backend> {
    pub model: Qwen3ForCausalLM<B>,
    pub tokenizer: Option<Qwen3Tokenizer>,
    pub adapters: Option<LoraAdapters<B>>,
}

impl<B: Backend> LoadedModel<B> {
    /// Loads `dir` (config.json + safetensors; tokenizer.json if present) onto `device`.
    pub fn open(dir: &Path, device: &B::Device, options: LoadOptions) -> Result<Self> {
        let model = load_pretrained::<B>(dir, device, options)
            .with_context(|| format!("loading the model in {}", dir.display()))?
            .for_inference();
        let tokenizer = if dir.join("tokenizer.json").is_file() {
            let tokenizer = Qwen3Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
            tokenizer.check_fits_vocabulary(dir, model.config.vocab_size)?;
            Some(tokenizer)
        } else {
            None
        };
        Ok(Self { model, tokenizer, adapters: None })
    }

    /// [`Self::open`], then the PEFT adapter directory `adapter` (if given) onto the model.
    pub fn open_with_adapter(dir: &Path, adapter: Option<&Path>, device: &B::Device, options: LoadOptions) -> Result<Self> {
        let mut loaded = Self::open(dir, device, options)?;
        if let Some(adapter) = adapter {
            let (adapters, _) = load_adapter::<B>(adapter, &loaded.model.config, device)
                .with_context(|| format!("loading the LoRA adapter in {}", adapter.display()))?;
            loaded.adapters = Some(adapters);
        }
        Ok(loaded)
    }

    /// The model with its adapters, as scoring and generation take it.
    pub fn policy(&self) -> LoraModel<'_, B> {
        LoraModel::new(&self.model, self.adapters.as_ref())
    }

    /// The tokenizer, or an error saying the directory has none. `what` is a command, or a text
    /// flag such as `--prompt`, whose `-ids` form the error then suggests instead.
    pub fn require_tokenizer(&self, dir: &Path, what: &str) -> Result<&Qwen3Tokenizer> {
        self.tokenizer.as_ref().with_context(|| missing_tokenizer(dir, what))
    }

    /// Token ids that end a sequence: the config's EOS ids plus `<|im_end|>` when known.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids = self.model.config.eos_token_ids.clone();
        if let Some(t) = &self.tokenizer {
            ids.push(t.special().im_end);
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The id used to pad batches.
    pub fn pad_id(&self) -> u32 {
        let config = &self.model.config;
        config
            .pad_token_id
            .or(config.eos_token_ids.first().copied())
            .unwrap_or(0)
    }
}

/// What an agent directory names: the model to load and the LoRA adapters to merge into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentDir {
    /// The model directory (an adapter's base model).
    pub model: PathBuf,
    /// The PEFT adapter directory, if the agent is LoRA adapters.
    pub adapter: Option<PathBuf>,
}

/// Resolves `dir` as an agent: a model directory, a PEFT adapter directory (`export` of a LoRA
/// run; its base from `adapter_config.json`, refused if it is not the base the adapters were
/// trained on), or a training run's directory (its newest checkpoint, either of those).
pub fn resolve_agent(dir: &Path) -> Result<AgentDir> {
    let dir = checkpoint_dir(dir)?;
    if !is_adapter_dir(&dir) {
        return Ok(AgentDir { model: dir, adapter: None });
    }
    let config = read_adapter_config(&dir)?;
    let base = base_model_dir(&dir, &config).with_context(|| {
        format!(
            "{} holds LoRA adapters whose base model ({}) is not a local model directory: merge them with `prompt-r1 export --merge --base DIR`",
            dir.display(),
            config.base_model_name_or_path.as_deref().unwrap_or("not recorded")
        )
    })?;
    check_trained_base(&dir, &base, "point base_model_name_or_path in its adapter_config.json at that model")?;
    Ok(AgentDir { model: base, adapter: Some(dir) })
}

/// A checkpoint directory as given (a model or a LoRA adapter), or the newest checkpoint of a
/// run directory. A write of the directory killed between its renames is finished first
/// ([`model::publish`]), so that it is taken for the model it was becoming.
pub fn checkpoint_dir(path: &Path) -> Result<PathBuf> {
    if !path.exists() {
        bail!("{} does not exist: name a checkpoint or a run directory", path.display());
    }
    model::publish::finish_interrupted(path)?;
    if path.join("config.json").is_file() || is_adapter_dir(path) {
        return Ok(path.to_path_buf());
    }
    match trainer::run::latest_checkpoint(path)? {
        Some(dir) => Ok(dir),
        None => bail!(
            "{} is neither a checkpoint (no config.json or adapter_config.json) nor a run with checkpoints",
            path.display()
        ),
    }
}

/// Loads the agent `dir` names ([`resolve_agent`]) onto `device`, LoRA adapters merged into
/// their base: the model an agent samples from, with its tokenizer (the adapter's own, else the
/// base's).
pub fn load_agent<B: Backend>(dir: &Path, device: &B::Device, options: LoadOptions) -> Result<LoadedModel<B>> {
    let agent = resolve_agent(dir)?;
    let mut loaded = LoadedModel::open_with_adapter(&agent.model, agent.adapter.as_deref(), device, options)?;
    if let Some(adapters) = loaded.adapters.take() {
        loaded.model = merge_adapters(loaded.model, &adapters);
    }
    if let Some(adapter) = agent.adapter.as_deref().filter(|a| a.join("tokenizer.json").is_file()) {
        let tokenizer = Qwen3Tokenizer::from_dir(adapter).with_context(|| format!("loading the tokenizer in {}", adapter.display()))?;
        tokenizer.check_fits_vocabulary(adapter, loaded.model.config.vocab_size)?;
        loaded.tokenizer = Some(tokenizer);
    }
    Ok(loaded)
}

/// Refuses `base` for the adapters of checkpoint `source` when the checkpoint records another
/// base model (config or weights that differ): the adapters would be merged into, or exported
/// for, weights they were not trained on. `how` says how to name another base (a flag, a key).
pub fn check_trained_base(source: &Path, base: &Path, how: &str) -> Result<()> {
    let Some(recorded) = trainer::run::recorded_base_model(source)? else {
        return Ok(());
    };
    let Some(now) = trainer::run::BaseModel::of(base) else {
        return Ok(());
    };
    if now.fingerprint == recorded.fingerprint {
        return Ok(());
    }
    if now.path == recorded.path {
        bail!(
            "{} changed since {} was trained on it (its config.json or weights differ from those recorded): the adapters would go onto other weights",
            base.display(),
            source.display()
        );
    }
    bail!(
        "{} is not the base model {} was trained on ({}; the config.json or weights differ): {how}",
        base.display(),
        source.display(),
        recorded.path
    );
}

/// Token ids given on the command line as `1,2,3` (one flag value, not repeated flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenIds(pub Vec<u32>);

impl std::str::FromStr for TokenIds {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_ids(s).map(TokenIds)
    }
}

/// Parses `1,2,3` (spaces allowed) into token ids; an empty place between commas (`1,,2`) is
/// an error, not skipped.
pub fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    if text.trim().is_empty() {
        return Err("no token ids given".into());
    }
    let ids: Result<Vec<u32>, _> = text
        .split(',')
        .map(str::trim)
        .map(|s| match s {
            "" => Err(format!("\"{text}\" has an empty place between commas")),
            s => s.parse::<u32>().map_err(|_| format!("\"{s}\" is not a token id")),
        })
        .collect();
    let ids = ids?;
    if ids.is_empty() {
        return Err("no token ids given".into());
    }
    Ok(ids)
}

/// The dtype of weights written to a file (`init-model --dtype`, `export --dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FileDtype {
    #[value(alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
}

impl std::fmt::Display for FileDtype {
    /// As the flag takes it: `f32`, `bf16`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileDtype::F32 => "f32",
            FileDtype::Bf16 => "bf16",
        })
    }
}

impl From<FileDtype> for StorageDtype {
    fn from(dtype: FileDtype) -> Self {
        match dtype {
            FileDtype::F32 => StorageDtype::F32,
            FileDtype::Bf16 => StorageDtype::BF16,
        }
    }
}

/// The `--preset` flag: one of the names in [`Preset::ALL`], listed by `--help` and in errors.
pub fn preset_parser() -> impl clap::builder::TypedValueParser<Value = Preset> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Preset::ALL.map(|(name, _)| name))
        .map(|name| Preset::from_name(&name).expect("the parser admits only listed names"))
}

/// Parses the `--dtype` flag of the model commands.
pub fn parse_dtype(text: &str) -> Result<DType, String> {
    match text {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(format!("unknown dtype \"{other}\": use f32 or bf16")),
    }
}

/// Parses the `--matmul` flag (the precision of f32 matrix products).
pub fn parse_matmul(text: &str) -> Result<MatmulPrecision, String> {
    match text {
        "f32" => Ok(MatmulPrecision::F32),
        "bf16" => Ok(MatmulPrecision::Bf16),
        other => Err(format!("unknown matmul precision \"{other}\": use f32 or bf16")),
    }
}

/// The error for a directory without `tokenizer.json`: a text flag is told its token-id form,
/// a command (serve, the agent) that it needs the model's tokenizer file.
fn missing_tokenizer(dir: &Path, what: &str) -> String {
    let dir = dir.display();
    if what.starts_with("--") {
        format!("{what} needs a tokenizer, but {dir} has no tokenizer.json; give token ids with {what}-ids instead")
    } else {
        format!("{what} needs a tokenizer, but {dir} has no tokenizer.json; copy the model's tokenizer.json (and tokenizer_config.json) into {dir}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_id_lists() {
        assert_eq!(parse_ids("1, 2,3"), Ok(vec![1, 2, 3]));
        assert!(parse_ids("1,x").unwrap_err().contains("\"x\""));
        assert!(parse_ids(" ").is_err());
        assert!(parse_ids("1,,2").unwrap_err().contains("empty place"));
        assert!(parse_ids("1,2,").unwrap_err().contains("empty place"));
    }

    #[test]
    fn a_missing_tokenizer_suggests_what_works() {
        let dir = Path::new("m");
        let flag = missing_tokenizer(dir, "--prompt");
        assert!(flag.contains("--prompt-ids instead"), "{flag}");
        let command = missing_tokenizer(dir, "serve");
        assert!(
            command.contains("copy the model's tokenizer.json") && !command.contains("token ids"),
            "{command}"
        );
    }
}


/// The chat template of model directory `dir`, for `command`: Qwen3's (with a note) when the
/// directory has none, an error when it has one that is not Qwen3's ChatML.
pub fn chat_template(dir: &Path, command: &str) -> Result<ChatTemplate> {
    match ChatTemplate::from_dir(dir) {
        Ok(template) => Ok(template),
        Err(ChatTemplateError::MissingTemplate { .. } | ChatTemplateError::Read { .. }) => {
            eprintln!("note: {} has no chat template; using Qwen3's", dir.display());
            Ok(ChatTemplate::Qwen3)
        }
        Err(err) => Err(err).with_context(|| format!("{command} renders prompts with the Qwen3 chat template")),
    }
}

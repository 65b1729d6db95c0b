//! `prompt-r1 generate`: continue a prompt with a model directory.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use clap::Args as ClapArgs;
use model::chat_template::{ChatMessage, RenderOptions};
use model::{generate, Sampling, SamplingConfig};

use crate::device::{run_on, ComputeArgs, OnBackend};
use crate::model_dir::{LoadedModel, TokenIds};

/// Generate text (or token ids) from a Qwen3 checkpoint.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Model directory in Hugging Face layout (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// A PEFT LoRA adapter directory applied to the model (e.g. from `prompt-r1 export` of a
    /// LoRA run).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Prompt text (needs tokenizer.json in the model directory).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3 (works without a tokenizer).
    #[arg(long)]
    pub prompt_ids: Option<TokenIds>,
    /// Wrap --prompt as a user message in the chat template, with the assistant header after it.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample only among the K most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities add up to P.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Random seed: the same seed gives the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Extra token ids that stop generation (the config's EOS ids and <|im_end|> always do).
    #[arg(long)]
    pub stop_ids: Option<TokenIds>,
    #[command(flatten)]
    pub compute: ComputeArgs,
    /// Print one JSON object {"tokens": [...], "text": ...} instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let device = args.compute.device;
    run_on(device, args)
}

impl OnBackend for Args {
    type Output = ();

    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        let loaded = LoadedModel::<B>::open_with_adapter(&self.model, self.adapter.as_deref(), &device, self.compute.load_options())?;
        let prompt_ids = match (&self.prompt, &self.prompt_ids) {
            (_, Some(ids)) => ids.0.clone(),
            (Some(text), None) => {
                let tokenizer = loaded.require_tokenizer(&self.model, "--prompt")?;
                let text = if self.chat {
                    let template = crate::model_dir::chat_template(&self.model, "generate --chat")?;
                    template.render(&[ChatMessage::user(text.as_str())], RenderOptions::generation(true))
                } else {
                    text.clone()
                };
                tokenizer.encode(&text)?
            }
            (None, None) => bail!("give --prompt or --prompt-ids"),
        };
        if prompt_ids.is_empty() {
            bail!("the prompt encodes to no tokens");
        }
        let context = loaded.model.config.max_position_embeddings;
        if prompt_ids.len() >= context {
            bail!(
                "the prompt's {} tokens leave no room in the model's context of {context} tokens (max_position_embeddings): shorten the prompt",
                prompt_ids.len()
            );
        }
        if prompt_ids.len().saturating_add(self.max_new_tokens) > context {
            bail!(
                "the prompt's {} tokens and --max-new-tokens {} exceed the model's context of {context} tokens (max_position_embeddings): ask for at most {} new tokens",
                prompt_ids.len(),
                self.max_new_tokens,
                context.saturating_sub(prompt_ids.len())
            );
        }
        let mut stop_token_ids = loaded.stop_ids();
        if let Some(ids) = &self.stop_ids {
            loaded.model.check_token_ids(&ids.0).context("--stop-ids")?;
            stop_token_ids.extend(&ids.0);
        }
        let config = SamplingConfig {
            sampling: Sampling {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            },
            max_new_tokens: self.max_new_tokens,
            stop_token_ids,
        };
        let out = generate(&loaded.policy(), &[prompt_ids], &config)?;
        let tokens = &out[0].tokens;
        let text = match &loaded.tokenizer {
            Some(t) => Some(t.decode(tokens, false)?),
            None => None,
        };
        if self.json {
            println!("{}", serde_json::json!({"tokens": tokens, "text": text}));
        } else {
            match text {
                Some(text) => println!("{text}"),
                None => println!("{}", tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
            }
        }
        Ok(())
    }
}

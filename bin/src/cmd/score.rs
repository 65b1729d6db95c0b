//! `prompt-r1 score`: the log-probability of each completion token given a prompt.

use std::path::PathBuf;

use anyhow::Result;
use burn::tensor::backend::Backend;
use clap::Args as ClapArgs;
use model::completion_logprobs;

use crate::device::{run_on, ComputeArgs, OnBackend};
use crate::model_dir::{LoadedModel, TokenIds};

/// Score a completion: log p(completion token t | prompt, completion tokens before t).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Model directory in Hugging Face layout.
    #[arg(long)]
    pub model: PathBuf,
    /// A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) applied to
    /// the model, e.g. from `prompt-r1 export` of a LoRA run.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Prompt as comma-separated token ids.
    #[arg(long, required_unless_present = "prompt")]
    pub prompt_ids: Option<TokenIds>,
    /// Completion as comma-separated token ids.
    #[arg(long, required_unless_present = "completion")]
    pub completion_ids: Option<TokenIds>,
    /// Prompt text instead of ids (needs tokenizer.json).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Completion text instead of ids (needs tokenizer.json).
    #[arg(long, conflicts_with = "completion_ids")]
    pub completion: Option<String>,
    #[command(flatten)]
    pub compute: ComputeArgs,
    /// Print {"token_logprobs": [...], "sum_logprob": x}.
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
        let ids = |given: &Option<TokenIds>, text: &Option<String>, flag: &str| -> Result<Vec<u32>> {
            match (given, text) {
                (Some(ids), _) => Ok(ids.0.clone()),
                (None, Some(text)) => Ok(loaded.require_tokenizer(&self.model, flag)?.encode(text)?),
                (None, None) => anyhow::bail!("{flag} or its -ids form is required"),
            }
        };
        let prompt = ids(&self.prompt_ids, &self.prompt, "--prompt")?;
        let completion = ids(&self.completion_ids, &self.completion, "--completion")?;
        let logprobs = completion_logprobs(&loaded.policy(), &[(prompt, completion.clone())], loaded.pad_id())?
            .remove(0);
        let sum: f64 = logprobs.iter().map(|&x| f64::from(x)).sum();
        if self.json {
            println!("{}", serde_json::json!({"token_logprobs": logprobs, "sum_logprob": sum}));
        } else {
            for (id, lp) in completion.iter().zip(&logprobs) {
                let token = loaded
                    .tokenizer
                    .as_ref()
                    .and_then(|t| t.token(*id))
                    .unwrap_or_default();
                println!("{id:>8}  {lp:>10.4}  {token}");
            }
            println!("sum log-prob: {sum:.4}");
        }
        Ok(())
    }
}

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
        check_lengths(prompt.len(), completion.len(), loaded.model.config.max_position_embeddings)?;
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

/// Both parts must hold tokens, and together fit the model's context.
fn check_lengths(prompt: usize, completion: usize, context: usize) -> Result<()> {
    for (len, what) in [(prompt, "the prompt"), (completion, "the completion")] {
        if len == 0 {
            anyhow::bail!("{what} holds no tokens: give at least one");
        }
    }
    if prompt + completion > context {
        anyhow::bail!(
            "the prompt's {prompt} and the completion's {completion} tokens exceed the model's context of {context} tokens (max_position_embeddings)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_parts_must_hold_tokens_and_fit_the_context() {
        assert!(check_lengths(3, 5, 8).is_ok());
        let err = |p, c| check_lengths(p, c, 8).unwrap_err().to_string();
        assert!(err(0, 2).starts_with("the prompt holds no tokens"));
        assert!(err(2, 0).starts_with("the completion holds no tokens"));
        assert!(err(4, 5).contains("context of 8 tokens"));
    }
}

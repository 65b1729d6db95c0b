//! `prompt-r1 export`: a checkpoint (or a run's newest one) as a Hugging Face directory that
//! transformers and vLLM load directly, in bf16 or f32, with the tokenizer files.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::backend::Flex;
use clap::Args as ClapArgs;
use model::{load_pretrained, save_pretrained, LoadOptions};

use crate::model_dir::FileDtype;

/// Export a training checkpoint as an HF model directory.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// A checkpoint directory (runs/x/checkpoints/step-0000010) or a run directory (its newest
    /// checkpoint is used).
    pub checkpoint: PathBuf,
    /// Output directory (created; must not hold a model unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Weight dtype of the exported file: bf16 (what Qwen3 ships) or f32.
    #[arg(long, value_enum, default_value_t = FileDtype::Bf16)]
    pub dtype: FileDtype,
    /// Overwrite an existing model in --out.
    #[arg(long)]
    pub force: bool,
}

const COPIED: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];

pub fn run(args: Args) -> Result<()> {
    let source = resolve(&args.checkpoint)?;
    if args.out.join("model.safetensors").exists() && !args.force {
        bail!("{} already holds a model; pass --force to overwrite it", args.out.display());
    }
    let model = load_pretrained::<Flex>(&source, &Default::default(), LoadOptions::default())
        .with_context(|| format!("loading {}", source.display()))?;
    save_pretrained(&model, &args.out, args.dtype.into())?;
    for file in COPIED {
        let from = source.join(file);
        if from.is_file() {
            std::fs::copy(&from, args.out.join(file)).with_context(|| format!("copying {}", from.display()))?;
        }
    }
    eprintln!("exported {} to {} ({:?})", source.display(), args.out.display(), args.dtype);
    Ok(())
}

/// A checkpoint directory as given, or the newest checkpoint of a run directory.
fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join("config.json").is_file() {
        return Ok(path.to_path_buf());
    }
    match trainer::run::latest_checkpoint(path)? {
        Some(dir) => Ok(dir),
        None => bail!("{} is neither a checkpoint (no config.json) nor a run with checkpoints", path.display()),
    }
}

//! `prompt-r1 export`: a checkpoint (or a run's newest one) as a Hugging Face directory that
//! transformers and vLLM load directly, in bf16 or f32, with the tokenizer files. A LoRA
//! checkpoint exports as a PEFT adapter directory (`peft.PeftModel.from_pretrained`, vLLM's
//! `--lora-modules`), or with `--merge` as the base with the adapters merged in.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burn::backend::Flex;
use clap::Args as ClapArgs;
use model::lora::{base_model_dir, is_adapter_dir, load_adapter, merge_adapters, read_adapter_config, save_adapter};
use model::{load_pretrained, save_pretrained, LoadOptions};

use super::model_out::write_model_dir;
use crate::model_dir::FileDtype;

/// Export a training checkpoint as an HF model directory, or (LoRA runs) a PEFT adapter
/// directory.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// A checkpoint directory (runs/x/checkpoints/step-0000010) or a run directory (its newest
    /// checkpoint is used).
    pub checkpoint: PathBuf,
    /// Output directory (created; must not hold a model unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Weight dtype of an exported model: bf16 (what Qwen3 ships) or f32. LoRA adapters are
    /// written in f32 (their training dtype).
    #[arg(long, value_enum, default_value_t = FileDtype::Bf16)]
    pub dtype: FileDtype,
    /// LoRA checkpoints: write the base with the adapters merged into its weights (a plain HF
    /// model directory) instead of the adapter directory.
    #[arg(long)]
    pub merge: bool,
    /// LoRA checkpoints: the base model directory (default: the one the checkpoint's
    /// adapter_config.json names, i.e. the run's `model`).
    #[arg(long)]
    pub base: Option<PathBuf>,
    /// Replace an existing model in --out: its weights (shards and index too), configs and
    /// tokenizer files go once the new ones are written; other files stay.
    #[arg(long)]
    pub force: bool,
}

const COPIED: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];

pub fn run(args: Args) -> Result<()> {
    let source = crate::model_dir::checkpoint_dir(&args.checkpoint)?;
    if super::same_dir(&source, &args.out) {
        bail!("--out {} is the checkpoint being exported: choose another directory", args.out.display());
    }
    if let Some(existing) = super::model_out::existing_model(&args.out).filter(|_| !args.force) {
        bail!("{} already holds a model ({existing}); pass --force to overwrite it", args.out.display());
    }
    let device = Default::default();
    if is_adapter_dir(&source) {
        let adapter = read_adapter_config(&source)?;
        let base = match &args.base {
            Some(base) => base.clone(),
            None => base_model_dir(&source, &adapter).with_context(|| {
                format!(
                    "{}: its base model ({}) is not a local model directory; pass --base",
                    source.display(),
                    adapter.base_model_name_or_path.as_deref().unwrap_or("not recorded")
                )
            })?,
        };
        if super::same_dir(&base, &args.out) {
            bail!("--out {} is the base model of {}: choose another directory", args.out.display(), source.display());
        }
        crate::model_dir::check_trained_base(&source, &base, "pass that model with --base")?;
        let base_model = load_pretrained::<Flex>(&base, &device, LoadOptions::default())
            .with_context(|| format!("loading the base model {}", base.display()))?;
        let (adapters, _) = load_adapter::<Flex>(&source, &base_model.config, &device)
            .with_context(|| format!("loading the adapters in {}", source.display()))?;
        if args.merge {
            write_model_dir(&args.out, |dir| {
                save_pretrained(&merge_adapters(base_model, &adapters), dir, args.dtype.into())?;
                copy_tokenizer(&[&source, &base], dir)
            })?;
            eprintln!("merged {} into {} and exported it to {} ({})", source.display(), base.display(), args.out.display(), args.dtype);
        } else {
            let base = std::path::absolute(&base).unwrap_or(base);
            write_model_dir(&args.out, |dir| {
                save_adapter(&adapters, dir, &base.to_string_lossy())?;
                if let Some(trained_on) = trainer::run::BaseModel::of(&base) {
                    let record = format!("{}\n", serde_json::to_string_pretty(&trained_on)?);
                    std::fs::write(dir.join(trainer::run::BASE_MODEL_FILE), record)?;
                }
                copy_tokenizer(&[&source, &base], dir)
            })?;
            eprintln!("exported the LoRA adapter {} (base {}) to {}", source.display(), base.display(), args.out.display());
        }
        return Ok(());
    }
    if args.merge || args.base.is_some() {
        bail!("{} holds a whole model, not LoRA adapters: --merge and --base apply to LoRA checkpoints", source.display());
    }
    let model = load_pretrained::<Flex>(&source, &device, LoadOptions::default())
        .with_context(|| format!("loading {}", source.display()))?;
    write_model_dir(&args.out, |dir| {
        save_pretrained(&model, dir, args.dtype.into())?;
        copy_tokenizer(&[&source], dir)
    })?;
    eprintln!("exported {} to {} ({})", source.display(), args.out.display(), args.dtype);
    Ok(())
}

/// Copies each tokenizer file from the first of `sources` that has it, with a note when none
/// has `tokenizer.json` (the export then holds no tokenizer).
fn copy_tokenizer(sources: &[&Path], out: &Path) -> Result<()> {
    for file in COPIED {
        match sources.iter().map(|s| s.join(file)).find(|p| p.is_file()) {
            Some(from) => {
                // Read and written, not `fs::copy`: a read-only source must not make a read-only copy.
                let bytes = std::fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
                std::fs::write(out.join(file), bytes).with_context(|| format!("writing {}", out.join(file).display()))?;
            }
            None if file == "tokenizer.json" => {
                let searched: Vec<String> = sources.iter().map(|s| s.display().to_string()).collect();
                eprintln!("note: no tokenizer.json in {}: the export holds no tokenizer", searched.join(" or "));
            }
            None => {}
        }
    }
    Ok(())
}


//! `prompt-r1 init-model`: a randomly initialised checkpoint in Hugging Face layout, so a fresh
//! machine with no downloads can run everything and benchmarks have real-sized models.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::tiny_tokenizer::{train_tiny_tokenizer, write_tokenizer_files, TINY_VOCAB_SIZE};
use model::Preset;

use crate::model_dir::{preset_parser, FileDtype};

/// Write a random Qwen3 checkpoint (config.json + model.safetensors [+ tokenizer]).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Architecture: tiny, small (both with the project's own 512-token BPE tokenizer), or the
    /// real shapes qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b (vocabulary 151,936).
    #[arg(long, default_value = "tiny", value_parser = preset_parser())]
    pub preset: Preset,
    /// Output directory (created; must not already hold a checkpoint unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype: f32 (default for tiny/small) or bf16 (default for the real shapes).
    #[arg(long, value_enum)]
    pub dtype: Option<FileDtype>,
    /// A Qwen3 tokenizer.json to copy into the directory (for the real shapes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Replace an existing model in --out: its weights (shards and index too), configs and
    /// tokenizer files go once the new ones are written; other files stay.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: Args) -> Result<()> {
    if let Some(existing) = super::model_out::existing_model(&args.out).filter(|_| !args.force) {
        bail!("{} already holds a checkpoint ({existing}); pass --force to overwrite it", args.out.display());
    }
    if args.preset.uses_tiny_tokenizer() && args.tokenizer.is_some() {
        bail!("--tokenizer is for the real Qwen3 shapes; the small presets bring their own");
    }
    if let Some(path) = &args.tokenizer {
        model::tokenizer::Qwen3Tokenizer::from_file(path).with_context(|| format!("--tokenizer {}", path.display()))?;
    }
    let mut written = None;
    super::model_out::write_model_dir(&args.out, |dir| {
        let config = if args.preset.uses_tiny_tokenizer() {
            let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE)?;
            write_tokenizer_files(&tokenizer, dir)?;
            let special = tokenizer.special();
            args.preset.config(tokenizer.vocab_size(), vec![special.im_end, special.endoftext])
        } else {
            if let Some(path) = &args.tokenizer {
                // Read and written, not `fs::copy`: a read-only source must not make a read-only copy.
                let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
                std::fs::write(dir.join("tokenizer.json"), bytes).with_context(|| format!("writing {}", dir.join("tokenizer.json").display()))?;
            }
            args.preset.config(0, vec![])
        };
        let dtype = args.dtype.map(StorageDtype::from).unwrap_or(if args.preset.uses_tiny_tokenizer() {
            StorageDtype::F32
        } else {
            StorageDtype::BF16
        });
        let progress = indicatif::ProgressBar::new_spinner()
            .with_message(format!("writing {} parameters to {}", config.num_parameters(), args.out.display()));
        progress.enable_steady_tick(std::time::Duration::from_millis(200));
        write_random_checkpoint(&config, dir, args.seed, dtype)?;
        progress.finish_and_clear();
        written = Some(config);
        Ok(())
    })?;
    let config = written.expect("written");
    eprintln!(
        "wrote {} ({} parameters, {} layers, hidden {}, vocab {}) to {}",
        args.preset.name(),
        config.num_parameters(),
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
        args.out.display()
    );
    Ok(())
}

//! `prompt-r1 demo`: the built-in default job for a fresh machine with no downloads. It makes a
//! tiny random Qwen3 with its own tokenizer (`init-model --preset tiny`), then generates a reply
//! to a question through the Qwen3 chat template on the CPU.

use std::path::PathBuf;

use anyhow::Result;
use burn::tensor::DType;
use clap::Args as ClapArgs;

use crate::device::DeviceChoice;

/// Run the built-in demo: make a tiny random model and generate with it.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Where the demo writes its model.
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// The question to ask.
    #[arg(long, default_value = "Which river flows through Paris?")]
    pub question: String,
    /// Compute device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
}

pub fn run(args: Args) -> Result<()> {
    let model_dir = args.out.join("tiny-model");
    if !model_dir.join("model.safetensors").is_file() {
        super::init_model::run(super::init_model::Args {
            preset: model::Preset::Tiny,
            out: model_dir.clone(),
            seed: 0,
            dtype: None,
            tokenizer: None,
            force: false,
        })?;
    } else {
        eprintln!("using the tiny model already in {}", model_dir.display());
    }
    eprintln!("question: {}", args.question);
    eprintln!("reply of the untrained tiny model (random weights, so expect noise):");
    super::generate::run(super::generate::Args {
        model: model_dir,
        prompt: Some(args.question),
        prompt_ids: None,
        chat: true,
        max_new_tokens: 48,
        temperature: 0.8,
        top_k: Some(50),
        top_p: Some(0.95),
        seed: 0,
        stop_ids: None,
        device: args.device,
        dtype: DType::F32,
        json: false,
    })
}

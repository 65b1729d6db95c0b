//! The inference workloads of `prompt-r1 bench`, run with candle's Qwen3 (candle-transformers
//! 0.11.1) on the same checkpoint: load, prefill, decode at each batch size and scoring. Prints
//! one JSON list in the format of `prompt-r1 bench --json`, so scripts/bench_compare.sh can
//! divide the two line by line. candle has no training step for this model, so there is none.
//!
//!     bench-candle MODEL_DIR [f32|bf16] [PROMPT_LEN=256] [DECODE_TOKENS=32] [BATCHES=1,8]

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use candle_transformers::models::qwen3::{Config, Model, ModelForCausalLM};
use serde_json::{json, Value};

const TIMED_RUNS: usize = 3;

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Resets the kernel's high-water mark, so each workload reports its own peak (as ours does).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn figure(name: &str, seconds: f64, tokens: Option<f64>) -> Value {
    json!({
        "workload": name,
        "seconds": seconds,
        "tokens_per_second": tokens.map(|t| t / seconds),
        "peak_rss_mb": peak_rss_mb(),
    })
}

fn median(mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut times = (0..TIMED_RUNS).map(|_| run()).collect::<Result<Vec<_>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[TIMED_RUNS / 2])
}

fn weights(dir: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    // SAFETY: the checkpoint is not modified while it is mapped.
    Ok(unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? })
}

/// Prefill of `prompts` (equal lengths, no padding) then `new_tokens - 1` sampled decode steps.
fn generate(model: &mut ModelForCausalLM, prompts: &[Vec<u32>], new_tokens: usize, device: &Device) -> Result<()> {
    model.clear_kv_cache();
    let mut samplers: Vec<LogitsProcessor> =
        (0..prompts.len()).map(|i| LogitsProcessor::from_sampling(i as u64, Sampling::All { temperature: 1.0 })).collect();
    let mut input = Tensor::new(prompts.to_vec(), device)?;
    let mut offset = 0;
    for _ in 0..new_tokens {
        let len = input.dim(1)?;
        let logits = model.forward(&input, offset)?.squeeze(1)?.to_dtype(DType::F32)?;
        offset += len;
        let next = samplers
            .iter_mut()
            .enumerate()
            .map(|(i, s)| s.sample(&logits.get(i)?).map(|t| vec![t]))
            .collect::<candle_core::Result<Vec<_>>>()?;
        input = Tensor::new(next, device)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).context("usage: bench-candle MODEL_DIR [f32|bf16] [PROMPT_LEN] [DECODE_TOKENS] [BATCHES]")?);
    let dtype = match args.get(2).map_or("f32", String::as_str) {
        "bf16" => DType::BF16,
        _ => DType::F32,
    };
    let prompt_len: usize = args.get(3).map_or(Ok(256), |s| s.parse())?;
    let decode_tokens: usize = args.get(4).map_or(Ok(32), |s| s.parse())?;
    let batches: Vec<usize> = args.get(5).map_or("1,8", String::as_str).split(',').map(str::parse).collect::<Result<_, _>>()?;
    let device = Device::Cpu;
    let config: Config = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    let vocab = config.vocab_size;

    let mut figures = Vec::new();
    let start = Instant::now();
    let mut model = ModelForCausalLM::new(&config, weights(&dir, dtype, &device)?)?;
    figures.push(figure("load", start.elapsed().as_secs_f64(), None));
    let prompt: Vec<u32> = (0..prompt_len).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();

    generate(&mut model, &[prompt[..8].to_vec()], 2, &device)?;
    reset_peak_rss();
    let seconds = median(|| {
        let start = Instant::now();
        generate(&mut model, &[prompt.clone()], 1, &device)?;
        Ok(start.elapsed().as_secs_f64())
    })?;
    figures.push(figure(&format!("prefill {prompt_len} tokens"), seconds, Some(prompt_len as f64)));

    for &batch in &batches {
        let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt[b % 8..b % 8 + 16].to_vec()).collect();
        reset_peak_rss();
        let seconds = median(|| {
            let start = Instant::now();
            generate(&mut model, &prompts, 1, &device)?;
            let prefill = start.elapsed().as_secs_f64();
            let start = Instant::now();
            generate(&mut model, &prompts, decode_tokens, &device)?;
            Ok((start.elapsed().as_secs_f64() - prefill).max(1e-9))
        })?;
        figures.push(figure(&format!("decode batch {batch}"), seconds, Some((batch * (decode_tokens - 1)) as f64)));
    }
    drop(model);

    // Scoring needs the logits of every position: the base model and the (tied) head apart.
    let vb = weights(&dir, dtype, &device)?;
    let head_name = if config.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
    let head = Linear::new(vb.get((vocab, config.hidden_size), head_name)?, None);
    let half = prompt_len / 2;
    let ids = Tensor::new(vec![prompt.clone(), prompt.clone()], &device)?;
    let targets = ids.narrow(1, half, prompt_len - half)?.contiguous()?.unsqueeze(2)?;
    reset_peak_rss();
    let seconds = median(|| {
        // A fresh model for every run, untimed: the base model's KV cache cannot be cleared.
        let mut base = Model::new(&config, vb.clone())?;
        let start = Instant::now();
        let hidden = base.forward(&ids, 0)?.narrow(1, half - 1, prompt_len - half)?;
        let logits = head.forward(&hidden)?.to_dtype(DType::F32)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?.gather(&targets, 2)?;
        logp.sum_all()?.to_scalar::<f32>()?;
        Ok(start.elapsed().as_secs_f64())
    })?;
    figures.push(figure(&format!("score 2 x {prompt_len} tokens"), seconds, Some(2.0 * prompt_len as f64)));
    println!("{}", serde_json::to_string_pretty(&figures)?);
    Ok(())
}

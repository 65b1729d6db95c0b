//! `prompt-r1 check-device`: runs one model on a device and on the CPU reference (burn-flex with
//! the fused kernels) and compares what they compute: logits of a padded batch, greedy and
//! sampled tokens (chosen on the device off the CPU kernels), completion log-probs, one GRPO
//! learn step (loss and gradient norm), that the device's scoring and update agree (the first
//! PPO ratio is exactly 1) and the device's f32 → bf16 rounding. A self-test for a
//! new GPU host; with `--device cpu` it checks burn's portable tensor ops (the path every other
//! backend takes) against the fused CPU kernels.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::{backend::Backend, bf16, DType, Tensor, TensorData};
use clap::Args as ClapArgs;
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::{
    completion_logprobs, generate, load_pretrained, LoadOptions, MatmulPrecision, Padding, Preset, SamplingConfig, TokenBatch,
};
use trainer::grpo::{learn_step, sequence_logprobs, LearnConfig, PolicyBatch, PolicySequence};

use crate::device::{run_on, DeviceChoice, OnBackend};

/// Compare a device's results with the CPU reference on one model (a GPU host's self-test).
///
/// Runs the same model on the CPU (burn-flex with the fused kernels, f32) and on --device, and
/// checks: the logits of a right- and a left-padded batch, 16 greedy and 16 sampled tokens per
/// prompt (same seeds; off the CPU kernels tokens are chosen on the device),
/// completion log-probs, one GRPO learn step (loss and gradient norm), that the device scores
/// old log-probs exactly as its update computes them (the first ratio is 1, with f32 and bf16
/// products) and, off the CPU, that the device's f32 → bf16 cast rounds to nearest even (bf16
/// rollout copies use it). Exits non-zero
/// when a check fails. `--device cpu` compares burn's portable tensor ops (the path CUDA takes) with the
/// fused kernels.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Device to check: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Model directory to run; without it, a random `--preset` model is written to a temporary
    /// directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Architecture of the random model.
    #[arg(long, default_value = "tiny", conflicts_with = "model")]
    pub preset: String,
    /// Largest |difference| allowed for logits and log-probs (f32 on both sides).
    #[arg(long, default_value_t = 2e-3)]
    pub atol: f32,
}

/// What one side computed.
struct Results {
    logits: Vec<Vec<f32>>,
    greedy: Vec<Vec<u32>>,
    /// Temperature 1, seed 3.
    sampled: Vec<Vec<u32>>,
    logprobs: Vec<Vec<f32>>,
    loss: f32,
    grad_norm: f32,
    /// `approx_kl + clip_frac` of a learn step whose old log-probs this backend scored without
    /// autodiff, with f32 and with bf16 products: 0 when scoring and update agree bit for bit.
    ratio_drift: [f32; 2],
    /// Values whose f32 → bf16 cast on this backend is not the nearest bf16 (ties to even).
    cast_errors: usize,
}

/// The same fixed inputs for both sides.
struct Probe {
    dir: PathBuf,
    vocab: usize,
    prompts: Vec<Vec<u32>>,
}

/// Every low half-word under a few sign/exponent/high-mantissa patterns (ties, values just
/// above and below them, both signs), cast to bf16 with the backend's own `cast` (what the model
/// uses off the CPU for bf16 rollout copies) and compared with round-to-nearest-even.
fn cast_errors<B: Backend>(device: &B::Device) -> Result<usize> {
    let values: Vec<f32> = [0x3f80u32, 0xbc46, 0x4049, 0xc2f7]
        .iter()
        .flat_map(|&high| (0..1u32 << 16).map(move |low| f32::from_bits(high << 16 | low)))
        .collect();
    let n = values.len();
    let cast: Vec<bf16> = Tensor::<B, 1>::from_data(TensorData::new(values.clone(), [n]), device)
        .cast(DType::BF16)
        .into_data()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("reading the cast values: {e:?}"))?;
    Ok(values.iter().zip(&cast).filter(|(v, c)| bf16::from_f32(**v).to_bits() != c.to_bits()).count())
}

impl<'a> OnBackend for &'a Probe {
    type Output = Results;

    fn run<B: Backend>(self, device: B::Device) -> Result<Results> {
        let model = load_pretrained::<B>(&self.dir, &device, LoadOptions { dtype: DType::F32 })?;
        let mut logits = Vec::new();
        for padding in [Padding::Right, Padding::Left] {
            logits.push(padded_logits(&model, &self.prompts, padding, &device)?);
        }
        let config = SamplingConfig { max_new_tokens: 16, temperature: 0.0, ..Default::default() };
        let greedy = generate(&model, &self.prompts, &config, 0)?.into_iter().map(|s| s.tokens).collect();
        let config = SamplingConfig { temperature: 1.0, seed: 3, ..config };
        let sampled = generate(&model, &self.prompts, &config, 0)?.into_iter().map(|s| s.tokens).collect();
        let pairs: Vec<(Vec<u32>, Vec<u32>)> =
            self.prompts.iter().map(|p| (p[..p.len() / 2].to_vec(), p[p.len() / 2..].to_vec())).collect();
        let logprobs = completion_logprobs(&model, &pairs, 0)?;
        drop(model);

        let policy = load_pretrained::<Autodiff<B>>(&self.dir, &device, LoadOptions { dtype: DType::F32 })?;
        let learn = LearnConfig { mini_batch_size: 2, micro_batch_size: 2, ..LearnConfig::default() };
        let mut optimizer = learn.optimizer.init::<Autodiff<B>, _>()?;
        // Old log-probs of a uniform policy, which a random model is close to: ratios near 1,
        // so the clipped objective still depends on every token.
        let uniform = -(self.vocab as f32).ln();
        let old = self.prompts.iter().map(|p| vec![uniform; p.len()]).collect();
        let (_, stats) = learn_step(policy, &mut optimizer, &self.batch(old)?, &learn)?;
        let grad_norm = *stats.grad_norms.first().context("the learn step computed no gradient")?;
        let ratio_drift =
            [self.ratio_drift::<B>(&device, MatmulPrecision::F32)?, self.ratio_drift::<B>(&device, MatmulPrecision::Bf16)?];
        Ok(Results {
            logits,
            greedy,
            sampled,
            logprobs,
            loss: stats.loss,
            grad_norm,
            ratio_drift,
            cast_errors: cast_errors::<B>(&device)?,
        })
    }
}

impl Probe {
    /// One learn step whose old log-probs are the policy's own, scored on the plain backend as
    /// the trainer does, with products at `matmul`: its `approx_kl + clip_frac`, which is 0 when
    /// scoring and the update compute the same log-probs (every ratio exactly 1).
    fn ratio_drift<B: Backend>(&self, device: &B::Device, matmul: MatmulPrecision) -> Result<f32> {
        let policy = load_pretrained::<Autodiff<B>>(&self.dir, device, LoadOptions { dtype: DType::F32 })?
            .with_matmul_precision(matmul);
        let old = sequence_logprobs(&policy.valid(), &self.prompts, 0, 2)?;
        let learn = LearnConfig { mini_batch_size: 2, micro_batch_size: 2, matmul, ..LearnConfig::default() };
        let mut optimizer = learn.optimizer.init::<Autodiff<B>, _>()?;
        let (_, stats) = learn_step(policy, &mut optimizer, &self.batch(old)?, &learn)?;
        Ok(stats.approx_kl.abs() + stats.clip_frac)
    }

    /// The learn steps' batch: the two prompts with advantages +1 and −1, every token after the
    /// first in the loss, and `old` (one row per prompt) as both old and reference log-probs.
    fn batch(&self, old: Vec<Vec<f32>>) -> Result<PolicyBatch> {
        let sequences = self
            .prompts
            .iter()
            .zip(old)
            .zip([1.0, -1.0])
            .map(|((tokens, old), advantage)| PolicySequence {
                tokens: tokens.clone(),
                loss_mask: std::iter::once(0).chain(std::iter::repeat_n(1, tokens.len() - 1)).collect(),
                ref_logprobs: Some(old.clone()),
                old_logprobs: old,
                advantage,
            })
            .collect();
        Ok(PolicyBatch::new(sequences)?)
    }
}

/// The logits of `prompts` padded to one length (on the left or the right), real positions only.
fn padded_logits<B: Backend>(
    model: &model::Qwen3ForCausalLM<B>,
    prompts: &[Vec<u32>],
    padding: Padding,
    device: &B::Device,
) -> Result<Vec<f32>> {
    let batch = TokenBatch::<B>::new(prompts, padding, 0, device)?;
    let logits: Vec<f32> = model
        .forward(batch.input_ids.clone(), batch.position_ids.clone(), batch.mask(), None)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
    let row_len = logits.len() / prompts.len();
    let vocab = row_len / batch.len;
    Ok(logits
        .chunks(row_len)
        .zip(&batch.lengths)
        .flat_map(|(row, &len)| match padding {
            Padding::Right => &row[..len * vocab],
            Padding::Left => &row[(batch.len - len) * vocab..],
        })
        .copied()
        .collect())
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn run(args: Args) -> Result<()> {
    // Before the CPU reference, which takes a while for a large model.
    crate::device::check_available(args.device)?;
    let temp;
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let preset = Preset::from_name(&args.preset).with_context(|| format!("unknown preset \"{}\"", args.preset))?;
            temp = tempfile::tempdir()?;
            write_random_checkpoint(&preset.config(512, vec![2]), temp.path(), 7, StorageDtype::F32)?;
            temp.path().to_path_buf()
        }
    };
    let vocab = model::Qwen3Config::from_file(&dir.join("config.json"))?.vocab_size;
    let prompt = |len: usize, salt: usize| -> Vec<u32> { (0..len).map(|i| ((i * 7919 + salt) % vocab) as u32).collect() };
    let probe = Probe { dir, vocab, prompts: vec![prompt(24, 13), prompt(17, 101)] };

    eprintln!("reference: CPU, fused kernels");
    model::cpu_kernels::set_portable_ops(false);
    let reference = run_on(DeviceChoice::Cpu, &probe)?;
    let target = match args.device {
        DeviceChoice::Cpu => {
            eprintln!("checked: CPU, burn's portable tensor ops");
            model::cpu_kernels::set_portable_ops(true);
            run_on(DeviceChoice::Cpu, &probe)
        }
        device => {
            eprintln!("checked: {device:?}");
            run_on(device, &probe)
        }
    }?;

    let relative = |a: f32, b: f32| (a - b).abs() / a.abs().max(b.abs()).max(1e-6);
    let mut checks = vec![
        ("logits, right- and left-padded batch", max_diff(&reference.logits, &target.logits), args.atol),
        ("completion log-probs", max_diff(&reference.logprobs, &target.logprobs), args.atol),
        ("greedy tokens differing (2 x 16)", differing(&reference.greedy, &target.greedy) as f32, 0.0),
        ("sampled tokens differing (2 x 16, T = 1)", differing(&reference.sampled, &target.sampled) as f32, 0.0),
        ("learn step loss (relative)", relative(reference.loss, target.loss), 1e-3),
        ("learn step gradient norm (relative)", relative(reference.grad_norm, target.grad_norm), 1e-3),
        ("first ratio off 1, f32 products", target.ratio_drift[0], 0.0),
        ("first ratio off 1, bf16 products", target.ratio_drift[1], 0.0),
    ];
    // On the CPU the model rounds to bf16 through its own kernel, not burn-flex's cast (which
    // does not round every value to the nearest bf16; see BENCHMARKS.md, sixth session).
    if args.device != DeviceChoice::Cpu {
        checks.push(("f32 -> bf16 casts not to nearest even", target.cast_errors as f32, 0.0));
    }
    println!("{:<40} {:>12} {:>12}  result", "check", "measured", "allowed");
    let mut failed = 0;
    for &(name, measured, allowed) in &checks {
        let ok = measured <= allowed;
        failed += usize::from(!ok);
        println!("{name:<40} {measured:>12.3e} {allowed:>12.3e}  {}", if ok { "ok" } else { "FAILED" });
    }
    if failed > 0 {
        bail!("{failed} of {} checks failed on {:?}", checks.len(), args.device);
    }
    Ok(())
}

/// Generated tokens that differ between the two sides (a shorter sequence counts its missing ones).
fn differing(a: &[Vec<u32>], b: &[Vec<u32>]) -> usize {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).filter(|(p, q)| p != q).count() + x.len().abs_diff(y.len()))
        .sum()
}

//! `prompt-r1 check-device`: runs one model on a device and on the CPU reference (burn-flex with
//! the fused kernels) and compares what they compute: logits of a padded batch, greedy and
//! sampled tokens (chosen on the device off the CPU kernels), the logits of decoding steps into
//! which sequences join (ragged passes on a GPU), completion log-probs, one GRPO
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
use model::cpu_kernels::Kernels;
use model::{
    completion_logprobs, generate, load_pretrained, LoadOptions, MatmulPrecision, Padding, Preset, Sampling, SamplingConfig, TokenBatch,
};
use trainer::grpo::{learn_step, sequence_logprobs, LearnConfig, PolicyBatch, PolicySequence};

use crate::device::{run_on, DeviceChoice, OnBackend};

/// Compare a device's results with the CPU reference on one model (a GPU host's self-test).
///
/// Runs the same model on the CPU (burn-flex with the fused kernels, f32) and on --device, and
/// checks: the logits of a right- and a left-padded batch, 16 greedy and 16 sampled tokens per
/// prompt (same seeds; off the CPU kernels tokens are chosen on the device), 16 greedy tokens
/// after a 1,100-token prompt (a GPU splits those decoding steps' columns into spans), the
/// logits of decoding steps into which two sequences join (ragged passes on a GPU whose kernel
/// takes prefills), completion log-probs, one GRPO learn step (loss and gradient norm), that the device scores
/// old log-probs exactly as its update computes them (the first ratio is 1, with f32 and bf16
/// products, and with activation checkpointing) and, off the CPU, that the device's f32 → bf16 cast rounds to nearest even (bf16
/// rollout copies use it). Exits non-zero when a check fails. `--device cpu` compares burn's
/// portable tensor ops (the path CUDA takes) with the fused kernels.
///
/// Logits and log-probs are compared relative to the largest |value| of the reference (--rtol).
/// CubeCL runs f32 matrix products on tensor cores as TF32 where the GPU has them (10-bit
/// mantissa: about 5e-4 relative error per product), so a correct CUDA run differs from the
/// CPU by up to about 1e-3 of the largest logit; the default 1e-2 allows that, and a wrong
/// kernel is off by far more. A token that differs is forgiven when the reference's choice was
/// within the logits' tolerance of a tie: greedy, when its top two logits are that close;
/// sampled, when the draw lay that close to a boundary between two tokens' cumulative
/// probabilities (the device sums them in f32, the CPU in f64). The row's later tokens are then
/// not compared, as they continue different texts.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Device to check: cpu, cuda, cuda:N or wgpu.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Model directory to run; without it, a random `--preset` model is written to a temporary
    /// directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Architecture of the random model.
    #[arg(long, default_value = "tiny", conflicts_with = "model", value_parser = crate::model_dir::preset_parser())]
    pub preset: Preset,
    /// Largest |difference| allowed for logits and log-probs, relative to the largest |value| of
    /// the reference (f32 weights on both sides; TF32 products on tensor cores need about 1e-3).
    #[arg(long, default_value_t = 1e-2, value_parser = parse_rtol)]
    pub rtol: f32,
    /// Weight dtype of the inference checks (logits, tokens, log-probs), the same on both sides:
    /// f32 or bf16 (then give a wider --rtol, e.g. 5e-2). The learn steps keep f32 weights.
    #[arg(long, default_value = "f32", value_parser = crate::model_dir::parse_dtype)]
    pub dtype: DType,
}

/// `--rtol`: a finite number above 0.
fn parse_rtol(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(rtol) if rtol.is_finite() && rtol > 0.0 => Ok(rtol),
        _ => Err(format!("{text} is not a finite number above 0")),
    }
}

/// What one side computed.
struct Results {
    logits: Vec<Vec<f32>>,
    greedy: Vec<Vec<u32>>,
    /// The logits before each greedy token, `[tokens, vocab]` per prompt.
    greedy_logits: Vec<Vec<f32>>,
    /// Temperature 1, seed [`SAMPLING_SEED`].
    sampled: Vec<Vec<u32>>,
    /// The logits before each sampled token, `[tokens, vocab]` per prompt.
    sampled_logits: Vec<Vec<f32>>,
    /// 16 greedy tokens after the long prompt, and the logits before each.
    long_greedy: Vec<Vec<u32>>,
    long_greedy_logits: Vec<Vec<f32>>,
    /// The logits of each step of [`joining_steps`] (rows in the order of their sequences).
    joining_logits: Vec<Vec<f32>>,
    logprobs: Vec<Vec<f32>>,
    loss: f32,
    grad_norm: f32,
    /// `approx_kl + clip_frac` of a learn step whose old log-probs this backend scored without
    /// autodiff, with f32 and with bf16 products, and with f32 products under activation
    /// checkpointing: 0 when scoring and update agree bit for bit. `None` for bf16 on a backend
    /// without bf16 (wgpu).
    ratio_drift: [Option<f32>; 3],
    /// Values whose f32 → bf16 cast on this backend is not the nearest bf16 (ties to even);
    /// `None` on a backend without bf16.
    cast_errors: Option<usize>,
    /// The passes over the KV cache that ran through a kernel lent to the model
    /// (`model::device_kernels`: the GPU builds' paged-attention kernel) rather than burn's ops.
    paged_attention_kernel: Option<model::device_kernels::KernelPasses>,
    /// Whether the RMS-norm kernels are lent to the model for this backend (the generation
    /// passes' norms, with the residual addition before them or RoPE and the KV cache's write
    /// after them, then run through them, and SwiGLU's `silu(gate) · up` through its kernel).
    rms_norm_kernel: bool,
}

/// The same fixed inputs for both sides.
#[derive(Clone)]
struct Probe {
    dir: PathBuf,
    /// Weight dtype of the inference checks.
    dtype: DType,
    vocab: usize,
    prompts: Vec<Vec<u32>>,
    /// A prompt of [`LONG_PROMPT`] tokens, decoded from alone.
    long_prompt: Vec<u32>,
    /// The CPU kernels of every model the probe loads (burn-flex only).
    cpu_kernels: Kernels,
    /// The GPU kernels they run (on a GPU backend).
    device_kernels: model::DeviceKernelChoice,
}

/// Tokens of the long prompt: its decoding steps walk 18 tiles of the tiny model's
/// columns (64 a tile), which a GPU's paged-attention kernel splits into 4 spans (FlashDecoding),
/// a row alone giving it few cubes.
const LONG_PROMPT: usize = 1100;

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
        let model = load_pretrained::<B>(&self.dir, &device, self.options(self.dtype))?.for_inference();
        let mut logits = Vec::new();
        for padding in [Padding::Right, Padding::Left] {
            logits.push(padded_logits(&model, &self.prompts, padding, &device)?);
        }
        let config = SamplingConfig { max_new_tokens: 16, sampling: Sampling::greedy(), ..Default::default() };
        let greedy: Vec<Vec<u32>> = generate(&model, &self.prompts, &config)?.into_iter().map(|s| s.tokens).collect();
        let long = [self.long_prompt.clone()];
        let long_greedy: Vec<Vec<u32>> = generate(&model, &long, &config)?.into_iter().map(|s| s.tokens).collect();
        let long_greedy_logits = step_logits(&model, &long, &long_greedy, &device)?;
        let joining_logits = joining_steps(&model, self)?;
        let sampling = Sampling { temperature: 1.0, seed: SAMPLING_SEED, ..Sampling::default() };
        let config = SamplingConfig { sampling, ..config };
        let sampled: Vec<Vec<u32>> = generate(&model, &self.prompts, &config)?.into_iter().map(|s| s.tokens).collect();
        let greedy_logits = step_logits(&model, &self.prompts, &greedy, &device)?;
        let sampled_logits = step_logits(&model, &self.prompts, &sampled, &device)?;
        let pairs: Vec<(Vec<u32>, Vec<u32>)> =
            self.prompts.iter().map(|p| (p[..p.len() / 2].to_vec(), p[p.len() / 2..].to_vec())).collect();
        let logprobs = completion_logprobs(&model, &pairs, 0)?;
        drop(model);

        let policy = load_pretrained::<Autodiff<B>>(&self.dir, &device, self.options(DType::F32))?;
        let learn = LearnConfig { mini_batch_size: 2, micro_batch_size: 2, ..LearnConfig::default() };
        let mut optimizer = learn.optimizer.init::<Autodiff<B>, _>()?;
        // Old log-probs of a uniform policy, which a random model is close to: ratios near 1,
        // so the clipped objective still depends on every token.
        let uniform = -(self.vocab as f32).ln();
        let old = self.prompts.iter().map(|p| vec![uniform; p.len()]).collect();
        let (_, stats) = learn_step(policy, &mut optimizer, &self.batch(old)?, &learn)?;
        let grad_norm = *stats.grad_norms.first().context("the learn step computed no gradient")?;
        let bf16 = B::supports_dtype(&device, DType::BF16);
        let ratio_drift = [
            Some(self.ratio_drift::<B>(&device, MatmulPrecision::F32, false)?),
            if bf16 { Some(self.ratio_drift::<B>(&device, MatmulPrecision::Bf16, false)?) } else { None },
            Some(self.ratio_drift::<B>(&device, MatmulPrecision::F32, true)?),
        ];
        Ok(Results {
            logits,
            greedy,
            greedy_logits,
            sampled,
            sampled_logits,
            long_greedy,
            long_greedy_logits,
            joining_logits,
            logprobs,
            loss: stats.loss,
            grad_norm,
            ratio_drift,
            cast_errors: if bf16 { Some(cast_errors::<B>(&device)?) } else { None },
            paged_attention_kernel: self.device_kernels.passes.filter(|_| self.device_kernels.paged_attention::<B>(1).is_some()),
            rms_norm_kernel: self.device_kernels.norms::<B>().is_some(),
        })
    }
}

impl Probe {
    /// How the probe's models load: weights of `dtype`, the probe's CPU and GPU kernels.
    fn options(&self, dtype: DType) -> LoadOptions {
        LoadOptions { dtype, compute: model::Compute::default().with_cpu_kernels(self.cpu_kernels).with_device_kernels(self.device_kernels) }
    }

    /// One learn step whose old log-probs are the policy's own, scored on the plain backend as
    /// the trainer does, with products at `matmul` (and with `activation_checkpointing`): its
    /// `approx_kl + clip_frac`, which is 0 when scoring and the update compute the same
    /// log-probs (every ratio exactly 1).
    fn ratio_drift<B: Backend>(&self, device: &B::Device, matmul: MatmulPrecision, activation_checkpointing: bool) -> Result<f32> {
        let policy = load_pretrained::<Autodiff<B>>(&self.dir, device, self.options(DType::F32))?
            .with_matmul_precision(matmul);
        let old = sequence_logprobs(&policy.valid(), &self.prompts, 0, 2)?;
        let learn = LearnConfig { mini_batch_size: 2, micro_batch_size: 2, matmul, activation_checkpointing, ..LearnConfig::default() };
        let mut optimizer = learn.optimizer.init::<Autodiff<B>, _>()?;
        let (_, stats) = learn_step(policy, &mut optimizer, &self.batch(old)?, &learn)?;
        Ok(stats.policy.approx_kl.abs() + stats.policy.clip_frac)
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

/// The logits before each of `tokens[i]` continuing `prompts[i]`: `[tokens, vocab]` per prompt,
/// from one forward pass over the prompt and its tokens.
fn step_logits<B: Backend>(
    model: &model::Qwen3ForCausalLM<B>,
    prompts: &[Vec<u32>],
    tokens: &[Vec<u32>],
    device: &B::Device,
) -> Result<Vec<Vec<f32>>> {
    prompts
        .iter()
        .zip(tokens)
        .map(|(prompt, tokens)| {
            let text = [prompt.as_slice(), tokens].concat();
            let batch = TokenBatch::<B>::new(&[text], Padding::Right, 0, device)?;
            let positions = (prompt.len() - 1, tokens.len());
            let logits = model.forward(batch.input_ids, batch.position_ids, None, None).narrow(1, positions.0, positions.1);
            logits.into_data().convert::<f32>().to_vec().map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))
        })
        .collect()
}

/// Decoding steps into which sequences join, through the decoder the rollouts and `serve` use:
/// the long prompt decodes [`JOINING_STEPS`] steps alone, then the two short prompts join (on a
/// GPU whose kernel takes prefills, one ragged pass: their prefill beside the long row's
/// decoding step, which walks its 1,100 columns), and all three decode [`JOINING_STEPS`] more.
/// Fixed tokens are fed, so that both sides run the same positions: the logits of each step,
/// rows in the order of their sequences.
fn joining_steps<B: Backend>(model: &model::Qwen3ForCausalLM<B>, probe: &Probe) -> Result<Vec<Vec<f32>>> {
    let mut decoder = model::Decoder::<B>::new(model::DecoderLimits::default());
    decoder.add(model, 0, probe.long_prompt.clone())?;
    let mut steps = Vec::new();
    for step in 0..2 * JOINING_STEPS + 1 {
        if step == JOINING_STEPS + 1 {
            for (id, prompt) in (1..).zip(&probe.prompts) {
                decoder.add(model, id, prompt.clone())?;
            }
        }
        let out = decoder.step(model)?.context("the decoder ran out of sequences")?;
        let [rows, vocab] = out.logits.dims();
        let logits: Vec<f32> = out.logits.into_data().convert::<f32>().to_vec().map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))?;
        let mut order: Vec<usize> = (0..rows).collect();
        order.sort_by_key(|&row| out.ids[row]);
        steps.push(order.iter().flat_map(|&row| logits[row * vocab..(row + 1) * vocab].iter().copied()).collect());
        for &id in &out.ids {
            decoder.accept(id, ((step * 31 + id as usize * 7 + 5) % probe.vocab) as u32)?;
        }
    }
    Ok(steps)
}

/// Steps of [`joining_steps`] before and after the joins.
const JOINING_STEPS: usize = 3;

/// Largest |a - b| over both, relative to the largest |a|; infinite where their shapes differ.
fn relative_max_diff(reference: &[Vec<f32>], got: &[Vec<f32>]) -> f32 {
    if reference.len() != got.len() || reference.iter().zip(got).any(|(a, b)| a.len() != b.len()) {
        return f32::INFINITY;
    }
    let diff = reference.iter().flatten().zip(got.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    diff / reference.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE)
}

pub fn run(args: Args) -> Result<()> {
    // Before the CPU reference, which takes a while for a large model.
    crate::device::check_available(args.device)?;
    let temp;
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let preset = args.preset;
            temp = crate::scratch::ScratchDir::new()?;
            write_random_checkpoint(&preset.config(512, vec![2]), temp.path(), 7, StorageDtype::F32)?;
            temp.path().to_path_buf()
        }
    };
    let vocab = model::Qwen3Config::from_file(&dir.join("config.json"))?.vocab_size;
    let prompt = |len: usize, salt: usize| -> Vec<u32> { (0..len).map(|i| ((i * 7919 + salt) % vocab) as u32).collect() };
    // The reference runs the CPU kernels (at the environment's cap and with its product kernel)
    // even where the environment switches them off; `main` has refused a variable naming nothing.
    let kernels = Kernels::from_env_on().unwrap_or_else(|_| Kernels::host());
    let probe = Probe {
        dir,
        dtype: args.dtype,
        vocab,
        prompts: vec![prompt(24, 13), prompt(17, 101)],
        long_prompt: prompt(LONG_PROMPT, 7),
        cpu_kernels: kernels,
        device_kernels: crate::device::device_kernels(DeviceChoice::Cpu),
    };

    eprintln!("reference: CPU, fused kernels");
    let reference = run_on(DeviceChoice::Cpu, &probe)?;
    let target = match args.device {
        DeviceChoice::Cpu => {
            eprintln!("checked: CPU, burn's portable tensor ops");
            run_on(DeviceChoice::Cpu, &Probe { cpu_kernels: Kernels::off(), ..probe.clone() })
        }
        device => {
            eprintln!("checked: {device}");
            run_on(device, &Probe { device_kernels: crate::device::device_kernels(device), ..probe.clone() })
        }
    }?;
    match target.paged_attention_kernel {
        Some(model::device_kernels::KernelPasses::All) => {
            eprintln!("the prompts' prefill and the decoding steps (greedy and sampled tokens) attend through prompt-r1's paged-attention kernel (--device-kernels off: burn's ops)");
            eprintln!("sequences joining a decode ran their prefill beside the decoding row in ragged passes");
        }
        Some(model::device_kernels::KernelPasses::Decode) => {
            eprintln!("the decoding steps (greedy and sampled tokens) attend through prompt-r1's paged-attention kernel, the prefill through burn's ops (--device-kernels all: the kernel for both; off: burn's ops)")
        }
        None => {}
    }
    if target.rms_norm_kernel {
        eprintln!("the prefill and the decoding steps normalise through prompt-r1's RMS-norm kernels (with the residual addition before input_layernorm, post_attention_layernorm and the final norm, and RoPE and the KV cache's write after q_norm and k_norm) and compute SwiGLU through its kernel, scoring and the update through burn's ops, and tokens are chosen by prompt-r1's token-choice kernel (--device-kernels off: burn's ops for all)");
    }

    let relative = |a: f32, b: f32| (a - b).abs() / a.abs().max(b.abs()).max(1e-6);
    // Logits may differ by this much: the tolerance of ties between tokens.
    let logit_tol = f64::from(args.rtol) * reference.logits.iter().flatten().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
    let greedy = compare_tokens(&reference.greedy, &target.greedy, greedy_tie(&reference.greedy_logits, probe.vocab, logit_tol));
    let long_greedy = compare_tokens(&reference.long_greedy, &target.long_greedy, greedy_tie(&reference.long_greedy_logits, probe.vocab, logit_tol));
    let draws = sampling_draws(probe.prompts.len(), 16);
    let sampled = compare_tokens(&reference.sampled, &target.sampled, |row, step| {
        let logits = &reference.sampled_logits[row][step * probe.vocab..(step + 1) * probe.vocab];
        let token = reference.sampled[row][step] as usize;
        boundary_distance(logits, token, draws[row][step]) <= 2.0 * logit_tol + CDF_TOL
    });
    println!(
        "tokens forgiven as ties within the tolerance (later tokens of their row not compared): greedy {}, sampled {}, greedy after the long prompt {}",
        greedy.forgiven, sampled.forgiven, long_greedy.forgiven
    );
    let mut checks = vec![
        ("logits, right- and left-padded batch", Some(relative_max_diff(&reference.logits, &target.logits)), args.rtol),
        ("completion log-probs", Some(relative_max_diff(&reference.logprobs, &target.logprobs)), args.rtol),
        ("greedy tokens differing (2 x 16)", Some(greedy.differing as f32), 0.0),
        ("sampled tokens differing (2 x 16, T = 1)", Some(sampled.differing as f32), 0.0),
        ("greedy after a long prompt (1 x 16)", Some(long_greedy.differing as f32), 0.0),
        ("logits, sequences joining a decode", Some(relative_max_diff(&reference.joining_logits, &target.joining_logits)), args.rtol),
        ("learn step loss (relative)", Some(relative(reference.loss, target.loss)), 1e-3),
        ("learn step gradient norm (relative)", Some(relative(reference.grad_norm, target.grad_norm)), 1e-3),
        ("first ratio off 1, f32 products", target.ratio_drift[0], 0.0),
        ("first ratio off 1, bf16 products", target.ratio_drift[1], 0.0),
        ("first ratio off 1, f32, checkpointing", target.ratio_drift[2], 0.0),
    ];
    // On the CPU the model rounds to bf16 through its own kernel, not burn-flex's cast (which
    // does not round every value to the nearest bf16; BENCHMARKS.md, "A burn-flex rounding
    // difference").
    if args.device != DeviceChoice::Cpu {
        checks.push(("f32 -> bf16 casts not to nearest even", target.cast_errors.map(|n| n as f32), 0.0));
    }
    println!("{:<40} {:>12} {:>12}  result", "check", "measured", "allowed");
    let mut failed = 0;
    for &(name, measured, allowed) in &checks {
        match measured {
            Some(measured) => {
                let ok = measured <= allowed;
                failed += usize::from(!ok);
                println!("{name:<40} {measured:>12.3e} {allowed:>12.3e}  {}", if ok { "ok" } else { "FAILED" });
            }
            None => println!("{name:<40} {:>12} {allowed:>12.3e}  skipped: the backend has no bf16", "-"),
        }
    }
    if failed > 0 {
        bail!("{failed} of {} checks failed on {}", checks.len(), args.device);
    }
    Ok(())
}

/// Seed of the sampled generation (temperature 1) on both sides.
const SAMPLING_SEED: u64 = 3;

/// How far the device's f32 cumulative probabilities may lie from the CPU's f64 ones: sums of
/// 151,936 weights in two levels (blocks of 128, then the block sums) round to about 1e-5.
const CDF_TOL: f64 = 1e-4;

/// Tokens of two generations compared: those that differ, and those forgiven as ties.
#[derive(Debug, Default, PartialEq)]
struct TokenComparison {
    differing: usize,
    forgiven: usize,
}

/// Compares generated tokens row by row up to their first difference, which is forgiven when
/// `near_tie(row, step)` says the reference's choice there was within tolerance of a tie (the
/// row's later tokens continue different texts and are not compared); otherwise it counts, with
/// every later position and any difference in length.
fn compare_tokens(reference: &[Vec<u32>], got: &[Vec<u32>], near_tie: impl Fn(usize, usize) -> bool) -> TokenComparison {
    let mut result = TokenComparison::default();
    for (row, (want, have)) in reference.iter().zip(got).enumerate() {
        match want.iter().zip(have).position(|(a, b)| a != b) {
            None => result.differing += want.len().abs_diff(have.len()),
            Some(step) if near_tie(row, step) => result.forgiven += 1,
            Some(step) => result.differing += want.len().max(have.len()) - step,
        }
    }
    result
}

/// The uniform draws behind the first `steps` sampled tokens of each of `rows` rows: what
/// `generate` draws from each row's seeded generator (one per token).
fn sampling_draws(rows: usize, steps: usize) -> Vec<Vec<f64>> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    (0..rows)
        .map(|row| {
            let mut rng = StdRng::seed_from_u64(model::generation::row_seed(SAMPLING_SEED, row as u64));
            (0..steps).map(|_| rng.random::<f64>()).collect()
        })
        .collect()
}

/// Whether the greedy choice at `(row, step)` lay within `logit_tol` of a tie: its top two logits
/// (`logits[row]`, `[steps, vocab]`) closer than twice that.
fn greedy_tie(logits: &[Vec<f32>], vocab: usize, logit_tol: f64) -> impl Fn(usize, usize) -> bool + '_ {
    move |row, step| top_two_gap(&logits[row][step * vocab..(step + 1) * vocab]) <= 2.0 * logit_tol
}

/// The gap between the two largest logits.
fn top_two_gap(logits: &[f32]) -> f64 {
    let (first, second) = logits.iter().fold((f32::NEG_INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
        if x > a {
            (x, a)
        } else {
            (a, b.max(x))
        }
    });
    f64::from(first) - f64::from(second)
}

/// `token`'s interval `[start, end)` of the cumulative distribution `softmax(logits)` in
/// vocabulary order (computed in f64): a draw in it samples `token`.
fn token_interval(logits: &[f32], token: usize) -> (f64, f64) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let weights: Vec<f64> = logits.iter().map(|&x| (f64::from(x) - f64::from(max)).exp()).collect();
    let total: f64 = weights.iter().sum();
    let start = weights[..token].iter().sum::<f64>() / total;
    (start, start + weights[token] / total)
}

/// How far the uniform `draw` lies from the nearer end of `token`'s interval.
fn boundary_distance(logits: &[f32], token: usize, draw: f64) -> f64 {
    let (start, end) = token_interval(logits, token);
    (draw - start).abs().min((end - draw).abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtol_is_a_finite_number_above_zero() {
        assert_eq!(parse_rtol("5e-2"), Ok(5e-2));
        for bad in ["-1", "0", "nan", "inf", "x"] {
            assert!(parse_rtol(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_first_difference_near_a_tie_is_forgiven_with_the_rest_of_its_row() {
        let reference = vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8], vec![1, 1]];
        let got = vec![vec![1, 9, 9, 9], vec![5, 6, 0, 8], vec![1, 1, 1]];
        let tie_at = |row: usize, step: usize| (row, step) == (0, 1);
        // Row 0 forgiven; row 1 differs from step 2 on (2 tokens); row 2 is one token longer.
        assert_eq!(compare_tokens(&reference, &got, tie_at), TokenComparison { differing: 3, forgiven: 1 });
        assert_eq!(compare_tokens(&reference, &reference, |_, _| false), TokenComparison::default());
    }

    #[test]
    fn boundary_distance_measures_to_the_nearer_end() {
        // Probabilities 0.25, 0.25, 0.5: token 1 spans [0.25, 0.5).
        let logits = [0.0, 0.0, 2f32.ln()];
        assert!((boundary_distance(&logits, 1, 0.3) - 0.05).abs() < 1e-6);
        assert!((boundary_distance(&logits, 1, 0.49) - 0.01).abs() < 1e-6);
        assert!((top_two_gap(&[0.5, 3.0, 2.5, -1.0]) - 0.5).abs() < 1e-9);
    }

    /// On the CPU kernels (tokens chosen on the host, in f64) every sampled token's interval,
    /// computed from the replayed logits, holds its replayed draw.
    #[test]
    fn replayed_draws_and_logits_explain_every_sampled_token() {
        let dir = tempfile::tempdir().unwrap();
        write_random_checkpoint(&Preset::Tiny.config(512, vec![2]), dir.path(), 7, StorageDtype::F32).unwrap();
        let device = Default::default();
        let model = load_pretrained::<burn::backend::Flex>(dir.path(), &device, LoadOptions::default()).unwrap();
        let prompts = vec![vec![5, 17, 300, 41], vec![9, 8]];
        let sampling = Sampling { temperature: 1.0, seed: SAMPLING_SEED, ..Sampling::default() };
        let config = SamplingConfig { max_new_tokens: 6, sampling, ..Default::default() };
        let sampled: Vec<Vec<u32>> = generate(&model, &prompts, &config).unwrap().into_iter().map(|s| s.tokens).collect();
        let logits = step_logits(&model, &prompts, &sampled, &device).unwrap();
        let draws = sampling_draws(2, 6);
        for (row, tokens) in sampled.iter().enumerate() {
            for (step, &token) in tokens.iter().enumerate() {
                let (start, end) = token_interval(&logits[row][step * 512..(step + 1) * 512], token as usize);
                let draw = draws[row][step];
                assert!(start - 1e-6 <= draw && draw < end + 1e-6, "row {row} step {step}: {draw} not in [{start}, {end})");
            }
        }
    }
}

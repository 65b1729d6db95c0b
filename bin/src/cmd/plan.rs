//! `prompt-r1 plan --config run.toml`: the memory a run will need at its peak, term by term
//! and phase by phase, and whether it fits the device; `train` checks the same plan at start.
//! The arithmetic is `trainer::plan`'s; this module reads the inputs and prints.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use model::tiny_tokenizer::TINY_VOCAB_SIZE;
use model::device_kernels::KernelPasses;
use model::{Compute, Preset, Qwen3Config};
use trainer::plan::{auto_kv_budget, format_size, kv_position_bytes, parse_device_memory, MemoryPlan, PlanDevice, PlanSettings, Verdict, AUTO_KV_BUDGET, PROMPT_ALLOWANCE};
use trainer::run::TrainConfig;

use crate::device::{total_memory, DeviceChoice};
use crate::model_dir::preset_parser;

/// Predict a run's peak memory before starting it: weights, adapters, gradients, optimiser
/// state, KL reference, rollout copy (or merged LoRA weights) and KV cache, activations with and without checkpointing;
/// and whether it fits the device (the model's config.json is read, no weights).
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// The run configuration (TOML), as for `train`.
    #[arg(long)]
    pub config: PathBuf,
    /// The device's memory (e.g. 80GiB, 80GB); default: run.device_memory, else the GPU's
    /// total where it can be read (CUDA), else this machine's RAM.
    #[arg(long, value_parser = device_memory_text)]
    pub device_memory: Option<String>,
    /// The device the run trains on: cpu, cuda, cuda:N or wgpu (the GPU backends run burn's
    /// tensor ops: with attn_implementation = "eager" their attention keeps [batch, heads, q, k]
    /// tensors, with "memory_efficient" blocks). A plan for a GPU needs no GPU here. On CUDA,
    /// with the GPU's memory known, each phase also counts the whole pages CubeCL's memory pool
    /// reserves around its largest tensors (their size classes follow the GPU's memory).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Tokens of the longest episode (default: 1024 for the prompt plus
    /// episode.max_response_tokens, within the model's max_position_embeddings).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub context: Option<usize>,
    /// Override the model directory (its config.json gives the shape).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Plan for a preset's shape (e.g. qwen3-8b) instead of the model directory's.
    #[arg(long, conflicts_with = "model", value_parser = preset_parser())]
    pub preset: Option<Preset>,
}

pub fn run(args: Args) -> Result<()> {
    let mut config = TrainConfig::from_toml_file(&args.config)?;
    if let Some(model) = &args.model {
        config.model = model.clone();
    }
    if let Some(size) = &args.device_memory {
        config.run.device_memory = Some(size.clone());
    }
    config.device_kernels = crate::device::device_kernels(args.device);
    let shape = match args.preset {
        Some(preset) => preset.config(TINY_VOCAB_SIZE, Vec::new()),
        None => model_shape(&config)?,
    };
    refuse_what_train_refuses(&config, &shape, args.device, args.context)?;
    let memory = device_memory(&config, args.device)?;
    if config.rollout.kv_budget_is_auto() {
        match &memory {
            Some(memory) => match settle_auto_kv_budget(&mut config, &shape, args.device, args.context, memory) {
                Ok(line) => println!("{line}"),
                Err(short) => println!("{short}; the plan below has no budget"),
            },
            None => println!(
                "rollout.kv_budget = \"{AUTO_KV_BUDGET}\": the memory of {:?} is unknown, so the plan has no budget; pass --device-memory",
                args.device
            ),
        }
    }
    let plan = MemoryPlan::new(settings_for(&config, shape, args.device, args.context, memory.as_ref()));
    print!("{}", describe(&plan));
    if let Some(note) = plan.settings.kv_budget_note() {
        println!("{note}");
    }
    match memory {
        Some((bytes, source)) => {
            let verdict = plan.check(bytes);
            print!("{}", describe_verdict(&plan, &verdict, bytes, &source));
        }
        None => println!(
            "device memory: unknown for {}; pass --device-memory to check the fit",
            args.device
        ),
    }
    if let Some((line, _)) = host_fit(&plan) {
        println!("{line}");
    }
    Ok(())
}

/// Fails where `train` would refuse the run whatever its data (an episode past the model's
/// context, a KV budget that holds none, a `--context` past the model's), rather than plan it;
/// notes where the plan's context is the model's, shorter than the default allowance.
fn refuse_what_train_refuses(config: &TrainConfig, shape: &Qwen3Config, device: DeviceChoice, context: Option<usize>) -> Result<()> {
    let most = shape.max_position_embeddings;
    if let Some(context) = context.filter(|&c| c > most) {
        bail!("--context {context} passes the model's context of {most} tokens (max_position_embeddings): `train` refuses longer episodes");
    }
    let responses = config.episode.max_response_tokens;
    if let Some(why) = settings_for(config, shape.clone(), device, context, None).refusal(responses) {
        bail!("{why}");
    }
    if context.is_none() && PROMPT_ALLOWANCE + responses > most {
        println!(
            "note: the plan's context is the model's {most} tokens (max_position_embeddings), less than \
             {PROMPT_ALLOWANCE} for the first prompt and episode.max_response_tokens = {responses}"
        );
    }
    Ok(())
}

/// On a GPU, the step's episodes against this machine's RAM (on the CPU they are in the
/// plan's phases): the line to print, and whether they fit. `None` on the CPU, or when the
/// RAM cannot be read.
fn host_fit(plan: &MemoryPlan) -> Option<(String, bool)> {
    if plan.settings.device.is_host() {
        return None;
    }
    let ram = trainer::run::total_ram_bytes()?;
    let usable = PlanDevice::CpuKernels.usable(ram);
    let episodes = plan.host_episodes();
    let fits = episodes.bytes <= usable;
    let verdict = if fits { "fits" } else { "does NOT fit: lower rollout.batch_size or rollout.n" };
    let line = format!(
        "host memory: {} {}, of this machine's {} RAM ({} usable): {verdict}",
        episodes.name,
        format_size(episodes.bytes),
        format_size(ram),
        format_size(usable)
    );
    Some((line, fits))
}

/// Settles `rollout.kv_budget = "auto"` against the device's `memory`
/// ([`trainer::plan::auto_kv_budget`]): the configuration gets the size it comes to, or no
/// budget where every episode in flight fits at the full context. Returns the line that says
/// which; the error says what is short where not even one episode fits.
fn settle_auto_kv_budget(
    config: &mut TrainConfig,
    shape: &Qwen3Config,
    device: DeviceChoice,
    context: Option<usize>,
    memory: &(u64, String),
) -> Result<String> {
    let (bytes, source) = memory;
    let mut settings = settings_for(config, shape.clone(), device, context, Some(memory));
    let budget = auto_kv_budget(&settings, *bytes)?;
    config.rollout.kv_budget = budget.map(|b| b.to_string());
    settings.rollout.kv_budget = budget;
    let auto = format!("rollout.kv_budget = \"{AUTO_KV_BUDGET}\"");
    let of_device = format!("{} ({source})", format_size(*bytes));
    Ok(match budget {
        _ if settings.rollout.workers.is_some() => format!("{auto}: the rollouts run on the workers, which hold their own caches"),
        None => format!(
            "{auto}: no budget needed: {} episodes in flight at the full context fit the {of_device}",
            settings.generation_batch
        ),
        Some(budget) => {
            let positions = budget / kv_position_bytes(&settings.model, settings.rollout_cache_dtype()).max(1);
            format!(
                "{auto}: {} ({} KV positions, {:.1} episodes at the full context of {}), what the {of_device} leaves \
                 the rollouts' cache after the plan's margin and the rollout phase's other terms",
                format_size(budget),
                positions,
                positions as f64 / settings.episode_kv_positions() as f64,
                settings.context
            )
        }
    })
}

/// The model's shape, from the model directory's config.json.
fn model_shape(config: &TrainConfig) -> Result<Qwen3Config> {
    let path = config.model.join("config.json");
    Qwen3Config::from_file(&path).with_context(|| format!("the model's shape ({})", path.display()))
}

/// What the plan assumes of a device, from the `compute` the model is loaded with: the CPU with
/// or without its CPU kernels, or a GPU whose prefill passes gather the KV cache or not (its
/// device kernels' choice, every pass under `--device-kernels all`).
pub fn plan_device(device: DeviceChoice, compute: &Compute) -> PlanDevice {
    match device {
        DeviceChoice::Cpu if !compute.cpu_kernels.is_on() => PlanDevice::CpuPortable,
        DeviceChoice::Cpu => PlanDevice::CpuKernels,
        DeviceChoice::Cuda(_) | DeviceChoice::Wgpu if compute.device_kernels.passes == Some(KernelPasses::All) => {
            PlanDevice::GpuPagedPrefill
        }
        DeviceChoice::Cuda(_) | DeviceChoice::Wgpu => PlanDevice::Gpu,
    }
}

/// The plan's settings of `config` on `device`: on CUDA with its memory known, the phases count
/// the whole pages of CubeCL's pool there.
fn settings_for(config: &TrainConfig, shape: Qwen3Config, device: DeviceChoice, context: Option<usize>, memory: Option<&(u64, String)>) -> PlanSettings {
    let mut settings = PlanSettings::from_config(config, shape, plan_device(device, &config.compute()), context);
    settings.cuda_memory = memory.and_then(|(bytes, _)| cuda_pages_memory(device, *bytes));
    settings
}

/// The memory whose CubeCL pages the plan counts: the GPU's on CUDA, none elsewhere (the CPU has
/// no such pool, and wgpu's pages follow its adapter's limits).
pub fn cuda_pages_memory(device: DeviceChoice, memory: u64) -> Option<u64> {
    matches!(device, DeviceChoice::Cuda(_)).then_some(memory)
}

/// A device's memory as written (checked as [`parse_device_memory`] does), kept as text so that
/// `run.device_memory` holds what the user wrote.
pub fn device_memory_text(text: &str) -> Result<String, model::SettingError> {
    parse_device_memory(text).map(|_| text.trim().to_owned())
}

/// The device's memory and where the figure comes from: `run.device_memory`, else what the
/// device reports; `None` when neither is known.
pub fn device_memory(config: &TrainConfig, device: DeviceChoice) -> Result<Option<(u64, String)>> {
    if let Some(size) = &config.run.device_memory {
        let bytes = parse_device_memory(size).context("run.device_memory")?;
        return Ok(Some((bytes, "as given".into())));
    }
    Ok(total_memory(device))
}

/// The plan as a table: what lives throughout, each phase at its worst moment, the
/// activations both ways, and the peak.
pub fn describe(plan: &MemoryPlan) -> String {
    let s = &plan.settings;
    let m = &s.model;
    let mut out = format!(
        "memory plan: {} layers, hidden {}, {} parameters, {}; micro-batch {} × {} tokens, {} episodes per rollout batch, {}, {} attention\n",
        m.num_hidden_layers,
        m.hidden_size,
        parameter_count(m.num_parameters() as u64),
        match &s.lora {
            Some(lora) => {
                let targets: Vec<&str> = lora.targets.iter().map(|t| t.name()).collect();
                format!("LoRA rank {} on {}", lora.rank, targets.join("/"))
            }
            None => "full fine-tuning".into(),
        },
        s.micro_batch,
        s.context,
        s.generation_batch,
        s.device,
        s.attention,
    );
    let line = |out: &mut String, name: &str, bytes: u64| {
        if bytes > 0 {
            out.push_str(&format!("    {name:<60} {:>10}\n", format_size(bytes)));
        }
    };
    out.push_str(&format!(
        "  held throughout{:>59}\n",
        format_size(plan.persistent_total())
    ));
    for term in &plan.persistent {
        line(&mut out, &term.name, term.bytes);
    }
    for phase in &plan.phases {
        let marker = if phase.name == plan.peak_phase().name {
            " (peak)"
        } else {
            ""
        };
        let title = format!("{}{marker}", phase.name);
        if phase.terms.is_empty() {
            // A phase the trainer does not run itself (rollouts on workers): its line says so.
            out.push_str(&format!("  {title}\n"));
            continue;
        }
        out.push_str(&format!(
            "  {title:<62} {:>10}\n",
            format_size(phase.total())
        ));
        for term in &phase.terms {
            line(&mut out, &term.name, term.bytes);
        }
    }
    let a = plan.activations;
    out.push_str(&format!(
        "  activations per micro-batch: {} without checkpointing, {} with (grpo.activation_checkpointing = {})\n",
        format_size(a.without_checkpointing),
        format_size(a.with_checkpointing),
        s.checkpointing
    ));
    out.push_str(&format!(
        "  peak: {} ({})\n",
        format_size(plan.peak()),
        plan.peak_phase().name
    ));
    out
}

/// A parameter count as model cards write it: `4.02B`, `596M`, `107k`.
fn parameter_count(n: u64) -> String {
    let n = n as f64;
    match n {
        _ if n >= 1e9 => format!("{:.2}B", n / 1e9),
        _ if n >= 1e6 => format!("{:.0}M", n / 1e6),
        _ => format!("{:.0}k", n / 1e3),
    }
}

/// Whether the plan fits, and if not, its largest terms and what to change.
pub fn describe_verdict(
    plan: &MemoryPlan,
    verdict: &Verdict,
    device_memory: u64,
    source: &str,
) -> String {
    let margin = plan.settings.device.margin() * 100.0;
    let mut out = format!(
        "device memory: {} ({source}); {} usable after a {margin:.0}% margin: ",
        format_size(device_memory),
        format_size(verdict.usable)
    );
    if verdict.fits {
        out.push_str(&format!(
            "fits ({} to spare)\n",
            format_size(verdict.usable - plan.peak())
        ));
        return out;
    }
    out.push_str(&format!(
        "does NOT fit ({} short)\n",
        format_size(plan.peak() - verdict.usable)
    ));
    let largest: Vec<String> = plan
        .largest_terms(3)
        .iter()
        .map(|t| format!("{} {}", t.name, format_size(t.bytes)))
        .collect();
    out.push_str(&format!("  largest terms: {}\n", largest.join("; ")));
    if plan.largest_terms(1).first().is_some_and(|t| t.name == plan.host_episodes().name) {
        out.push_str("  lower rollout.batch_size or rollout.n: the step's episodes are the largest term\n");
    }
    for advice in &verdict.advice {
        out.push_str(&format!("  try {advice}\n"));
    }
    if let Some(line) = auto_budget_advice(plan, device_memory) {
        out.push_str(&format!("  try {line}\n"));
    }
    out
}

/// `rollout.kv_budget = "auto"` as advice, where the budget it comes to on this device makes
/// the run fit and differs from the run's own.
fn auto_budget_advice(plan: &MemoryPlan, device_memory: u64) -> Option<String> {
    let budget = auto_kv_budget(&plan.settings, device_memory).ok()??;
    if plan.settings.rollout.kv_budget == Some(budget) {
        return None;
    }
    let mut settings = plan.settings.clone();
    settings.rollout.kv_budget = Some(budget);
    let with = MemoryPlan::new(settings);
    with.check(device_memory).fits.then(|| {
        format!(
            "rollout.kv_budget = \"{AUTO_KV_BUDGET}\" ({} on this device): peak {}",
            format_size(budget),
            format_size(with.peak())
        )
    })
}

/// Fails, before anything big is loaded, when the run's plan does not fit the device; prints
/// nothing when it fits and a note when the device's memory is unknown. `rollout.kv_budget =
/// "auto"` is settled first (a note says what it came to), and refused where the device's memory
/// is unknown. Returns the plan.
pub fn check_before_training(config: &mut TrainConfig, device: DeviceChoice) -> Result<MemoryPlan> {
    let memory = device_memory(config, device)?;
    let auto = config.rollout.kv_budget_is_auto();
    if auto && memory.is_none() {
        bail!(
            "rollout.kv_budget = \"{AUTO_KV_BUDGET}\" sizes the KV cache from the device's memory, which is unknown for \
             {device}: set run.device_memory (or --device-memory), or a size such as \"24GiB\""
        );
    }
    let shape = model_shape(config)?;
    if let Some(memory) = memory.as_ref().filter(|_| auto) {
        let line = settle_auto_kv_budget(config, &shape, device, None, memory)?;
        eprintln!("note: {line}");
    }
    let plan = MemoryPlan::new(settings_for(config, shape, device, None, memory.as_ref()));
    if let Some((line, false)) = host_fit(&plan) {
        bail!("this run's episodes do not fit in this machine's memory.\n{line}");
    }
    let Some((bytes, source)) = memory else {
        eprintln!("note: the memory of {device} is unknown, so the run's fit is not checked (set run.device_memory)");
        return Ok(plan);
    };
    let verdict = plan.check(bytes);
    if verdict.fits {
        return Ok(plan);
    }
    bail!(
        "this run needs about {} at its peak ({}), more than the {} usable of {} ({source}).\n{}\
         `prompt-r1 plan --config ...` shows every term; if the device has more memory, set run.device_memory \
         (or --device-memory)",
        format_size(plan.peak()),
        plan.peak_phase().name,
        format_size(verdict.usable),
        format_size(bytes),
        describe_verdict(&plan, &verdict, bytes, &source)
            .lines()
            .skip(1)
            .map(|l| format!("{}\n", l.trim_start()))
            .collect::<String>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;
    use model::cpu_kernels::Kernels;
    use model::device_kernels::DeviceKernelChoice;

    /// The plan follows the kernels the model is loaded with, not the environment's: the CPU
    /// kernels on the CPU, the device kernels' passes on a GPU.
    #[test]
    fn the_plan_follows_the_models_kernels() {
        let cpu = |kernels| Compute::default().with_cpu_kernels(kernels);
        assert_eq!(plan_device(DeviceChoice::Cpu, &cpu(Kernels::off())), PlanDevice::CpuPortable);
        assert_eq!(plan_device(DeviceChoice::Cpu, &cpu(Kernels::at(model::cpu_kernels::Isa::Portable))), PlanDevice::CpuKernels);
        let gpu = |passes| Compute::default().with_device_kernels(DeviceKernelChoice::with_passes(passes));
        assert_eq!(plan_device(DeviceChoice::Wgpu, &gpu(Some(KernelPasses::All))), PlanDevice::GpuPagedPrefill);
        assert_eq!(plan_device(DeviceChoice::Cuda(0), &gpu(Some(KernelPasses::All))), PlanDevice::GpuPagedPrefill);
        assert_eq!(plan_device(DeviceChoice::Wgpu, &gpu(Some(KernelPasses::Decode))), PlanDevice::Gpu);
        assert_eq!(plan_device(DeviceChoice::Cuda(0), &gpu(None)), PlanDevice::Gpu);
    }

    #[test]
    fn parameter_counts_read_as_model_cards_write_them() {
        assert_eq!(parameter_count(4_022_468_096), "4.02B");
        assert_eq!(parameter_count(596_049_920), "596M");
        assert_eq!(parameter_count(106_880), "107k");
    }

    /// What `train` hands the trainer: `rollout.kv_budget = "auto"` settled into a size (within
    /// `run.device_memory`, less than every episode would hold) that the rollouts' decoder takes
    /// as positions; with room for every episode, no budget at all.
    #[test]
    fn train_settles_an_auto_kv_budget_into_a_size_the_decoder_takes() {
        let dir = tempfile::tempdir().unwrap();
        let shape = Preset::Qwen3_0_6B.config(151_936, Vec::new());
        std::fs::write(dir.path().join("config.json"), shape.to_hf_json().to_string()).unwrap();
        let run = dir.path().join("run.toml");
        let toml = |memory: &str| {
            format!(
                "model = \".\"\n[data]\ntrain = [\"train.csv\"]\n[environment]\nbase_url = \"http://127.0.0.1:9/v1\"\n\
                 model = \"m\"\n[episode]\nmax_response_tokens = 8192\n[rollout]\ngeneration_batch = 64\nkv_budget = \"auto\"\n\
                 [grpo]\nactivation_checkpointing = true\n[run]\ndevice_memory = \"{memory}\"\n"
            )
        };
        std::fs::write(&run, toml("64GiB")).unwrap();
        let mut config = TrainConfig::from_toml_file(&run).unwrap();
        let plan = check_before_training(&mut config, DeviceChoice::Cpu).unwrap();
        let bytes: u64 = config.rollout.kv_budget.as_deref().expect("a budget").parse().unwrap();
        assert_eq!(plan.settings.rollout.kv_budget, Some(bytes));
        let per_position = kv_position_bytes(&shape, DType::F32);
        let limits = config.rollout.decoder_limits(&shape, DType::F32).unwrap();
        assert_eq!(limits.kv_budget, Some((bytes / per_position) as usize));
        assert!(plan.rollout_peak() <= (64u64 << 30) * 8 / 10, "within the CPU's 20% margin");

        std::fs::write(&run, toml("4TiB")).unwrap();
        let mut roomy = TrainConfig::from_toml_file(&run).unwrap();
        check_before_training(&mut roomy, DeviceChoice::Cpu).unwrap();
        assert_eq!(roomy.rollout.kv_budget, None);
    }
}

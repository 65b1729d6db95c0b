//! `prompt-r1`: the command-line entry point. Each subcommand lives in its own module under
//! `cmd/`; this file only parses arguments and dispatches.

#![forbid(unsafe_code)]

mod agent_flags;
mod cmd;
mod device;
mod model_dir;
mod panic_text;
mod plot;
mod scratch;
mod serve;

use clap::{Parser, Subcommand};
#[cfg(target_os = "linux")]
use model::cpu_kernels::large_alloc;
use device::KernelChoice;
use model::device_kernels::DecodingKernel;

/// Prompt-R1 in Rust: a small Qwen3 agent trained with GRPO to prompt a large LLM.
#[derive(Parser)]
#[command(name = "prompt-r1", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Megabytes of freed tensor buffers the binary's allocator may keep for reuse (default:
    /// half of RAM; 0 turns the cache off). It adds at most a quarter to peak memory.
    #[arg(long, global = true, value_name = "MB", env = "PROMPT_R1_ALLOC_CACHE_MB", value_parser = megabytes)]
    alloc_cache_mb: Option<usize>,
    /// burn's kernel fusion on the GPU backends (on or off). Off works around burn 0.21's
    /// fusion bugs ("Should have handle for tensor", NaN losses), at some speed.
    #[arg(long, global = true, value_name = "on|off", env = "PROMPT_R1_FUSION", default_value = "on",
          action = clap::ArgAction::Set, value_parser = crate::on_off)]
    fusion: bool,
    /// prompt-r1's own CubeCL kernels on the GPU backends: the attention of the passes over the
    /// paged KV cache read where it lies, the RMS norms as one kernel each (the residual
    /// addition before input_layernorm and post_attention_layernorm in it; q_norm and k_norm
    /// with RoPE and the write of the keys and values to the cache in one), SwiGLU's
    /// silu(gate)·up, and the choice of each sampled or greedy token as one kernel. `decode` (or
    /// `on`): the attention of decoding steps; `all`: of prefill chunks too, and a step's
    /// joining sequences run beside its decoding rows in one ragged pass (less memory, fewer
    /// passes; faster on an H200, slower on lavapipe); `auto`: `all` on CUDA, `decode` on wgpu;
    /// `off`: burn's ops everywhere, the keys and values of each layer gathered first (for
    /// comparisons, or to rule the kernels out).
    #[arg(long, global = true, value_name = "auto|decode|all|off", env = "PROMPT_R1_DEVICE_KERNELS", default_value = "auto",
          value_parser = kernel_passes)]
    device_kernels: KernelChoice,
    /// Split a decoding step's attention over a long context across more of the GPU (on or off):
    /// each row's columns are cut into spans, a block of threads each, joined by a second small
    /// kernel (FlashDecoding), where the step's blocks alone would leave most of the GPU's
    /// multiprocessors idle (few rows, contexts of 512 positions or more). CUDA only (wgpu
    /// reports no multiprocessors); off: one block walks all of a row's columns (for comparisons).
    #[arg(long, global = true, value_name = "on|off", env = "PROMPT_R1_SPLIT_DECODING", default_value = "on",
          action = clap::ArgAction::Set, value_parser = crate::on_off)]
    split_decoding: bool,
    /// The kernel that computes the attention of rows of one query on the GPU backends (decoding
    /// steps, and the decoding rows of ragged passes): `own` (a kernel made for them: a unit a
    /// column, 16-byte loads, four barriers a chunk of 128 columns) or `general` (the kernel that
    /// also takes prefill chunks, as before the thirtieth session; for comparisons).
    #[arg(long, global = true, value_name = "own|general", env = "PROMPT_R1_DECODING_KERNEL", default_value = "own",
          value_parser = decoding_kernel)]
    decoding_kernel: DecodingKernel,
    /// The projections of decoding steps (passes of at most 64 rows over the KV cache) on the GPU
    /// backends through prompt-r1's skinny-matmul kernel (on), or burn's matmul (off, for
    /// comparisons); auto: on for CUDA, off for wgpu (lavapipe ran a 64-row decoding step 1.9x
    /// slower through the kernel; no real GPU measured through wgpu). burn's matmul without
    /// autotune gives such a product a cube per 64 x 64 outputs, which leaves most of a GPU idle:
    /// 16 cubes for Qwen3-0.6B's down_proj at 64 rows, 205 us on an H200, where the kernel cuts
    /// the weight's rows across the GPU. Taken wherever --device-kernels runs any kernel.
    #[arg(long, global = true, value_name = "auto|on|off", env = "PROMPT_R1_SKINNY_MATMUL", default_value = "auto",
          value_parser = auto_on_off)]
    skinny_matmul: AutoOnOff,
    /// The attention of prefill chunks, scoring and a training step's forward on the GPU's
    /// tensor cores (on): 16 x 16 x 16 products of bf16 or f16 operands summed in f32, 64 (head,
    /// query) pairs a block of threads, walking the keys twice (the maxima and sums, then the
    /// outputs). Off (the default): the attention kernel's products on the CUDA cores. Taken
    /// where the GPU has tensor cores for the model's dtype (CUDA; bf16 from an A100 on) and
    /// --device-kernels gives the kernel such passes; f32 models and other GPUs keep the CUDA
    /// cores. Off by default until a GPU has checked and timed it (`prompt-r1 check-device`).
    #[arg(long, global = true, value_name = "on|off", env = "PROMPT_R1_TENSOR_CORE_ATTENTION", default_value = "off",
          action = clap::ArgAction::Set, value_parser = crate::on_off)]
    tensor_core_attention: bool,
    /// Folder of the GPU backends' persistent kernel and autotune caches (default:
    /// $XDG_CACHE_HOME/prompt-r1/cubecl, else ~/.cache/prompt-r1/cubecl).
    #[arg(long, global = true, value_name = "DIR", env = "PROMPT_R1_KERNEL_CACHE")]
    kernel_cache: Option<std::path::PathBuf>,
    /// Append the name of each GPU kernel CubeCL compiles to FILE. Unlike CubeCL's own
    /// CUBECL_DEBUG_LOG, this leaves CubeCL's profiler off: that one also times every kernel,
    /// making each wait for the GPU before and after it runs, which slowed decoding on lavapipe by
    /// 35-46%. (On wgpu it also creates the Vulkan instance with its debugging flags.)
    #[arg(long, global = true, value_name = "FILE", env = "PROMPT_R1_KERNEL_LOG")]
    kernel_log: Option<std::path::PathBuf>,
}

fn decoding_kernel(value: &str) -> Result<DecodingKernel, String> {
    let wanted = value.trim().to_ascii_lowercase();
    DecodingKernel::ALL
        .into_iter()
        .find(|kernel| kernel.name() == wanted)
        .ok_or_else(|| "own or general is expected (--decoding-kernel or PROMPT_R1_DECODING_KERNEL)".to_string())
}

fn kernel_passes(value: &str) -> Result<KernelChoice, String> {
    KernelChoice::parse(value)
        .ok_or_else(|| "auto, decode, all or off is expected (--device-kernels or PROMPT_R1_DEVICE_KERNELS)".to_string())
}

/// A switch's value: on or off (also true/false, yes/no, 1/0 and their first letters, as its
/// environment variable may give it).
pub(crate) fn on_off(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "t" | "yes" | "y" | "1" => Ok(true),
        "off" | "false" | "f" | "no" | "n" | "0" => Ok(false),
        _ => Err("on or off is expected".to_string()),
    }
}

/// A setting that is `auto` (`None`: each backend's default), on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AutoOnOff(Option<bool>);

/// `auto`, or on or off as [`on_off`] reads them.
fn auto_on_off(value: &str) -> Result<AutoOnOff, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(AutoOnOff(None)),
        other => on_off(other).map(|on| AutoOnOff(Some(on))).map_err(|_| "auto, on or off is expected".to_string()),
    }
}

/// Opens `path` for appending, making its folder: CubeCL would panic on a log file it cannot
/// open.
fn open_for_appending(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::OpenOptions::new().create(true).append(true).open(path)
}

/// A whole number of megabytes; the message names both ways of giving it.
fn megabytes(value: &str) -> Result<usize, String> {
    value.trim().parse().map_err(|_| {
        "a whole number of megabytes is expected (--alloc-cache-mb or PROMPT_R1_ALLOC_CACHE_MB)".to_string()
    })
}

#[derive(Subcommand)]
enum Command {
    /// Train the agent with GRPO against a large LLM (config in TOML).
    Train(cmd::train::Args),
    /// Predict a run's peak memory, term by term, and whether it fits the device.
    Plan(cmd::plan::Args),
    /// Fine-tune a model on chat transcripts or saved episodes, assistant tokens only (config in TOML).
    Sft(cmd::sft::Args),
    /// Export a training checkpoint as a Hugging Face model directory.
    Export(cmd::export::Args),
    /// Run the built-in demo on a fresh machine (no downloads).
    Demo(cmd::demo::Args),
    /// Send one short request to the environment LLM: latency and reply, or what is wrong.
    EnvCheck(cmd::env_check::Args),
    /// Generate text or token ids from a model directory.
    Generate(cmd::generate::Args),
    /// Print the log-probability of each completion token given a prompt.
    Score(cmd::score::Args),
    /// Write a randomly initialised checkpoint (no download needed).
    InitModel(cmd::init_model::Args),
    /// Measure load, prefill, decode and scoring speed with peak memory.
    Bench(cmd::bench::Args),
    /// Compare a device's results with the CPU reference on one model (a GPU host's self-test).
    CheckDevice(cmd::check_device::Args),
    Reward(cmd::reward::Args),
    Metrics(cmd::metrics::Args),
    Serve(cmd::serve::Args),
    Infer(cmd::infer::Args),
    Eval(cmd::eval::Args),
    /// Draw a run's training curves (metrics.jsonl) to a PNG.
    Plot(cmd::plot::Args),
}

/// Keeps freed tensor buffers for reuse instead of returning them to the kernel.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: large_alloc::CachingAllocator = large_alloc::CachingAllocator;

fn main() {
    if let Err(e) = model::cpu_kernels::Kernels::from_env() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let cli = Cli::parse();
    if let Some(path) = &cli.kernel_log {
        if let Err(e) = open_for_appending(path) {
            eprintln!("error: --kernel-log {}: {e}", path.display());
            std::process::exit(2);
        }
    }
    device::set_gpu_options(device::GpuOptions {
        fusion: cli.fusion,
        device_kernels: cli.device_kernels,
        split_decoding: cli.split_decoding,
        decoding_kernel: cli.decoding_kernel,
        skinny_matmul: cli.skinny_matmul.0,
        tensor_core_attention: cli.tensor_core_attention,
        kernel_cache: cli.kernel_cache,
        kernel_log: cli.kernel_log,
    });
    #[cfg(target_os = "linux")]
    large_alloc::configure(cli.alloc_cache_mb);
    let result = match cli.command {
        Command::Train(args) => cmd::train::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Sft(args) => cmd::sft::run(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Demo(args) => cmd::demo::run(args),
        Command::EnvCheck(args) => cmd::env_check::run(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Score(args) => cmd::score::run(args),
        Command::InitModel(args) => cmd::init_model::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::CheckDevice(args) => cmd::check_device::run(args),
        Command::Reward(args) => cmd::reward::run(args),
        Command::Metrics(args) => cmd::metrics::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Infer(args) => cmd::infer::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Plot(args) => cmd::plot::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {}", error_text(&err));
        std::process::exit(1);
    }
}

/// `err` and its causes joined by ": ", leaving out a cause whose text already ends the line
/// (our error types name their source in their own message, e.g. "cannot read tokenizer file
/// F: No such file or directory", which `{:#}` would repeat).
fn error_text(err: &anyhow::Error) -> String {
    let mut text = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !text.ends_with(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::tokenizer::TokenizerError;

    #[test]
    fn causes_are_named_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let read = TokenizerError::Read { path: "t.json".into(), source: io() };
        let err = anyhow::Error::new(read);
        let once = "cannot read tokenizer file t.json: no such file";
        assert_eq!(format!("{err:#}"), format!("{once}: no such file"));
        assert_eq!(error_text(&err), once);
        let err = err.context("loading the agent");
        assert_eq!(error_text(&err), format!("loading the agent: {once}"));
        let err = anyhow::Error::new(io()).context("reading data/train.csv");
        assert_eq!(error_text(&err), "reading data/train.csv: no such file");
    }

    /// A switch takes on or off (and the spellings its environment variable may use); a bad
    /// value's error says so, and `--help` shows no `true, false` beside `on|off`.
    #[test]
    fn switches_are_on_or_off() {
        for (value, on) in [("on", true), ("OFF", false), ("true", true), ("0", false), (" yes ", true)] {
            assert_eq!(on_off(value), Ok(on), "{value}");
        }
        let cli = Cli::try_parse_from(["prompt-r1", "--fusion", "off", "demo"]).expect("parses");
        assert!(!cli.fusion);
        let err = Cli::try_parse_from(["prompt-r1", "--fusion", "maybe", "demo"]).err().expect("refused").to_string();
        assert!(err.contains("on or off is expected"), "{err}");
        let mut command = <Cli as clap::CommandFactory>::command();
        let help = command.render_long_help().to_string();
        assert!(help.contains("--fusion <on|off>") && !help.contains("possible values: true, false"), "{help}");
    }

    /// `--kernel-log`'s file is opened (its folder made) before CubeCL, which would panic on
    /// one it cannot open, sees it.
    #[test]
    fn the_kernel_log_is_opened_before_cubecl_sees_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("logs").join("kernels.log");
        open_for_appending(&log).expect("the folder is made");
        assert!(log.is_file());
        let under_a_file = log.join("kernels.log");
        assert!(open_for_appending(&under_a_file).is_err());
    }

    /// `--device-kernels` takes the passes by name, `auto`, and the old on/off spellings
    /// (scripts and `PROMPT_R1_DEVICE_KERNELS=0` keep working); anything else names the flag.
    /// `auto`, the default, is every pass on CUDA and decoding steps on wgpu; the CPU never
    /// takes them.
    #[test]
    fn device_kernels_are_named_by_their_passes() {
        use device::DeviceChoice;
        use model::device_kernels::KernelPasses;
        for (value, passes) in [("decode", Some(KernelPasses::Decode)), ("on", Some(KernelPasses::Decode)), ("1", Some(KernelPasses::Decode)), ("All", Some(KernelPasses::All)), ("off", None), ("0", None)] {
            let choice = KernelChoice::Passes(passes);
            assert_eq!(kernel_passes(value), Ok(choice), "{value}");
            let cli = Cli::try_parse_from(["prompt-r1", "--device-kernels", value, "demo"]).expect("parses");
            assert_eq!(cli.device_kernels, choice, "{value}");
            assert_eq!(choice.passes_on(DeviceChoice::Cuda(0)), passes, "{value}");
            assert_eq!(choice.passes_on(DeviceChoice::Wgpu), passes, "{value}");
            assert_eq!(choice.passes_on(DeviceChoice::Cpu), None, "{value}");
        }
        assert_eq!(kernel_passes(" Auto "), Ok(KernelChoice::Auto));
        assert_eq!(KernelChoice::Auto.passes_on(DeviceChoice::Cuda(1)), Some(KernelPasses::All));
        assert_eq!(KernelChoice::Auto.passes_on(DeviceChoice::Wgpu), Some(KernelPasses::Decode));
        assert_eq!(KernelChoice::Auto.passes_on(DeviceChoice::Cpu), None);
        if std::env::var_os("PROMPT_R1_DEVICE_KERNELS").is_none() {
            let default = Cli::try_parse_from(["prompt-r1", "demo"]).expect("parses");
            assert_eq!(default.device_kernels, KernelChoice::Auto);
        }
        let err = kernel_passes("prefill").unwrap_err();
        assert!(err.contains("--device-kernels") && err.contains("PROMPT_R1_DEVICE_KERNELS"), "{err}");
    }

    /// `--split-decoding` is on unless turned off (on/off, as `--fusion`).
    #[test]
    fn decoding_steps_split_unless_turned_off() {
        for (value, split) in [("off", false), ("0", false), ("on", true), ("true", true)] {
            let cli = Cli::try_parse_from(["prompt-r1", "--split-decoding", value, "demo"]).expect("parses");
            assert_eq!(cli.split_decoding, split, "{value}");
        }
        if std::env::var_os("PROMPT_R1_SPLIT_DECODING").is_none() {
            assert!(Cli::try_parse_from(["prompt-r1", "demo"]).expect("parses").split_decoding);
        }
        assert!(Cli::try_parse_from(["prompt-r1", "--split-decoding", "sometimes", "demo"]).is_err());
    }

    /// `--skinny-matmul` is auto (each backend's default) unless turned on or off.
    #[test]
    fn skinny_matmul_is_auto_unless_asked() {
        for (value, on) in [("off", Some(false)), ("no", Some(false)), ("on", Some(true)), ("1", Some(true)), (" Auto ", None)] {
            let cli = Cli::try_parse_from(["prompt-r1", "--skinny-matmul", value, "demo"]).expect("parses");
            assert_eq!(cli.skinny_matmul.0, on, "{value}");
        }
        if std::env::var_os("PROMPT_R1_SKINNY_MATMUL").is_none() {
            assert_eq!(Cli::try_parse_from(["prompt-r1", "demo"]).expect("parses").skinny_matmul.0, None);
        }
        assert!(Cli::try_parse_from(["prompt-r1", "--skinny-matmul", "maybe", "demo"]).is_err());
    }

    /// `--tensor-core-attention` is off unless turned on.
    #[test]
    fn tensor_core_attention_is_off_unless_asked() {
        for (value, on) in [("off", false), ("on", true), (" yes ", true)] {
            let cli = Cli::try_parse_from(["prompt-r1", "--tensor-core-attention", value, "demo"]).expect("parses");
            assert_eq!(cli.tensor_core_attention, on, "{value}");
        }
        if std::env::var_os("PROMPT_R1_TENSOR_CORE_ATTENTION").is_none() {
            assert!(!Cli::try_parse_from(["prompt-r1", "demo"]).expect("parses").tensor_core_attention);
        }
        assert!(Cli::try_parse_from(["prompt-r1", "--tensor-core-attention", "auto", "demo"]).is_err());
    }

    /// `--decoding-kernel` is `own` unless `general` is asked for; anything else names both ways
    /// of giving it.
    #[test]
    fn decoding_kernel_is_its_own_unless_asked() {
        for (value, kernel) in [("own", DecodingKernel::Own), (" General ", DecodingKernel::General)] {
            let cli = Cli::try_parse_from(["prompt-r1", "--decoding-kernel", value, "demo"]).expect("parses");
            assert_eq!(cli.decoding_kernel, kernel, "{value}");
        }
        if std::env::var_os("PROMPT_R1_DECODING_KERNEL").is_none() {
            assert_eq!(Cli::try_parse_from(["prompt-r1", "demo"]).expect("parses").decoding_kernel, DecodingKernel::Own);
        }
        let err = decoding_kernel("flash").unwrap_err();
        assert!(err.contains("--decoding-kernel") && err.contains("PROMPT_R1_DECODING_KERNEL"), "{err}");
    }
}

//! Choosing the compute backend at run time: `--device cpu` (burn-flex, pure Rust),
//! `--device cuda[:N]` (burn-cuda, in builds with the `cuda` feature) or `--device wgpu` (burn's
//! wgpu backend on Vulkan, in builds with the `wgpu` feature; it runs the CUDA backend's CubeCL
//! kernels). Commands write their work once, generic over the backend, as an [`OnBackend`] task.

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod gpu;

use std::str::FromStr;

use anyhow::Result;
use burn::tensor::{backend::Backend, DType};

use crate::model_dir::parse_dtype;

/// `--device` and `--dtype`, for every command that runs a model for inference.
#[derive(clap::Args, Debug, Clone)]
pub struct ComputeArgs {
    /// Compute device: cpu, cuda, cuda:N or wgpu. On the GPU backends `--fusion off` turns
    /// burn's kernel fusion off.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Weight dtype on the device: f32 or bf16. bf16 halves the memory; on CPUs with AVX-512
    /// BF16 it is also the faster choice (wgpu has no bf16).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    #[command(flatten)]
    pub attention: AttentionArgs,
}

impl ComputeArgs {
    /// How the model is loaded: `--dtype`, the attention flags, f32 products, the GPU kernels
    /// for `--device`.
    pub fn load_options(&self) -> model::LoadOptions {
        model::LoadOptions { dtype: self.dtype, compute: self.attention.compute(model::MatmulPrecision::F32, self.device) }
    }
}

/// `--attn-implementation` and `--attention-block-size`: how attention computes (the model's
/// [`model::Compute`], chosen at load).
#[derive(clap::Args, Debug, Clone)]
pub struct AttentionArgs {
    /// Attention's implementation: memory_efficient (blocks of queries and keys with an online
    /// softmax; no [batch, heads, queries, keys] tensor; the GPU path's default) or eager (HF's
    /// formula, the reference). On the CPU with its kernels on, the fused CPU kernel runs for both.
    #[arg(long, default_value = "memory_efficient", value_parser = clap::value_parser!(model::AttnImplementation))]
    pub attn_implementation: model::AttnImplementation,
    /// Queries per block of the memory-efficient attention (and the fewest keys per block).
    #[arg(long, default_value_t = model::qwen3::compute::DEFAULT_ATTENTION_BLOCK_SIZE, value_parser = parse_block_size)]
    pub attention_block_size: usize,
    /// The CPU kernels (burn-flex only): what the environment says (`PROMPT_R1_CPU_ISA`,
    /// `PROMPT_R1_BF16_PRODUCTS`, `PROMPT_R1_PORTABLE_OPS`), read once; `bench` sets its flags'.
    #[arg(skip)]
    pub cpu_kernels: model::cpu_kernels::Kernels,
}

/// A block size of at least 1.
fn parse_block_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("\"{s}\" is not a block size: use a whole number of at least 1")),
    }
}

impl AttentionArgs {
    /// The model's [`model::Compute`] on `device` with products at `matmul`.
    pub fn compute(&self, matmul: model::MatmulPrecision, device: DeviceChoice) -> model::Compute {
        model::Compute {
            attn_implementation: self.attn_implementation,
            attention_block_size: self.attention_block_size,
            matmul,
            cpu_kernels: self.cpu_kernels,
            device_kernels: device_kernels(device),
        }
    }
}

/// A device named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
    /// wgpu's default adapter (`CUBECL_WGPU_DEFAULT_DEVICE` picks another).
    Wgpu,
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            "wgpu" => Ok(Self::Wgpu),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!("unknown device \"{other}\": use cpu, cuda, cuda:N or wgpu")),
            },
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    /// As `--device` takes it: `cpu`, `cuda:N`, `wgpu`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::Wgpu => f.write_str("wgpu"),
        }
    }
}

/// Work that runs on whichever backend the user picked.
pub trait OnBackend {
    type Output;
    fn run<B: Backend>(self, device: B::Device) -> Result<Self::Output>;
}

/// Settings of the GPU backends, from the command line or their environment variables.
#[derive(Debug, Clone)]
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
pub struct GpuOptions {
    /// burn's kernel fusion (`--fusion`, `PROMPT_R1_FUSION`).
    pub fusion: bool,
    /// The passes prompt-r1's CubeCL kernels take (`--device-kernels`,
    /// `PROMPT_R1_DEVICE_KERNELS`).
    pub device_kernels: KernelChoice,
    /// Whether the paged-attention kernel splits a decoding step's columns into spans where the
    /// GPU would otherwise sit idle (`--split-decoding`, `PROMPT_R1_SPLIT_DECODING`).
    pub split_decoding: bool,
    /// The kernel of rows of one query (`--decoding-kernel`, `PROMPT_R1_DECODING_KERNEL`).
    pub decoding_kernel: model::device_kernels::DecodingKernel,
    /// Whether decoding steps' projections run through the skinny-matmul kernel
    /// (`--skinny-matmul`, `PROMPT_R1_SKINNY_MATMUL`); `None`: on CUDA, not on wgpu.
    pub skinny_matmul: Option<bool>,
    /// Whether the attention's blocks of several queries multiply on the tensor cores, where the
    /// GPU has them (`--tensor-core-attention`, `PROMPT_R1_TENSOR_CORE_ATTENTION`).
    pub tensor_core_attention: bool,
    /// The folder of CubeCL's persistent caches (`--kernel-cache`, `PROMPT_R1_KERNEL_CACHE`).
    pub kernel_cache: Option<std::path::PathBuf>,
    /// Where CubeCL's compilation log goes, without its profiler (`--kernel-log`,
    /// `PROMPT_R1_KERNEL_LOG`).
    pub kernel_log: Option<std::path::PathBuf>,
}

static GPU_OPTIONS: std::sync::OnceLock<GpuOptions> = std::sync::OnceLock::new();

/// Sets the GPU backends' options once, before any work (later calls are ignored).
pub fn set_gpu_options(options: GpuOptions) {
    let _ = GPU_OPTIONS.set(options);
}

/// The GPU backends' options: as set, else fusion and our kernels on and the default cache folder.
pub(crate) fn gpu_options() -> GpuOptions {
    GPU_OPTIONS.get().cloned().unwrap_or(GpuOptions {
        fusion: true,
        device_kernels: KernelChoice::Auto,
        split_decoding: true,
        decoding_kernel: model::device_kernels::DecodingKernel::Own,
        skinny_matmul: None,
        tensor_core_attention: false,
        kernel_cache: None,
        kernel_log: None,
    })
}

/// The GPU kernels a model loaded for `device` runs (part of its [`model::Compute`]), as the
/// GPU options say ([`GpuOptions::device_kernels`]).
pub fn device_kernels(device: DeviceChoice) -> model::DeviceKernelChoice {
    gpu_options().device_kernels(device)
}

impl GpuOptions {
    /// The GPU kernels a model loaded for `device` runs: the passes `--device-kernels` gives them
    /// there, decoding steps cut and computed as `--split-decoding` and `--decoding-kernel` say,
    /// their projections as `--skinny-matmul` says (auto: the kernel on CUDA only), the
    /// attention's blocks of queries on the tensor cores as `--tensor-core-attention` says; none
    /// on the CPU.
    pub fn device_kernels(&self, device: DeviceChoice) -> model::DeviceKernelChoice {
        model::DeviceKernelChoice {
            passes: self.device_kernels.passes_on(device),
            decoding: model::device_kernels::Decoding { split: self.split_decoding, kernel: self.decoding_kernel },
            skinny_matmul: self.skinny_matmul.unwrap_or(matches!(device, DeviceChoice::Cuda(_))),
            tensor_cores: self.tensor_core_attention,
        }
    }
}

/// `--device-kernels`: the passes prompt-r1's CubeCL kernels take on the GPU backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    /// Each backend's measured best: every pass on CUDA (an H200 ran prefill 1.8x and the
    /// rollout bench 1.2x faster so, BENCHMARKS.md), decoding steps only on wgpu (lavapipe ran
    /// prefill through the kernel slower; no real GPU measured through wgpu).
    Auto,
    /// These passes on every GPU backend; `None`: burn's ops everywhere.
    Passes(Option<model::device_kernels::KernelPasses>),
}

impl KernelChoice {
    /// A setting: `auto`, or what [`model::device_kernels::KernelPasses::parse_setting`]
    /// takes (`decode`, `all`, `off` and the on/off spellings); `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        if value.trim().eq_ignore_ascii_case("auto") {
            return Some(Self::Auto);
        }
        model::device_kernels::KernelPasses::parse_setting(value).map(Self::Passes)
    }

    /// The passes the kernels take on `device` (`None`: off, and always on the CPU).
    pub fn passes_on(self, device: DeviceChoice) -> Option<model::device_kernels::KernelPasses> {
        use model::device_kernels::KernelPasses;
        match (self, device) {
            (_, DeviceChoice::Cpu) => None,
            (Self::Passes(passes), _) => passes,
            (Self::Auto, DeviceChoice::Cuda(_)) => Some(KernelPasses::All),
            (Self::Auto, DeviceChoice::Wgpu) => Some(KernelPasses::Decode),
        }
    }
}

/// Runs `task` on the chosen device.
pub fn run_on<T: OnBackend>(choice: DeviceChoice, task: T) -> Result<T::Output> {
    match choice {
        DeviceChoice::Cpu => task.run::<burn::backend::Flex>(Default::default()),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(index) => gpu::run_on_cuda(index, task),
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => gpu::run_on_wgpu(task),
        #[cfg(not(all(feature = "cuda", feature = "wgpu")))]
        other => Err(not_built(other)),
    }
}

/// Fails with the reason when the chosen device cannot run work (no support for it in this
/// build, no driver), before any work starts.
pub fn check_available(choice: DeviceChoice) -> Result<()> {
    match choice {
        DeviceChoice::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(index) => gpu::check_cuda(index),
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => gpu::check_wgpu(),
        #[cfg(not(all(feature = "cuda", feature = "wgpu")))]
        other => Err(not_built(other)),
    }
}

/// The device's total memory and where the figure comes from: the machine's RAM for the CPU,
/// the GPU's total for CUDA (in builds with it); `None` where it cannot be read (wgpu).
pub fn total_memory(choice: DeviceChoice) -> Option<(u64, String)> {
    match choice {
        DeviceChoice::Cpu => trainer::run::total_ram_bytes().map(|b| (b, "this machine's RAM".to_owned())),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(index) => gpu::cuda_total_memory(index).map(|b| (b, format!("GPU {index}'s total"))),
        _ => None,
    }
}

pub use trainer::run::DeviceMemory;

/// The chosen GPU's memory now; `None` for the CPU (or a GPU whose runtime has not started).
pub fn device_memory(choice: DeviceChoice) -> Option<DeviceMemory> {
    match choice {
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(index) => gpu::cuda_memory(index),
        #[cfg(feature = "wgpu")]
        DeviceChoice::Wgpu => gpu::wgpu_memory(),
        _ => None,
    }
}

/// [`device_memory`] as the trainer reads it ([`trainer::run::Trainer::watch_device_memory`]);
/// `None` for the CPU, which has no pool to read.
pub fn memory_probe(choice: DeviceChoice) -> Option<trainer::run::DeviceMemoryProbe> {
    (choice != DeviceChoice::Cpu).then(|| std::sync::Arc::new(move || device_memory(choice)) as trainer::run::DeviceMemoryProbe)
}

/// The largest GPU memory ([`device_memory`]) seen at the moments it is sampled. CubeCL keeps
/// one memory pool per thread that issues tensor operations, so [`MemoryProbe::sample`] must be
/// called from that thread (e.g. after each step): a peak between two samples is missed, the
/// reserved bytes (which only grow until the pool is cleaned) are not.
pub struct MemoryProbe {
    choice: DeviceChoice,
    peak: std::cell::Cell<DeviceMemory>,
}

impl MemoryProbe {
    /// A probe of `choice`'s memory; `None` for the CPU.
    pub fn new(choice: DeviceChoice) -> Option<Self> {
        device_memory(choice).map(|now| Self { choice, peak: std::cell::Cell::new(now) })
    }

    /// Records the memory now, on this thread's pool.
    pub fn sample(&self) {
        self.record();
    }

    /// The largest figures since the last call (or the start), then starts over from now.
    pub fn take(&self) -> DeviceMemory {
        let (peak, now) = self.record();
        self.peak.set(now);
        peak
    }

    /// Adds the memory now to the peak; returns the peak and the memory now.
    fn record(&self) -> (DeviceMemory, DeviceMemory) {
        let now = device_memory(self.choice).unwrap_or_default();
        let p = self.peak.get();
        let peak = DeviceMemory { in_use: p.in_use.max(now.in_use), reserved: p.reserved.max(now.reserved) };
        self.peak.set(peak);
        (peak, now)
    }
}

/// The error for a device whose backend this binary was built without.
#[cfg(not(all(feature = "cuda", feature = "wgpu")))]
fn not_built(choice: DeviceChoice) -> anyhow::Error {
    let (name, feature) = if choice == DeviceChoice::Wgpu { ("wgpu", "wgpu") } else { ("CUDA", "cuda") };
    anyhow::anyhow!(
        "this binary was built without {name} support: rebuild with `cargo build --release --features {feature}`, or use --device cpu"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(3)));
        assert_eq!("wgpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Wgpu));
        assert!("gpu".parse::<DeviceChoice>().is_err());
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
        for device in [DeviceChoice::Cpu, DeviceChoice::Cuda(0), DeviceChoice::Cuda(3), DeviceChoice::Wgpu] {
            assert_eq!(device.to_string().parse::<DeviceChoice>(), Ok(device), "shown as --device takes it");
        }
    }

    #[test]
    fn a_model_is_loaded_with_the_kernels_its_device_and_the_flags_give() {
        use model::device_kernels::{Decoding, DecodingKernel, KernelPasses};
        let defaults = GpuOptions {
            fusion: true,
            device_kernels: KernelChoice::Auto,
            split_decoding: true,
            decoding_kernel: DecodingKernel::Own,
            skinny_matmul: None,
            tensor_core_attention: false,
            kernel_cache: None,
            kernel_log: None,
        };
        let passes = |options: &GpuOptions, device| options.device_kernels(device).passes;
        assert_eq!(passes(&defaults, DeviceChoice::Cpu), None, "no GPU kernel on the CPU");
        assert_eq!(passes(&defaults, DeviceChoice::Cuda(1)), Some(KernelPasses::All));
        assert_eq!(passes(&defaults, DeviceChoice::Wgpu), Some(KernelPasses::Decode));
        assert_eq!(defaults.device_kernels(DeviceChoice::Cuda(0)).decoding, Decoding { split: true, kernel: DecodingKernel::Own });
        let chosen = GpuOptions {
            device_kernels: KernelChoice::Passes(Some(KernelPasses::Decode)),
            split_decoding: false,
            decoding_kernel: DecodingKernel::General,
            ..defaults.clone()
        };
        assert_eq!(passes(&chosen, DeviceChoice::Cuda(0)), Some(KernelPasses::Decode));
        assert_eq!(passes(&chosen, DeviceChoice::Cpu), None, "not even when asked for");
        assert_eq!(chosen.device_kernels(DeviceChoice::Wgpu).decoding, Decoding { split: false, kernel: DecodingKernel::General });
        assert!(defaults.device_kernels(DeviceChoice::Cuda(0)).skinny_matmul, "the skinny matmul by default on CUDA");
        assert!(!defaults.device_kernels(DeviceChoice::Wgpu).skinny_matmul, "not on wgpu");
        let plain = GpuOptions { skinny_matmul: Some(false), ..defaults.clone() };
        assert!(!plain.device_kernels(DeviceChoice::Cuda(0)).skinny_matmul);
        let asked = GpuOptions { skinny_matmul: Some(true), ..defaults.clone() };
        assert!(asked.device_kernels(DeviceChoice::Wgpu).skinny_matmul);
        assert!(!defaults.device_kernels(DeviceChoice::Cuda(0)).tensor_cores, "the tensor cores only when asked for");
        let tensor_cores = GpuOptions { tensor_core_attention: true, ..defaults.clone() };
        assert!(tensor_cores.device_kernels(DeviceChoice::Cuda(0)).tensor_cores && tensor_cores.device_kernels(DeviceChoice::Wgpu).tensor_cores);
        let off = GpuOptions { device_kernels: KernelChoice::Passes(None), ..defaults };
        assert_eq!(passes(&off, DeviceChoice::Cuda(0)), None);
    }
}

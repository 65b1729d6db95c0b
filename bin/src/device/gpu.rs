//! The GPU backends, both CubeCL runtimes: CUDA (kernels compiled by NVRTC) and wgpu on Vulkan
//! (kernels compiled to SPIR-V). Before the first use this sets CubeCL's persistent caches, probes
//! the device (a missing runtime becomes an error naming its cause), and runs the task with
//! burn's kernel fusion on, or off with `--fusion off` (`PROMPT_R1_FUSION=0`), and prompt-r1's own
//! CubeCL kernels (`prompt-r1-device-kernels`) lent to the backend; the models a command loads
//! run them as their `Compute` says (`--device-kernels`, see [`super::device_kernels`]). A panic
//! inside the
//! backend becomes an error that says how to try without fusion; one on CubeCL's own device
//! threads (which CubeCL would swallow, computing on with a tensor never written, e.g. after an
//! allocation the device refused) stops the process with its cause.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Once;

use anyhow::{anyhow, bail, Result};
use burn::cubecl::config::cache::CacheConfig;
use burn::cubecl::config::compilation::CompilationLogLevel;
use burn::cubecl::config::profiling::ProfilingLogLevel;
use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use burn::tensor::backend::Backend;
use device_kernels::DeviceKernels;
use model::probe::probe_device;

use super::OnBackend;

/// Whether burn's kernel fusion is on (`--fusion`, `PROMPT_R1_FUSION`; default on).
fn fusion_enabled() -> bool {
    super::gpu_options().fusion
}

/// Where CubeCL keeps compiled kernels and autotune results between processes:
/// `--kernel-cache` (`$PROMPT_R1_KERNEL_CACHE`), else `$XDG_CACHE_HOME/prompt-r1/cubecl`, else
/// `~/.cache/prompt-r1/cubecl`.
fn cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    super::gpu_options().kernel_cache.or_else(|| {
        let base = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|home| home.join(".cache")))?;
        Some(base.join("prompt-r1").join("cubecl"))
    })
}

/// Sets CubeCL's configuration once, before its first use: what a `cubecl.toml` (or `burn.toml`)
/// in the working directory or above it says, with `CUBECL_*` variables applied, and unless
/// that file chose otherwise, compiled kernels (PTX, SPIR-V) and autotune results kept in
/// [`cache_dir`]. CubeCL's defaults keep no compiled kernels and write autotune results into the
/// `target/` of whatever Cargo project holds the working directory. `--kernel-log` adds the
/// compilation log; a note on stderr says when CubeCL's profiler will time every kernel.
fn configure_cubecl() {
    static CONFIGURED: Once = Once::new();
    CONFIGURED.call_once(|| {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        if let Some(dir) = cache_dir() {
            if config.compilation.cache.is_none() {
                config.compilation.cache = Some(CacheConfig::File(dir.clone()));
            }
            if matches!(config.autotune.cache, CacheConfig::Target) {
                config.autotune.cache = CacheConfig::File(dir);
            }
        }
        if let Some(file) = super::gpu_options().kernel_log {
            log_compilations(&mut config, file);
        }
        if profiles_every_kernel(&config) {
            eprintln!(
                "note: CubeCL's profiler times every GPU kernel in this run (CUBECL_DEBUG_LOG, CUBECL_DEBUG_OPTION or a \
                 cubecl.toml asks for it): each kernel waits for the GPU before and after it runs, so the run is slower \
                 than without it. For the compilation log alone use --kernel-log FILE (PROMPT_R1_KERNEL_LOG)"
            );
        }
        CubeClRuntimeConfig::set(config);
    });
}

/// Appends CubeCL's compilation log to `file`: each kernel's name as it compiles (`basic`; a
/// configuration that asks for more, such as `CUBECL_DEBUG_LOG`'s `full` with the sources, keeps
/// it). Its profiler stays as the configuration has it. `full` would also compile every kernel
/// with debug scopes, so a timed run logs at `basic`.
fn log_compilations(config: &mut CubeClRuntimeConfig, file: PathBuf) {
    if matches!(config.compilation.logger.level, CompilationLogLevel::Disabled) {
        config.compilation.logger.level = CompilationLogLevel::Basic;
    }
    config.compilation.logger.file = Some(file);
}

/// Whether CubeCL's profiler times each kernel launch, which then waits for the GPU before and
/// after it runs (cubecl-runtime 0.10's `ComputeClient::launch_inner`: every level but
/// `minimal`, which only names the kernels run). `CUBECL_DEBUG_LOG` alone sets `medium`.
fn profiles_every_kernel(config: &CubeClRuntimeConfig) -> bool {
    !matches!(config.profiling.logger.level, ProfilingLogLevel::Disabled | ProfilingLogLevel::Minimal)
}

/// Configures CubeCL and probes `device` on backend `B`; `what` names the runtime in errors.
fn ready<B: Backend>(device: &B::Device, what: &str, help: &str) -> Result<()> {
    configure_cubecl();
    probe_device::<B>(device).map_err(|cause| anyhow!("{what} is not usable on this machine: {cause}. {help}"))
}

/// Runs `work` (a task on a GPU backend); a panic in it becomes an error, which suggests
/// turning fusion off when it was on.
fn catch_backend_panic<O>(work: impl FnOnce() -> Result<O>) -> Result<O> {
    match catch_unwind(AssertUnwindSafe(work)) {
        Ok(result) => result,
        Err(panic) => {
            let text = crate::panic_text::panic_text(&*panic);
            if fusion_enabled() {
                bail!(
                    "the GPU backend failed: {text}. burn 0.21's kernel fusion has open bugs that show as \
                     \"Should have handle for tensor\" or as NaNs: try again with --fusion off (or PROMPT_R1_FUSION=0; slower)"
                )
            }
            bail!("the GPU backend failed (fusion off): {text}")
        }
    }
}

/// Stops the process after a panic on one of CubeCL's device threads (installed once the device
/// answered the probe, see [`model::probe::watch_device_threads`]): CubeCL would log it and go
/// on, and every result after it would be wrong. Files being written are left whole: results and
/// checkpoints are written to a temporary name and renamed.
fn device_thread_failed(text: &str) {
    let hint = if text.contains("can't allocate buffer") || text.contains("out of memory") || text.contains("OutOfMemory") {
        "the device has no room for a tensor: more memory than it has, or than it allows in one buffer (CUDA: a \
         quarter of the GPU's memory; wgpu: the adapter's largest storage buffer). Lower the batch, \
         rollout.max_num_batched_tokens or the sequence length (`prompt-r1 plan` estimates a run's memory)"
    } else if fusion_enabled() {
        "burn 0.21's kernel fusion has open bugs: try again with --fusion off (or PROMPT_R1_FUSION=0; slower)"
    } else {
        "a bug in the GPU backend or in prompt-r1: please report it with this message"
    };
    eprintln!("error: the GPU backend failed on its device thread: {text}. Its results from here on would be wrong, so prompt-r1 stops: {hint}");
    std::process::exit(1);
}

/// Runs `task` on backend `B` (fused) or `U` (the same runtime unfused), as `--fusion` says,
/// with prompt-r1's CubeCL kernels lent to both (the models the task loads run those their
/// [`model::DeviceKernelChoice`] names, see [`super::device_kernels`]).
fn run_fused_or_not<B, U, T>(device: B::Device, unfused: U::Device, what: &str, help: &str, task: T) -> Result<T::Output>
where
    B: DeviceKernels,
    U: DeviceKernels,
    T: OnBackend,
{
    device_kernels::register::<B>();
    device_kernels::register::<U>();
    // Training records the memory-efficient attention as one autodiff node on these backends.
    if fusion_enabled() {
        ready::<B>(&device, what, help)?;
        model::probe::watch_device_threads(device_thread_failed);
        model::qwen3::register_autodiff_attention::<burn::backend::Autodiff<B>>();
        catch_backend_panic(|| task.run::<B>(device))
    } else {
        ready::<U>(&unfused, what, help)?;
        model::probe::watch_device_threads(device_thread_failed);
        model::qwen3::register_autodiff_attention::<burn::backend::Autodiff<U>>();
        catch_backend_panic(|| task.run::<U>(unfused))
    }
}

#[cfg(feature = "cuda")]
const CUDA_HELP: &str = "It needs an NVIDIA driver (libcuda), NVRTC (libnvrtc) and the CUDA toolkit headers \
                         for NVRTC (set CUDA_PATH); use --device cpu otherwise";

/// burn-cuda without fusion.
#[cfg(feature = "cuda")]
type CudaUnfused = burn_cubecl::CubeBackend<burn::cubecl::cuda::CudaRuntime, f32, i32, u8>;

#[cfg(feature = "cuda")]
pub(super) fn run_on_cuda<T: OnBackend>(index: usize, task: T) -> Result<T::Output> {
    let device = burn_cuda::CudaDevice::new(index);
    run_fused_or_not::<burn_cuda::Cuda, CudaUnfused, T>(device.clone(), device, "CUDA", CUDA_HELP, task)
}

#[cfg(feature = "cuda")]
pub(super) fn check_cuda(index: usize) -> Result<()> {
    let device = burn_cuda::CudaDevice::new(index);
    if fusion_enabled() {
        ready::<burn_cuda::Cuda>(&device, "CUDA", CUDA_HELP)
    } else {
        ready::<CudaUnfused>(&device, "CUDA", CUDA_HELP)
    }
}

/// GPU `index`'s total memory, as CubeCL's CUDA runtime read it (`cuDeviceTotalMem`) when it
/// started: cubecl-cuda 0.10 sets the largest allocation to a quarter of it. `None` when the
/// runtime cannot start.
#[cfg(feature = "cuda")]
pub(super) fn cuda_total_memory(index: usize) -> Option<u64> {
    use burn::cubecl::Runtime;
    configure_cubecl();
    let device = burn_cuda::CudaDevice::new(index);
    catch_unwind(AssertUnwindSafe(|| {
        burn::cubecl::cuda::CudaRuntime::client(&device).properties().memory.max_page_size * 4
    }))
    .ok()
}

#[cfg(feature = "wgpu")]
const WGPU_HELP: &str = "It needs a Vulkan driver (libvulkan and an ICD: a GPU's, or Mesa's lavapipe on the CPU \
                         from the mesa-vulkan-drivers package); use --device cpu otherwise";

/// burn's wgpu backend on Vulkan without fusion.
#[cfg(feature = "wgpu")]
type WgpuUnfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

#[cfg(feature = "wgpu")]
pub(super) fn run_on_wgpu<T: OnBackend>(task: T) -> Result<T::Output> {
    use burn_wgpu::WgpuDevice;
    run_fused_or_not::<burn_wgpu::Vulkan, WgpuUnfused, T>(
        WgpuDevice::DefaultDevice,
        WgpuDevice::DefaultDevice,
        "wgpu (Vulkan)",
        WGPU_HELP,
        task,
    )
}

/// CubeCL's memory pool of this thread on `device` of runtime `R`: bytes in use by tensors and
/// bytes reserved.
fn pool_memory<R: burn::cubecl::Runtime>(device: &R::Device) -> Option<super::DeviceMemory> {
    let usage = R::client(device).memory_usage().ok()?;
    Some(super::DeviceMemory { in_use: usage.bytes_in_use, reserved: usage.bytes_reserved })
}

/// [`pool_memory`] on CUDA GPU `index`.
#[cfg(feature = "cuda")]
pub(super) fn cuda_memory(index: usize) -> Option<super::DeviceMemory> {
    pool_memory::<burn::cubecl::cuda::CudaRuntime>(&burn_cuda::CudaDevice::new(index))
}

/// [`pool_memory`] on wgpu's default adapter.
#[cfg(feature = "wgpu")]
pub(super) fn wgpu_memory() -> Option<super::DeviceMemory> {
    pool_memory::<burn_wgpu::WgpuRuntime>(&burn_wgpu::WgpuDevice::DefaultDevice)
}

#[cfg(feature = "wgpu")]
pub(super) fn check_wgpu() -> Result<()> {
    let device = burn_wgpu::WgpuDevice::DefaultDevice;
    if fusion_enabled() {
        ready::<burn_wgpu::Vulkan>(&device, "wgpu (Vulkan)", WGPU_HELP)
    } else {
        ready::<WgpuUnfused>(&device, "wgpu (Vulkan)", WGPU_HELP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--kernel-log` turns on the compilation log alone: the profiler, whose timing of every
    /// kernel made the GPU leases' steps wait for the GPU twice a kernel, stays off.
    #[test]
    fn the_kernel_log_leaves_the_profiler_off() {
        let mut config = CubeClRuntimeConfig::default();
        assert!(!profiles_every_kernel(&config), "CubeCL's default profiles nothing");
        log_compilations(&mut config, PathBuf::from("kernels.log"));
        assert!(matches!(config.compilation.logger.level, CompilationLogLevel::Basic));
        assert_eq!(config.compilation.logger.file.as_deref(), Some(std::path::Path::new("kernels.log")));
        assert!(!profiles_every_kernel(&config));
        // A configuration that logs the sources keeps logging them.
        config.compilation.logger.level = CompilationLogLevel::Full;
        log_compilations(&mut config, PathBuf::from("kernels.log"));
        assert!(matches!(config.compilation.logger.level, CompilationLogLevel::Full));
    }

    /// The levels at which CubeCL's profiler syncs around each launch (`CUBECL_DEBUG_LOG` sets
    /// `medium`), and `minimal`, which only names the kernels.
    #[test]
    fn profiling_levels_that_time_each_kernel() {
        let mut config = CubeClRuntimeConfig::default();
        for (level, times) in [
            (ProfilingLogLevel::Minimal, false),
            (ProfilingLogLevel::Basic, true),
            (ProfilingLogLevel::Medium, true),
            (ProfilingLogLevel::Full, true),
        ] {
            config.profiling.logger.level = level;
            assert_eq!(profiles_every_kernel(&config), times, "{level:?}");
        }
    }
}

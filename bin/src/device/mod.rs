//! Choosing the compute backend at run time: `--device cpu` (burn-flex, pure Rust) or
//! `--device cuda[:N]` (burn-cuda, only in builds with the `cuda` feature). Commands write their
//! work once, generic over the backend, as an [`OnBackend`] task.

use std::str::FromStr;

use anyhow::{bail, Result};
use burn::tensor::{backend::Backend, DType};

use crate::model_dir::parse_dtype;

/// `--device` and `--dtype`, for every command that runs a model for inference.
#[derive(clap::Args, Debug, Clone)]
pub struct ComputeArgs {
    /// Compute device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Weight dtype on the device: f32 or bf16. bf16 halves the memory; on CPUs with AVX-512
    /// BF16 it is also the faster choice.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
}

/// A device named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!("unknown device \"{other}\": use cpu, cuda or cuda:N")),
            },
        }
    }
}

/// Work that runs on whichever backend the user picked.
pub trait OnBackend {
    type Output;
    fn run<B: Backend>(self, device: B::Device) -> Result<Self::Output>;
}

/// Runs `task` on the chosen device.
pub fn run_on<T: OnBackend>(choice: DeviceChoice, task: T) -> Result<T::Output> {
    match choice {
        DeviceChoice::Cpu => task.run::<burn::backend::Flex>(Default::default()),
        DeviceChoice::Cuda(index) => run_on_cuda(index, task),
    }
}

/// Fails with the reason when the chosen device cannot run work (no CUDA support in this
/// build, no driver), before any work starts.
pub fn check_available(choice: DeviceChoice) -> Result<()> {
    match choice {
        DeviceChoice::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(index) => probe_cuda(&burn::backend::cuda::CudaDevice::new(index)),
        #[cfg(not(feature = "cuda"))]
        DeviceChoice::Cuda(_) => bail!(NO_CUDA),
    }
}

#[cfg(feature = "cuda")]
fn run_on_cuda<T: OnBackend>(index: usize, task: T) -> Result<T::Output> {
    use burn::backend::{cuda::CudaDevice, Cuda};
    let device = CudaDevice::new(index);
    probe_cuda(&device)?;
    task.run::<Cuda>(device)
}

/// Touches the device once so that a missing driver or toolkit becomes an error message rather
/// than a panic deep inside a command (cudarc and cubecl panic when libcuda or NVRTC is absent,
/// on cubecl's own device thread: the first panic message of any thread is the cause).
#[cfg(feature = "cuda")]
fn probe_cuda(device: &burn::backend::cuda::CudaDevice) -> Result<()> {
    use std::sync::{Arc, Mutex};

    use burn::backend::Cuda;
    use burn::tensor::Tensor;

    let first_panic: Arc<Mutex<Option<String>>> = Arc::default();
    let record = Arc::clone(&first_panic);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let mut slot = record.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            let text = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("unknown error");
            *slot = Some(text.to_owned());
        }
    }));
    let probe = std::panic::catch_unwind(|| {
        let t = Tensor::<Cuda, 1>::from_floats([1.0, 2.0], device);
        t.sum().into_scalar()
    });
    std::panic::set_hook(previous);
    match probe {
        Ok(v) if v == 3.0 => Ok(()),
        Ok(v) => bail!("CUDA device {device:?} answered 1 + 2 = {v}; refusing to run on it"),
        Err(_) => {
            let cause = first_panic
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap_or_else(|| "unknown error".into());
            bail!(
                "CUDA is not usable on this machine: {cause}. \
                 It needs an NVIDIA driver (libcuda) and the CUDA toolkit headers for NVRTC \
                 (set CUDA_PATH); use --device cpu otherwise"
            )
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn run_on_cuda<T: OnBackend>(_index: usize, _task: T) -> Result<T::Output> {
    bail!(NO_CUDA)
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str =
    "this binary was built without CUDA support: rebuild with `cargo build --release --features cuda`, or use --device cpu";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(3)));
        assert!("gpu".parse::<DeviceChoice>().is_err());
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
    }
}

//! Touching a backend's device once, before any work, so that a missing driver, compiler or
//! adapter becomes one error message rather than a panic deep inside a command.
//!
//! CubeCL's backends (CUDA, wgpu) panic when their runtime is missing (libcuda, NVRTC or its
//! headers, a Vulkan adapter), sometimes on their own device thread and sometimes only as a
//! wrong result after an error was logged. The probe adds 1 and 2 on the device and keeps the
//! first panic message of any thread while it runs, so the error names the real cause.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};

use burn::tensor::{backend::Backend, ElementConversion, Tensor};

/// Serialises probes: each one swaps the process's panic hook and must restore it.
static PROBING: Mutex<()> = Mutex::new(());

/// Adds 1 and 2 on `device`; `Err` holds why the device cannot run work (the first panic
/// message seen while probing, with the wrong sum when one came back).
pub fn probe_device<B: Backend>(device: &B::Device) -> Result<(), String> {
    let _serial = PROBING.lock().unwrap_or_else(PoisonError::into_inner);
    let first_panic: Arc<Mutex<Option<String>>> = Arc::default();
    let record = Arc::clone(&first_panic);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let mut slot = record.lock().unwrap_or_else(PoisonError::into_inner);
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
    // Nothing the closure touches outlives a panic in it but the device handle, which stays usable.
    let probe = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let t = Tensor::<B, 1>::from_floats([1.0, 2.0], device);
        t.sum().into_scalar().elem::<f32>()
    }));
    std::panic::set_hook(previous);
    let cause = first_panic.lock().unwrap_or_else(PoisonError::into_inner).take();
    verdict(probe.ok(), cause)
}

/// The probe's outcome from its sum (`None` when it panicked) and the first panic message seen
/// on any thread: a wrong sum reports that message too, since it is the likelier cause.
fn verdict(sum: Option<f32>, cause: Option<String>) -> Result<(), String> {
    match (sum, cause) {
        (Some(sum), _) if sum == 3.0 => Ok(()),
        (Some(sum), None) => Err(format!("the device answered 1 + 2 = {sum}")),
        (Some(sum), Some(cause)) => Err(format!("{cause} (and the device answered 1 + 2 = {sum})")),
        (None, cause) => Err(cause.unwrap_or_else(|| "unknown error".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn the_cpu_backend_passes() {
        assert_eq!(probe_device::<Flex>(&Default::default()), Ok(()));
    }

    #[test]
    fn a_wrong_sum_reports_the_panic_behind_it() {
        let nvrtc = || Some("Unable to find libnvrtc".to_string());
        assert_eq!(verdict(Some(3.0), nvrtc()), Ok(()));
        assert_eq!(verdict(Some(0.0), nvrtc()), Err("Unable to find libnvrtc (and the device answered 1 + 2 = 0)".into()));
        assert_eq!(verdict(Some(0.0), None), Err("the device answered 1 + 2 = 0".into()));
        assert_eq!(verdict(None, nvrtc()), Err("Unable to find libnvrtc".into()));
        assert_eq!(verdict(None, None), Err("unknown error".into()));
    }
}

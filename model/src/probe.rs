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

/// Why a device cannot run work: the first panic message seen while probing it, with the wrong
/// sum when one came back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DeviceUnusable(pub String);

/// Adds 1 and 2 on `device`; `Err` says why the device cannot run work.
pub fn probe_device<B: Backend>(device: &B::Device) -> Result<(), DeviceUnusable> {
    let _serial = PROBING.lock().unwrap_or_else(PoisonError::into_inner);
    let first_panic: Arc<Mutex<Option<String>>> = Arc::default();
    let record = Arc::clone(&first_panic);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let mut slot = record.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(panic_message(info).to_owned());
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

/// Passes every later panic on one of CubeCL's device threads (named `DSU-*` and `DSD-*`: the
/// fusion server and the device server) to `on_failure`, with the first line of its message,
/// after the panic hook installed before it has run (which prints it). CubeCL catches such a
/// panic, logs it and goes on: a tensor whose allocation failed (more memory than the device
/// has, or than it allows in one buffer) is never written, and every result computed from it
/// after is wrong, so `on_failure` is where a program stops. The first call installs it; later
/// calls do nothing.
pub fn watch_device_threads(on_failure: fn(&str)) {
    static WATCHING: std::sync::Once = std::sync::Once::new();
    WATCHING.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            if std::thread::current().name().is_some_and(is_device_thread) {
                on_failure(first_line(panic_message(info)));
            }
        }));
    });
}

/// Whether a thread of this name is one of CubeCL's device threads (`DS` with `U`pstream or
/// `D`ownstream, then the device's type and index, as cubecl-common names them).
fn is_device_thread(name: &str) -> bool {
    name.starts_with("DSD-") || name.starts_with("DSU-")
}

/// A panic's message, when it carries one.
fn panic_message<'a>(info: &'a std::panic::PanicHookInfo<'_>) -> &'a str {
    info.payload()
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| info.payload().downcast_ref::<&str>().copied())
        .unwrap_or("unknown error")
}

/// The first line of `text` (CubeCL's errors carry a backtrace after it).
fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text).trim_end()
}

/// The probe's outcome from its sum (`None` when it panicked) and the first panic message seen
/// on any thread: a wrong sum reports that message too, since it is the likelier cause.
fn verdict(sum: Option<f32>, cause: Option<String>) -> Result<(), DeviceUnusable> {
    match (sum, cause) {
        (Some(sum), _) if sum == 3.0 => Ok(()),
        (Some(sum), None) => Err(DeviceUnusable(format!("the device answered 1 + 2 = {sum}"))),
        (Some(sum), Some(cause)) => Err(DeviceUnusable(format!("{cause} (and the device answered 1 + 2 = {sum})"))),
        (None, cause) => Err(DeviceUnusable(cause.unwrap_or_else(|| "unknown error".into()))),
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
    fn device_threads_are_known_by_name() {
        assert!(is_device_thread("DSD-4-0") && is_device_thread("DSU-0-1"));
        assert!(!is_device_thread("main") && !is_device_thread("DS") && !is_device_thread("DSX-0-0"));
        assert_eq!(first_line("can't allocate buffer of size: 150077440\n   0: backtrace"), "can't allocate buffer of size: 150077440");
        assert_eq!(first_line(""), "");
    }

    #[test]
    fn a_wrong_sum_reports_the_panic_behind_it() {
        let nvrtc = || Some("Unable to find libnvrtc".to_string());
        assert_eq!(verdict(Some(3.0), nvrtc()), Ok(()));
        assert_eq!(verdict(Some(0.0), nvrtc()), Err(DeviceUnusable("Unable to find libnvrtc (and the device answered 1 + 2 = 0)".into())));
        assert_eq!(verdict(Some(0.0), None), Err(DeviceUnusable("the device answered 1 + 2 = 0".into())));
        assert_eq!(verdict(None, nvrtc()), Err(DeviceUnusable("Unable to find libnvrtc".into())));
        assert_eq!(verdict(None, None), Err(DeviceUnusable("unknown error".into())));
    }
}

//! A panic on CubeCL's device thread reaches `model::probe::watch_device_threads` (CubeCL itself
//! logs it and goes on): here a tensor larger than the adapter allows in one buffer, whose
//! allocation the device thread refuses. `prompt-r1` stops on it with the cause.

use std::sync::Mutex;

use burn::cubecl::Runtime;
use burn::tensor::Tensor;

type B = burn_wgpu::Vulkan;

/// Every device-thread failure seen in this process (other tests' included).
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn record(text: &str) {
    SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(text.to_owned());
}

#[test]
fn a_refused_allocation_on_the_device_thread_is_reported() {
    if !crate::common::backend_ready::<B>() {
        return;
    }
    let device = burn_wgpu::WgpuDevice::DefaultDevice;
    let largest = burn_wgpu::WgpuRuntime::client(&device).properties().memory.max_page_size;
    if largest > 1 << 30 {
        eprintln!("skipped: this adapter allows buffers of {largest} bytes; the test needs a size it refuses");
        return;
    }
    model::probe::watch_device_threads(record);
    let elements = (largest / 4) as usize + 1024;
    // Reading from it makes the fused stream run; the read itself may fail in turn.
    let read = std::panic::catch_unwind(|| {
        let big = Tensor::<B, 1>::zeros([elements], &device) + 1.0;
        big.slice([0..1]).into_data()
    });
    let seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    assert!(
        seen.iter().any(|text| text.contains(&format!("can't allocate buffer of size: {}", 4 * elements))),
        "no device-thread failure reported for a {}-byte buffer (largest {largest}); read {}; seen: {seen:?}",
        4 * elements,
        if read.is_ok() { "returned" } else { "panicked" }
    );
}

//! Peak resident memory of this process (Linux `/proc`; `None` elsewhere), for the metrics of a
//! run and for benchmarks; the device's unused memory given back between a step's phases, and
//! what the device's memory pool held at each phase's end.

use std::sync::Arc;

use burn::tensor::backend::Backend;

use super::TrainError;

/// A GPU's memory as its backend's memory pool (CubeCL's) counts it: bytes in use by tensors,
/// and bytes reserved from the device (pages kept for reuse included; what `nvidia-smi` shows,
/// less the CUDA context).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    pub in_use: u64,
    pub reserved: u64,
}

/// Reads the memory pool of the device a run computes on, from the thread that calls it (CubeCL
/// keeps a pool per thread that issues tensor operations); `None` where there is no pool to read
/// (the CPU). burn's `Backend` has no such query, so the caller that knows the runtime gives it.
pub type DeviceMemoryProbe = Arc<dyn Fn() -> Option<DeviceMemory> + Send + Sync>;

/// Gives the device back the memory pages no tensor uses any more, as verl empties PyTorch's
/// cache after its rollouts. CubeCL's pools (the GPU backends) keep a freed page for later
/// allocations of its size class, and their classes are wide (on CUDA a tensor above 1/32 of
/// the GPU's memory holds a page of a quarter of it), so without this the rollouts' KV pages and
/// the update's activations, of other sizes, would stay reserved together. The calling thread's
/// pool, once its queued work has run ([`model::device_memory::release_unused_pages`]).
pub fn release_unused_device_memory<B: Backend>(device: &B::Device) -> Result<(), TrainError> {
    end_device_phase::<B>(device, None).map(drop)
}

/// [`release_unused_device_memory`], reading `probe` between the queued work and the release:
/// what the pool held as the phase ended. Its reservation then is the most the pool reserved
/// since the last release (CubeCL gives pages back only when asked to), so the phase's peak; the
/// bytes in use are the moment's, not a peak.
pub fn end_device_phase<B: Backend>(device: &B::Device, probe: Option<&DeviceMemoryProbe>) -> Result<Option<DeviceMemory>, TrainError> {
    model::device_memory::release_unused_pages::<B, _>(device, || probe.and_then(|read| read())).map_err(|e| TrainError::Device(e.to_string()))
}

/// Bytes in GiB (bytes / 1024³), as verl's memory metrics give them.
pub(crate) fn gib(bytes: u64) -> f32 {
    (bytes as f64 / f64::from(1u32 << 30)) as f32
}

/// Peak resident set size since start or since the last [`reset_peak_rss`], in MB.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub use model::host_memory::total_ram_bytes;

/// Resets the kernel's peak-RSS counter of this process, so the next [`peak_rss_mb`] covers
/// only what follows (Linux; a no-op elsewhere).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rss_covers_a_large_allocation() {
        // From the current RSS: a peak that tests running alongside set earlier (and freed
        // since) would hide part of the block.
        reset_peak_rss();
        let Some(before) = peak_rss_mb() else { return };
        // black_box keeps the optimiser from eliding the touched 64 MB. Tests running alongside
        // may free some megabytes meanwhile, so half the block is what is required.
        let block = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = peak_rss_mb().unwrap();
        assert!(after >= before + 32.0, "{before} -> {after}");
        assert_eq!(std::hint::black_box(&block).iter().map(|&b| u64::from(b)).sum::<u64>(), 64 << 20);
    }

    #[test]
    fn total_ram_is_more_than_the_peak_so_far() {
        let (Some(ram), Some(peak)) = (total_ram_bytes(), peak_rss_mb()) else { return };
        assert!(ram as f64 > peak * 1024.0 * 1024.0, "{ram} bytes of RAM, peak {peak} MB");
    }
}

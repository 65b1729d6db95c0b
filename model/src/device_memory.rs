//! A GPU's memory pool between pieces of work. CubeCL's pools (burn's GPU backends) keep a freed
//! page for later tensors of its size class and give it back to the device only when asked; burn's
//! kernel fusion frees a dropped tensor's buffer only once it runs the operations queued before
//! the drop. Nothing here does anything on the CPU backend.

use burn::tensor::backend::Backend;

use crate::error::ModelError;

/// Runs the device's queued work, then calls `between` (to read the pool at its fullest, say),
/// then gives the device back the pages no tensor uses any more. CubeCL keeps a pool per thread
/// that issues tensor operations: this releases the calling thread's.
pub fn release_unused_pages<B: Backend, T>(device: &B::Device, between: impl FnOnce() -> T) -> Result<T, ModelError> {
    B::sync(device).map_err(|e| ModelError::Device(e.to_string()))?;
    let seen = between();
    B::memory_cleanup(device);
    Ok(seen)
}

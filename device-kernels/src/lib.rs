//! CubeCL kernels for the model's GPU path, lent through [`model::device_kernels`]: the
//! attention of a decoding step read in place from the paged KV cache
//! ([`paged_decode`]), so that burn's ops need not gather each layer's
//! `[rows, kv_heads, width, head_dim]` keys and values first. They run on any CubeCL runtime
//! (CUDA; wgpu, where the tests check them against burn's ops), fused (`Fusion<CubeBackend>`, a
//! custom operation in the fusion stream) or not.
//!
//! A binary calls [`register`] for each backend it runs on.

mod fusion;
pub mod paged_decode;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorPrimitive};
use model::device_kernels::{register_paged_decode, PagedDecode};

/// A backend that computes [`PagedDecode`] with a kernel of this crate.
pub trait DeviceKernels: Backend {
    /// [`PagedDecode`] on primitives: `query` `[rows, heads, d]`, pools `[kv_heads, slots, d]`,
    /// `read` `[rows · width]`, `valid` `[rows, width]`; `[rows, heads, d]`.
    fn paged_decode(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self>;
}

/// Lends the model this crate's kernels on backend `B` (idempotent).
pub fn register<B: DeviceKernels>() {
    register_paged_decode::<B>(run_paged_decode::<B>);
}

fn run_paged_decode<B: DeviceKernels>(step: PagedDecode<B>) -> Tensor<B, 3> {
    let PagedDecode { query, keys, values, read, valid, scale } = step;
    let output = B::paged_decode(
        query.into_primitive().tensor(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        read.into_primitive(),
        valid.into_primitive().tensor(),
        scale,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// FNV-1a of `source`, folded to 32 bits: a kernel's revision (see `paged_decode::REVISION`).
const fn source_revision(source: &[u8]) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < source.len() {
        hash ^= source[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    (hash ^ (hash >> 32)) as u32
}

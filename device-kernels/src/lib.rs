//! CubeCL kernels for the model's GPU path, lent through [`model::device_kernels`]: the
//! attention of a pass over the paged KV cache (a decoding step or a prefill chunk) read in
//! place from its pools ([`paged_attention`]), so that burn's ops need not gather each layer's
//! `[rows, kv_heads, width, head_dim]` keys and values first; and the RMS norm as one kernel
//! ([`rms_norm`]) where burn's ops take three. They run on any CubeCL runtime
//! (CUDA; wgpu, where the tests check them against burn's ops), fused (`Fusion<CubeBackend>`, a
//! custom operation in the fusion stream) or not.
//!
//! A binary calls [`register`] for each backend it runs on.

mod fusion;
pub mod paged_attention;
pub mod rms_norm;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
pub use model::device_kernels::KernelPasses;
use model::device_kernels::{register_paged_attention, register_rms_norm, PagedAttention};

/// A backend that computes [`PagedAttention`] and the RMS norm with kernels of this crate.
pub trait DeviceKernels: Backend {
    /// [`PagedAttention`] on primitives: `query` `[rows, queries, heads, d]`, pools
    /// `[kv_heads, slots, d]`, `read` `[rows · width]`, `valid` `[rows, width]`;
    /// `[rows, queries, heads, d]`.
    fn paged_attention(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self>;

    /// [`model::device_kernels::RmsNormFn`] on primitives: `input` `[rows, hidden]`, `weight`
    /// `[hidden]`.
    fn rms_norm(input: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DeviceKernels for CubeBackend<R, F, I, BT> {
    fn paged_attention(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        paged_attention::paged_attention(query, keys, values, read, valid, scale)
    }

    fn rms_norm(input: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm::rms_norm(input, weight, eps)
    }
}

/// Lends the model this crate's kernels on backend `B`: the paged attention for `passes`, and
/// the RMS norm (idempotent).
pub fn register<B: DeviceKernels>(passes: KernelPasses) {
    register_paged_attention::<B>(run_paged_attention::<B>, passes);
    register_rms_norm::<B>(run_rms_norm::<B>);
}

fn run_rms_norm<B: DeviceKernels>(x: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let output = B::rms_norm(x.into_primitive().tensor(), weight.into_primitive().tensor(), eps);
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

fn run_paged_attention<B: DeviceKernels>(pass: PagedAttention<B>) -> Tensor<B, 4> {
    let PagedAttention { query, keys, values, read, valid, scale } = pass;
    let output = B::paged_attention(
        query.into_primitive().tensor(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        read.into_primitive(),
        valid.into_primitive().tensor(),
        scale,
    );
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// FNV-1a of `source`, folded to 32 bits: a kernel's revision (see `paged_attention::REVISION`).
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

//! CubeCL kernels for the model's GPU path, lent through [`model::device_kernels`]: the
//! attention of a pass over the paged KV cache (a prefill chunk, a ragged pass, or a decoding
//! step, which has a kernel of its own: [`paged_decode`]) read in place from its pools
//! ([`paged_attention`]), so that burn's ops need not gather each layer's
//! `[rows, kv_heads, width, head_dim]` keys and values first, and by the same kernel the
//! attention of a pass without a cache, with its log-sum-exp for the backward
//! ([`paged_attention::fresh_attention`]: scoring, a training step's forward), their blocks of
//! several queries on the tensor cores where a model asks ([`tensor_core_attention`]); the RMS norm as one kernel
//! ([`rms_norm`]) where burn's ops take three, alone or after the residual addition; `q_norm`
//! and `k_norm` with RoPE and the keys and values written to the cache's pools as one kernel a
//! layer ([`rms_norm::qk_norm_rope_write`]); SwiGLU's `silu(gate) · up` ([`swiglu`]); and the
//! choice of each row's token from its logits
//! ([`sampling`]) where burn's ops take about 17; and the projections of a decoding step's few
//! rows ([`skinny_matmul`]), where burn's matmul leaves most of a GPU idle. The norm-with-RoPE and SwiGLU kernels take
//! their projections one by one or as one stacked product (`qkv_proj`'s and `gate_up_proj`'s
//! output, as vLLM's do), read where it lies. They run on any CubeCL runtime (CUDA; wgpu,
//! where the tests check them against burn's ops), fused (`Fusion<CubeBackend>`, a custom
//! operation in the fusion stream) or not.
//!
//! A binary calls [`register`] for each backend it runs on; a model's
//! [`model::DeviceKernelChoice`] says which of the kernels it runs. [`definitions`] gives every
//! kernel as CubeCL defines it for a compiler, so that CUDA's compile is checked without a GPU
//! (`scripts/nvrtc_check.sh`); a new kernel adds its definition there.

pub mod definitions;
mod fusion;
pub mod paged_attention;
pub mod paged_decode;
pub mod rms_norm;
pub mod sampling;
pub mod skinny_matmul;
pub mod swiglu;
pub mod tensor_core_attention;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
pub use paged_attention::{DecodingKernel, Products, RowLens, Spans};
use model::device_kernels::{
    register_fresh_attention, register_norms, register_paged_attention, register_silu_mul, register_skinny_matmul, register_token_choice, FreshAttention, NormKernels,
    PagedAttention,
};
pub use rms_norm::{QkNormRopeWrite, Qkv};
pub use swiglu::GateUp;

/// A backend that computes [`PagedAttention`], the RMS norms, SwiGLU's `silu(gate) · up` and the
/// token choice with kernels of this crate.
pub trait DeviceKernels: Backend {
    /// [`PagedAttention`] on primitives: `query` a token a row, `[rows · queries, heads · d]`,
    /// of `shape` `[rows, queries, heads, d]`, pools `[kv_heads, slots, d]`, `read`
    /// `[rows · width]`, `valid` `[rows, width]`; the output a token a row as the query. A
    /// ragged pass's `shape` is `[1, tokens, heads, d]`, with its rows' starts `[rows + 1]` and
    /// their lengths as the host counts them. Each row's columns are cut into `spans`; rows of
    /// one query go to the kernel `decoding` says; blocks of several queries are multiplied as
    /// `products` says.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        query: FloatTensor<Self>,
        shape: [usize; 4],
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        ragged: Option<(IntTensor<Self>, RowLens)>,
        scale: f32,
        spans: Spans,
        decoding: DecodingKernel,
        products: Products,
    ) -> FloatTensor<Self>;

    /// [`model::device_kernels::FreshAttention`] on primitives (see
    /// [`paged_attention::fresh_attention`]): `query` `[rows, queries, heads, d]`, `keys` and
    /// `values` `[rows · width, kv_heads, d]`, `valid` `[rows, width]`; the output
    /// `[rows, queries, heads, d]` and the log-sum-exp `[rows · queries, heads]` f32; the products
    /// as `products` says.
    fn fresh_attention(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
        products: Products,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`model::device_kernels::RmsNormFn`] on primitives: `input` `[rows, hidden]`, `weight`
    /// `[hidden]`.
    fn rms_norm(input: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;

    /// [`model::device_kernels::AddRmsNormFn`] on primitives: `(residual + delta, norm)`.
    fn add_rms_norm(
        residual: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`model::device_kernels::ChooseTokensFn`] on primitives: `logits` `[rows, vocab]`,
    /// `temperatures` and `uniforms` `[rows]` f32; `[rows, 2]` f32.
    fn choose_tokens(logits: FloatTensor<Self>, temperatures: FloatTensor<Self>, uniforms: FloatTensor<Self>) -> FloatTensor<Self>;

    /// [`model::device_kernels::SiluMulFn`] on primitives.
    fn silu_mul(operands: GateUp<FloatTensor<Self>>) -> FloatTensor<Self>;

    /// [`model::device_kernels::QkNormRopeWriteFn`] on primitives (see
    /// [`rms_norm::qk_norm_rope_write`]): `(rotated query, keys, values)`.
    fn qk_norm_rope_write(pass: QkNormRopeWrite<FloatTensor<Self>, IntTensor<Self>>) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`model::device_kernels::SkinnyMatmulFn`] on primitives (see
    /// [`skinny_matmul::skinny_matmul`]): `x` `[rows, k]`, `weight` `[k, columns]`.
    fn skinny_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> DeviceKernels for CubeBackend<R, F, I, BT> {
    fn paged_attention(
        query: FloatTensor<Self>,
        shape: [usize; 4],
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        read: IntTensor<Self>,
        valid: FloatTensor<Self>,
        ragged: Option<(IntTensor<Self>, RowLens)>,
        scale: f32,
        spans: Spans,
        decoding: DecodingKernel,
        products: Products,
    ) -> FloatTensor<Self> {
        let ragged = ragged.map(|(starts, lens)| paged_attention::Ragged { starts, lens });
        let [rows, queries, heads, d] = shape;
        assert_eq!(query.meta.shape().dims::<2>(), [rows * queries, heads * d], "paged attention: a query of {shape:?} a token a row");
        // A packed query (the norm kernel's) and the kernel's packed output reshape without a
        // copy: only their metadata changes.
        let query = burn_cubecl::ops::reshape(query, Shape::new(shape));
        let output = paged_attention::paged_attention(query, keys, values, read, valid, ragged, scale, spans, decoding, products);
        burn_cubecl::ops::reshape(output, Shape::new([rows * queries, heads * d]))
    }

    fn fresh_attention(
        query: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f32,
        products: Products,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        paged_attention::fresh_attention(query, keys, values, valid, scale, products)
    }

    fn rms_norm(input: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm::rms_norm(input, weight, eps)
    }

    fn choose_tokens(logits: FloatTensor<Self>, temperatures: FloatTensor<Self>, uniforms: FloatTensor<Self>) -> FloatTensor<Self> {
        sampling::choose_tokens(logits, temperatures, uniforms)
    }

    fn add_rms_norm(
        residual: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::add_rms_norm(residual, delta, weight, eps)
    }

    fn qk_norm_rope_write(pass: QkNormRopeWrite<FloatTensor<Self>, IntTensor<Self>>) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::qk_norm_rope_write(pass)
    }

    fn silu_mul(operands: GateUp<FloatTensor<Self>>) -> FloatTensor<Self> {
        swiglu::silu_mul(operands)
    }

    fn skinny_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        skinny_matmul::skinny_matmul(x, weight, None)
    }
}

/// Lends the model this crate's kernels on backend `B` (a later call replaces them): the paged
/// attention, the attention of passes without a cache ([`paged_attention::fresh_attention`]:
/// scoring's and a training step's forward), the RMS norms, SwiGLU's `silu(gate) · up`, the
/// products of few rows ([`skinny_matmul`]) and the token choice. Which of them a model runs, and how its decoding steps are cut and computed, is
/// its [`model::DeviceKernelChoice`].
pub fn register<B: DeviceKernels>() {
    register_paged_attention::<B>(run_paged_attention::<B>);
    register_fresh_attention::<B>(run_fresh_attention::<B>);
    register_token_choice::<B>(run_choose_tokens::<B>);
    register_silu_mul::<B>(run_silu_mul::<B>);
    register_skinny_matmul::<B>(run_skinny_matmul::<B>);
    register_norms::<B>(NormKernels {
        rms_norm: run_rms_norm::<B>,
        add_rms_norm: run_add_rms_norm::<B>,
        qk_norm_rope_write: run_qk_norm_rope_write::<B>,
    });
}

fn float<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

fn run_rms_norm<B: DeviceKernels>(x: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    tensor(B::rms_norm(float(x), float(weight), eps))
}

fn run_add_rms_norm<B: DeviceKernels>(residual: Tensor<B, 2>, delta: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (sum, normed) = B::add_rms_norm(float(residual), float(delta), float(weight), eps);
    (tensor(sum), tensor(normed))
}

fn run_qk_norm_rope_write<B: DeviceKernels>(pass: model::device_kernels::QkNormRopeWrite<B>) -> (Tensor<B, 2>, Tensor<B, 3>, Tensor<B, 3>) {
    let model::device_kernels::QkNormRopeWrite { qkv, heads, q_weight, k_weight, cos, signed_sin, slots, keys, values, eps } = pass;
    let qkv = match qkv {
        model::device_kernels::Qkv::Stacked(qkv) => Qkv::Stacked(float(qkv)),
        model::device_kernels::Qkv::Separate(each) => Qkv::Separate(each.map(float)),
    };
    let (query, keys, values) = B::qk_norm_rope_write(QkNormRopeWrite {
        qkv,
        heads,
        q_weight: float(q_weight),
        k_weight: float(k_weight),
        cos: float(cos),
        signed_sin: float(signed_sin),
        slots: slots.into_primitive(),
        keys: float(keys),
        values: float(values),
        eps,
    });
    (tensor(query), tensor(keys), tensor(values))
}

fn run_silu_mul<B: DeviceKernels>(operands: model::device_kernels::GateUp<B>) -> Tensor<B, 2> {
    tensor(B::silu_mul(match operands {
        model::device_kernels::GateUp::Stacked(gate_up) => GateUp::Stacked(float(gate_up)),
        model::device_kernels::GateUp::Separate(gate, up) => GateUp::Separate(float(gate), float(up)),
    }))
}

fn run_skinny_matmul<B: DeviceKernels>(x: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2> {
    tensor(B::skinny_matmul(float(x), float(weight)))
}

fn run_choose_tokens<B: DeviceKernels>(logits: Tensor<B, 2>, temperatures: Tensor<B, 1>, uniforms: Tensor<B, 1>) -> Tensor<B, 2> {
    tensor(B::choose_tokens(float(logits), float(temperatures), float(uniforms)))
}

/// [`PagedAttention`] with decoding steps split where the device would sit idle (or whole) and
/// rows of one query through the kernel the pass's [`model::device_kernels::Decoding`] names.
fn run_paged_attention<B: DeviceKernels>(pass: PagedAttention<B>) -> Tensor<B, 2> {
    let PagedAttention { query, shape, keys, values, read, valid, scale, ragged, decoding, tensor_cores } = pass;
    let spans = if decoding.split { Spans::Auto } else { Spans::WHOLE };
    let ragged = ragged.map(|rows| (rows.starts.into_primitive(), rows.lens));
    tensor(B::paged_attention(float(query), shape, float(keys), float(values), read.into_primitive(), float(valid), ragged, scale, spans, decoding.kernel, products(tensor_cores)))
}

/// [`FreshAttention`] through [`paged_attention::fresh_attention`]: the keys and values as their
/// tokens' rows (a reshape, free where they are laid out as the projections left them).
fn run_fresh_attention<B: DeviceKernels>(pass: FreshAttention<B>) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let FreshAttention { query, key, value, valid, scale, tensor_cores } = pass;
    let [rows, queries, heads, _] = query.dims();
    let [_, width, kv_heads, head_dim] = key.dims();
    let tokens = |t: Tensor<B, 4>| float(t.reshape([rows * width, kv_heads, head_dim]));
    let (output, lse) = B::fresh_attention(float(query), tokens(key), tokens(value), float(valid), scale, products(tensor_cores));
    (tensor(output), tensor::<B, 2>(lse).reshape([rows, queries, heads]))
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

/// The products a model's choice of the tensor cores asks of the attention kernels.
fn products(tensor_cores: bool) -> Products {
    if tensor_cores {
        Products::TensorCores
    } else {
        Products::Units
    }
}

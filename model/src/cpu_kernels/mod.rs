//! Hand-written CPU kernels for what burn-flex does slowly on the inference path:
//! - matmuls with bf16 weights: burn-flex 0.21 upcasts both operands of a bf16 matmul to fresh
//!   f32 buffers on every call, i.e. the whole weight matrix per generated token;
//! - matmuls of a few rows (decode) with f32 weights: memory-bound, so a streaming kernel reads
//!   the weights at full bandwidth where a general GEMM does not;
//! - f32 matmuls at bf16 precision (`MatmulPrecision::Bf16`): operands rounded to bf16 and
//!   multiplied with `vdpbf16ps`, about twice the f32 GEMM's throughput;
//! - RMSNorm, the SwiGLU product and RoPE (f32): several single-threaded passes (and strided
//!   broadcasts in bf16) become one parallel pass;
//! - the log-probability of chosen tokens: one parallel reduction per row of logits instead of
//!   six single-threaded passes over `[b, n, vocab]`;
//! - attention: scores, mask, softmax and the weighted sum of values in one parallel pass over
//!   the strided query/key/value views, where burn's ops copy, upcast and broadcast each step.
//!
//! Each entry point returns `None` unless the backend is burn-flex itself (checked at run time
//! by type, so the model stays generic over its backend) and the dtypes are ones the kernel
//! handles; the caller then uses burn's own ops. Under autodiff the chosen-token
//! log-probability, the embedding lookup, RMSNorm, SwiGLU, RoPE, attention and the
//! bf16-precision matmul have kernels, each registered as one operation of the graph with its
//! own backward (see `tracked`); everything else records burn's ops.

/// Evaluates `$body` in a copy compiled with AVX-512 enabled when the CPU has it, so that the
/// loops inlined into it vectorise 16 lanes wide; otherwise as compiled for the baseline.
macro_rules! wide_simd {
    ($body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if $crate::cpu_kernels::has_avx512() {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: the CPU has the features `run` is compiled for.
                unsafe { run(#[inline(always)] || $body) }
            } else {
                $body
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $body
        }
    }};
}

mod attention;
mod attention_backward;
mod bf16_bits;
mod bf16_rate;
mod fused;
mod tracked;
mod transpose;
mod weight_matmul;

use std::any::{Any, TypeId};
use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::{backend::Backend, bf16, Bytes, DType, Int, Shape, Tensor, TensorPrimitive};
use burn_flex::{FlexTensor, Layout};
use rayon::prelude::*;

pub use bf16_rate::bf16_mac_ratio;
pub(crate) use transpose::transpose_into;
use transpose::transpose;

/// How a weight matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WeightLayout {
    /// `[in, out]`, burn's `Linear` layout: `y = x · w`.
    InOut,
    /// `[out, in]`, an embedding table used as the head: `y = x · wᵀ`.
    OutIn,
}

impl WeightLayout {
    /// `(k, n)` of `y[m, n] = x[m, k] · w` for a weight of shape `dims` stored this way.
    fn inner_outer(self, [rows, cols]: [usize; 2]) -> (usize, usize) {
        match self {
            WeightLayout::InOut => (rows, cols),
            WeightLayout::OutIn => (cols, rows),
        }
    }
}

/// `x · w` (or `x · wᵀ`) through [`weight_matmul`] when `B` is burn-flex, `w` is a contiguous
/// matrix and either `w` is bf16 and `x` bf16 or f32 (the result has `x`'s dtype), or both are
/// f32 with at most [`weight_matmul::SMALL_M`] rows on a CPU with the SIMD kernels; `None`
/// otherwise, for the caller to use burn's matmul.
pub(crate) fn weight_matmul<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
    layout: WeightLayout,
) -> Option<Tensor<B, D>> {
    let (k, n) = layout.inner_outer(w.dims());
    let mut dims = x.dims();
    let m: usize = dims[..D - 1].iter().product();
    let small_f32 = m <= weight_matmul::SMALL_M && weight_matmul::has_fast_path();
    let handled = match (w.dtype(), x.dtype()) {
        (DType::BF16, DType::BF16 | DType::F32) => true,
        (DType::F32, DType::F32) => small_f32,
        _ => false,
    };
    if !handled || dims[D - 1] != k {
        return None;
    }
    let weight = to_flex(w.clone())?;
    let input = flex_contiguous(&to_flex(x.clone())?);
    dims[D - 1] = n;
    let (bytes, dtype) = match (weight.dtype(), input.dtype()) {
        (DType::BF16, DType::BF16) => {
            let (x, w) = (input.as_slice::<bf16>()?, weight.as_slice::<bf16>()?);
            let y = weight_matmul::matmul_bf16(x, w, layout, m, k, n);
            (Bytes::from_elems(y), DType::BF16)
        }
        (DType::BF16, _) => {
            let (x, w) = (input.as_slice::<f32>()?, weight.as_slice::<bf16>()?);
            let y = weight_matmul::matmul_f32_bf16(x, w, layout, m, k, n);
            (Bytes::from_elems(y), DType::F32)
        }
        _ => {
            let (x, w) = (input.as_slice::<f32>()?, weight.as_slice::<f32>()?);
            let y = weight_matmul::matmul_f32_small(x, w, layout, m, k, n)?;
            (Bytes::from_elems(y), DType::F32)
        }
    };
    flex_output(bytes, dims, dtype)
}

/// `x · w` (or `x · wᵀ`) for f32 `x` and `w` with both operands rounded to bf16 (to nearest,
/// ties to even) and the products summed in f32, through [`weight_matmul::matmul_rounded`], when
/// `B` is burn-flex or burn-flex under autodiff (one node, see [`tracked`]) on a CPU with the
/// AVX-512 BF16 kernels; `None` otherwise.
pub(crate) fn bf16_matmul<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
    layout: WeightLayout,
) -> Option<Tensor<B, D>> {
    let (k, n) = layout.inner_outer(w.dims());
    let mut dims = x.dims();
    let handled = weight_matmul::has_fast_path() && x.dtype() == DType::F32 && w.dtype() == DType::F32;
    if !handled || dims[D - 1] != k {
        return None;
    }
    if let Some(y) = tracked::bf16_matmul(x, w, layout, k, n) {
        return Some(y);
    }
    let weight = to_flex(w.clone())?;
    let input = flex_contiguous(&to_flex(x.clone())?);
    let m = input.layout().num_elements() / k;
    let xb = narrow_all(input.as_slice()?);
    let y = weight_matmul::matmul_rounded(&xb, weight.as_slice()?, layout, m, k, n);
    dims[D - 1] = n;
    flex_output(Bytes::from_elems(y), dims, DType::F32)
}

/// Whether this CPU runs bf16 products through the AVX-512 BF16 kernels (otherwise bf16 weights
/// and [`crate::MatmulPrecision::Bf16`] fall back to slower portable loops or burn's ops).
pub fn has_bf16_kernels() -> bool {
    weight_matmul::has_fast_path()
}

/// HF's `Qwen3RMSNorm` (see [`fused::rms_norm_f32`]) when `B` is burn-flex and `x` and `weight`
/// are both f32 or both bf16, or when it is burn-flex under autodiff and both are f32 (see
/// [`tracked`]).
pub(crate) fn rms_norm<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Option<Tensor<B, D>> {
    if x.dims()[D - 1] != weight.dims()[0] {
        return None;
    }
    let eps = eps as f32;
    let Some(weight) = to_flex(weight.clone()) else {
        return tracked::rms_norm(x, weight, eps);
    };
    let input = flex_contiguous(&to_flex(x.clone())?);
    let (bytes, dtype) = match (input.dtype(), weight.dtype()) {
        (DType::F32, DType::F32) => {
            let y = fused::rms_norm_f32(input.as_slice()?, weight.as_slice()?, eps);
            (Bytes::from_elems(y), DType::F32)
        }
        (DType::BF16, DType::BF16) => {
            let y = fused::rms_norm_bf16(input.as_slice()?, weight.as_slice()?, eps);
            (Bytes::from_elems(y), DType::BF16)
        }
        _ => return None,
    };
    flex_output(bytes, x.dims(), dtype)
}

/// `silu(gate) * up` when `B` is burn-flex and both are f32 or both bf16, of one shape, or when
/// it is burn-flex under autodiff and both are f32 (see [`tracked`]).
pub(crate) fn silu_mul<B: Backend, const D: usize>(
    gate: &Tensor<B, D>,
    up: &Tensor<B, D>,
) -> Option<Tensor<B, D>> {
    if gate.dims() != up.dims() {
        return None;
    }
    let Some(g) = to_flex(gate.clone()).map(|g| flex_contiguous(&g)) else {
        return tracked::silu_mul(gate, up);
    };
    let u = flex_contiguous(&to_flex(up.clone())?);
    let (bytes, dtype) = match (g.dtype(), u.dtype()) {
        (DType::F32, DType::F32) => (
            Bytes::from_elems(fused::silu_mul_f32(g.as_slice()?, u.as_slice()?)),
            DType::F32,
        ),
        (DType::BF16, DType::BF16) => (
            Bytes::from_elems(fused::silu_mul_bf16(g.as_slice()?, u.as_slice()?)),
            DType::BF16,
        ),
        _ => return None,
    };
    flex_output(bytes, gate.dims(), dtype)
}

/// `t` in `dtype`, f32 to bf16 rounding to nearest, ties to even, as PyTorch's `.to()` does.
/// burn-flex 0.21's own `cast` rounds some values the other way (e.g. f32 bits `0xbc468001` to
/// `0xbc46` where round-to-nearest gives `0xbc47`), so on burn-flex that conversion goes through
/// [`to_bf16`]; everything else is burn's `cast`.
pub(crate) fn cast<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    match (t.dtype(), dtype) {
        (from, to) if from == to => t,
        (DType::F32, DType::BF16) => to_bf16(&t).unwrap_or_else(|| t.cast(dtype)),
        _ => t.cast(dtype),
    }
}

/// `t` rounded to bf16 (to nearest, ties to even) when `B` is burn-flex and `t` is f32; `None`
/// otherwise.
fn to_bf16<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    let values = flex_contiguous(&to_flex(t.clone())?);
    flex_output(Bytes::from_elems(narrow_all(values.as_slice()?)), t.dims(), DType::BF16)
}

/// `values` rounded to bf16 (to nearest, ties to even), in parallel.
fn narrow_all(values: &[f32]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; values.len()];
    out.par_chunks_mut(1 << 16)
        .zip(values.par_chunks(1 << 16))
        .for_each(|(out, x)| wide_simd!(for (o, &x) in out.iter_mut().zip(x) {
            *o = bf16_bits::narrow(x);
        }));
    out
}

/// HF's `apply_rotary_pos_emb` (see [`fused::rotary_f32`]) when `B` is burn-flex and `x` and
/// both tables are f32 or all bf16 of one shape, or burn-flex under autodiff (see [`tracked`])
/// and they are f32; `None` otherwise. The tables take no gradient.
pub(crate) fn rotary<B: Backend>(
    x: &Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    signed_sin: &Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    let dims = x.dims();
    if cos.dims() != dims || signed_sin.dims() != dims || !dims[3].is_multiple_of(2) {
        return None;
    }
    let Some(input) = to_flex(x.clone()) else {
        return tracked::rotary(x, cos, signed_sin);
    };
    let operands = [input, to_flex(cos.clone())?, to_flex(signed_sin.clone())?];
    let dtype = operands[0].dtype();
    if operands.iter().any(|t| t.dtype() != dtype) {
        return None;
    }
    let [x, c, s] = operands.map(|t| flex_contiguous(&t));
    let d = dims[3];
    let y = match dtype {
        DType::F32 => Bytes::from_elems(fused::rotary_f32(x.as_slice()?, c.as_slice()?, s.as_slice()?, d)),
        DType::BF16 => Bytes::from_elems(fused::rotary_bf16(x.as_slice()?, c.as_slice()?, s.as_slice()?, d)),
        _ => return None,
    };
    flex_output(y, dims, dtype)
}

/// Grouped-query attention through [`attention::grouped_attention`] when `B` is burn-flex and
/// the operands are all f32 or all bf16, or when it is burn-flex under autodiff and they are f32
/// (see [`tracked`]): `query` `[b, q, heads, d]`, `key` and `value` `[b, kv_heads, k, d]` (views
/// with any non-negative strides), `bias` `[b, 1, q, k]`. Returns `[b, q, heads * d]`.
pub(crate) fn grouped_attention<B: Backend>(
    query: &Tensor<B, 4>,
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    bias: &Tensor<B, 4>,
    scale: f32,
) -> Option<Tensor<B, 3>> {
    let [batch, queries, heads, head_dim] = query.dims();
    let [_, kv_heads, keys, _] = key.dims();
    let shapes_agree = key.dims() == [batch, kv_heads, keys, head_dim]
        && value.dims() == key.dims()
        && bias.dims() == [batch, 1, queries, keys]
        && kv_heads > 0
        && heads % kv_heads == 0;
    let dtype = query.dtype();
    let dtypes_agree = [key.dtype(), value.dtype(), bias.dtype()].iter().all(|&t| t == dtype);
    if !shapes_agree || !dtypes_agree || !matches!(dtype, DType::F32 | DType::BF16) {
        return None;
    }
    let shape = attention::AttentionShape {
        batch,
        queries,
        keys,
        heads,
        kv_heads,
        head_dim,
    };
    let Some(q) = to_flex(query.clone()).map(rows_contiguous) else {
        return tracked::grouped_attention(query, key, value, bias, shape, scale);
    };
    let [k, v, m] = [key, value, bias].map(|t| to_flex(t.clone()).map(rows_contiguous));
    let (k, v, m) = (k?, v?, m?);
    fn run<T: attention::Element + burn::tensor::Element + bytemuck::Pod>(
        [q, k, v, m]: [&FlexTensor; 4],
        shape: attention::AttentionShape,
        scale: f32,
    ) -> Bytes {
        let (q, k, v, m) = attention_views::<T>([q, k, v, m]);
        let out = attention::grouped_attention(q, k, v, m, shape, scale);
        Bytes::from_elems(out)
    }
    let operands = [&q, &k, &v, &m];
    let bytes = match dtype {
        DType::F32 => run::<f32>(operands, shape, scale),
        _ => run::<bf16>(operands, shape, scale),
    };
    flex_output(bytes, [batch, queries, heads * head_dim], dtype)
}

/// The attention operands `[query, key, value, bias]` (layouts as for [`grouped_attention`], rows
/// contiguous) as the attention kernels read them.
#[allow(clippy::type_complexity)]
fn attention_views<T: burn::tensor::Element + bytemuck::Pod>(
    [q, k, v, m]: [&FlexTensor; 4],
) -> (attention::Heads<'_, T>, attention::Heads<'_, T>, attention::Heads<'_, T>, attention::Bias<'_, T>) {
    (heads_view(q, [0, 2, 1]), heads_view(k, [0, 1, 2]), heads_view(v, [0, 1, 2]), bias_view(m))
}

/// `t` read through its strides, with its axes `[batch, head, position]` at the given indices.
fn heads_view<T: burn::tensor::Element + bytemuck::Pod>(
    t: &FlexTensor,
    [batch, head, position]: [usize; 3],
) -> attention::Heads<'_, T> {
    let s = t.layout().strides();
    attention::Heads {
        data: t.storage::<T>(),
        offset: t.layout().start_offset(),
        batch_stride: s[batch] as usize,
        head_stride: s[head] as usize,
        position_stride: s[position] as usize,
    }
}

/// A bias view `[b, 1, q, k]` as the attention kernel reads it.
fn bias_view<T: burn::tensor::Element + bytemuck::Pod>(m: &FlexTensor) -> attention::Bias<'_, T> {
    let s = m.layout().strides();
    attention::Bias {
        data: m.storage::<T>(),
        offset: m.layout().start_offset(),
        batch_stride: s[0] as usize,
        query_stride: s[2] as usize,
        key_stride: s[3] as usize,
    }
}

/// The log-probability of each target token, `[b, n]` f32, from `logits` `[b, n, vocab]` (f32 or
/// bf16) and `targets` `[b, n]` (see [`fused::chosen_logprobs`]) when `B` is burn-flex, or when
/// it is burn-flex under autodiff and the logits are f32 (see [`tracked`]); `None` otherwise or
/// for a target outside the vocabulary.
pub(crate) fn chosen_logprobs<B: Backend>(
    logits: &Tensor<B, 3>,
    targets: &Tensor<B, 2, Int>,
) -> Option<Tensor<B, 2>> {
    let [b, n, vocab] = logits.dims();
    let ids = token_ids(targets, b * n, vocab)?;
    let Some(flex) = to_flex(logits.clone()) else {
        return tracked::chosen_logprobs(logits, ids, [b, n, vocab]);
    };
    let logits = flex_contiguous(&flex);
    let (values, _) = match logits.dtype() {
        DType::F32 => fused::chosen_logprobs(logits.as_slice::<f32>()?, vocab, &ids, |x| x),
        DType::BF16 => fused::chosen_logprobs(logits.as_slice::<bf16>()?, vocab, &ids, bf16_bits::widen),
        _ => return None,
    };
    flex_output(Bytes::from_elems(values), [b, n], DType::F32)
}

/// The entropy of each row's softmax, `[b, n]` f32, from f32 `logits` `[b, n, vocab]`, as a value
/// without gradient (see [`fused::row_entropy`]) when `B` is burn-flex, plain or under autodiff;
/// `None` otherwise.
pub(crate) fn entropy<B: Backend>(logits: &Tensor<B, 3>) -> Option<Tensor<B, 2>> {
    let [b, n, vocab] = logits.dims();
    let Some(flex) = to_flex(logits.clone()) else {
        return tracked::untracked_entropy(logits, [b, n, vocab]);
    };
    let logits = flex_contiguous(&flex);
    let values = fused::row_entropy(logits.as_slice::<f32>()?, vocab);
    flex_output(Bytes::from_elems(values), [b, n], DType::F32)
}

/// `weight[ids]` `[b, s, hidden]` for a `[vocab, hidden]` table when `B` is burn-flex under
/// autodiff and the table is f32 (see [`tracked`]); `None` otherwise.
pub(crate) fn embedding<B: Backend>(weight: &Tensor<B, 2>, ids: &Tensor<B, 2, Int>) -> Option<Tensor<B, 3>> {
    let table = tracked::as_tracked(weight)?;
    let [b, s] = ids.dims();
    let token_ids = token_ids(ids, b * s, weight.dims()[0])?;
    tracked::embedding(table, token_ids, [b, s])
}

/// The `len` ids of a burn-flex integer tensor, when all are below `vocab`.
fn token_ids<B: Backend, const D: usize>(
    ids: &Tensor<B, D, Int>,
    len: usize,
    vocab: usize,
) -> Option<Vec<usize>> {
    let ids = to_flex_int(ids.clone())?.to_contiguous();
    let ids: Vec<usize> = match ids.dtype() {
        DType::I64 => ids.as_slice::<i64>()?.iter().map(|&t| t as usize).collect(),
        DType::I32 => ids.as_slice::<i32>()?.iter().map(|&t| t as usize).collect(),
        _ => return None,
    };
    (ids.len() == len && ids.iter().all(|&t| t < vocab)).then_some(ids)
}

/// `t` itself when its strides are non-negative and its last axis is contiguous, else a
/// contiguous copy.
fn rows_contiguous(t: FlexTensor) -> FlexTensor {
    let strides = t.layout().strides();
    if strides.last() == Some(&1) && strides.iter().all(|&s| s >= 0) {
        t
    } else {
        t.to_contiguous()
    }
}

/// `t` laid out contiguously when `B` is burn-flex (see [`flex_contiguous`]); unchanged
/// otherwise (other backends make their own copies where their ops need them).
pub(crate) fn contiguous<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    match to_flex(t.clone()) {
        Some(flex) => from_flex::<B>(flex_contiguous(&flex))
            .map_or(t, |p| Tensor::from_primitive(TensorPrimitive::Float(p))),
        None => t,
    }
}

/// `t` with its elements in row-major order from offset 0, like burn-flex's `to_contiguous`.
/// An f32 or bf16 view whose last axis is contiguous (e.g. after `swap_dims` of two other
/// axes) is copied a row at a time, in parallel: burn-flex walks views that keep more than
/// two axes after merging one element at a time, on one thread.
pub(super) fn flex_contiguous(t: &FlexTensor) -> FlexTensor {
    let layout = t.layout();
    let whole = t.is_contiguous()
        && layout.start_offset() == 0
        && t.bytes().len() == layout.num_elements() * t.dtype().size();
    if whole {
        return t.clone();
    }
    let strides = layout.strides();
    let dims = layout.shape().to_vec();
    if strides.last() != Some(&1) || strides.iter().any(|&s| s < 0) || dims.contains(&0) {
        return t.to_contiguous();
    }
    let strides: Vec<usize> = strides.iter().map(|&s| s as usize).collect();
    let offset = layout.start_offset();
    fn copy_rows<T: Copy + Default + Send + Sync>(src: &[T], dims: &[usize], strides: &[usize], offset: usize) -> Vec<T> {
        let d = *dims.last().expect("a view has at least one axis");
        let rows_per_task = (1 << 14) / d + 1;
        let mut out = vec![T::default(); dims.iter().product()];
        out.par_chunks_mut(d * rows_per_task).enumerate().for_each(|(task, rows)| {
            for (r, dst) in rows.chunks_exact_mut(d).enumerate() {
                let (mut rest, mut start) = (task * rows_per_task + r, offset);
                for (&n, &stride) in dims[..dims.len() - 1].iter().zip(strides).rev() {
                    start += (rest % n) * stride;
                    rest /= n;
                }
                dst.copy_from_slice(&src[start..start + d]);
            }
        });
        out
    }
    let bytes = match t.dtype() {
        DType::F32 => Bytes::from_elems(copy_rows(t.storage::<f32>(), &dims, &strides, offset)),
        DType::BF16 => Bytes::from_elems(copy_rows(t.storage::<bf16>(), &dims, &strides, offset)),
        _ => return t.to_contiguous(),
    };
    FlexTensor::new(bytes, Layout::contiguous(Shape::from(dims)), t.dtype())
}

/// A contiguous burn-flex result as a tensor of `B` (which is burn-flex when this is reached).
fn flex_output<B: Backend, const D: usize>(
    bytes: Bytes,
    dims: [usize; D],
    dtype: DType,
) -> Option<Tensor<B, D>> {
    let out = FlexTensor::new(bytes, Layout::contiguous(Shape::from(dims.to_vec())), dtype);
    from_flex::<B>(out).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}

/// Whether the CPU has the AVX-512 subset that the element-wise loops are compiled for in their
/// wide variants (see `fused` and `attention`).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    })
}

/// The burn-flex tensor behind `t`, when `B` is burn-flex.
fn to_flex<B: Backend, const D: usize>(t: Tensor<B, D>) -> Option<FlexTensor> {
    if portable_ops() {
        return None;
    }
    let primitive: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    primitive.downcast::<FlexTensor>().ok().map(|t| *t)
}

/// Whether `B`'s float tensors are burn-flex tensors (not under autodiff) and the fused kernels
/// are on: then tensor data already lives in host memory and host loops over it are cheap.
pub fn cpu_kernels_active<B: Backend>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<FlexTensor>() && !portable_ops()
}

/// Whether the fused CPU kernels are switched off (see [`set_portable_ops`]).
pub fn portable_ops() -> bool {
    match PORTABLE_OPS.load(Ordering::Relaxed) {
        PORTABLE_UNSET => {
            let on = std::env::var_os("PROMPT_R1_PORTABLE_OPS").is_some_and(|v| v == "1");
            set_portable_ops(on);
            on
        }
        state => state == PORTABLE_ON,
    }
}

/// Switches the fused CPU kernels off (`true`) or on, for the whole process. Off, every op runs
/// through burn's portable tensor ops: the path the CUDA backend takes, so that CPU tests check
/// that path and benchmarks measure what the kernels gain. Until this is called the setting
/// comes from the environment: `PROMPT_R1_PORTABLE_OPS=1` switches the kernels off.
pub fn set_portable_ops(on: bool) {
    PORTABLE_OPS.store(if on { PORTABLE_ON } else { PORTABLE_OFF }, Ordering::Relaxed);
}

/// The portable-ops setting: unset until [`portable_ops`] or [`set_portable_ops`] first runs.
static PORTABLE_OPS: AtomicU8 = AtomicU8::new(PORTABLE_UNSET);
const PORTABLE_UNSET: u8 = 0;
const PORTABLE_OFF: u8 = 1;
const PORTABLE_ON: u8 = 2;

/// The burn-flex tensor behind the integer tensor `t`, when `B` is burn-flex.
fn to_flex_int<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Option<FlexTensor> {
    if portable_ops() {
        return None;
    }
    let primitive: Box<dyn Any> = Box::new(t.into_primitive());
    primitive.downcast::<FlexTensor>().ok().map(|t| *t)
}

/// `t` as `B`'s float primitive, when `B` is burn-flex.
fn from_flex<B: Backend>(t: FlexTensor) -> Option<B::FloatTensorPrimitive> {
    let primitive: Box<dyn Any> = Box::new(t);
    primitive
        .downcast::<B::FloatTensorPrimitive>()
        .ok()
        .map(|t| *t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::Distribution;

    /// Row-wise parallel copies give burn's element order for views of both float dtypes:
    /// swapped axes, a slice with an offset, and a view that is already contiguous.
    #[test]
    fn contiguous_copies_views_in_row_major_order() {
        let device = Default::default();
        let base = Tensor::<Flex, 4>::random([2, 37, 8, 16], Distribution::Normal(0.0, 1.0), &device);
        for dtype in [DType::F32, DType::BF16] {
            let base = base.clone().cast(dtype);
            let views = [
                base.clone().swap_dims(1, 2),
                base.clone().swap_dims(1, 2).slice([0..2, 1..7, 3..30, 0..16]),
                base.clone().slice([1..2, 0..37, 0..8, 0..16]),
            ];
            for view in views {
                let ours = contiguous(view.clone());
                let flex = to_flex(ours.clone()).unwrap();
                assert!(flex.is_contiguous() && flex.layout().start_offset() == 0);
                assert_eq!(ours.dims(), view.dims());
                assert_eq!(ours.into_data(), view.into_data());
            }
        }
    }

    fn max_diff<B: Backend>(a: Tensor<B, 3>, b: Tensor<B, 3>) -> f32 {
        let a: Vec<f32> = a.cast(DType::F32).into_data().to_vec().unwrap();
        let b: Vec<f32> = b.cast(DType::F32).into_data().to_vec().unwrap();
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Both layouts and both activation dtypes agree with burn's own matmul, for a decode-sized
    /// and a prefill-sized input; bf16 results within a few bf16 ulps of values of size ~10.
    #[test]
    fn flex_bf16_weights_match_burn_matmul() {
        let device = Default::default();
        let w = Tensor::<Flex, 2>::random([96, 80], Distribution::Normal(0.0, 1.0), &device)
            .cast(DType::BF16);
        for rows in [1, 40] {
            let x =
                Tensor::<Flex, 3>::random([2, rows, 96], Distribution::Normal(0.0, 1.0), &device);
            for dtype in [DType::F32, DType::BF16] {
                let x = x.clone().cast(dtype);
                let want = x
                    .clone()
                    .cast(DType::F32)
                    .matmul(w.clone().cast(DType::F32).unsqueeze());
                let got = weight_matmul(&x, &w, WeightLayout::InOut)
                    .expect("flex + bf16 takes the kernel");
                assert_eq!(got.dtype(), dtype);
                assert!(
                    max_diff(got, want.clone()) < 0.2,
                    "in-out, {rows} rows, {dtype:?}"
                );
                let wt = w.clone().transpose().cast(DType::F32).cast(DType::BF16);
                let got = weight_matmul(&x, &wt, WeightLayout::OutIn)
                    .expect("flex + bf16 takes the kernel");
                assert!(max_diff(got, want) < 0.2, "out-in, {rows} rows, {dtype:?}");
            }
        }
    }

    /// f32 weights take the streaming kernel for decode-sized inputs only.
    #[test]
    fn flex_f32_weights_match_burn_matmul_for_few_rows() {
        let device = Default::default();
        let w = Tensor::<Flex, 2>::random([96, 80], Distribution::Normal(0.0, 1.0), &device);
        let x = Tensor::<Flex, 3>::random([2, 3, 96], Distribution::Normal(0.0, 1.0), &device);
        let want = x.clone().matmul(w.clone().unsqueeze());
        let wt = Tensor::<Flex, 2>::from_data(w.clone().transpose().into_data(), &device);
        for (got, layout) in [
            (weight_matmul(&x, &w, WeightLayout::InOut), "in-out"),
            (weight_matmul(&x, &wt, WeightLayout::OutIn), "out-in"),
        ] {
            match got {
                Some(got) => assert!(max_diff(got, want.clone()) < 1e-4, "{layout}"),
                None => assert!(
                    !weight_matmul::has_fast_path(),
                    "{layout}: kernel not taken"
                ),
            }
        }
        let many = Tensor::<Flex, 3>::ones([2, 9, 96], &device);
        assert!(
            weight_matmul(&many, &w, WeightLayout::InOut).is_none(),
            "18 rows go to burn's GEMM"
        );
    }

    #[test]
    fn other_dtypes_and_backends_keep_burns_matmul() {
        let device = Default::default();
        let x = Tensor::<Flex, 3>::ones([1, 2, 4], &device).cast(DType::BF16);
        assert!(weight_matmul(&x, &Tensor::ones([4, 3], &device), WeightLayout::InOut).is_none());
        let x = Tensor::<Autodiff<Flex>, 3>::ones([1, 2, 4], &device);
        let w = Tensor::<Autodiff<Flex>, 2>::ones([4, 3], &device).cast(DType::BF16);
        assert!(weight_matmul(&x, &w, WeightLayout::InOut).is_none());
    }
}

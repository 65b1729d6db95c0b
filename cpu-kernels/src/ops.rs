//! The named points where the model hands work to the kernels. Each takes tensors of any
//! backend and the [`Kernels`] to run, and returns `None` unless the backend is burn-flex
//! (plain, or under autodiff where the kernel has a backward), the kernels are on and the
//! dtypes are ones the kernel handles; the caller then computes the same thing with burn's ops.
//! The paged KV cache's writes and gathers (`write_slots`, `gather_slots`) compute nothing and
//! run whatever the kernels.

use burn::tensor::{backend::Backend, bf16, Bytes, DType, Int, Tensor, TensorPrimitive};
use burn_flex::FlexTensor;

use crate::flex::{flex_contiguous, flex_output, from_flex, narrow_all, rows_contiguous, to_flex, token_ids};
use crate::{attention, bf16_bits, fused, tracked, weight_matmul, Kernels};

/// How a weight matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
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

/// `x · w` (or `x · wᵀ`, see [`WeightLayout`]) at the operands' precision when `B` is
/// burn-flex, `w` is a contiguous matrix, and either `w` is bf16 and `x` bf16 or f32 (the
/// result has `x`'s dtype; f32 sums), or both are f32 with at most 16 rows (decode) at the
/// AVX-512 BF16 level, whose streaming kernel reads the weights at full bandwidth; `None`
/// otherwise, for the caller to use burn's matmul.
pub fn linear<B: Backend, const D: usize>(
    kernels: Kernels,
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
    layout: WeightLayout,
) -> Option<Tensor<B, D>> {
    if !kernels.is_on() {
        return None;
    }
    let (k, n) = layout.inner_outer(w.dims());
    let mut dims = x.dims();
    let m: usize = dims[..D - 1].iter().product();
    let small_f32 = m <= weight_matmul::SMALL_M && weight_matmul::has_fast_path(kernels);
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
            let y = weight_matmul::matmul_bf16(kernels, x, w, layout, m, k, n);
            (Bytes::from_elems(y), DType::BF16)
        }
        (DType::BF16, _) => {
            let (x, w) = (input.as_slice::<f32>()?, weight.as_slice::<bf16>()?);
            let y = weight_matmul::matmul_f32_bf16(kernels, x, w, layout, m, k, n);
            (Bytes::from_elems(y), DType::F32)
        }
        _ => {
            let (x, w) = (input.as_slice::<f32>()?, weight.as_slice::<f32>()?);
            let y = weight_matmul::matmul_f32_small(kernels, x, w, layout, m, k, n)?;
            (Bytes::from_elems(y), DType::F32)
        }
    };
    flex_output(bytes, dims, dtype)
}

/// `x · w` (or `x · wᵀ`) of f32 operands at bf16 precision: both rounded to bf16 (to nearest,
/// ties to even), their products (exact in f32) summed in f32, and the f32 sums returned
/// unrounded. When `B` is burn-flex, plain or under autodiff (one node whose backward rounds
/// the output gradient too, see `tracked`), at every instruction-set level: the AVX-512 BF16
/// kernels where they run, else the rounded operands through burn-flex's f32 GEMM. Scoring
/// (plain) and the update (autodiff) therefore compute the same sums, bit for bit. `None` for
/// other backends and dtypes.
pub fn linear_bf16<B: Backend, const D: usize>(
    kernels: Kernels,
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
    layout: WeightLayout,
) -> Option<Tensor<B, D>> {
    let (k, n) = layout.inner_outer(w.dims());
    let mut dims = x.dims();
    if !kernels.is_on() || x.dtype() != DType::F32 || w.dtype() != DType::F32 || dims[D - 1] != k {
        return None;
    }
    if let Some(y) = tracked::bf16_matmul(kernels, x, w, layout, k, n) {
        return Some(y);
    }
    let weight = to_flex(w.clone())?;
    let input = flex_contiguous(&to_flex(x.clone())?);
    let m = input.layout().num_elements() / k;
    let xb = narrow_all(kernels, input.as_slice()?);
    let y = weight_matmul::matmul_rounded(kernels, &xb, weight.as_slice()?, layout, m, k, n);
    dims[D - 1] = n;
    flex_output(Bytes::from_elems(y), dims, DType::F32)
}

/// Whether bf16 products run through the hand-written AVX-512 BF16 kernels at `kernels`' level
/// (otherwise bf16 weights take portable loops, and bf16-precision products burn-flex's f32
/// GEMM on rounded operands).
pub fn has_bf16_kernels(kernels: Kernels) -> bool {
    weight_matmul::has_fast_path(kernels)
}

/// HF's `Qwen3RMSNorm` (see `fused::rms_norm_f32`) when `B` is burn-flex and `x` and `weight`
/// are both f32 or both bf16, or when it is burn-flex under autodiff and both are f32 (see
/// `tracked`).
pub fn rms_norm<B: Backend, const D: usize>(
    kernels: Kernels,
    x: &Tensor<B, D>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Option<Tensor<B, D>> {
    if !kernels.is_on() || x.dims()[D - 1] != weight.dims()[0] {
        return None;
    }
    let eps = eps as f32;
    let Some(weight) = to_flex(weight.clone()) else {
        return tracked::rms_norm(kernels, x, weight, eps);
    };
    let input = flex_contiguous(&to_flex(x.clone())?);
    let (bytes, dtype) = match (input.dtype(), weight.dtype()) {
        (DType::F32, DType::F32) => {
            let y = fused::rms_norm_f32(kernels, input.as_slice()?, weight.as_slice()?, eps);
            (Bytes::from_elems(y), DType::F32)
        }
        (DType::BF16, DType::BF16) => {
            let y = fused::rms_norm_bf16(kernels, input.as_slice()?, weight.as_slice()?, eps);
            (Bytes::from_elems(y), DType::BF16)
        }
        _ => return None,
    };
    flex_output(bytes, x.dims(), dtype)
}

/// `silu(gate) * up` when `B` is burn-flex and both are f32 or both bf16, of one shape, or when
/// it is burn-flex under autodiff and both are f32 (see `tracked`).
pub fn silu_mul<B: Backend, const D: usize>(
    kernels: Kernels,
    gate: &Tensor<B, D>,
    up: &Tensor<B, D>,
) -> Option<Tensor<B, D>> {
    if !kernels.is_on() || gate.dims() != up.dims() {
        return None;
    }
    let Some(g) = to_flex(gate.clone()).map(|g| flex_contiguous(&g)) else {
        return tracked::silu_mul(kernels, gate, up);
    };
    let u = flex_contiguous(&to_flex(up.clone())?);
    let (bytes, dtype) = match (g.dtype(), u.dtype()) {
        (DType::F32, DType::F32) => (
            Bytes::from_elems(fused::silu_mul_f32(kernels, g.as_slice()?, u.as_slice()?)),
            DType::F32,
        ),
        (DType::BF16, DType::BF16) => (
            Bytes::from_elems(fused::silu_mul_bf16(kernels, g.as_slice()?, u.as_slice()?)),
            DType::BF16,
        ),
        _ => return None,
    };
    flex_output(bytes, gate.dims(), dtype)
}

/// `t` in `dtype`, f32 to bf16 rounding to nearest, ties to even, as PyTorch's `.to()` does.
/// burn-flex 0.21's own `cast` rounds some values the other way (e.g. f32 bits `0xbc468001` to
/// `0xbc46` where round-to-nearest gives `0xbc47`), so on burn-flex that conversion goes through
/// `to_bf16`; everything else is burn's `cast`.
pub fn cast<B: Backend, const D: usize>(kernels: Kernels, t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    match (t.dtype(), dtype) {
        (from, to) if from == to => t,
        (DType::F32, DType::BF16) => to_bf16(kernels, &t).unwrap_or_else(|| t.cast(dtype)),
        _ => t.cast(dtype),
    }
}

/// `t` rounded to bf16 (to nearest, ties to even) when `B` is burn-flex and `t` is f32; `None`
/// otherwise.
fn to_bf16<B: Backend, const D: usize>(kernels: Kernels, t: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    if !kernels.is_on() {
        return None;
    }
    let values = flex_contiguous(&to_flex(t.clone())?);
    flex_output(Bytes::from_elems(narrow_all(kernels, values.as_slice()?)), t.dims(), DType::BF16)
}

/// HF's `apply_rotary_pos_emb` (see `fused::rotary_f32`) when `B` is burn-flex and `x` and
/// both tables are f32 or all bf16 of one shape, or burn-flex under autodiff (see `tracked`)
/// and they are f32; `None` otherwise. The tables take no gradient.
pub fn rotary<B: Backend>(
    kernels: Kernels,
    x: &Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    signed_sin: &Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    let dims = x.dims();
    if !kernels.is_on() || cos.dims() != dims || signed_sin.dims() != dims || !dims[3].is_multiple_of(2) {
        return None;
    }
    let Some(input) = to_flex(x.clone()) else {
        return tracked::rotary(kernels, x, cos, signed_sin);
    };
    let operands = [input, to_flex(cos.clone())?, to_flex(signed_sin.clone())?];
    let dtype = operands[0].dtype();
    if operands.iter().any(|t| t.dtype() != dtype) {
        return None;
    }
    let [x, c, s] = operands.map(|t| flex_contiguous(&t));
    let d = dims[3];
    let y = match dtype {
        DType::F32 => Bytes::from_elems(fused::rotary_f32(kernels, x.as_slice()?, c.as_slice()?, s.as_slice()?, d)),
        DType::BF16 => Bytes::from_elems(fused::rotary_bf16(kernels, x.as_slice()?, c.as_slice()?, s.as_slice()?, d)),
        _ => return None,
    };
    flex_output(y, dims, dtype)
}

/// Grouped-query attention through `attention::grouped_attention` when `B` is burn-flex and
/// the operands are all f32 or all bf16, or when it is burn-flex under autodiff and they are f32
/// (see `tracked`): `query` `[b, q, heads, d]`, `key` and `value` `[b, kv_heads, k, d]` (views
/// with any non-negative strides), `bias` `[b, 1, q, k]`. Returns `[b, q, heads * d]`.
pub fn grouped_attention<B: Backend>(
    kernels: Kernels,
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
    if !kernels.is_on() || !shapes_agree || !kernel_dtypes(dtype, [key.dtype(), value.dtype(), bias.dtype()]) {
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
        return tracked::grouped_attention(kernels, query, key, value, bias, shape, scale);
    };
    let [k, v, m] = [key, value, bias].map(|t| to_flex(t.clone()).map(rows_contiguous));
    let (k, v, m) = (k?, v?, m?);
    fn run<T: attention::Element + burn::tensor::Element + bytemuck::Pod>(
        kernels: Kernels,
        [q, k, v, m]: [&FlexTensor; 4],
        shape: attention::AttentionShape,
        scale: f32,
    ) -> Bytes {
        let (q, k, v, m) = attention_views::<T>([q, k, v, m]);
        let out = attention::grouped_attention(kernels, q, k, v, m, shape, scale);
        Bytes::from_elems(out)
    }
    let operands = [&q, &k, &v, &m];
    let bytes = match dtype {
        DType::F32 => run::<f32>(kernels, operands, shape, scale),
        _ => run::<bf16>(kernels, operands, shape, scale),
    };
    flex_output(bytes, [batch, queries, heads * head_dim], dtype)
}

/// [`grouped_attention`] over a paged KV cache: row `r`'s key and value `c` are slot
/// `table[r * width + c]` of `key_pool` and `value_pool` (`[kv_heads, slots, d]`, contiguous),
/// read where they lie (runs of consecutive slots at a time; `skip`'s positions, masked
/// padding, not read) instead of gathered into `[b, kv_heads, width, d]` first. Same
/// conditions as [`grouped_attention`] (plain burn-flex, the kernels on, f32 or bf16), and
/// `None` otherwise, for the caller to gather.
#[allow(clippy::too_many_arguments)]
pub fn grouped_attention_paged<B: Backend>(
    kernels: Kernels,
    query: &Tensor<B, 4>,
    key_pool: &Tensor<B, 3>,
    value_pool: &Tensor<B, 3>,
    table: &[usize],
    skip: Option<usize>,
    bias: &Tensor<B, 4>,
    scale: f32,
) -> Option<Tensor<B, 3>> {
    // Other backends (and the kernels off) return before the table is scanned.
    if !kernels.is_on() {
        return None;
    }
    let q = to_flex(query.clone()).map(rows_contiguous)?;
    let [batch, queries, heads, head_dim] = query.dims();
    let [kv_heads, slots, _] = key_pool.dims();
    let keys = table.len().checked_div(batch)?;
    let shapes_agree = key_pool.dims() == [kv_heads, slots, head_dim]
        && value_pool.dims() == key_pool.dims()
        && table.len() == batch * keys
        && table.iter().all(|&s| s < slots)
        && bias.dims() == [batch, 1, queries, keys]
        && kv_heads > 0
        && heads % kv_heads == 0;
    let dtype = query.dtype();
    if !shapes_agree || !kernel_dtypes(dtype, [key_pool.dtype(), value_pool.dtype(), bias.dtype()]) {
        return None;
    }
    let [k, v] = [key_pool, value_pool].map(|t| to_flex(t.clone()).map(|t| flex_contiguous(&t)));
    let (k, v, m) = (k?, v?, to_flex(bias.clone()).map(rows_contiguous)?);
    let shape = attention::AttentionShape { batch, queries, keys, heads, kv_heads, head_dim };
    let pages = attention::Pages { slots: table, width: keys, skip };
    fn run<T: attention::Element + burn::tensor::Element + bytemuck::Pod>(
        kernels: Kernels,
        [q, k, v, m]: [&FlexTensor; 4],
        pages: attention::Pages<'_>,
        shape: attention::AttentionShape,
        scale: f32,
    ) -> Bytes {
        let (q, _, _, m) = attention_views::<T>([q, q, q, m]);
        let out = attention::grouped_attention(kernels, q, pool_view(k, pages, shape.head_dim), pool_view(v, pages, shape.head_dim), m, shape, scale);
        Bytes::from_elems(out)
    }
    let operands = [&q, &k, &v, &m];
    let bytes = match dtype {
        DType::F32 => run::<f32>(kernels, operands, pages, shape, scale),
        _ => run::<bf16>(kernels, operands, pages, shape, scale),
    };
    flex_output(bytes, [batch, queries, heads * head_dim], dtype)
}

/// Whether the attention kernels take operands of `dtype` (f32 or bf16) with `others` of it too.
fn kernel_dtypes(dtype: DType, others: [DType; 3]) -> bool {
    matches!(dtype, DType::F32 | DType::BF16) && others.iter().all(|&t| t == dtype)
}

/// A contiguous `[kv_heads, slots, d]` pool read through `pages`.
fn pool_view<'a, T: burn::tensor::Element + bytemuck::Pod>(t: &'a FlexTensor, pages: attention::Pages<'a>, d: usize) -> attention::Heads<'a, T> {
    attention::Heads {
        data: t.storage::<T>(),
        offset: 0,
        batch_stride: 0,
        head_stride: t.layout().shape()[1] * d,
        position_stride: d,
        pages: Some(pages),
    }
}

/// The attention operands `[query, key, value, bias]` (layouts as for [`grouped_attention`], rows
/// contiguous) as the attention kernels read them.
#[allow(clippy::type_complexity)]
pub(crate) fn attention_views<T: burn::tensor::Element + bytemuck::Pod>(
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
        pages: None,
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
/// bf16) and `targets` `[b, n]` (see `fused::chosen_logprobs`) when `B` is burn-flex, or when
/// it is burn-flex under autodiff and the logits are f32 (see `tracked`); `None` otherwise or
/// for a target outside the vocabulary.
pub fn chosen_logprobs<B: Backend>(
    kernels: Kernels,
    logits: &Tensor<B, 3>,
    targets: &Tensor<B, 2, Int>,
) -> Option<Tensor<B, 2>> {
    if !kernels.is_on() {
        return None;
    }
    let [b, n, vocab] = logits.dims();
    let ids = token_ids(targets, b * n, vocab)?;
    let Some(flex) = to_flex(logits.clone()) else {
        return tracked::chosen_logprobs(kernels, logits, ids, [b, n, vocab]);
    };
    let logits = flex_contiguous(&flex);
    let (values, _) = match logits.dtype() {
        DType::F32 => fused::chosen_logprobs(kernels, logits.as_slice::<f32>()?, vocab, &ids, |x| x),
        DType::BF16 => fused::chosen_logprobs(kernels, logits.as_slice::<bf16>()?, vocab, &ids, bf16_bits::widen),
        _ => return None,
    };
    flex_output(Bytes::from_elems(values), [b, n], DType::F32)
}

/// The entropy of each row's softmax, `[b, n]` f32, from f32 `logits` `[b, n, vocab]`, as a value
/// without gradient (see `fused::row_entropy`) when `B` is burn-flex, plain or under autodiff;
/// `None` otherwise.
pub fn entropy<B: Backend>(kernels: Kernels, logits: &Tensor<B, 3>) -> Option<Tensor<B, 2>> {
    if !kernels.is_on() {
        return None;
    }
    let [b, n, vocab] = logits.dims();
    let Some(flex) = to_flex(logits.clone()) else {
        return tracked::untracked_entropy(kernels, logits, [b, n, vocab]);
    };
    let logits = flex_contiguous(&flex);
    let values = fused::row_entropy(kernels, logits.as_slice::<f32>()?, vocab);
    flex_output(Bytes::from_elems(values), [b, n], DType::F32)
}

/// `weight[ids]` `[b, s, hidden]` for a `[vocab, hidden]` table when `B` is burn-flex under
/// autodiff and the table is f32 (see `tracked`); `None` otherwise.
pub fn embedding<B: Backend>(kernels: Kernels, weight: &Tensor<B, 2>, ids: &Tensor<B, 2, Int>) -> Option<Tensor<B, 3>> {
    if !kernels.is_on() {
        return None;
    }
    let table = tracked::as_tracked(weight)?;
    let [b, s] = ids.dims();
    let token_ids = token_ids(ids, b * s, weight.dims()[0])?;
    tracked::embedding(table, token_ids, [b, s])
}

/// `pool` (`[h, slots, d]`, a paged KV cache's keys or values) with `value` (`[b, h, n, d]`)
/// written to its slots: row `r`'s position `j` to slot `slots[r * n + j]`, in place, when `B`
/// is plain burn-flex, the pool is contiguous and held alone, and both have one dtype (f32,
/// bf16 or f16); otherwise `Err(pool)` and the caller uses `scatter_nd` (burn-flex 0.21's copies
/// the whole pool). A slot named twice gets the later write. The write computes nothing, so it
/// applies with the portable ops on too.
pub fn write_slots<B: Backend>(pool: Tensor<B, 3>, slots: &[usize], value: &Tensor<B, 4>) -> Result<Tensor<B, 3>, Tensor<B, 3>> {
    // Other backends return before the slots are scanned (a GPU pass's host time).
    if !crate::flex::is_plain_flex::<B>() {
        return Err(pool);
    }
    let [h, capacity, d] = pool.dims();
    let [b, vh, n, vd] = value.dims();
    let fits = [vh, vd] == [h, d] && slots.len() == b * n && slots.iter().all(|&s| s < capacity) && value.dtype() == pool.dtype();
    if !fits || !matches!(pool.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(pool);
    }
    let mut flex = crate::flex::flex_of(pool)?;
    let source = crate::flex::flex_of(value.clone()).map_err(|_| ()).map(|s| flex_contiguous(&s));
    let whole = flex.is_contiguous() && flex.layout().start_offset() == 0 && flex.bytes().len() == capacity * h * d * flex.dtype().size();
    /// Copies each of `src`'s (`[b, h, n, d]`) positions to its slot of `dst` (`[h, capacity, d]`).
    fn copy<T: bytemuck::Pod + burn::tensor::Element>(dst: &mut FlexTensor, src: &FlexTensor, slots: &[usize], [h, capacity, n, d]: [usize; 4]) -> bool {
        let src = src.storage::<T>();
        let Some(dst) = dst.try_storage_mut::<T>() else { return false };
        for (i, &slot) in slots.iter().enumerate() {
            let (r, j) = (i / n, i % n);
            for head in 0..h {
                let from = ((r * h + head) * n + j) * d;
                let to = (head * capacity + slot) * d;
                dst[to..to + d].copy_from_slice(&src[from..from + d]);
            }
        }
        true
    }
    let plan = [h, capacity, n, d];
    let written = match (&source, whole) {
        (Ok(src), true) => match flex.dtype() {
            DType::F32 => copy::<f32>(&mut flex, src, slots, plan),
            DType::BF16 => copy::<bf16>(&mut flex, src, slots, plan),
            _ => copy::<burn::tensor::f16>(&mut flex, src, slots, plan),
        },
        _ => false,
    };
    let tensor = from_flex::<B>(flex).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p))).expect("B is burn-flex");
    if written {
        Ok(tensor)
    } else {
        Err(tensor)
    }
}

/// Elements from which [`gather_slots`] copies on every thread.
const PARALLEL_GATHER_ELEMENTS: usize = 1 << 16;

/// The slots `table` (`rows × width`, row-major) of `pool` (`[h, slots, d]`) as a contiguous
/// `[rows, h, width, d]` tensor, column `c` of row `r` from slot `table[r * width + c]` (zeros
/// where that is `zero_slot`: padding), when `B` is plain burn-flex (the portable ops on or
/// off: it computes nothing) and the pool is f32, bf16 or f16; `None` otherwise, for the caller
/// to use `select`. Runs of consecutive slots (a block's positions) are copied in one piece,
/// one task per row and head.
pub fn gather_slots<B: Backend>(pool: &Tensor<B, 3>, table: &[usize], rows: usize, zero_slot: Option<usize>) -> Option<Tensor<B, 4>> {
    use rayon::prelude::*;
    let [h, capacity, d] = pool.dims();
    if !crate::flex::is_plain_flex::<B>() || rows == 0 || table.len() % rows != 0 || table.iter().any(|&s| s >= capacity) {
        return None;
    }
    let width = table.len() / rows;
    let flex = crate::flex::flex_of(pool.clone()).ok()?;
    let flex = flex_contiguous(&flex);
    fn gather<T: bytemuck::Pod + Default + Send + Sync + burn::tensor::Element>(
        src: &[T],
        table: &[usize],
        zero_slot: Option<usize>,
        [h, capacity, width, d]: [usize; 4],
    ) -> Vec<T> {
        let mut out = vec![T::default(); table.len() * h * d];
        if width == 0 {
            return out;
        }
        let fill = |(task, dst): (usize, &mut [T])| {
            let (r, head) = (task / h, task % h);
            let slots = &table[r * width..(r + 1) * width];
            let mut c = 0;
            while c < width {
                let start = slots[c];
                if Some(start) == zero_slot {
                    // `out` starts zeroed.
                    c += 1;
                    continue;
                }
                let run = 1 + slots[c + 1..].iter().zip(start + 1..).take_while(|&(&s, next)| s == next).count();
                let from = (head * capacity + start) * d;
                dst[c * d..(c + run) * d].copy_from_slice(&src[from..from + run * d]);
                c += run;
            }
        };
        // A decode step's small gathers cost less on one thread than waking the others.
        if out.len() < PARALLEL_GATHER_ELEMENTS {
            out.chunks_mut(width * d).enumerate().for_each(fill);
        } else {
            out.par_chunks_mut(width * d).enumerate().for_each(fill);
        }
        out
    }
    let plan = [h, capacity, width, d];
    let bytes = match flex.dtype() {
        DType::F32 => Bytes::from_elems(gather(flex.storage::<f32>(), table, zero_slot, plan)),
        DType::BF16 => Bytes::from_elems(gather(flex.storage::<bf16>(), table, zero_slot, plan)),
        DType::F16 => Bytes::from_elems(gather(flex.storage::<burn::tensor::f16>(), table, zero_slot, plan)),
        _ => return None,
    };
    flex_output(bytes, [rows, h, width, d], flex.dtype())
}

#[cfg(test)]
mod tests {
    use crate::Kernels;
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::Distribution;

    /// Writing into a pool's slots gives what `scatter_nd` gives, in place when the pool is held
    /// once; gathering slots gives `select` laid out as `[rows, h, width, d]`, with zeros where
    /// the table names the zero slot.
    #[test]
    fn slots_are_written_and_gathered_as_burn_does() {
        use burn::tensor::{IndexingUpdateOp, TensorData};
        let device = Default::default();
        for dtype in [DType::F32, DType::BF16] {
            let pool = Tensor::<Flex, 3>::random([2, 9, 4], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
            let value = Tensor::<Flex, 4>::random([2, 2, 3, 4], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
            let slots = [7, 1, 4, 2, 8, 0];
            // (head, slot) of each of the values' `[b, n, h]` rows.
            let pairs: Vec<i64> = slots.iter().flat_map(|&s| [0, s as i64, 1, s as i64]).collect();
            let index = Tensor::<Flex, 2, Int>::from_data(TensorData::new(pairs, [12, 2]), &device);
            let rows = value.clone().swap_dims(1, 2).reshape([12, 4]);
            let want = pool.clone().scatter_nd(index, rows, IndexingUpdateOp::Assign).into_data();
            let written = write_slots(pool.clone().mul_scalar(1.0), &slots, &value).expect("a pool held once is written in place");
            assert_eq!(written.clone().into_data(), want, "{dtype:?}");
            let shared = pool.clone();
            assert!(write_slots(pool, &slots, &value).is_err(), "a shared pool is not written");
            drop(shared);
            // Runs of consecutive slots and single ones.
            let table = [3, 4, 5, 8, 0, 1, 2, 6];
            let index = Tensor::<Flex, 1, Int>::from_data(TensorData::new(table.map(|s| s as i64).to_vec(), [8]), &device);
            let want = written.clone().select(1, index).reshape([2, 2, 4, 4]).swap_dims(0, 1);
            let got = gather_slots(&written, &table, 2, None).expect("burn-flex gathers");
            assert_eq!(got.dims(), [2, 2, 4, 4]);
            assert_eq!(got.into_data(), want.clone().into_data(), "{dtype:?}");
            // Slot 0 (row 1, column 0) read as zeros.
            let padded = gather_slots(&written, &table, 2, Some(0)).unwrap();
            let zeroed = want.slice_assign([1..2, 0..2, 0..1, 0..4], Tensor::zeros([1, 2, 1, 4], (&device, dtype)));
            assert_eq!(padded.into_data(), zeroed.into_data(), "{dtype:?}");
        }
    }

    /// Attention over a paged pool equals attention over the same keys and values gathered
    /// first, on both paths (in place for decode-sized query groups, packed for prefills), with
    /// leading padding read from a skipped slot.
    #[test]
    fn paged_attention_equals_attention_over_gathered_keys() {
        let device = Default::default();
        let (heads, kv_heads, d, slots) = (4, 2, 32, 40);
        for dtype in [DType::F32, DType::BF16] {
            for queries in [1, 9] {
                let pool = |seed| {
                    <Flex as Backend>::seed(&device, seed);
                    Tensor::<Flex, 3>::random([kv_heads, slots, d], Distribution::Normal(0.0, 1.0), &device).cast(dtype)
                };
                let (k, v) = (pool(1), pool(2));
                let query = Tensor::<Flex, 4>::random([2, queries, heads, d], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
                // Row 0: a padding column (slot 0, skipped) right before slots 1 and 2, then a
                // run 16..20 and a run 5..11; row 1: slots 28..39 and then 1 and 2.
                let width = 13;
                let mut table: Vec<usize> = vec![0, 1, 2];
                table.extend(16..20);
                table.extend(5..11);
                table.extend(28..39);
                table.extend([1, 2]);
                let valid = |r: usize, c: usize| r == 1 || c >= 1;
                let bias: Vec<f32> = (0..2)
                    .flat_map(|r| (0..queries).flat_map(move |i| (0..width).map(move |c| {
                        let causal = c + queries <= width + i;
                        if valid(r, c) && causal { 0.0 } else { -1.0e9 }
                    })))
                    .collect();
                let bias = Tensor::<Flex, 4>::from_data(burn::tensor::TensorData::new(bias, [2, 1, queries, width]), &device).cast(dtype);
                let gathered = |pool: &Tensor<Flex, 3>| gather_slots(pool, &table, 2, None).unwrap();
                let want = grouped_attention(Kernels::default(), &query, &gathered(&k), &gathered(&v), &bias, 0.125).expect("burn-flex attends");
                let got = grouped_attention_paged(Kernels::default(), &query, &k, &v, &table, Some(0), &bias, 0.125).expect("burn-flex attends to pages");
                let diff = max_diff(want.cast(DType::F32), got.cast(DType::F32));
                let tolerance = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                assert!(diff <= tolerance, "{dtype:?}, {queries} queries: {diff}");
            }
        }
    }

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
                let flex = flex_contiguous(&to_flex(view.clone()).unwrap());
                assert!(flex.is_contiguous() && flex.layout().start_offset() == 0);
                let ours = Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(flex));
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
                let got = linear(Kernels::default(), &x, &w, WeightLayout::InOut)
                    .expect("flex + bf16 takes the kernel");
                assert_eq!(got.dtype(), dtype);
                assert!(
                    max_diff(got, want.clone()) < 0.2,
                    "in-out, {rows} rows, {dtype:?}"
                );
                let wt = w.clone().transpose().cast(DType::F32).cast(DType::BF16);
                let got = linear(Kernels::default(), &x, &wt, WeightLayout::OutIn)
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
            (linear(Kernels::default(), &x, &w, WeightLayout::InOut), "in-out"),
            (linear(Kernels::default(), &x, &wt, WeightLayout::OutIn), "out-in"),
        ] {
            match got {
                Some(got) => assert!(max_diff(got, want.clone()) < 1e-4, "{layout}"),
                None => assert!(
                    !weight_matmul::has_fast_path(Kernels::default()),
                    "{layout}: kernel not taken"
                ),
            }
        }
        let many = Tensor::<Flex, 3>::ones([2, 9, 96], &device);
        assert!(
            linear(Kernels::default(), &many, &w, WeightLayout::InOut).is_none(),
            "18 rows go to burn's GEMM"
        );
    }

    #[test]
    fn other_dtypes_and_backends_keep_burns_matmul() {
        let device = Default::default();
        let x = Tensor::<Flex, 3>::ones([1, 2, 4], &device).cast(DType::BF16);
        assert!(linear(Kernels::default(), &x, &Tensor::ones([4, 3], &device), WeightLayout::InOut).is_none());
        let x = Tensor::<Autodiff<Flex>, 3>::ones([1, 2, 4], &device);
        let w = Tensor::<Autodiff<Flex>, 2>::ones([4, 3], &device).cast(DType::BF16);
        assert!(linear(Kernels::default(), &x, &w, WeightLayout::InOut).is_none());
    }
}

//! `Qwen3RMSNorm` as one CubeCL kernel (see [`model::device_kernels::NormKernels`]): one cube
//! of [`UNITS`] units a row; each unit sums the squares of its strided elements in f32, the cube
//! adds the partial sums in shared memory, and each unit writes its elements as
//! `weight · cast(x / sqrt(mean(x²) + eps))`. burn's ops take a reduction and two element-wise
//! kernels for the same (the fusion cannot join a reduction to the scaling after it without
//! autotune), and a decoding step runs four norms a layer.
//!
//! Two variants take in the operations next to a norm, which would otherwise run as kernels of
//! their own beside the custom operation: the residual addition before a layer's
//! `input_layernorm` and `post_attention_layernorm` and before the final norm
//! ([`add_rms_norm`], vLLM's `fused_add_rms_norm`), and
//! RoPE after `q_norm` and `k_norm` with the keys and values written to the paged KV cache
//! ([`qk_norm_rope_write`]: where burn's ops take two norm kernels and two scatters a layer).

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

/// Units per cube (one cube a row).
pub const UNITS: u32 = 64;

/// Cubes along the grid's first axis at most (wgpu allows 65,535 a dimension): more rows take
/// the second axis too.
const GRID_X: usize = 32_768;

/// A hash of this file (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("rms_norm.rs"));

/// The sum over the cube of each unit's `own` value, in f32, through `partial` (one slot a
/// unit). Every unit of the cube must call it.
#[cube]
fn cube_sum(partial: &mut SharedMemory<f32>, own: f32) -> f32 {
    let unit = UNIT_POS_X as usize;
    partial[unit] = own;
    sync_cube();
    if unit == 0 {
        let mut total = 0.0f32;
        for j in 0..CUBE_DIM_X as usize {
            total += partial[j];
        }
        partial[0] = total;
    }
    sync_cube();
    let total = partial[0];
    // No unit may overwrite its slot (a later call) before every unit has read the total.
    sync_cube();
    total
}

/// `1 / sqrt(mean + eps)` of a row of `width` elements whose squares this unit summed to
/// `own_squares` (the cube's units together cover the row). Every unit of the cube must call it.
#[cube]
fn inverse_rms(partial: &mut SharedMemory<f32>, own_squares: f32, #[comptime] width: u32, eps: f32) -> f32 {
    let total = cube_sum(partial, own_squares);
    1.0f32 / (total / f32::cast_from(width) + eps).sqrt()
}

/// The sum of the squares, in f32, of this unit's strided elements of the row of `n` from `base`.
#[cube]
fn own_squares<F: Float>(input: &Tensor<F>, base: usize, n: usize) -> f32 {
    let mut sum = 0.0f32;
    let mut i = UNIT_POS_X as usize;
    while i < n {
        let x = f32::cast_from(input[base + i]);
        sum += x * x;
        i += CUBE_DIM_X as usize;
    }
    sum
}

/// `weight[i] · cast(x · scale)`, rounded to `F` as HF rounds it: the normalised value in the
/// input's dtype before the weight.
#[cube]
fn normed<F: Float>(x: F, weight: F, scale: f32) -> F {
    let normalised = F::cast_from(f32::cast_from(x) * scale);
    F::cast_from(f32::cast_from(weight) * f32::cast_from(normalised))
}

/// The row this cube computes (the grid's two axes, see [`grid`]).
#[cube]
pub(crate) fn cube_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

#[cube(launch)]
fn rms_norm_kernel<F: Float>(
    input: &Tensor<F>,
    weight: &Tensor<F>,
    output: &mut Tensor<F>,
    eps: f32,
    #[comptime] hidden: u32,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = cube_row();
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let n = hidden as usize;
    let mut partial = SharedMemory::<f32>::new(UNITS as usize);
    // Every unit of a cube takes the same branch, so the syncs inside are reached by all.
    if row < input.shape(0) {
        let base = row * n;
        let scale = inverse_rms(&mut partial, own_squares::<F>(input, base, n), hidden, eps);
        let mut i = unit;
        while i < n {
            output[base + i] = normed::<F>(input[base + i], weight[i], scale);
            i += units;
        }
    }
}

/// [`rms_norm_kernel`] of `residual + delta`, which it writes too (`sum`, rounded to `F` as
/// burn's addition rounds it; the statistics are of the rounded sum).
#[cube(launch)]
fn add_rms_norm_kernel<F: Float>(
    residual: &Tensor<F>,
    delta: &Tensor<F>,
    weight: &Tensor<F>,
    sum: &mut Tensor<F>,
    output: &mut Tensor<F>,
    eps: f32,
    #[comptime] hidden: u32,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = cube_row();
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let n = hidden as usize;
    let mut partial = SharedMemory::<f32>::new(UNITS as usize);
    if row < residual.shape(0) {
        let base = row * n;
        let mut squares = 0.0f32;
        let mut i = unit;
        while i < n {
            let s = residual[base + i] + delta[base + i];
            sum[base + i] = s;
            let s = f32::cast_from(s);
            squares += s * s;
            i += units;
        }
        let scale = inverse_rms(&mut partial, squares, hidden, eps);
        let mut i = unit;
        while i < n {
            // Each unit reads back only the elements it wrote.
            output[base + i] = normed::<F>(sum[base + i], weight[i], scale);
            i += units;
        }
    }
}

/// [`rms_norm_kernel`] of the head of `head_dim` at `base` of `input` by `weight`, then RoPE
/// at table row `table`: `y · cos + swap_halves(y) · signed_sin`, in `F` as burn's ops compute
/// it, written to `output` from `out`. The normalised head waits in `head` for the swap of its
/// halves. Every unit of the cube must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_rope_head<F: Float>(
    input: &Tensor<F>,
    base: usize,
    weight: &Tensor<F>,
    cos: &Tensor<F>,
    signed_sin: &Tensor<F>,
    table: usize,
    output: &mut Tensor<F>,
    out: usize,
    partial: &mut SharedMemory<f32>,
    head: &mut SharedMemory<F>,
    eps: f32,
    #[comptime] head_dim: u32,
) {
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let n = head_dim as usize;
    let half = n / 2;
    let scale = inverse_rms(partial, own_squares::<F>(input, base, n), head_dim, eps);
    let mut i = unit;
    while i < n {
        head[i] = normed::<F>(input[base + i], weight[i], scale);
        i += units;
    }
    sync_cube();
    let mut i = unit;
    while i < n {
        let swapped = if i < half { head[i + half] } else { head[i - half] };
        output[out + i] = head[i] * cos[table + i] + swapped * signed_sin[table + i];
        i += units;
    }
}

/// `q_norm` and `k_norm` with RoPE ([`norm_rope_head`]) of one pass's query and key heads, the
/// rotated keys and the values written to their token's slot of a layer's pools
/// (`[kv_heads, slots, head_dim]`): one cube a head of a token, its `heads` query heads and then
/// its `kv_heads` key heads. A token's query heads start its row of `query`, its key heads
/// `key_column` into its row of `key`, its value heads `value_column` into its row of `value`,
/// rows `stride(0)` apart: three projections, or one stacked product (`qkv_proj`'s) passed as
/// all three. The query heads go to `rotated_query`, packed.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn qk_norm_rope_write_kernel<F: Float, I: Numeric>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    q_weight: &Tensor<F>,
    k_weight: &Tensor<F>,
    cos: &Tensor<F>,
    signed_sin: &Tensor<F>,
    slots: &Tensor<I>,
    rotated_query: &mut Tensor<F>,
    keys: &mut Tensor<F>,
    values: &mut Tensor<F>,
    eps: f32,
    heads: u32,
    kv_heads: u32,
    key_column: u32,
    value_column: u32,
    #[comptime] head_dim: u32,
    #[comptime] _revision: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = cube_row();
    let n = head_dim as usize;
    let h = heads as usize;
    let kv = kv_heads as usize;
    let token = row / (h + kv);
    let j = row % (h + kv);
    let mut partial = SharedMemory::<f32>::new(UNITS as usize);
    let mut head = SharedMemory::<F>::new(head_dim as usize);
    // Every unit of a cube takes the same branches, so the syncs inside are reached by all.
    if token < slots.shape(0) {
        let table = token * n;
        if j < h {
            let out = (token * h + j) * n;
            norm_rope_head::<F>(query, token * query.stride(0) + j * n, q_weight, cos, signed_sin, table, rotated_query, out, &mut partial, &mut head, eps, head_dim);
        } else {
            let kv_head = j - h;
            let slot = u32::cast_from(slots[token]) as usize;
            let at = (kv_head * keys.shape(1) + slot) * n;
            let key_at = token * key.stride(0) + key_column as usize + kv_head * n;
            norm_rope_head::<F>(key, key_at, k_weight, cos, signed_sin, table, keys, at, &mut partial, &mut head, eps, head_dim);
            let value_at = token * value.stride(0) + value_column as usize + kv_head * n;
            let mut i = UNIT_POS_X as usize;
            while i < n {
                values[at + i] = value[value_at + i];
                i += CUBE_DIM_X as usize;
            }
        }
    }
}

/// Launches `rms_norm_kernel` on CubeCL runtime `R` for `input` `[rows, hidden]` and `weight`
/// `[hidden]` of one dtype.
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn rms_norm<R: CubeRuntime>(input: CubeTensor<R>, weight: CubeTensor<R>, eps: f64) -> CubeTensor<R> {
    let [rows, hidden] = input.shape().dims::<2>();
    check_operands("rms norm", &input, &weight, &[], hidden);
    let [input, weight] = [input, weight].map(into_contiguous);
    let client = input.client.clone();
    let dtype = input.dtype.into();
    let output = empty_device_contiguous_dtype(client.clone(), input.device.clone(), Shape::new([rows, hidden]), input.dtype);
    if rows > 0 {
        rms_norm_kernel::launch::<R>(
            &client,
            grid(rows),
            CubeDim::new_1d(UNITS),
            input.into_tensor_arg(),
            weight.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            eps as f32,
            hidden as u32,
            REVISION,
            dtype,
        );
    }
    output
}

/// Launches `add_rms_norm_kernel` for `residual` and `delta` `[rows, hidden]` and `weight`
/// `[hidden]` of one dtype: `(residual + delta, norm(residual + delta))`.
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn add_rms_norm<R: CubeRuntime>(
    residual: CubeTensor<R>,
    delta: CubeTensor<R>,
    weight: CubeTensor<R>,
    eps: f64,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [rows, hidden] = residual.shape().dims::<2>();
    assert_eq!(delta.shape().dims::<2>(), [rows, hidden], "add rms norm: a delta of the residual's shape");
    check_operands("add rms norm", &residual, &weight, &[&delta], hidden);
    let [residual, delta, weight] = [residual, delta, weight].map(into_contiguous);
    let client = residual.client.clone();
    let dtype = residual.dtype.into();
    let empty = || empty_device_contiguous_dtype(client.clone(), residual.device.clone(), Shape::new([rows, hidden]), residual.dtype);
    let (sum, output) = (empty(), empty());
    if rows > 0 {
        add_rms_norm_kernel::launch::<R>(
            &client,
            grid(rows),
            CubeDim::new_1d(UNITS),
            residual.into_tensor_arg(),
            delta.into_tensor_arg(),
            weight.into_tensor_arg(),
            sum.clone().into_tensor_arg(),
            output.clone().into_tensor_arg(),
            eps as f32,
            hidden as u32,
            REVISION,
            dtype,
        );
    }
    (sum, output)
}

/// A pass's query, key and value projections, a token a row (rows may lie further apart than
/// their width): side by side in one stacked product `[tokens, (heads + 2 · kv_heads) · head_dim]`
/// (`qkv_proj`'s), or one each, `[tokens, heads or kv_heads · head_dim]`.
#[derive(Debug)]
pub enum Qkv<F> {
    Stacked(F),
    Separate([F; 3]),
}

/// The operands of [`qk_norm_rope_write`]: one pass's projections ([`Qkv`]) and its number of
/// query heads; the norms' weights `[head_dim]`; RoPE's `cos` and `signed_sin` `[tokens,
/// head_dim]`; the slot of each token `[tokens]` (ints); a layer's pools `[kv_heads, slots,
/// head_dim]`. All floats of one dtype. `F` and `I` are a backend's float and int primitives.
#[derive(Debug)]
pub struct QkNormRopeWrite<F, I> {
    pub qkv: Qkv<F>,
    pub heads: usize,
    pub q_weight: F,
    pub k_weight: F,
    pub cos: F,
    pub signed_sin: F,
    pub slots: I,
    pub keys: F,
    pub values: F,
    pub eps: f64,
}

/// Launches `qk_norm_rope_write_kernel`: `(rotated query, keys, values)`, the query `[tokens,
/// heads · head_dim]`, the pools written in place where nothing else holds them (a KV cache's
/// pools, passed on from pass to pass), else in a copy. A stacked product is read where it
/// lies, as all three projections. The slots are the caller's to keep below the pools' size
/// (the KV cache checks them when a pass is set); the kernel does not.
///
/// Panics on operands whose shapes or dtypes disagree, or an odd `head_dim`.
pub fn qk_norm_rope_write<R: CubeRuntime>(pass: QkNormRopeWrite<CubeTensor<R>, CubeTensor<R>>) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let QkNormRopeWrite { qkv, heads, q_weight, k_weight, cos, signed_sin, slots, keys, values, eps } = pass;
    let [head_dim] = q_weight.shape().dims::<1>();
    let [kv_heads, pool_slots, pool_dim] = keys.shape().dims::<3>();
    assert!(head_dim > 0 && head_dim % 2 == 0, "qk norm rope write: an even head_dim");
    let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
    let ([query, key, value], [key_column, value_column]) = match qkv {
        Qkv::Stacked(qkv) => {
            let [_, width] = qkv.shape().dims::<2>();
            assert_eq!(width, q_width + 2 * kv_width, "qk norm rope write: stacked rows of {width} for {heads} query and twice {kv_heads} key-value heads of {head_dim}");
            let qkv = packed_rows(qkv);
            ([qkv.clone(), qkv.clone(), qkv], [q_width, q_width + kv_width])
        }
        Qkv::Separate([query, key, value]) => {
            for (name, tensor, width) in [("query", &query, q_width), ("key", &key, kv_width), ("value", &value, kv_width)] {
                assert_eq!(tensor.shape().dims::<2>()[1], width, "qk norm rope write: {name} rows of {width} expected");
            }
            ([query, key, value].map(packed_rows), [0, 0])
        }
    };
    let tokens = query.shape().dims::<2>()[0];
    assert!(key.shape().dims::<2>()[0] == tokens && value.shape().dims::<2>()[0] == tokens, "qk norm rope write: projections of one number of tokens");
    assert_eq!(cos.shape().dims::<2>(), [tokens, head_dim], "qk norm rope write: a cos row of head_dim a token");
    assert_eq!(signed_sin.shape().dims::<2>(), [tokens, head_dim], "qk norm rope write: cos and sin of one shape");
    assert_eq!(pool_dim, head_dim, "qk norm rope write: pools of the queries' head_dim");
    assert_eq!(k_weight.shape().dims::<1>(), [head_dim], "qk norm rope write: a k_norm weight of the heads' width");
    assert_eq!(values.shape().dims::<3>(), [kv_heads, pool_slots, head_dim], "qk norm rope write: values pool of another shape than the keys'");
    assert_eq!(slots.shape().num_elements(), tokens, "qk norm rope write: a slot a token");
    check_operands("qk norm rope write", &query, &q_weight, &[&key, &value, &k_weight, &cos, &signed_sin, &keys, &values], head_dim);
    let [q_weight, k_weight, cos, signed_sin, slots] = [q_weight, k_weight, cos, signed_sin, slots].map(into_contiguous);
    let [keys, values] = [keys, values].map(writable);
    let client = query.client.clone();
    let dtypes = [query.dtype.into(), slots.dtype.into()];
    let rotated = empty_device_contiguous_dtype(client.clone(), query.device.clone(), Shape::new([tokens, q_width]), query.dtype);
    if tokens == 0 {
        return (rotated, keys, values);
    }
    qk_norm_rope_write_kernel::launch::<R>(
        &client,
        grid(tokens * (heads + kv_heads)),
        CubeDim::new_1d(UNITS),
        query.into_tensor_arg(),
        key.into_tensor_arg(),
        value.into_tensor_arg(),
        q_weight.into_tensor_arg(),
        k_weight.into_tensor_arg(),
        cos.into_tensor_arg(),
        signed_sin.into_tensor_arg(),
        slots.into_tensor_arg(),
        rotated.clone().into_tensor_arg(),
        keys.clone().into_tensor_arg(),
        values.clone().into_tensor_arg(),
        eps as f32,
        heads as u32,
        kv_heads as u32,
        key_column as u32,
        value_column as u32,
        head_dim as u32,
        REVISION,
        dtypes,
    );
    (rotated, keys, values)
}

/// A `[rows, width]` operand whose rows a kernel reads `stride(0)` apart: itself where its
/// columns are adjacent (packed, or a range of columns of a wider tensor), else a packed copy.
pub(crate) fn packed_rows<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
    let strides = tensor.meta.strides();
    let [rows, width] = tensor.shape().dims::<2>();
    if strides[1] == 1 && (rows <= 1 || strides[0] >= width) {
        tensor
    } else {
        into_contiguous(tensor)
    }
}

/// `pool` packed row-major and held by nothing else, for a kernel to write in place: itself
/// where it is so (a KV cache's pool), else a copy.
fn writable<R: CubeRuntime>(pool: CubeTensor<R>) -> CubeTensor<R> {
    let pool = into_contiguous(pool);
    if pool.can_mut() {
        pool
    } else {
        pool.copy()
    }
}

/// One cube a row: `rows` cubes over the grid's two axes (see [`cube_row`]).
pub(crate) fn grid(rows: usize) -> CubeCount {
    let (x, y) = (rows.min(GRID_X), rows.div_ceil(GRID_X));
    CubeCount::Static(x as u32, y as u32, 1)
}

/// Panics unless `weight` is `[width]`, it and `others` share `input`'s dtype, and the dtype has
/// a kernel.
fn check_operands<R: CubeRuntime>(kernel: &str, input: &CubeTensor<R>, weight: &CubeTensor<R>, others: &[&CubeTensor<R>], width: usize) {
    assert_eq!(weight.shape().dims::<1>(), [width], "{kernel}: a weight of the rows' width");
    assert!(others.iter().chain([&weight]).all(|t| t.dtype == input.dtype), "{kernel}: operands of one dtype");
    assert!(matches!(input.dtype, DType::F32 | DType::F16 | DType::BF16), "{kernel}: no kernel for {:?}", input.dtype);
}

/// [`rms_norm_kernel`] and [`add_rms_norm_kernel`] in `dtype` as CubeCL defines them for
/// compilation, for rows of `hidden`.
pub(crate) fn definitions<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, hidden: u32) -> [KernelDefinition; 2] {
    let arg = crate::definitions::arg;
    let settings = || crate::definitions::settings(UNITS);
    [
        rms_norm_kernel::RmsNormKernel::<R>::new(settings(), client.clone(), arg(), arg(), arg(), (), hidden, REVISION, dtype).define(),
        add_rms_norm_kernel::AddRmsNormKernel::<R>::new(settings(), client.clone(), arg(), arg(), arg(), arg(), arg(), (), hidden, REVISION, dtype).define(),
    ]
}

/// [`qk_norm_rope_write_kernel`] over `dtypes` (the heads', the slots') as CubeCL defines it for
/// compilation, for heads of `head_dim`.
pub(crate) fn qk_norm_rope_write_definition<R: Runtime>(client: &ComputeClient<R>, dtypes: [StorageType; 2], head_dim: u32) -> KernelDefinition {
    let arg = crate::definitions::arg;
    qk_norm_rope_write_kernel::QkNormRopeWriteKernel::<R>::new(
        crate::definitions::settings(UNITS),
        client.clone(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        arg(),
        (),
        (),
        (),
        (),
        (),
        head_dim,
        REVISION,
        dtypes,
    )
    .define()
}

//! The paged-attention kernels of `prompt-r1-device-kernels`, run on wgpu (fused and unfused),
//! against burn's ops on the CPU (`reference`, in f32): each row's queries (its last columns,
//! causal) attend to the slots its read table names, masked columns (padding, pointing at a
//! scratch slot full of large values) left out.
//! Shapes that exercise the kernel's edges: grouped query heads, a head size above and below its
//! 64 units, a width that is not a whole number of tiles, a first tile wholly masked, rows with
//! one key, one query a row (a decoding step) and prefill chunks of 5 and 37 queries (blocks of
//! queries cut short, queries that see no key at all), heads whose size takes keys and values
//! in vectors of 4, 2 and 1 elements. f32 and f16 (the dtype the GPU's bf16 takes the same code
//! for); the kernel sums in f32 either way.

use burn::tensor::backend::Backend;
use burn::tensor::{activation::softmax, Bool, DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
use device_kernels::{DeviceKernels, Products};
use prompt_r1_model::device_kernels::{Decoding, DeviceKernelChoice, KernelPasses, PagedAttention, RaggedRows, RowLens};

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

/// Slots in each pool; slot 0 is scratch.
const SLOTS: usize = 200;
const ROWS: usize = 4;
/// Columns of each row.
const WIDTH: usize = 150;
/// Columns of each row in a decoding step over a long context: several of the decoding
/// kernel's chunks of 128, row 0's padding over more than two of them.
const LONG_WIDTH: usize = 700;

/// Queries a row in each pass checked: a decoding step, a chunk shorter than a block of
/// queries, and one of several blocks, the last cut short (blocks of 4, 8 and 16 here).
const QUERIES: [usize; 3] = [1, 5, 37];

/// Which columns of each row of `width` are keys: row 0 is padded over its first 7/15 (70 of
/// 150: more than a tile), row 1 not at all, row 2 has five keys, row 3 one.
fn valid_columns(row: usize, column: usize, width: usize) -> bool {
    match row {
        0 => column >= width * 7 / 15,
        1 => true,
        2 => column >= width - 5,
        _ => column == width - 1,
    }
}

/// The read table: masked columns read the scratch slot, keys a slot spread over the pool
/// (rows share some, as sequences sharing a prefix do).
fn read_table(width: usize) -> (Vec<i64>, Vec<f32>) {
    let mut read = Vec::new();
    let mut valid = Vec::new();
    for row in 0..ROWS {
        for column in 0..width {
            let key = valid_columns(row, column, width);
            read.push(if key { (1 + (row * 37 + column * 13) % (SLOTS - 1)) as i64 } else { 0 });
            valid.push(if key { 1.0 } else { 0.0 });
        }
    }
    (read, valid)
}

/// Whether query `i` of `queries` in `row` of `width` sees any key (causal: columns up to
/// `width − queries + i`).
fn sees_a_key(row: usize, queries: usize, i: usize, width: usize) -> bool {
    (0..=width - queries + i).any(|column| valid_columns(row, column, width))
}

/// `softmax(q Kᵀ scale + mask) V` with burn's ops over the gathered keys, in f32, `query`
/// `[rows, queries, heads, d]`; zeros for a query that sees no key (the kernel's answer: burn's
/// ops would average the masked columns).
fn reference<B: Backend>(query: Tensor<B, 4>, keys: Tensor<B, 3>, values: Tensor<B, 3>, read: Tensor<B, 1, Int>, valid: Tensor<B, 2>, scale: f32) -> Tensor<B, 4> {
    let [rows, queries, heads, d] = query.dims();
    let kv_heads = keys.dims()[0];
    let width = valid.dims()[1];
    let device = query.device();
    let gathered = |pool: Tensor<B, 3>| {
        let per_row = pool.cast(DType::F32).select(1, read.clone()).reshape([kv_heads, rows, width, d]).swap_dims(0, 1);
        per_row.reshape([rows, kv_heads, 1, width, d]).repeat_dim(2, heads / kv_heads).reshape([rows, heads, width, d])
    };
    let query = query.cast(DType::F32).swap_dims(1, 2);
    let padding = valid.equal_elem(0.0).reshape([rows, 1, 1, width]).expand([rows, heads, queries, width]);
    let future = Tensor::<B, 2, Bool>::tril_mask([queries, width], (width - queries) as i64, &device)
        .reshape([1, 1, queries, width])
        .expand([rows, heads, queries, width]);
    let scores = query.matmul(gathered(keys).swap_dims(2, 3)).mul_scalar(scale).mask_fill(padding.bool_or(future), -1.0e9);
    let output = softmax(scores, 3).matmul(gathered(values)).swap_dims(1, 2);
    let blind: Vec<bool> = (0..rows).flat_map(|r| (0..queries).map(move |i| !sees_a_key(r, queries, i, width))).collect();
    let blind = Tensor::<B, 2, Bool>::from_data(TensorData::new(blind, [rows, queries]), &device);
    output.mask_fill(blind.reshape([rows, queries, 1, 1]).expand([rows, queries, heads, d]), 0.0)
}

/// Burn's CPU backend: [`reference`] and the comparison run there, so that only the kernel
/// under test (and its inputs' making) compiles for the backend checked.
type Cpu = burn::backend::Flex;

/// `x` on the CPU in f32.
fn to_cpu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<Cpu, D> {
    Tensor::from_data(x.cast(DType::F32).into_data(), &Default::default())
}

/// Each row's last `lens[r]` queries of `x` (`[rows, queries, ..]`), one row after another.
fn last_queries<C: Backend>(x: Tensor<C, 4>, lens: &[usize; ROWS]) -> Tensor<C, 4> {
    let queries = x.dims()[1];
    Tensor::cat((0..ROWS).map(|r| x.clone().narrow(0, r, 1).narrow(1, queries - lens[r], lens[r])).collect(), 1)
}

/// The kernel's output against [`reference`] on backend `B` for `queries` queries a row: the
/// largest difference, divided by the output's magnitude where that exceeds 1.
fn worst_difference<B: DeviceKernels>(heads: usize, kv_heads: usize, d: usize, queries: usize, dtype: DType) -> f32 {
    worst_ragged_difference::<B>(heads, kv_heads, d, &[queries; ROWS], WIDTH, false, dtype, &registered::<B>)
}

/// The kernel as a model finds it that hands it every pass.
fn registered<B: DeviceKernels>(pass: PagedAttention<B>) -> Tensor<B, 2> {
    device_kernels::register::<B>();
    let kernel = DeviceKernelChoice::with_passes(Some(KernelPasses::All)).paged_attention::<B>(2).expect("registered just now");
    kernel(pass)
}

/// The kernel on the unfused backend with each row's columns cut into `splits` spans (as
/// `splits_for` cuts them on a GPU with few cubes a pass; lavapipe gives no count of
/// multiprocessors, so it never splits on its own).
fn split_into(splits: usize) -> impl Fn(PagedAttention<Unfused>) -> Tensor<Unfused, 2> {
    through(splits, device_kernels::DecodingKernel::Own, Products::Units)
}

/// [`split_into`], rows of one query through the `decoding` kernel, blocks of several queries
/// multiplied as `products` says.
fn through(splits: usize, decoding: device_kernels::DecodingKernel, products: Products) -> impl Fn(PagedAttention<Unfused>) -> Tensor<Unfused, 2> {
    move |pass| {
        let PagedAttention { query, shape, keys, values, read, valid, scale, ragged, decoding: _, tensor_cores: _ } = pass;
        let [rows, queries, heads, d] = shape;
        let float = |t: Tensor<Unfused, 4>| t.into_primitive().tensor();
        let pool = |t: Tensor<Unfused, 3>| t.into_primitive().tensor();
        let ragged = ragged.map(|rows| device_kernels::paged_attention::Ragged { lens: rows.lens, starts: rows.starts.into_primitive() });
        let output = device_kernels::paged_attention::paged_attention(
            float(query.reshape(shape)),
            pool(keys),
            pool(values),
            read.into_primitive(),
            valid.into_primitive().tensor(),
            ragged,
            scale,
            device_kernels::paged_attention::Spans::Exactly(splits.try_into().expect("spans")),
            decoding,
            products,
        );
        Tensor::<Unfused, 4>::from_primitive(TensorPrimitive::Float(output)).reshape([rows * queries, heads * d])
    }
}

/// [`worst_difference`] with row `r` running `lens[r]` queries over `width` columns; `ragged`: as one ragged pass
/// (`[1, tokens, heads, d]`, the rows' queries one after another), else (equal lengths only)
/// as `[rows, queries, heads, d]`. The reference runs every row with the longest row's queries
/// and keeps each row's last `lens[r]`: those see the same columns.
#[allow(clippy::too_many_arguments)]
fn worst_ragged_difference<B: DeviceKernels>(
    heads: usize,
    kv_heads: usize,
    d: usize,
    lens: &[usize; ROWS],
    width: usize,
    ragged: bool,
    dtype: DType,
    attend: &dyn Fn(PagedAttention<B>) -> Tensor<B, 2>,
) -> f32 {
    let queries = lens.iter().copied().max().expect("rows");
    let device = Default::default();
    let pool = |seed| {
        let pool = Tensor::<B, 3>::random([kv_heads, SLOTS, d], Distribution::Normal(0.0, 1.0), &device).mul_scalar(seed);
        // The scratch slot holds what would swamp any result it leaked into.
        pool.slice_assign([0..kv_heads, 0..1, 0..d], Tensor::full([kv_heads, 1, d], 1.0e4, &device)).cast(dtype)
    };
    let (keys, values) = (pool(1.0), pool(2.0));
    let query = Tensor::<B, 4>::random([ROWS, queries, heads, d], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
    let (read, valid) = read_table(width);
    let read = Tensor::<B, 1, Int>::from_data(TensorData::new(read, [ROWS * width]), &device);
    // The mask as a transposed view: the kernel reads it through its strides.
    let valid_by_column: Vec<f32> = (0..width).flat_map(|c| (0..ROWS).map(move |r| (r, c))).map(|(r, c)| valid[r * width + c]).collect();
    let valid = Tensor::<B, 2>::from_data(TensorData::new(valid_by_column, [width, ROWS]), &device).transpose();
    let scale = (d as f32).powf(-0.5);
    let cpu_read = Tensor::<Cpu, 1, Int>::from_data(read.clone().into_data().convert::<i64>(), &Default::default());
    let expected = reference(to_cpu(query.clone()), to_cpu(keys.clone()), to_cpu(values.clone()), cpu_read, to_cpu(valid.clone()), scale);
    let (query, expected, rows) = match ragged {
        true => {
            let starts: Vec<i64> = (0..=ROWS).map(|r| lens[..r].iter().sum::<usize>() as i64).collect();
            let starts = Tensor::<B, 1, Int>::from_data(TensorData::new(starts, [ROWS + 1]), &device);
            (last_queries(query, lens), last_queries(expected, lens), Some(RaggedRows { starts, lens: RowLens::of(lens) }))
        }
        false => (query, expected, None),
    };
    let shape = query.dims();
    let [batch, tokens, heads, d] = shape;
    let query = query.reshape([batch * tokens, heads * d]);
    let output = attend(PagedAttention { query, shape, keys, values, read, valid, scale, ragged: rows, decoding: Decoding::default(), tensor_cores: false }).reshape(shape);
    assert_eq!(output.dtype(), dtype, "the output keeps the query's dtype");
    // Relative to the output where it exceeds 1: f16 rounds each output to its own step.
    ((to_cpu(output) - expected.clone()).abs() / expected.abs().clamp_min(1.0)).max().into_scalar()
}

/// Each shape on backend `B` within `tolerance`.
fn check_shapes<B: DeviceKernels>(dtype: DType, tolerance: f32) {
    for (heads, kv_heads, d) in [(4, 2, 24), (4, 4, 128), (6, 2, 72), (2, 1, 10), (2, 2, 5)] {
        for queries in QUERIES {
            let worst = worst_difference::<B>(heads, kv_heads, d, queries, dtype);
            println!("{} {dtype:?}, {heads} heads over {kv_heads}, head_dim {d}, {queries} queries a row: worst |Δ| {worst:.2e}", std::any::type_name::<B>());
            assert!(worst <= tolerance, "{heads} heads over {kv_heads}, head_dim {d}, {queries} queries, {dtype:?}: |Δ| {worst} > {tolerance}");
        }
    }
}

/// Ragged passes: rows of a decoding step's one query beside prefill chunks of 5 and 37, in
/// several orders (a row with few keys running many queries, some of which see none), and a
/// pass of one row.
fn check_ragged<B: DeviceKernels>(dtype: DType, tolerance: f32) {
    for (heads, kv_heads, d) in [(4, 2, 24), (6, 2, 72)] {
        for lens in [[1, 37, 1, 5], [37, 1, 5, 1], [1, 1, 1, 37], [5, 5, 5, 5], [1, 1, 1, 1]] {
            let worst = worst_ragged_difference::<B>(heads, kv_heads, d, &lens, WIDTH, true, dtype, &registered::<B>);
            println!("{} {dtype:?}, {heads} heads over {kv_heads}, head_dim {d}, ragged rows of {lens:?} queries: worst |Δ| {worst:.2e}", std::any::type_name::<B>());
            assert!(worst <= tolerance, "{heads} heads over {kv_heads}, head_dim {d}, ragged {lens:?}, {dtype:?}: |Δ| {worst} > {tolerance}");
        }
    }
}

/// A ragged pass (rows of different lengths, their queries one after another) gives each row
/// what a pass of its own gives it, within the f32 tolerance below.
#[test]
fn the_kernel_takes_ragged_passes() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check_ragged::<Fused>(DType::F32, 1e-5);
    check_ragged::<Unfused>(DType::F32, 1e-5);
    check_ragged::<Fused>(DType::F16, 2e-3);
}

/// f32: both sum in f32, in another order (1e-5 at these sizes: values of order 1, sums of up to
/// 150 terms).
#[test]
fn the_kernel_matches_burns_ops_in_f32() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check_shapes::<Fused>(DType::F32, 1e-5);
    check_shapes::<Unfused>(DType::F32, 1e-5);
}

/// f16 operands, f32 sums: within f16's rounding of the output and of the probabilities that
/// weigh the values (2⁻¹¹ relative each; 2e-3). The values are of order 2 and a query that sees
/// few keys returns about one of them, so outputs reach 4-8: an absolute bound of 2e-3 failed
/// once in CI at 3.3e-3.
#[test]
fn the_kernel_matches_burns_ops_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check_shapes::<Fused>(DType::F16, 2e-3);
}

/// A pass split into spans of columns (FlashDecoding's split, which `splits_for` picks on a GPU
/// whose multiprocessors a pass's cubes would leave idle) gives what the whole pass gives: each
/// shape and pass above in 2, 3 and 5 spans (as many as the row has tiles at most: 3 or 5 here),
/// spans that see no key (row 0's padding, row 3's one key, a prefill's early queries) among
/// them; f32 within the unsplit pass's tolerance, f16 (the output rounded once, after the spans
/// are joined in f32) within its.
#[test]
fn a_pass_split_into_spans_matches_burns_ops() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    for splits in [2, 3, 5] {
        for (heads, kv_heads, d) in [(4, 2, 24), (4, 4, 128), (6, 2, 72)] {
            for lens in QUERIES.map(|queries| [queries; ROWS]) {
                let worst = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &lens, WIDTH, false, DType::F32, &split_into(splits));
                println!("{splits} spans, {heads} heads over {kv_heads}, head_dim {d}, {} queries a row: worst |Δ| {worst:.2e}", lens[0]);
                assert!(worst <= 1e-5, "{splits} spans, {heads} heads over {kv_heads}, head_dim {d}, {} queries: |Δ| {worst} > 1e-5", lens[0]);
            }
            let lens = [1, 37, 1, 5];
            let worst = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &lens, WIDTH, true, DType::F32, &split_into(splits));
            assert!(worst <= 1e-5, "{splits} spans, {heads} heads over {kv_heads}, head_dim {d}, ragged {lens:?}: |Δ| {worst} > 1e-5");
        }
        let worst = worst_ragged_difference::<Unfused>(4, 4, 128, &[1; ROWS], WIDTH, false, DType::F16, &split_into(splits));
        assert!(worst <= 2e-3, "{splits} spans, f16: |Δ| {worst} > 2e-3");
    }
}

/// A decoding step over a long context (`paged_decode`'s kernel, which takes a row's columns 128
/// at a time): several chunks, row 0's padding over more than two of them, row 3's one key in the
/// last; whole (as the model runs it) and in 3 and 6 spans of whole chunks, spans that see no
/// key among them. Then ragged passes over as many columns, whose rows of one query that kernel
/// takes and whose prefill chunks the general one (each cutting the columns into as many spans
/// of its own pieces where split). And all of it through the general kernel alone
/// (`DecodingKernel::General`, kept for comparisons). f32 within 1e-5 (sums of up to 700 terms
/// of order 1), f16 within its tolerance above.
#[test]
fn a_decoding_step_over_a_long_context_matches_burns_ops() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    for (heads, kv_heads, d) in [(4, 2, 24), (4, 4, 128), (6, 2, 72)] {
        let whole = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &[1; ROWS], LONG_WIDTH, false, DType::F32, &registered::<Unfused>);
        let half = worst_ragged_difference::<Fused>(heads, kv_heads, d, &[1; ROWS], LONG_WIDTH, false, DType::F16, &registered::<Fused>);
        println!("{heads} heads over {kv_heads}, head_dim {d}, {LONG_WIDTH} columns: worst |Δ| {whole:.2e} (f32), {half:.2e} (f16)");
        assert!(whole <= 1e-5, "{heads} heads over {kv_heads}, head_dim {d}: |Δ| {whole} > 1e-5");
        assert!(half <= 2e-3, "{heads} heads over {kv_heads}, head_dim {d}, f16: |Δ| {half} > 2e-3");
        for splits in [3, 6] {
            let worst = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &[1; ROWS], LONG_WIDTH, false, DType::F32, &split_into(splits));
            println!("{splits} spans: worst |Δ| {worst:.2e}");
            assert!(worst <= 1e-5, "{splits} spans, {heads} heads over {kv_heads}, head_dim {d}: |Δ| {worst} > 1e-5");
        }
        for lens in [[1, 37, 1, 5], [5, 1, 1, 1], [1, 1, 1, 1]] {
            let whole = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &lens, LONG_WIDTH, true, DType::F32, &registered::<Unfused>);
            let half = worst_ragged_difference::<Fused>(heads, kv_heads, d, &lens, LONG_WIDTH, true, DType::F16, &registered::<Fused>);
            let split = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &lens, LONG_WIDTH, true, DType::F32, &split_into(4));
            println!("ragged rows of {lens:?} queries: worst |Δ| {whole:.2e} (f32), {half:.2e} (f16), {split:.2e} (f32, 4 spans)");
            assert!(whole <= 1e-5 && split <= 1e-5, "{heads} heads over {kv_heads}, head_dim {d}, ragged {lens:?}: |Δ| {whole}, split {split} > 1e-5");
            assert!(half <= 2e-3, "{heads} heads over {kv_heads}, head_dim {d}, ragged {lens:?}, f16: |Δ| {half} > 2e-3");
        }
        let general = device_kernels::DecodingKernel::General;
        for (lens, ragged) in [([1; ROWS], false), ([1, 37, 1, 5], true)] {
            for splits in [1, 3] {
                let worst = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &lens, LONG_WIDTH, ragged, DType::F32, &through(splits, general, Products::Units));
                println!("the general kernel alone, rows of {lens:?} queries, {splits} spans: worst |Δ| {worst:.2e}");
                assert!(worst <= 1e-5, "the general kernel, {heads} heads over {kv_heads}, head_dim {d}, {lens:?}, {splits} spans: |Δ| {worst} > 1e-5");
            }
        }
    }
}

/// The tensor-core kernel's layout (`Products::TensorCoreLayout`: its two walks over the columns,
/// 16 entries a warp, tiles of 16 columns staged in 16-bit, the weights `exp(s − max)` rounded to
/// 16 bits before they weigh the values, the outputs a warp's; its products a unit at a time, as lavapipe
/// has no tensor cores) against burn's ops in f16: grouped heads taking 1, 2 and 4 heads a cube,
/// heads of 16, 32, 64 and 128, prefill chunks of 5 and 37 queries (blocks cut short, queries
/// that see no key), ragged passes beside decoding rows (which the decoding kernel takes), and a
/// first tile wholly masked. Within the general kernel's f16 tolerance (2e-3), though the layout
/// also rounds the weights `exp(s − max)` (2⁻¹¹ relative each; the worst here was 9.1e-4).
#[test]
fn the_tensor_core_layout_matches_burns_ops() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    let layout = through(1, device_kernels::DecodingKernel::Own, Products::TensorCoreLayout);
    for (heads, kv_heads, d) in [(4, 2, 32), (4, 4, 128), (6, 2, 16), (8, 1, 64)] {
        for queries in [5, 37] {
            let worst = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &[queries; ROWS], WIDTH, false, DType::F16, &layout);
            println!("tensor-core layout, {heads} heads over {kv_heads}, head_dim {d}, {queries} queries a row: worst |Δ| {worst:.2e}");
            assert!(worst <= 2e-3, "{heads} heads over {kv_heads}, head_dim {d}, {queries} queries: |Δ| {worst} > 2e-3");
        }
        for lens in [[1, 37, 1, 5], [37, 1, 5, 1], [5, 5, 5, 5]] {
            let worst = worst_ragged_difference::<Unfused>(heads, kv_heads, d, &lens, WIDTH, true, DType::F16, &layout);
            println!("tensor-core layout, {heads} heads over {kv_heads}, head_dim {d}, ragged rows of {lens:?} queries: worst |Δ| {worst:.2e}");
            assert!(worst <= 2e-3, "{heads} heads over {kv_heads}, head_dim {d}, ragged {lens:?}: |Δ| {worst} > 2e-3");
        }
    }
}

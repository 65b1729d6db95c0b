//! The paged-decode kernel of `prompt-r1-device-kernels` against burn's ops on wgpu (fused and
//! unfused): each row's query attends to the slots its read table names, masked columns
//! (padding, pointing at a scratch slot full of large values) left out. Shapes that exercise the
//! kernel's edges: grouped query heads, a head size above and below its 64 units, a width that
//! is not a whole number of tiles, a first tile wholly masked, rows with one key. f32 and f16 (the
//! dtype the GPU's bf16 takes the same code for); the kernel sums in f32 either way.

use burn::tensor::backend::Backend;
use burn::tensor::{activation::softmax, DType, Distribution, Int, Tensor, TensorData};
use device_kernels::DeviceKernels;
use prompt_r1_model::device_kernels::PagedDecode;

use crate::common;

type Fused = burn_wgpu::Vulkan;
type Unfused = burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u8>;

/// Slots in each pool; slot 0 is scratch.
const SLOTS: usize = 200;
const ROWS: usize = 4;
const WIDTH: usize = 150;

/// Which columns of each row are keys: row 0 is padded over its first 70 columns (more than
/// a tile), row 1 not at all, row 2 has five keys, row 3 one.
fn valid_columns(row: usize, column: usize) -> bool {
    match row {
        0 => column >= 70,
        1 => true,
        2 => column >= WIDTH - 5,
        _ => column == WIDTH - 1,
    }
}

/// The read table: masked columns read the scratch slot, keys a slot spread over the pool
/// (rows share some, as sequences never do, which the kernel must not mind).
fn read_table() -> (Vec<i64>, Vec<f32>) {
    let mut read = Vec::new();
    let mut valid = Vec::new();
    for row in 0..ROWS {
        for column in 0..WIDTH {
            let key = valid_columns(row, column);
            read.push(if key { (1 + (row * 37 + column * 13) % (SLOTS - 1)) as i64 } else { 0 });
            valid.push(if key { 1.0 } else { 0.0 });
        }
    }
    (read, valid)
}

/// `softmax(q Kᵀ scale + mask) V` with burn's ops over the gathered keys, in f32.
fn reference<B: Backend>(query: Tensor<B, 3>, keys: Tensor<B, 3>, values: Tensor<B, 3>, read: Tensor<B, 1, Int>, valid: Tensor<B, 2>, scale: f32) -> Tensor<B, 3> {
    let [rows, heads, d] = query.dims();
    let kv_heads = keys.dims()[0];
    let gathered = |pool: Tensor<B, 3>| {
        let per_row = pool.cast(DType::F32).select(1, read.clone()).reshape([kv_heads, rows, WIDTH, d]).swap_dims(0, 1);
        per_row.reshape([rows, kv_heads, 1, WIDTH, d]).repeat_dim(2, heads / kv_heads).reshape([rows, heads, WIDTH, d])
    };
    let query = query.cast(DType::F32).reshape([rows, heads, 1, d]);
    let masked = valid.equal_elem(0.0).reshape([rows, 1, 1, WIDTH]).expand([rows, heads, 1, WIDTH]);
    let scores = query.matmul(gathered(keys).swap_dims(2, 3)).mul_scalar(scale).mask_fill(masked, -1.0e9);
    softmax(scores, 3).matmul(gathered(values)).reshape([rows, heads, d])
}

/// The kernel's output against [`reference`] on backend `B`: the largest difference.
fn worst_difference<B: DeviceKernels>(heads: usize, kv_heads: usize, d: usize, dtype: DType) -> f32 {
    let device = Default::default();
    let pool = |seed| {
        let pool = Tensor::<B, 3>::random([kv_heads, SLOTS, d], Distribution::Normal(0.0, 1.0), &device).mul_scalar(seed);
        // The scratch slot holds what would swamp any result it leaked into.
        pool.slice_assign([0..kv_heads, 0..1, 0..d], Tensor::full([kv_heads, 1, d], 1.0e4, &device)).cast(dtype)
    };
    let (keys, values) = (pool(1.0), pool(2.0));
    let query = Tensor::<B, 3>::random([ROWS, heads, d], Distribution::Normal(0.0, 1.0), &device).cast(dtype);
    let (read, valid) = read_table();
    let read = Tensor::<B, 1, Int>::from_data(TensorData::new(read, [ROWS * WIDTH]), &device);
    // The mask as a transposed view: the kernel reads it through its strides.
    let valid_by_column: Vec<f32> = (0..WIDTH).flat_map(|c| (0..ROWS).map(move |r| (r, c))).map(|(r, c)| valid[r * WIDTH + c]).collect();
    let valid = Tensor::<B, 2>::from_data(TensorData::new(valid_by_column, [WIDTH, ROWS]), &device).transpose();
    let scale = (d as f32).powf(-0.5);
    let expected = reference(query.clone(), keys.clone(), values.clone(), read.clone(), valid.clone(), scale);
    // Through the registry, as the model finds it.
    device_kernels::register::<B>();
    let kernel = prompt_r1_model::device_kernels::paged_decode::<B>().expect("registered just now");
    let output = kernel(PagedDecode { query, keys, values, read, valid, scale });
    assert_eq!(output.dtype(), dtype, "the output keeps the query's dtype");
    let difference = (output.cast(DType::F32) - expected).abs().max().into_scalar();
    difference.to_string().parse().expect("a float")
}

/// Each shape on backend `B` within `tolerance`.
fn check_shapes<B: DeviceKernels>(dtype: DType, tolerance: f32) {
    for (heads, kv_heads, d) in [(4, 2, 24), (4, 4, 128), (6, 2, 72)] {
        let worst = worst_difference::<B>(heads, kv_heads, d, dtype);
        println!("{} {dtype:?}, {heads} heads over {kv_heads}, head_dim {d}: worst |Δ| {worst:.2e}", std::any::type_name::<B>());
        assert!(worst <= tolerance, "{heads} heads over {kv_heads}, head_dim {d}, {dtype:?}: |Δ| {worst} > {tolerance}");
    }
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

/// f16 operands, f32 sums: within f16's rounding of the output (values of order 1: 1e-3).
#[test]
fn the_kernel_matches_burns_ops_in_f16() {
    if !common::backend_ready::<Fused>() {
        return;
    }
    check_shapes::<Fused>(DType::F16, 2e-3);
}

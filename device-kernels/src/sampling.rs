//! Token choice as one CubeCL kernel (see [`model::device_kernels::ChooseTokensFn`]): one cube
//! a row of logits finds the row's maximum of `logits / temperature` (and its first column, the
//! greedy token), sums `exp(s − max)` in f32 over contiguous chunks of the vocabulary, one chunk
//! a unit, and draws by inverse transform: the chunk where the running sum first exceeds
//! `uniform · total`, then the column within it. burn's ops take about 17 kernels for the same
//! (a reduction each for the maximum and the sum, then a cumulative sum, a comparison and a
//! count at two levels, and the gathers), at every decoding step of every batch size.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

/// Units per cube (one cube a row).
pub const UNITS: u32 = 128;

/// A hash of this file (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("sampling.rs"));

/// `x / temperature` in f32, as burn's ops divide (`x` itself for a greedy row, `temperature`
/// 1).
#[cube]
fn scaled<F: Float>(x: F, temperature: f32) -> f32 {
    f32::cast_from(x) / temperature
}

#[cube(launch)]
fn choose_tokens_kernel<F: Float>(
    logits: &Tensor<F>,
    temperatures: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    output: &mut Tensor<f32>,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let units = CUBE_DIM_X as usize;
    let vocab = logits.shape(1);
    let base = row * vocab;
    let mut temperature = temperatures[row];
    let greedy = temperature == 0.0;
    if greedy {
        temperature = 1.0;
    }
    let chunk = vocab.div_ceil(units);
    let first = unit * chunk;
    let mut end = first + chunk;
    if end > vocab {
        end = vocab;
    }

    // 1. The maximum of the scaled row and its first column.
    let mut best = f32::new(-3.0e38);
    let mut best_column = vocab;
    let mut i = first;
    while i < end {
        let s = scaled::<F>(logits[base + i], temperature);
        if s > best {
            best = s;
            best_column = i;
        }
        i += 1;
    }
    let mut maxima = SharedMemory::<f32>::new(UNITS as usize);
    let mut columns = SharedMemory::<u32>::new(UNITS as usize);
    let mut sums = SharedMemory::<f32>::new(UNITS as usize);
    maxima[unit] = best;
    columns[unit] = best_column as u32;
    sync_cube();
    if unit == 0 {
        // Chunks in column order: the first chunk holding the maximum has its first column.
        let mut m = maxima[0];
        let mut c = columns[0];
        for j in 1..units {
            if maxima[j] > m {
                m = maxima[j];
                c = columns[j];
            }
        }
        maxima[0] = m;
        columns[0] = c;
    }
    sync_cube();
    let max = maxima[0];

    // 2. Each chunk's sum of exp(s − max).
    let mut own = 0.0f32;
    let mut i = first;
    while i < end {
        own += (scaled::<F>(logits[base + i], temperature) - max).exp();
        i += 1;
    }
    sums[unit] = own;
    sync_cube();

    // 3. The total, and the draw: the chunk where the running sum first exceeds the target,
    // then the column within it (the last column where none does, as burn's ops give).
    if unit == 0 {
        let mut total = 0.0f32;
        for j in 0..units {
            total += sums[j];
        }
        let mut column = columns[0];
        if column >= vocab as u32 {
            // A row with no finite logit.
            column = (vocab - 1) as u32;
        }
        if !greedy {
            // Past the total (rounding): the last column, as burn's ops and the host give.
            column = (vocab - 1) as u32;
            let mut left = uniforms[row] * total;
            let mut chosen = units;
            for j in 0..units {
                if chosen == units {
                    if left < sums[j] {
                        chosen = j;
                    } else {
                        left -= sums[j];
                    }
                }
            }
            if chosen < units {
                let start = chosen * chunk;
                let mut stop = start + chunk;
                if stop > vocab {
                    stop = vocab;
                }
                // Subtracting the chunk's weights one by one may round below its sum: then
                // the chunk's last column with weight (a neighbour of the boundary).
                let mut searching = true;
                let mut i = start;
                while i < stop {
                    if searching {
                        let w = (scaled::<F>(logits[base + i], temperature) - max).exp();
                        if w > 0.0 {
                            column = i as u32;
                        }
                        if left < w {
                            searching = false;
                        } else {
                            left -= w;
                        }
                    }
                    i += 1;
                }
            }
        }
        output[row * 2] = f32::cast_from(column);
        output[row * 2 + 1] = scaled::<F>(logits[base + usize::cast_from(column)], temperature) - (total.ln() + max);
    }
}

/// Launches `choose_tokens_kernel` on CubeCL runtime `R`: `logits` `[rows, vocab]` (f32, f16
/// or bf16), `temperatures` and `uniforms` `[rows]` f32; `[rows, 2]` f32, each row's token and
/// its log-probability. See [`model::device_kernels::ChooseTokensFn`].
///
/// Panics on operands whose shapes or dtypes disagree.
pub fn choose_tokens<R: CubeRuntime>(logits: CubeTensor<R>, temperatures: CubeTensor<R>, uniforms: CubeTensor<R>) -> CubeTensor<R> {
    let [rows, vocab] = logits.shape().dims::<2>();
    assert!(vocab >= 1 && rows <= u16::MAX as usize, "token choice: {rows} rows of {vocab} logits");
    assert!(vocab < 1 << 24, "token choice: a vocabulary of {vocab} is not exact in f32");
    assert_eq!([temperatures.shape().num_elements(), uniforms.shape().num_elements()], [rows, rows], "token choice: a temperature and a uniform a row");
    assert!(temperatures.dtype == DType::F32 && uniforms.dtype == DType::F32, "token choice: f32 temperatures and uniforms");
    assert!(matches!(logits.dtype, DType::F32 | DType::F16 | DType::BF16), "token choice: no kernel for {:?}", logits.dtype);
    let [logits, temperatures, uniforms] = [logits, temperatures, uniforms].map(into_contiguous);
    let client = logits.client.clone();
    let dtype = logits.dtype.into();
    let output = empty_device_contiguous_dtype(client.clone(), logits.device.clone(), Shape::new([rows, 2]), DType::F32);
    choose_tokens_kernel::launch::<R>(
        &client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(UNITS),
        logits.into_tensor_arg(),
        temperatures.into_tensor_arg(),
        uniforms.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        REVISION,
        dtype,
    );
    output
}

/// [`choose_tokens_kernel`] over logits of `dtype` as CubeCL defines it for compilation.
pub(crate) fn definition<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> KernelDefinition {
    let arg = crate::definitions::arg;
    choose_tokens_kernel::ChooseTokensKernel::<R>::new(crate::definitions::settings(UNITS), client.clone(), arg(), arg(), arg(), arg(), REVISION, dtype).define()
}

//! Token choice as two CubeCL kernels (see [`model::device_kernels::ChooseTokensFn`]), for every
//! row of logits: the maximum of `logits / temperature` (and its first column, the greedy
//! token), the sum of `exp(s − max)` in f32, and a draw by inverse transform, the column where
//! the running sum in vocabulary order first exceeds `uniform · total`.
//!
//! 1. [`segment_maxima_kernel`]: a cube a segment of a row ([`SEGMENT_VECTORS`] vectors of
//!    columns, 32,768 bf16 columns on CUDA), its units reading the segment's vectors side by side
//!    ([`LOADS`] in flight a unit, [`BATCHES`] times), writes the segment's maximum, its first
//!    column and its sum of `exp(s − segment max)`.
//! 2. [`draw_kernel`]: a cube a row combines its segments (max, first column, total), and for a
//!    sampled row finds the segment where the draw falls, that segment's run of [`RUN`]
//!    vectors (each unit sums one run, in order), and the column within the run.
//!
//! The first version took one cube a row whose units each walked a contiguous chunk of the row a
//! column at a time, three times: loads no warp shared, one in flight a unit, 0.85 ms a decoding
//! step at 1 to 64 rows on an H200 (seventh lease). Each row is now read once whole and once a
//! segment, in vectors, by as many cubes as it has segments.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

/// Units per cube, in both kernels.
pub const UNITS: u32 = 256;

/// Vector loads a unit has in flight in a segment.
const LOADS: usize = 4;

/// Batches of [`LOADS`] a unit takes in a segment, one after another.
const BATCHES: usize = 4;

/// Vectors of a unit's run in the draw (consecutive vectors of the segment).
const RUN: usize = LOADS * BATCHES;

/// Vectors of columns a segment: a cube's units, [`RUN`] each (32,768 bf16 columns in CUDA's
/// 16-byte vectors: 5 segments a row of Qwen3's).
pub const SEGMENT_VECTORS: usize = UNITS as usize * RUN;

/// Entries a group when a cube's units' figures meet (so [`UNITS`] is `GROUP²`), and runs a
/// group when the draw looks for its run: a unit folds a group, then one unit the groups.
const GROUP: usize = 16;
const _: () = assert!(UNITS as usize == GROUP * GROUP);

/// The maximum before any column is seen (finite, so that `exp(s − max)` is 0 for `s` = −∞).
const NO_MAX: f32 = -3.0e38;

/// A hash of this file (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("sampling.rs"));

/// A row's temperature, 1 for a greedy row (temperature 0): burn's ops divide by it.
#[cube]
fn temperature_of(temperature: f32) -> f32 {
    let mut t = temperature;
    if t == 0.0 {
        t = 1.0;
    }
    t
}

/// Every unit's `(maximum, sum of exp(s − maximum), first column)` in shared memory combined
/// into entry 0, ties going to the smaller column: each of [`GROUP`] units folds a group of
/// [`GROUP`] entries into its first, then unit 0 folds those (two barriers, where a tree takes
/// eight).
#[cube]
fn reduce_maxima(maxima: &mut SharedMemory<f32>, sums: &mut SharedMemory<f32>, columns: &mut SharedMemory<u32>) {
    let unit = UNIT_POS_X as usize;
    if unit < GROUP {
        fold_maxima(maxima, sums, columns, unit * GROUP, 1);
    }
    sync_cube();
    if unit == 0 {
        fold_maxima(maxima, sums, columns, 0, GROUP);
    }
    sync_cube();
}

/// Merges a part's `(maximum, sum of exp(s − maximum), first column of it)` into `best`,
/// `sum` and `column` (FlashAttention's online softmax joining two parts): the sum rescaled to
/// the larger maximum, ties for it going to the smaller column.
#[cube]
fn merge(best: &mut f32, sum: &mut f32, column: &mut u32, m: f32, s: f32, c: u32) {
    if m > *best {
        *sum = *sum * (*best - m).exp() + s;
        *best = m;
        *column = c;
    } else {
        *sum += s * (m - *best).exp();
        if m == *best && c < *column {
            *column = c;
        }
    }
}

/// Folds the [`GROUP`] entries `first`, `first + step`, ... into entry `first`.
#[cube]
fn fold_maxima(maxima: &mut SharedMemory<f32>, sums: &mut SharedMemory<f32>, columns: &mut SharedMemory<u32>, first: usize, step: usize) {
    let mut best = maxima[first];
    let mut sum = sums[first];
    let mut column = columns[first];
    for i in 1..GROUP {
        let at = first + i * step;
        merge(&mut best, &mut sum, &mut column, maxima[at], sums[at], columns[at]);
    }
    maxima[first] = best;
    sums[first] = sum;
    columns[first] = column;
}

/// The entry of `weights[first..first + count]` where the draw's `left` falls, walking them in
/// order and taking each passed entry's weight off `left`: the first entry that weighs more
/// than what is left, or, where subtracting one by one rounds below their sum, the last entry
/// with weight (a neighbour of the boundary).
#[cube]
fn walk(weights: &SharedMemory<f32>, first: usize, count: usize, left: &mut f32) -> usize {
    let mut found = first;
    let mut searching = true;
    for i in first..first + count {
        if searching {
            let w = weights[i];
            if w > 0.0 {
                found = i;
            }
            if *left < w {
                searching = false;
            } else {
                *left -= w;
            }
        }
    }
    found
}

/// Cube `(segment, row)`: `partials[(row · segments + segment) · 3 ..]` gets the segment's
/// maximum of `logits / temperature`, its sum of `exp(s − maximum)` and its first column of the
/// maximum (`vocab` where it has no column above [`NO_MAX`]), in f32.
#[cube(launch)]
fn segment_maxima_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    temperatures: &Tensor<f32>,
    partials: &mut Tensor<f32>,
    vocab: u32,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let segment = CUBE_POS_X as usize;
    let row = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let n = N::value();
    let vocab = vocab as usize;
    let vectors = vocab / n;
    let temperature = temperature_of(temperatures[row]);

    // Batches of LOADS vectors a unit, all of a batch's loads issued before any is used (a load
    // past the row reads its last vector, and is not counted); the unit's columns in increasing
    // order, so the first of equal maxima stays.
    let mut best = f32::new(NO_MAX);
    let mut best_column = vocab;
    let mut sum = 0.0f32;
    for batch in 0..BATCHES {
        let first = segment * SEGMENT_VECTORS + batch * comptime!(UNITS as usize * LOADS) + unit;
        let mut loaded = Array::<Vector<f32, N>>::new(LOADS);
        #[unroll]
        for j in 0..LOADS {
            let mut v = first + j * comptime!(UNITS as usize);
            if v >= vectors {
                v = vectors - 1;
            }
            loaded[j] = Vector::<f32, N>::cast_from(logits[row * vectors + v]);
        }
        let mut batch_best = best;
        #[unroll]
        for j in 0..LOADS {
            let v = first + j * comptime!(UNITS as usize);
            if v < vectors {
                let x = loaded[j];
                #[unroll]
                for e in 0..n {
                    let s = x[e] / temperature;
                    if s > batch_best {
                        batch_best = s;
                        best_column = v * n + e;
                    }
                }
            }
        }
        // The sum so far rescaled to the new maximum, then the batch's terms.
        sum *= (best - batch_best).exp();
        #[unroll]
        for j in 0..LOADS {
            let v = first + j * comptime!(UNITS as usize);
            if v < vectors {
                let x = loaded[j];
                #[unroll]
                for e in 0..n {
                    sum += (x[e] / temperature - batch_best).exp();
                }
            }
        }
        best = batch_best;
    }

    let mut maxima = SharedMemory::<f32>::new(UNITS as usize);
    let mut sums = SharedMemory::<f32>::new(UNITS as usize);
    let mut columns = SharedMemory::<u32>::new(UNITS as usize);
    maxima[unit] = best;
    sums[unit] = sum;
    columns[unit] = best_column as u32;
    sync_cube();
    reduce_maxima(&mut maxima, &mut sums, &mut columns);
    if unit == 0 {
        let at = (row * CUBE_COUNT_X as usize + segment) * 3;
        partials[at] = maxima[0];
        partials[at + 1] = sums[0];
        partials[at + 2] = f32::cast_from(columns[0]);
    }
}

/// Cube `row`: the row's token and its log-probability to `output[row · 2 ..]`, from its
/// segments' `partials` (see [`segment_maxima_kernel`]) and, for a sampled row, one segment of
/// its logits read again.
#[cube(launch)]
fn draw_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    temperatures: &Tensor<f32>,
    uniforms: &Tensor<f32>,
    partials: &Tensor<f32>,
    output: &mut Tensor<f32>,
    vocab: u32,
    segments: u32,
    #[comptime] _revision: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let n = N::value();
    let vocab = vocab as usize;
    let vectors = vocab / n;
    let segments = segments as usize;
    let greedy = temperatures[row] == 0.0;
    let temperature = temperature_of(temperatures[row]);

    // 1. The row's maximum, first column and total: each unit folds every UNITS-th segment, in
    // order (an equal maximum keeps the earlier column), then the units' folds meet.
    let mut best = f32::new(NO_MAX);
    let mut sum = 0.0f32;
    let mut best_column = vocab as u32;
    let mut k = unit;
    while k < segments {
        let at = (row * segments + k) * 3;
        merge(&mut best, &mut sum, &mut best_column, partials[at], partials[at + 1], u32::cast_from(partials[at + 2]));
        k += comptime!(UNITS as usize);
    }
    let mut maxima = SharedMemory::<f32>::new(UNITS as usize);
    let mut sums = SharedMemory::<f32>::new(UNITS as usize);
    let mut columns = SharedMemory::<u32>::new(UNITS as usize);
    maxima[unit] = best;
    sums[unit] = sum;
    columns[unit] = best_column;
    sync_cube();
    reduce_maxima(&mut maxima, &mut sums, &mut columns);
    let max = maxima[0];
    let total = sums[0];
    let mut column = columns[0] as usize;
    if column >= vocab {
        // A row with no finite logit.
        column = vocab - 1;
    }

    if !greedy {
        // 2. The segment where the draw falls (the last column where none does: past the total
        // by rounding, as burn's ops and the host give), and what is left of the draw there.
        // `maxima[1]` carries the segment to every unit, `sums[1]` what is left.
        sync_cube();
        if unit == 0 {
            let mut left = uniforms[row] * total;
            let mut chosen = segments;
            for s in 0..segments {
                if chosen == segments {
                    let at = (row * segments + s) * 3;
                    let weight = partials[at + 1] * (partials[at] - max).exp();
                    if left < weight {
                        chosen = s;
                    } else {
                        left -= weight;
                    }
                }
            }
            maxima[1] = f32::cast_from(chosen);
            sums[1] = left;
        }
        sync_cube();
        let chosen = u32::cast_from(maxima[1]) as usize;
        let mut left = sums[1];
        column = vocab - 1;
        if chosen < segments {
            // 3. Each unit's run of RUN vectors of the segment, summed in order.
            let run_start = chosen * SEGMENT_VECTORS + unit * RUN;
            let mut run = 0.0f32;
            for j in 0..RUN {
                let v = run_start + j;
                if v < vectors {
                    let x = Vector::<f32, N>::cast_from(logits[row * vectors + v]);
                    #[unroll]
                    for e in 0..n {
                        run += (x[e] / temperature - max).exp();
                    }
                }
            }
            sync_cube();
            sums[unit] = run;
            sync_cube();
            // Each group's sum, beside the runs.
            let groups = comptime!(UNITS as usize / GROUP);
            if unit < groups {
                let mut group = 0.0f32;
                for r in 0..GROUP {
                    group += sums[unit * GROUP + r];
                }
                maxima[unit] = group;
            }
            sync_cube();
            if unit == 0 {
                // 4. The group, the run, then the column (where subtracting weights one by one
                // rounds below their sum, each level's last entry with weight).
                let g = walk(&maxima, 0, groups, &mut left);
                let r = walk(&sums, g * GROUP, GROUP, &mut left);
                let mut searching = true;
                let first_vector = chosen * SEGMENT_VECTORS + r * RUN;
                for j in 0..RUN {
                    let v = first_vector + j;
                    if v < vectors {
                        let x = Vector::<f32, N>::cast_from(logits[row * vectors + v]);
                        #[unroll]
                        for e in 0..n {
                            if searching {
                                let w = (x[e] / temperature - max).exp();
                                if w > 0.0 {
                                    column = v * n + e;
                                }
                                if left < w {
                                    searching = false;
                                } else {
                                    left -= w;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if unit == 0 {
        let x = Vector::<f32, N>::cast_from(logits[row * vectors + column / n]);
        output[row * 2] = f32::cast_from(column as u32);
        output[row * 2 + 1] = x[column % n] / temperature - (total.ln() + max);
    }
}

/// Vectors of the widest of 8, 4, 2 and 1 elements, at most `most_vector`, that divide the
/// vocabulary and the logits' offset.
fn vector_for(vocab: usize, offset: usize, most_vector: usize) -> usize {
    [8, 4, 2, 1].into_iter().find(|&v| v <= most_vector.max(1) && vocab.is_multiple_of(v) && offset.is_multiple_of(v)).unwrap_or(1)
}

/// Segments of a row of `vocab` columns in vectors of `vector`.
fn segments_for(vocab: usize, vector: usize) -> usize {
    (vocab / vector).div_ceil(SEGMENT_VECTORS)
}

/// Chooses each row's token on CubeCL runtime `R`: `logits` `[rows, vocab]` (f32, f16 or bf16),
/// `temperatures` and `uniforms` `[rows]` f32; `[rows, 2]` f32, each row's token and its
/// log-probability. See [`model::device_kernels::ChooseTokensFn`].
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
    let output = empty_device_contiguous_dtype(client.clone(), logits.device.clone(), Shape::new([rows, 2]), DType::F32);
    if rows == 0 {
        return output;
    }
    let element = logits.dtype.size();
    let offset = logits.handle.offset_start.unwrap_or(0) as usize / element;
    let most_vector = client.io_optimized_vector_sizes(element).max().unwrap_or(1);
    let vector = vector_for(vocab, offset, most_vector);
    let segments = segments_for(vocab, vector);
    let partials = empty_device_contiguous_dtype(client.clone(), logits.device.clone(), Shape::new([rows, segments, 3]), DType::F32);
    let dtype: StorageType = logits.dtype.into();
    segment_maxima_kernel::launch::<R>(
        &client,
        CubeCount::Static(segments as u32, rows as u32, 1),
        CubeDim::new_1d(UNITS),
        vector,
        logits.clone().into_tensor_arg(),
        temperatures.clone().into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        vocab as u32,
        REVISION,
        dtype,
    );
    draw_kernel::launch::<R>(
        &client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(UNITS),
        vector,
        logits.into_tensor_arg(),
        temperatures.into_tensor_arg(),
        uniforms.into_tensor_arg(),
        partials.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        vocab as u32,
        segments as u32,
        REVISION,
        dtype,
    );
    output
}

/// [`segment_maxima_kernel`] and [`draw_kernel`] over logits of `dtype` in vectors of `vector`,
/// as CubeCL defines them for compilation.
pub(crate) fn definitions<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType, vector: usize) -> [KernelDefinition; 2] {
    let arg = crate::definitions::arg;
    let settings = || crate::definitions::settings(UNITS);
    [
        segment_maxima_kernel::SegmentMaximaKernel::<R>::new(settings(), client.clone(), arg(), arg(), arg(), (), vector, REVISION, dtype).define(),
        draw_kernel::DrawKernel::<R>::new(settings(), client.clone(), arg(), arg(), arg(), arg(), arg(), (), (), vector, REVISION, dtype).define(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's vocabulary in CUDA's 16-byte vectors: bf16 rows of 5 segments, f32 of 10; a
    /// vocabulary or an offset that 8 does not divide takes shorter vectors.
    #[test]
    fn vectors_and_segments() {
        assert_eq!((vector_for(151_936, 0, 8), segments_for(151_936, 8)), (8, 5));
        assert_eq!((vector_for(151_936, 0, 4), segments_for(151_936, 4)), (4, 10));
        assert_eq!(vector_for(151_936, 151_936 * 3, 8), 8);
        assert_eq!(vector_for(1000, 4, 8), 4);
        assert_eq!(vector_for(1001, 0, 8), 1);
        assert_eq!(vector_for(5, 0, 0), 1);
        assert_eq!(segments_for(5, 1), 1);
        assert_eq!(segments_for(SEGMENT_VECTORS + 1, 1), 2);
    }
}

//! A decoding step's attention over the paged KV cache (one query a row, see
//! [`crate::paged_attention`]) as a kernel of its own, made for a long context's reads, which
//! also takes a ragged pass's rows of one query (a decoding step's rows beside the prefill
//! chunks of rows joining; the general kernel takes those chunks, its cubes of the other rows
//! returning at once): one cube
//! of [`UNITS`] units per (query heads sharing a key-value head, row, span of columns) takes the
//! row's columns [`UNITS`] at a time (a chunk), with four barriers a chunk:
//! 1. each unit takes one column: where it is a key, the unit reads the key's whole row from the
//!    pool in vectors (16 bytes each on CUDA), four independent loads at a time, and scores it
//!    against each of the cube's query heads (in shared memory, read by all units at once); a
//!    padded column, or one past the span, gets the masked score;
//! 2. one unit a head takes the chunk's largest score into its running maximum (FlashAttention's
//!    online softmax);
//! 3. each unit turns its column's scores into weights against those maxima;
//! 4. one unit a head adds the chunk's weights to its total while the units read the chunk's
//!    values: consecutive units read consecutive vectors of one value row (coalesced), a group
//!    of units a column, the groups taking every so many columns, each unit summing its
//!    vector's elements for every head in registers.
//!
//! At the end the groups' sums are added up in shared memory (one head at a time) and divided by
//! the totals, or, in a split pass, written unnormalised with their maxima and totals for
//! [`crate::paged_attention`]'s join. Each key and value is read from the pools once a cube.
//!
//! The general kernel ([`crate::paged_attention`], which also takes prefill chunks and ragged
//! passes) walks tiles of 32 columns with five barriers a tile and loads of one element; on the
//! fifth lease's H200 a tile took 50–60 µs, most of a long context's decoding step.

use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

/// Units per cube, and columns a chunk.
pub const UNITS: u32 = 128;

/// Bytes of shared memory a cube may take (as [`crate::paged_attention`]'s cubes).
const SHARED_BYTES: usize = 28 * 1024;

/// Query heads a cube takes at most: each unit keeps a vector of sums for each of them in
/// registers.
const MOST_HEADS: usize = 8;

/// f32 words of shared memory a cube of `heads` heads of `head_dim` takes with vectors of
/// `vector` elements: the queries, a chunk's scores, its slots, the groups' sums of one head,
/// and four statistics a head.
const fn shared_words(head_dim: usize, heads: usize, vector: usize) -> usize {
    heads * head_dim + heads * UNITS as usize + 2 * UNITS as usize + UNITS as usize * vector + 4 * heads
}

/// A decoding step's cut: query heads a cube, elements a vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// Query heads a cube takes, all of one key-value head.
    pub heads: u32,
    /// Elements a vector load takes.
    pub vector: u32,
}

/// The cut of a decoding step over heads of `head_dim`, `groups` query heads to a key-value
/// head, with vectors of up to `most_vector` elements: a cube takes the most of a group's heads
/// that divide it, up to `MOST_HEADS`, and the longest vector that divides `head_dim`.
/// `None` where a row's vectors would outnumber the units or the cube would not fit the shared
/// memory (the general kernel takes those).
pub fn cut_for(head_dim: usize, groups: usize, most_vector: usize) -> Option<Cut> {
    let vector = [8, 4, 2, 1].into_iter().find(|&v| v <= most_vector.max(1) && head_dim % v == 0)?;
    if head_dim / vector > UNITS as usize {
        return None;
    }
    let fits = |heads: usize| 4 * shared_words(head_dim, heads, vector) <= SHARED_BYTES;
    let heads = (1..=groups.clamp(1, MOST_HEADS)).rev().find(|&h| groups % h == 0 && fits(h))?;
    Some(Cut { heads: heads as u32, vector: vector as u32 })
}

/// A hash of this file and of `paged_attention.rs` (whose `key_slot` it calls), one of the
/// kernel's compile-time arguments (see `paged_attention::REVISION`).
const REVISION: u32 = crate::source_revision(include_bytes!("paged_decode.rs")).rotate_left(1) ^ crate::paged_attention::REVISION;

#[cube(launch)]
fn paged_decode_kernel<F: Float, N: Size, I: Numeric, V: Float>(
    query: &Tensor<F>,
    keys: &Tensor<Vector<F, N>>,
    values: &Tensor<Vector<F, N>>,
    read: &Tensor<I>,
    valid: &Tensor<V>,
    row_starts: &Tensor<I>,
    output: &mut Tensor<F>,
    partial: &mut Tensor<f32>,
    scale: f32,
    span: u32,
    #[comptime] ragged: bool,
    #[comptime] split: bool,
    #[comptime] head_dim: u32,
    #[comptime] cube_heads: u32,
    #[comptime] _revision: u32,
    #[define(F, I, V)] _dtypes: [StorageType; 3],
) {
    let row = CUBE_POS_Y as usize;
    let part = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let units = comptime!(UNITS as usize);
    let d = comptime!(head_dim as usize);
    let n = N::value();
    // Vectors a head's row, and the groups of units that read a chunk's values.
    let row_vectors = comptime!(d / n);
    let groups = comptime!(units / row_vectors);
    let hc = comptime!(cube_heads as usize);
    let first_head = CUBE_POS_X as usize * hc;
    let heads = query.shape(2);
    let kv_heads = keys.shape(0);
    let slots = keys.shape(1);
    let width = valid.shape(1);
    // The row's query: token `row` of the pass, or in a ragged pass token `row_starts[row]`,
    // where the row has that one (the general kernel takes the others).
    let mut token = row;
    if ragged {
        token = usize::cast_from(row_starts[row]);
        if usize::cast_from(row_starts[row + 1]) - token != 1 {
            terminate!();
        }
    }
    let pool_base = (first_head / (heads / kv_heads)) * slots * row_vectors;
    // The columns this cube walks: all of the row's (its one query is its last column), or its
    // span of them.
    let mut start = 0usize;
    let mut stop = width;
    if split {
        start = part * span as usize;
        if start + (span as usize) < stop {
            stop = start + span as usize;
        }
    }

    let masked = f32::new(-1.0e30);
    let mut q = SharedMemory::<Vector<f32, N>>::new(comptime!(hc * row_vectors));
    let mut scores = SharedMemory::<f32>::new(comptime!(hc * units));
    let mut slot_of = SharedMemory::<u32>::new(units);
    let mut is_key = SharedMemory::<u32>::new(units);
    let mut sums = SharedMemory::<f32>::new(comptime!(units * n));
    let mut running_max = SharedMemory::<f32>::new(hc);
    let mut total = SharedMemory::<f32>::new(hc);
    let mut rescale = SharedMemory::<f32>::new(hc);

    let mut i = unit;
    while i < hc * row_vectors {
        let mut query_vector = Vector::<f32, N>::empty();
        #[unroll]
        for e in 0..n {
            query_vector[e] = f32::cast_from(query[(token * heads + first_head) * d + i * n + e]) * scale;
        }
        q[i] = query_vector;
        i += units;
    }
    if unit < hc {
        running_max[unit] = masked;
        total[unit] = 0.0;
    }
    // The value vector this unit reads (element `lane · n` of a row) and its group.
    let lane = unit % row_vectors;
    let group = unit / row_vectors;
    let mut acc = Array::<Vector<f32, N>>::new(hc);
    #[unroll]
    for h in 0..hc {
        acc[h] = Vector::new(0.0);
    }
    sync_cube();

    while start < stop {
        // 1. This unit's column: its slot and scores.
        let found = crate::paged_attention::key_slot(read, valid, row, start + unit, stop);
        let slot = found.saturating_sub(1);
        let key = u32::min(found, 1);
        slot_of[unit] = slot;
        is_key[unit] = key;
        let mut dots = Array::<f32>::new(hc);
        #[unroll]
        for h in 0..hc {
            dots[h] = 0.0;
        }
        if key == 1 {
            let base = pool_base + slot as usize * row_vectors;
            // The key's vectors four at a time, unrolled: their loads are independent.
            for v0 in 0..comptime!(row_vectors.div_ceil(4)) {
                #[unroll]
                for k in 0..4usize {
                    let v = v0 * 4usize + k;
                    if v < row_vectors {
                        let key_vector = Vector::<f32, N>::cast_from(keys[base + v]);
                        #[unroll]
                        for h in 0..hc {
                            let query_vector = q[h * row_vectors + v];
                            #[unroll]
                            for e in 0..n {
                                dots[h] += query_vector[e] * key_vector[e];
                            }
                        }
                    }
                }
            }
        }
        #[unroll]
        for h in 0..hc {
            let mut score = masked;
            if key == 1 {
                score = dots[h];
            }
            scores[h * units + unit] = score;
        }
        sync_cube();

        // 2. The chunk's largest score into each head's running maximum.
        if unit < hc {
            let old_max = running_max[unit];
            // Four maxima side by side: independent reads of shared memory, a quarter of the
            // chain of comparisons.
            let mut most = Array::<f32>::new(4usize);
            #[unroll]
            for k in 0..4usize {
                most[k] = old_max;
            }
            for j in 0..comptime!(units / 4) {
                #[unroll]
                for k in 0..4usize {
                    let s = scores[unit * units + j * 4usize + k];
                    if s > most[k] {
                        most[k] = s;
                    }
                }
            }
            let new_max = f32::max(f32::max(most[0], most[1]), f32::max(most[2], most[3]));
            running_max[unit] = new_max;
            rescale[unit] = (old_max - new_max).exp();
        }
        sync_cube();

        // 3. This column's weights (a masked column none; a NaN score stays NaN).
        #[unroll]
        for h in 0..hc {
            let s = scores[h * units + unit];
            let mut weight = 0.0f32;
            if s != masked {
                weight = (s - running_max[h]).exp();
            }
            scores[h * units + unit] = weight;
        }
        sync_cube();

        // 4. The totals, and the chunk's values weighed into each unit's sums.
        if unit < hc {
            let mut sums4 = Array::<f32>::new(4usize);
            #[unroll]
            for k in 0..4usize {
                sums4[k] = 0.0;
            }
            for j in 0..comptime!(units / 4) {
                #[unroll]
                for k in 0..4usize {
                    sums4[k] += scores[unit * units + j * 4usize + k];
                }
            }
            total[unit] = total[unit] * rescale[unit] + (sums4[0] + sums4[1]) + (sums4[2] + sums4[3]);
        }
        #[unroll]
        for h in 0..hc {
            acc[h] = acc[h] * Vector::new(rescale[h]);
        }
        if group < groups {
            // The group's columns, four at a time unrolled: their loads are independent.
            for t in 0..comptime!(units.div_ceil(groups).div_ceil(4)) {
                #[unroll]
                for k in 0..4usize {
                    let j = group + (t * 4usize + k) * groups;
                    if j < units && is_key[j] == 1 {
                        let value = Vector::<f32, N>::cast_from(values[pool_base + slot_of[j] as usize * row_vectors + lane]);
                        #[unroll]
                        for h in 0..hc {
                            acc[h] += value * Vector::new(scores[h * units + j]);
                        }
                    }
                }
            }
        }
        sync_cube();
        start += units;
    }

    // The groups' sums of each head added up, then normalised (or, split, written as they are).
    let tokens = query.shape(0) * query.shape(1);
    #[unroll]
    for h in 0..hc {
        if group < groups {
            let a = acc[h];
            #[unroll]
            for e in 0..n {
                sums[group * d + lane * n + e] = a[e];
            }
        }
        sync_cube();
        let pair = token * heads + first_head + h;
        let mut i = unit;
        while i < d {
            let mut sum = 0.0f32;
            for g in 0..groups {
                sum += sums[g * d + i];
            }
            if split {
                partial[(part * tokens * heads + pair) * (d + 2) + i] = sum;
            } else {
                let mut out = 0.0f32;
                if total[h] > 0.0 {
                    out = sum / total[h];
                }
                output[pair * d + i] = F::cast_from(out);
            }
            i += units;
        }
        sync_cube();
    }
    if split && unit < hc {
        let base = (part * tokens * heads + token * heads + first_head + unit) * (d + 2);
        partial[base + d] = running_max[unit];
        partial[base + d + 1] = total[unit];
    }
}

/// How a pass goes to [`paged_decode_kernel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pass {
    /// Query heads a cube, elements a vector.
    pub cut: Cut,
    /// Spans a row's columns are cut into (1: whole).
    pub splits: usize,
    /// Columns a span: a multiple of [`UNITS`].
    pub span: usize,
    /// A ragged pass's (`query` `[1, tokens, heads, head_dim]`, rows as `row_starts` says; the
    /// kernel takes the rows of one query).
    pub ragged: bool,
}

/// Launches [`paged_decode_kernel`] over a decoding step's rows (`query` `[rows, 1, heads,
/// head_dim]`, packed) or a ragged pass's rows of one query; pools, read table, mask and row
/// starts as [`crate::paged_attention::paged_attention`] takes them (`row_starts` unread unless
/// ragged). Split, the spans' results go to `partial` (`[splits, tokens, heads, head_dim + 2]`)
/// for the join, else to `output`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: CubeRuntime>(
    query: CubeTensor<R>,
    keys: CubeTensor<R>,
    values: CubeTensor<R>,
    read: CubeTensor<R>,
    valid: CubeTensor<R>,
    row_starts: CubeTensor<R>,
    output: CubeTensor<R>,
    partial: CubeTensor<R>,
    scale: f32,
    pass: Pass,
) {
    let [_, _, heads, head_dim] = query.meta.shape().dims::<4>();
    let rows = valid.meta.shape().dims::<2>()[0];
    let client = query.client.clone();
    let dtypes = [query.dtype.into(), read.dtype.into(), valid.dtype.into()];
    let cut = pass.cut;
    paged_decode_kernel::launch::<R>(
        &client,
        CubeCount::Static((heads / cut.heads as usize) as u32, rows as u32, pass.splits as u32),
        CubeDim::new_1d(UNITS),
        cut.vector as usize,
        query.into_tensor_arg(),
        keys.into_tensor_arg(),
        values.into_tensor_arg(),
        read.into_tensor_arg(),
        valid.into_tensor_arg(),
        row_starts.into_tensor_arg(),
        output.into_tensor_arg(),
        partial.into_tensor_arg(),
        scale,
        pass.span as u32,
        pass.ragged,
        pass.splits > 1,
        head_dim as u32,
        cut.heads,
        REVISION,
        dtypes,
    );
}

/// [`paged_decode_kernel`] over `dtypes` (the query's and pools', the read table's, the mask's)
/// as CubeCL defines it for compilation, for heads of `head_dim` in groups of `groups`, vectors
/// of up to `most_vector` elements, a decoding step's or a `ragged` pass's, whole or `split`.
pub(crate) fn definition<R: Runtime>(
    client: &ComputeClient<R>,
    dtypes: [StorageType; 3],
    head_dim: usize,
    groups: usize,
    most_vector: usize,
    ragged: bool,
    split: bool,
) -> Option<KernelDefinition> {
    let arg = crate::definitions::arg;
    let cut = cut_for(head_dim, groups, most_vector)?;
    Some(
        paged_decode_kernel::PagedDecodeKernel::<R>::new(
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
            (),
            (),
            cut.vector as usize,
            ragged,
            split,
            head_dim as u32,
            cut.heads,
            REVISION,
            dtypes,
        )
        .define(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's heads of 128 take 16-byte vectors (8 bf16 or 4 f32 elements) and a group's
    /// heads a cube; head sizes whose rows would outnumber the units, or whose cubes would not
    /// fit the shared memory, are left to the general kernel.
    #[test]
    fn cuts_fit_the_units_and_the_shared_memory() {
        assert_eq!(cut_for(128, 2, 8), Some(Cut { heads: 2, vector: 8 }));
        assert_eq!(cut_for(128, 4, 4), Some(Cut { heads: 4, vector: 4 }));
        assert_eq!(cut_for(72, 3, 4), Some(Cut { heads: 3, vector: 4 }));
        assert_eq!(cut_for(24, 2, 8), Some(Cut { heads: 2, vector: 8 }));
        assert_eq!(cut_for(128, 16, 8), Some(Cut { heads: 8, vector: 8 }));
        assert_eq!(cut_for(2048, 2, 8), None);
        for d in [8, 24, 64, 72, 128, 256, 512] {
            for groups in [1, 2, 3, 4, 5, 8, 20, 64] {
                for most_vector in [1, 2, 4, 8] {
                    if let Some(cut) = cut_for(d, groups, most_vector) {
                        let (heads, vector) = (cut.heads as usize, cut.vector as usize);
                        assert!(4 * shared_words(d, heads, vector) <= SHARED_BYTES && groups % heads == 0 && heads <= MOST_HEADS, "{d} {groups}: {cut:?}");
                        assert!(vector <= most_vector && d % vector == 0 && d / vector <= UNITS as usize, "{d} {groups}: {cut:?}");
                    }
                }
            }
        }
    }
}

//! Matrix transposes on the host: the checkpoint loader's `[out, in]` → `[in, out]` (with a
//! dtype conversion) and the bf16-precision backward's operands.
//!
//! The matrix goes through 32 × 32 tiles: the source rows of a tile are converted into a small
//! row-major buffer in L1 (a contiguous, vectorisable pass), and the buffer is written out
//! transposed, so that both the reads and the writes are runs of contiguous elements. Whole
//! tiles of 2- and 4-byte elements are transposed in SSE2 registers (8 × 8 and 4 × 4 blocks);
//! other element sizes and the partial tiles at the edges go element by element.

use rayon::prelude::*;

/// Rows and columns of a tile.
const TILE: usize = 32;
/// Output rows per rayon task.
const BLOCK: usize = 256;

/// The `[cols, rows]` transpose of the row-major `[rows, cols]` matrix `values` (see
/// [`transpose_into`]).
pub(super) fn transpose<T: Copy + Default + Send + Sync>(
    values: &[T],
    rows: usize,
    cols: usize,
) -> Vec<T> {
    let mut out = vec![T::default(); values.len()];
    transpose_into(values, rows, cols, &mut out, |v| v);
    out
}

/// Writes the row-major `[rows, cols]` matrix `src`, converted by `conv`, into `out` as
/// `[cols, rows]`, in parallel over blocks of output rows.
pub fn transpose_into<S: Copy + Sync, T: Copy + Send>(
    src: &[S],
    rows: usize,
    cols: usize,
    out: &mut [T],
    conv: impl Fn(S) -> T + Sync,
) {
    assert!(src.len() == rows * cols && out.len() == src.len(), "a {rows} x {cols} matrix");
    let Some(&first) = src.first() else { return };
    out.par_chunks_mut(BLOCK * rows).enumerate().for_each(|(b, dst)| {
        let c0 = b * BLOCK;
        let width = dst.len() / rows;
        let mut tile = [[conv(first); TILE]; TILE];
        for r0 in (0..rows).step_by(TILE) {
            let height = TILE.min(rows - r0);
            for j0 in (0..width).step_by(TILE) {
                let run = TILE.min(width - j0);
                // The next tile's source lines (32 rows from as many pages, which the hardware
                // prefetchers do not follow).
                let (nr, nj) = if j0 + TILE < width { (r0, j0 + TILE) } else { (r0 + TILE, 0) };
                for r in nr..rows.min(nr + TILE) {
                    prefetch(&src[r * cols + c0 + nj..][..TILE.min(width - nj)]);
                }
                for (i, row) in tile.iter_mut().enumerate().take(height) {
                    let from = &src[(r0 + i) * cols + c0 + j0..][..run];
                    for (t, &v) in row.iter_mut().zip(from) {
                        *t = conv(v);
                    }
                }
                let to = &mut dst[j0 * rows + r0..];
                if height == TILE && run == TILE && write_full_tile(&tile, to, rows) {
                    continue;
                }
                for j in 0..run {
                    for (i, row) in tile.iter().enumerate().take(height) {
                        to[j * rows + i] = row[j];
                    }
                }
            }
        }
    });
}

/// Asks for `values` to be brought into the cache.
fn prefetch<S>(values: &[S]) {
    #[cfg(target_arch = "x86_64")]
    for offset in (0..size_of_val(values)).step_by(64) {
        // SAFETY: a prefetch reads nothing architecturally; the address lies inside `values`.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                (values.as_ptr() as *const i8).add(offset),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// `to[j * stride + i] = tile[i][j]` for a whole tile, in SIMD registers; `false` (nothing
/// written) for element sizes without a register path.
fn write_full_tile<T: Copy>(tile: &[[T; TILE]; TILE], to: &mut [T], stride: usize) -> bool {
    assert!(to.len() >= (TILE - 1) * stride + TILE, "the tile's destination");
    #[cfg(target_arch = "x86_64")]
    {
        let (src, dst) = (tile.as_ptr() as *const u8, to.as_mut_ptr() as *mut u8);
        match size_of::<T>() {
            // SAFETY: `tile` holds TILE x TILE elements of this size and `to` every destination
            // row (checked above); SSE2 is part of x86_64.
            2 => unsafe { sse2::tile_u16(src, dst, stride) },
            4 => unsafe { sse2::tile_u32(src, dst, stride) },
            _ => return false,
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (tile, stride);
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use super::TILE;
    use core::arch::x86_64::*;

    /// The 16 bytes at `p`.
    unsafe fn load<E>(p: *const E) -> __m128i {
        _mm_loadu_si128(p as *const __m128i)
    }

    /// Transposes the row-major TILE x TILE tile of 16-bit elements at `src` into rows of
    /// `dst` that are `stride` elements apart, as 8 x 8 blocks. Each destination row's 64 bytes
    /// are written before the next row's, so the 8 rows in flight stay in L1 even when `stride`
    /// maps them all to one cache set.
    pub(super) unsafe fn tile_u16(src: *const u8, dst: *mut u8, stride: usize) {
        let (src, dst) = (src as *const u16, dst as *mut u16);
        for bj in (0..TILE).step_by(8) {
            for bi in (0..TILE).step_by(8) {
                let a: [__m128i; 8] = core::array::from_fn(|i| load(src.add((bi + i) * TILE + bj)));
                // Pairs of rows interleaved, then pairs of pairs, then halves: column c of the
                // block ends up in the c-th result.
                let b: [__m128i; 8] = core::array::from_fn(|i| {
                    let (x, y) = (a[i / 2 * 2], a[i / 2 * 2 + 1]);
                    if i % 2 == 0 { _mm_unpacklo_epi16(x, y) } else { _mm_unpackhi_epi16(x, y) }
                });
                let c: [__m128i; 8] = core::array::from_fn(|i| {
                    let (x, y) = (b[i / 4 * 4 + i % 4 / 2], b[i / 4 * 4 + i % 4 / 2 + 2]);
                    if i % 2 == 0 { _mm_unpacklo_epi32(x, y) } else { _mm_unpackhi_epi32(x, y) }
                });
                for col in 0..8 {
                    let (x, y) = (c[col / 2], c[col / 2 + 4]);
                    let d = if col % 2 == 0 { _mm_unpacklo_epi64(x, y) } else { _mm_unpackhi_epi64(x, y) };
                    _mm_storeu_si128(dst.add((bj + col) * stride + bi) as *mut __m128i, d);
                }
            }
        }
    }

    /// As [`tile_u16`] for 32-bit elements, as 4 x 4 blocks.
    pub(super) unsafe fn tile_u32(src: *const u8, dst: *mut u8, stride: usize) {
        let (src, dst) = (src as *const u32, dst as *mut u32);
        for bj in (0..TILE).step_by(4) {
            for bi in (0..TILE).step_by(4) {
                let a: [__m128i; 4] = core::array::from_fn(|i| load(src.add((bi + i) * TILE + bj)));
                let b: [__m128i; 4] = core::array::from_fn(|i| {
                    let (x, y) = (a[i / 2 * 2], a[i / 2 * 2 + 1]);
                    if i % 2 == 0 { _mm_unpacklo_epi32(x, y) } else { _mm_unpackhi_epi32(x, y) }
                });
                for col in 0..4 {
                    let (x, y) = (b[col / 2], b[col / 2 + 2]);
                    let d = if col % 2 == 0 { _mm_unpacklo_epi64(x, y) } else { _mm_unpackhi_epi64(x, y) };
                    _mm_storeu_si128(dst.add((bj + col) * stride + bi) as *mut __m128i, d);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPES: [(usize, usize); 9] =
        [(0, 5), (1, 1), (3, 130), (150, 7), (129, 65), (40, 600), (33, 257), (64, 64), (300, 520)];

    /// Checks `t` against the transpose of the `rows x cols` matrix whose element `(r, c)` is
    /// `value(r * cols + c)`.
    fn check<T: Copy + PartialEq + std::fmt::Debug>(
        t: &[T],
        rows: usize,
        cols: usize,
        want: impl Fn(usize) -> T,
    ) {
        for (i, &v) in t.iter().enumerate() {
            let (c, r) = (i / rows, i % rows);
            assert_eq!(v, want(r * cols + c), "{rows} x {cols} at ({r}, {c})");
        }
    }

    #[test]
    fn transpose_moves_every_element() {
        for (rows, cols) in SHAPES {
            let n = rows * cols;
            let words: Vec<u32> = (0..n as u32).collect();
            check(&transpose(&words, rows, cols), rows, cols, |i| i as u32);
            let halves: Vec<u16> = (0..n).map(|i| (i * 40503) as u16).collect();
            check(&transpose(&halves, rows, cols), rows, cols, |i| (i * 40503) as u16);
            let bytes: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
            check(&transpose(&bytes, rows, cols), rows, cols, |i| (i * 7) as u8);
            let wide: Vec<u64> = (0..n as u64).map(|i| i << 33).collect();
            check(&transpose(&wide, rows, cols), rows, cols, |i| (i as u64) << 33);
        }
    }

    /// A conversion that changes the element size (bf16 bits widened to f32) is applied to
    /// every element, whole tiles and edges alike.
    #[test]
    fn transpose_converts_every_element() {
        for (rows, cols) in SHAPES {
            let bits: Vec<u16> = (0..rows * cols).map(|i| (i * 40503) as u16).collect();
            let mut out = vec![0f32; bits.len()];
            transpose_into(&bits, rows, cols, &mut out, |b| f32::from_bits((b as u32) << 16));
            let out: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            check(&out, rows, cols, |i| ((i * 40503) as u16 as u32) << 16);
        }
    }
}

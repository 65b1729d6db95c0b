//! Linear-layer matrix products on the CPU: bf16 weights at any size, f32 weights for few rows.
//!
//! [`matmul_bf16`] and [`matmul_f32_bf16`] compute `y[m, n] = sum_k x[m, k] * w[k, n]`
//! (row-major, contiguous) with f32 accumulation; with [`WeightLayout::OutIn`] they take the
//! weights transposed, `e[n, k]` (e.g. a tied embedding table used as the language-model head). On x86_64 with
//! AVX-512 (F, BW, VL, BF16) a hand-written SIMD path is used:
//!
//! * `m <= 16` (decode): memory-bound streaming over `w`. One row of `x` (batch-1 decode):
//!   bands of 256 weight rows are spread over the rayon pool, each read as four contiguous
//!   runs in lockstep, and their partial sums added in band order. More rows: column blocks
//!   are spread over the pool and read several rows at a time with software prefetch. Each
//!   32-column bf16 vector is widened to f32 (even/odd lanes via shift/mask) and FMA'd against
//!   broadcast f32 activations (bf16 activations are widened first, exactly). In the transposed
//!   layout rows of `e` are spread over the pool instead and dotted, four rows from separate
//!   pages at a time, with every row of `x` (`vdpbf16ps` for bf16 activations, widened f32 FMA
//!   otherwise).
//! * larger `m` (prefill): GotoBLAS-style blocking. `x` is packed once; per k-block a
//!   128-column block of `w` (prefetched during the previous block) is packed into 32-column
//!   panels, and an 8 x 32 register-blocked microkernel sweeps all rows against each panel
//!   while it sits in L1. `matmul_f32_bf16` packs `w` widened to f32 and uses f32 FMA.
//!   `matmul_bf16` packs k-pairs and uses `vdpbf16ps` ([`crate::Bf16Products::Pairs`], the
//!   default on AMD CPUs, where it does twice the multiply-adds of an FMA), or widens both
//!   operands and uses f32 FMA ([`crate::Bf16Products::Widened`], the default elsewhere: Intel
//!   Xeons issue `vdpbf16ps` at half the FMA rate); see [`crate::bf16_products`]. bf16 products
//!   are exact in f32, so both give the same sums up to f32 rounding.
//!   Transposed weights only change how a panel is packed (16 x 16 word blocks transposed in
//!   registers).
//!
//! [`matmul_f32_small`] does the same for f32 weights and at most
//! [`SMALL_M`] rows (decode), reusing the streaming kernels: a 32-weight chunk is loaded as two
//! f32 vectors directly instead of being widened.
//!
//! [`matmul_bf16_f32`] returns the f32 sums of `matmul_bf16` unrounded (training at bf16
//! precision), and [`matmul_rounded`] takes the weights in f32 and rounds them to bf16 as the
//! panels are packed.
//!
//! Below the AVX-512 BF16 level, `matmul_bf16_f32` and `matmul_rounded` widen their (rounded)
//! operands to f32 and use burn-flex's f32 GEMM, and the others portable, auto-vectorisable
//! loops: the same results up to f32 summation order.

// Off x86-64 only the portable paths exist, so the kernels' level is not read.
#![cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]

use half::bf16;
use rayon::prelude::*;

use crate::ops::WeightLayout;
use crate::Kernels;

/// Up to this many rows of `x` the memory-bound streaming kernels are used.
pub const SMALL_M: usize = 16;

/// `y[m, n] = sum_k x[m, k] * w[k, n]` with `w` stored as `layout` says: `[k, n]` (in × out)
/// or `[n, k]` (out × in, e.g. a tied embedding table as the head). All row-major, contiguous.
///
/// `x` and `w` bf16: products are accumulated in f32 and the result is rounded to bf16
/// (nearest-even) once at the end.
pub fn matmul_bf16(kernels: Kernels, x: &[bf16], w: &[bf16], layout: WeightLayout, m: usize, k: usize, n: usize) -> Vec<bf16> {
    check_shapes(x.len(), w.len(), m, k, n);
    #[cfg(target_arch = "x86_64")]
    if kernels.avx512_bf16() {
        // SAFETY: a `Kernels` level never exceeds the host's, so the CPU has these features.
        return unsafe { avx512::matmul_bf16(x, w, layout, m, k, n, kernels.pairs()) };
    }
    matmul_bf16_portable(x, w, layout, m, k, n)
}

/// Same as [`matmul_bf16`] with the f32 sums returned as they are, not rounded to bf16: the
/// product of two bf16 operands with f32 accumulation (what a training step's bf16 matmuls
/// compute for f32 activations and gradients). Below the AVX-512 BF16 level both operands are
/// widened to f32 (exactly) and multiplied by burn-flex's f32 GEMM: the products of bf16
/// values are exact in f32, so only the order of the f32 sums differs between levels.
pub fn matmul_bf16_f32(kernels: Kernels, x: &[bf16], w: &[bf16], layout: WeightLayout, m: usize, k: usize, n: usize) -> Vec<f32> {
    check_shapes(x.len(), w.len(), m, k, n);
    #[cfg(target_arch = "x86_64")]
    if kernels.avx512_bf16() {
        // SAFETY: a `Kernels` level never exceeds the host's, so the CPU has these features.
        return unsafe { avx512::matmul_bf16_f32(x, w, layout, m, k, n, kernels.pairs()) };
    }
    gemm_f32(widen_all(kernels, x), widen_all(kernels, w), layout, m, k, n)
}

/// [`matmul_bf16_f32`] with `w` given in f32 and rounded to bf16 (to nearest, ties to even) as
/// it is read, so no rounded copy of the weights is made (below the AVX-512 BF16 level, a
/// rounded f32 copy lives for the duration of the call, as burn-flex's own bf16 matmul makes).
/// Bit for bit what [`matmul_bf16_f32`] gives for the rounded weights, at every level.
pub fn matmul_rounded(kernels: Kernels, x: &[bf16], w: &[f32], layout: WeightLayout, m: usize, k: usize, n: usize) -> Vec<f32> {
    check_shapes(x.len(), w.len(), m, k, n);
    #[cfg(target_arch = "x86_64")]
    if kernels.avx512_bf16() {
        if m > SMALL_M {
            // SAFETY: a `Kernels` level never exceeds the host's, so the CPU has these features.
            return unsafe { avx512::matmul_rounded(x, w, layout, m, k, n, kernels.pairs()) };
        }
        // Few rows stream the weights once anyway: round them first.
        return matmul_bf16_f32(kernels, x, &crate::flex::narrow_all(kernels, w), layout, m, k, n);
    }
    gemm_f32(widen_all(kernels, x), round_all(kernels, w), layout, m, k, n)
}

/// `values` widened to f32 (exact), in parallel.
fn widen_all(kernels: Kernels, values: &[bf16]) -> Vec<f32> {
    crate::flex::map_all(kernels, values, crate::bf16_bits::widen)
}

/// `values` rounded to bf16 precision (to nearest, ties to even), kept in f32, in parallel.
fn round_all(kernels: Kernels, values: &[f32]) -> Vec<f32> {
    crate::flex::map_all(kernels, values, crate::bf16_bits::round)
}

/// `x[m, k] · w` (`w` stored as `layout` says) by burn-flex's f32 matmul.
fn gemm_f32(x: Vec<f32>, w: Vec<f32>, layout: WeightLayout, m: usize, k: usize, n: usize) -> Vec<f32> {
    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorData};
    let device = Default::default();
    let x = Tensor::<Flex, 2>::from_data(TensorData::new(x, [m, k]), &device);
    let w = match layout {
        WeightLayout::InOut => Tensor::<Flex, 2>::from_data(TensorData::new(w, [k, n]), &device),
        WeightLayout::OutIn => Tensor::<Flex, 2>::from_data(TensorData::new(w, [n, k]), &device).transpose(),
    };
    x.matmul(w).into_data().into_vec::<f32>().expect("an f32 matmul gives f32 values")
}

/// Same as [`matmul_bf16`] with f32 activations and an f32 result.
///
/// `x` is used exactly: each bf16 weight is widened to f32 (exact) and the product is a plain f32
/// FMA, so the only rounding is that of f32 accumulation.
pub fn matmul_f32_bf16(kernels: Kernels, x: &[f32], w: &[bf16], layout: WeightLayout, m: usize, k: usize, n: usize) -> Vec<f32> {
    check_shapes(x.len(), w.len(), m, k, n);
    #[cfg(target_arch = "x86_64")]
    if kernels.avx512_bf16() {
        // SAFETY: a `Kernels` level never exceeds the host's, so the CPU has these features.
        return unsafe { avx512::matmul_f32_bf16(x, w, layout, m, k, n) };
    }
    matmul_f32_bf16_portable(x, w, layout, m, k, n)
}

/// The same for f32 `x` and f32 `w` when `m <= SMALL_M`; `None` for larger `m` (use a general
/// GEMM then).
pub fn matmul_f32_small(
    kernels: Kernels,
    x: &[f32],
    w: &[f32],
    layout: WeightLayout,
    m: usize,
    k: usize,
    n: usize,
) -> Option<Vec<f32>> {
    check_shapes(x.len(), w.len(), m, k, n);
    #[cfg(target_arch = "x86_64")]
    if m <= SMALL_M && kernels.avx512_bf16() {
        // SAFETY: a `Kernels` level never exceeds the host's, so the CPU has these features.
        return Some(unsafe { avx512::matmul_f32_small(x, w, layout, m, k, n) });
    }
    matmul_f32_small_portable(x, w, layout, m, k, n)
}

/// Whether the hand-written SIMD kernels run at `kernels`' level (otherwise the portable
/// fallback does).
pub fn has_fast_path(kernels: Kernels) -> bool {
    cfg!(target_arch = "x86_64") && kernels.avx512_bf16()
}

fn check_shapes(x_len: usize, w_len: usize, m: usize, k: usize, n: usize) {
    assert_eq!(x_len, m * k, "x must have m * k elements");
    assert_eq!(w_len, k * n, "the weights must have k * n elements");
}

/// Raw pointer that may be shared across rayon tasks writing disjoint regions.
struct SyncPtr<T>(*mut T);
impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SyncPtr<T> {}
// SAFETY: only used for writes to disjoint output regions and reads of shared immutable data.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// A weight element of the portable paths.
trait Widen: Copy + Sync {
    fn widen(self) -> f32;
}

impl Widen for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// Portable path of [`matmul_bf16`] (public for tests and benchmarks only).
#[doc(hidden)]
pub fn matmul_bf16_portable(
    x: &[bf16],
    w: &[bf16],
    layout: WeightLayout,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<bf16> {
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    matmul_f32_bf16_portable(&xf, w, layout, m, k, n)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Portable path of [`matmul_f32_bf16`] (public for tests and benchmarks only).
#[doc(hidden)]
pub fn matmul_f32_bf16_portable(
    x: &[f32],
    w: &[bf16],
    layout: WeightLayout,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    check_shapes(x.len(), w.len(), m, k, n);
    match layout {
        WeightLayout::InOut => portable_f32(x, w, m, k, n),
        WeightLayout::OutIn => portable_f32_nt(x, w, m, k, n),
    }
}

/// Portable path of [`matmul_f32_small`] (public for tests and benchmarks only).
#[doc(hidden)]
pub fn matmul_f32_small_portable(
    x: &[f32],
    w: &[f32],
    layout: WeightLayout,
    m: usize,
    k: usize,
    n: usize,
) -> Option<Vec<f32>> {
    check_shapes(x.len(), w.len(), m, k, n);
    (m <= SMALL_M).then(|| match layout {
        WeightLayout::InOut => portable_f32(x, w, m, k, n),
        WeightLayout::OutIn => portable_f32_nt(x, w, m, k, n),
    })
}

/// Blocked f32 product: per task a column block of `PB` columns; rows in groups of `PR` whose
/// accumulators stay in a small stack array; each weight row slice is widened once per group.
fn portable_f32<W: Widen>(x: &[f32], w: &[W], m: usize, k: usize, n: usize) -> Vec<f32> {
    const PB: usize = 128;
    const PR: usize = 4;
    let mut y = vec![0f32; m * n];
    let yp = SyncPtr(y.as_mut_ptr());
    let blocks = n.div_ceil(PB);
    (0..blocks).into_par_iter().for_each(|b| {
        let c0 = b * PB;
        let nc = PB.min(n - c0);
        let mut wf = [0f32; PB];
        let mut r0 = 0;
        while r0 < m {
            let rows = PR.min(m - r0);
            let mut acc = [[0f32; PB]; PR];
            for kk in 0..k {
                let wrow = &w[kk * n + c0..kk * n + c0 + nc];
                for (d, s) in wf.iter_mut().zip(wrow) {
                    *d = s.widen();
                }
                for (r, acc_r) in acc.iter_mut().enumerate().take(rows) {
                    let xv = x[(r0 + r) * k + kk];
                    for (a, wv) in acc_r.iter_mut().zip(&wf[..nc]) {
                        *a += xv * wv;
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate().take(rows) {
                // SAFETY: each task writes only its own columns `c0..c0 + nc` of each row.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(yp.get().add((r0 + r) * n + c0), nc) };
                dst.copy_from_slice(&acc_r[..nc]);
            }
            r0 += rows;
        }
    });
    y
}

/// Transposed-layout product: per task a block of `PB` rows of `e`; each row is widened once and
/// dotted with every row of `x`.
fn portable_f32_nt<W: Widen>(x: &[f32], e: &[W], m: usize, k: usize, n: usize) -> Vec<f32> {
    const PB: usize = 64;
    let mut y = vec![0f32; m * n];
    let yp = SyncPtr(y.as_mut_ptr());
    (0..n.div_ceil(PB)).into_par_iter().for_each(|b| {
        let mut ef = vec![0f32; k];
        for j in b * PB..n.min(b * PB + PB) {
            for (d, s) in ef.iter_mut().zip(&e[j * k..j * k + k]) {
                *d = s.widen();
            }
            for r in 0..m {
                let v = dot(&x[r * k..r * k + k], &ef);
                // SAFETY: each task writes only its own columns `b * PB..` of each row.
                unsafe { *yp.get().add(r * n + j) = v };
            }
        }
    });
    y
}

/// Dot product with 16 independent partial sums (auto-vectorisable).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (ac, bc) = (a.chunks_exact(L), b.chunks_exact(L));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(p, q)| p * q)
        .sum();
    for (pa, pb) in ac.zip(bc) {
        for ((s, p), q) in acc.iter_mut().zip(pa).zip(pb) {
            *s += p * q;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{SyncPtr, SMALL_M};
    use crate::ops::WeightLayout;
    use core::arch::x86_64::*;
    use core::marker::PhantomData;
    use half::bf16;
    use rayon::prelude::*;
    use std::cell::RefCell;
    /// Rows per microkernel tile of the packed (large-m) path.
    const MR: usize = 8;
    /// Columns per packed panel (two zmm of f32 results).
    const NR: usize = 32;
    /// Bytes of f32 partial sums (rows of `x` x columns) per rayon task of the streaming
    /// (small-m) kernel: they stay in L1. Within it, tasks are as wide as possible, up to one per
    /// thread, so that each weight row is read in long contiguous runs.
    const SACC: usize = 16 << 10;
    /// Weight rows widened and held in registers at once by the streaming kernel.
    const SKU: usize = 8;
    /// Rows of `x` sharing the widened weights per pass of the streaming kernel.
    const SRG: usize = 4;
    /// Rows ahead of the current block that the streaming kernel prefetches.
    const SPF: usize = 16;
    /// Weight rows per band of the one-row streaming kernel: each band's partial sums are kept
    /// apart and added in band order at the end.
    const BAND: usize = 256;
    /// Runs of a band walked in lockstep by the one-row kernel.
    const SB: usize = 4;
    /// Fewest columns per task of the one-row kernel when bands are split by columns.
    const MIN_BAND_COLS: usize = 256;
    /// Rows of `e` per rayon task of the transposed streaming kernel.
    const TROWS: usize = 128;
    /// Rows of `e` dotted at once by the transposed streaming kernel (sharing each `x` load).
    const TER: usize = 4;
    /// Rows of `x` per pass of the transposed streaming kernel (sharing each `e` load).
    const TXR: usize = 4;

    /// One 64-byte aligned cache line of scratch data.
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([u32; 16]);

    thread_local! {
        static SCRATCH: RefCell<(Vec<Line>, Vec<Line>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    }

    /// Runs `f` with this thread's two scratch buffers, grown to at least `a` and `b` cache lines.
    fn with_scratch<R>(a: usize, b: usize, f: impl FnOnce(*mut u32, *mut u32) -> R) -> R {
        SCRATCH.with(|s| {
            let (sa, sb) = &mut *s.borrow_mut();
            for (v, len) in [(&mut *sa, a), (&mut *sb, b)] {
                if v.len() < len {
                    v.resize(len, Line([0; 16]));
                }
            }
            f(sa.as_mut_ptr() as *mut u32, sb.as_mut_ptr() as *mut u32)
        })
    }

    fn as_u16(v: &[bf16]) -> &[u16] {
        bytemuck::cast_slice(v)
    }

    /// Mask of the first `len.min(16)` lanes.
    #[inline(always)]
    fn mask16(len: usize) -> __mmask16 {
        if len >= 16 {
            0xffff
        } else {
            ((1u32 << len) - 1) as __mmask16
        }
    }

    /// Mask of the first `len.min(32)` lanes.
    #[inline(always)]
    fn mask32(len: usize) -> __mmask32 {
        if len >= 32 {
            u32::MAX
        } else {
            (1u32 << len) - 1
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn matmul_bf16(
        x: &[bf16],
        w: &[bf16],
        layout: WeightLayout,
        m: usize,
        k: usize,
        n: usize,
        pairs: bool,
    ) -> Vec<bf16> {
        if m <= SMALL_M {
            return f32_to_bf16(&matmul_bf16_f32(x, w, layout, m, k, n, pairs));
        }
        let mut y = vec![bf16::ZERO; m * n];
        let yp = SyncPtr(y.as_mut_ptr() as *mut u16);
        let (x, w) = (as_u16(x), as_u16(w));
        match pairs {
            true => packed::<Bf16Pairs<u16, u16>>(x, w, layout, m, k, n, yp),
            false => packed::<WideFma<u16, u16, u16>>(x, w, layout, m, k, n, yp),
        }
        y
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn matmul_bf16_f32(
        x: &[bf16],
        w: &[bf16],
        layout: WeightLayout,
        m: usize,
        k: usize,
        n: usize,
        pairs: bool,
    ) -> Vec<f32> {
        if m <= SMALL_M {
            return match layout {
                WeightLayout::InOut => {
                    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                    streaming(&xf, as_u16(w), m, k, n)
                }
                WeightLayout::OutIn => streaming_nt::<DotPairs>(as_u16(x), as_u16(w), m, k, n),
            };
        }
        let mut y = vec![0f32; m * n];
        let yp = SyncPtr(y.as_mut_ptr());
        let (x, w) = (as_u16(x), as_u16(w));
        match pairs {
            true => packed::<Bf16Pairs<u16, f32>>(x, w, layout, m, k, n, yp),
            false => packed::<WideFma<u16, u16, f32>>(x, w, layout, m, k, n, yp),
        }
        y
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn matmul_f32_bf16(
        x: &[f32],
        w: &[bf16],
        layout: WeightLayout,
        m: usize,
        k: usize,
        n: usize,
    ) -> Vec<f32> {
        if m <= SMALL_M {
            return match layout {
                WeightLayout::InOut => streaming(x, as_u16(w), m, k, n),
                WeightLayout::OutIn => streaming_nt::<DotWide<u16>>(x, as_u16(w), m, k, n),
            };
        }
        let mut y = vec![0f32; m * n];
        let yp = SyncPtr(y.as_mut_ptr());
        packed::<WideFma<f32, u16, f32>>(x, as_u16(w), layout, m, k, n, yp);
        y
    }

    /// The packed path; `m > SMALL_M`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn matmul_rounded(
        x: &[bf16],
        w: &[f32],
        layout: WeightLayout,
        m: usize,
        k: usize,
        n: usize,
        pairs: bool,
    ) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        let yp = SyncPtr(y.as_mut_ptr());
        match pairs {
            true => packed::<Bf16Pairs<f32, f32>>(as_u16(x), w, layout, m, k, n, yp),
            false => packed::<WideFma<u16, f32, f32>>(as_u16(x), w, layout, m, k, n, yp),
        }
        y
    }

    /// Streaming product with f32 weights; `m <= SMALL_M`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn matmul_f32_small(
        x: &[f32],
        w: &[f32],
        layout: WeightLayout,
        m: usize,
        k: usize,
        n: usize,
    ) -> Vec<f32> {
        match layout {
            WeightLayout::InOut => streaming(x, w, m, k, n),
            WeightLayout::OutIn => streaming_nt::<DotWide<f32>>(x, w, m, k, n),
        }
    }

    /// Rounds f32 to bf16 (nearest-even) with `vcvtneps2bf16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn f32_to_bf16(y: &[f32]) -> Vec<bf16> {
        let mut out = vec![bf16::ZERO; y.len()];
        let dst = out.as_mut_ptr() as *mut u16;
        let mut i = 0;
        while i < y.len() {
            let mk = mask16(y.len() - i);
            let v = _mm512_maskz_loadu_ps(mk, y.as_ptr().add(i));
            let h: __m256i = core::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(dst.add(i) as *mut i16, mk, h);
            i += 16;
        }
        out
    }

    // ---------------------------------------------------------------- streaming (small m)

    /// A weight element of the streaming kernels: bf16 bits (`u16`) or f32.
    trait Weight: Copy + Sync {
        /// Whether [`Weight::load32`] yields the even and the odd elements (bf16), rather than
        /// elements `0..16` and `16..32` (f32).
        const SPLIT: bool;
        /// Loads the first `mk` of 32 consecutive weights as two f32 vectors (zero past `mk`).
        unsafe fn load32(p: *const Self, mk: __mmask32) -> [__m512; 2];
    }

    impl Weight for u16 {
        const SPLIT: bool = true;

        /// One 512-bit load, widened on the 32-bit lanes by `<< 16` and `& 0xffff0000`.
        #[inline(always)]
        unsafe fn load32(p: *const u16, mk: __mmask32) -> [__m512; 2] {
            let v = _mm512_maskz_loadu_epi16(mk, p as *const i16);
            let hi = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
            [
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)),
                _mm512_castsi512_ps(hi),
            ]
        }
    }

    impl Weight for f32 {
        const SPLIT: bool = false;

        #[inline(always)]
        unsafe fn load32(p: *const f32, mk: __mmask32) -> [__m512; 2] {
            [
                _mm512_maskz_loadu_ps(mk as __mmask16, p),
                _mm512_maskz_loadu_ps((mk >> 16) as __mmask16, p.add(16)),
            ]
        }
    }

    /// Small-m product (one row: [`streaming_row`]). Each rayon task owns a block of columns
    /// (see [`SACC`]) and walks down `w` `SKU` rows at a time. Partial sums live in per-thread
    /// scratch laid out `[32-column slice][row][32]` (in [`Weight::load32`] order), so they stay
    /// in L1 without cache-set conflicts.
    fn streaming<W: Weight>(x: &[f32], w: &[W], m: usize, k: usize, n: usize) -> Vec<f32> {
        if m == 1 {
            return streaming_row(x, w, k, n);
        }
        let mut y = vec![0f32; m * n];
        let yp = SyncPtr(y.as_mut_ptr());
        let wp = SyncPtr(w.as_ptr() as *mut W);
        let cap = (SACC / 4 / m.max(1)) & !31;
        let cols = n
            .div_ceil(rayon::current_num_threads())
            .next_multiple_of(32)
            .min(cap)
            .max(32);
        (0..n.div_ceil(cols)).into_par_iter().for_each(|t| {
            let c0 = t * cols;
            let cw = cols.min(n - c0);
            with_scratch(m * cols / 16, 0, |acc, _| {
                let acc = acc as *mut f32;
                // SAFETY: `x`, `w`, `y` hold `m * k`, `k * n`, `m * n` elements and `acc`
                // `m * cols` f32; this task touches only columns `c0..c0 + cw` of `y`;
                // features were checked by the caller.
                unsafe {
                    let wc = wp.get().add(c0) as *const W;
                    stream_zero(acc, m, cw);
                    let main = k - k % SKU;
                    for k0 in (0..main).step_by(SKU) {
                        stream_rows::<W, SKU>(x, m, k, k0, wc, n, cw, acc);
                    }
                    for k0 in main..k {
                        stream_rows::<W, 1>(x, m, k, k0, wc, n, cw, acc);
                    }
                    stream_store(acc, m, cw, yp.get().add(c0), n, W::SPLIT);
                }
            });
        });
        y
    }

    /// One-row product (`m = 1`): `w`'s rows are cut into bands of [`BAND`] rows, each summed
    /// apart and added in band order at the end (so the result does not depend on the thread
    /// count). A task walks its band as [`SB`] runs in lockstep, each one contiguous stream,
    /// with the row's partial sums in L1. Bands are split by columns only when there are fewer
    /// of them than threads.
    fn streaming_row<W: Weight>(x: &[f32], w: &[W], k: usize, n: usize) -> Vec<f32> {
        let np = n.next_multiple_of(32);
        let bands = k.div_ceil(BAND);
        let blocks = rayon::current_num_threads()
            .div_ceil(bands)
            .min(n.div_ceil(MIN_BAND_COLS))
            .max(1);
        let cols = n.div_ceil(blocks).next_multiple_of(32);
        let blocks = n.div_ceil(cols);
        let mut partial = vec![Line([0; 16]); bands * np / 16];
        let pp = SyncPtr(partial.as_mut_ptr() as *mut f32);
        let wp = SyncPtr(w.as_ptr() as *mut W);
        (0..bands * blocks).into_par_iter().for_each(|t| {
            let (b, c0) = (t / blocks, t % blocks * cols);
            let cw = cols.min(n - c0);
            let (r0, r1) = (b * BAND, k.min(b * BAND + BAND));
            let run = (r1 - r0) / SB;
            // SAFETY: `x`, `w` hold `k`, `k * n` elements and `partial` `bands * np` f32; this
            // task writes only band `b`'s sums of columns `c0..c0 + cw`; features were checked
            // by the caller.
            unsafe {
                let acc = pp.get().add(b * np + c0);
                let wc = wp.get().add(c0) as *const W;
                for i in 0..run {
                    row_runs::<W, SB>(x.as_ptr(), r0 + i, run, wc, n, cw, acc);
                }
                for r in r0 + SB * run..r1 {
                    row_runs::<W, 1>(x.as_ptr(), r, 0, wc, n, cw, acc);
                }
            }
        });
        let mut y = vec![0f32; n];
        for c in (0..n).step_by(32) {
            // SAFETY: slice `c` of every band's sums lies inside `partial`, and `y` holds `n`.
            unsafe { band_sum(&partial, bands, np, c, n, y.as_mut_ptr(), W::SPLIT) };
        }
        y
    }

    /// `acc[0..cw] += sum_u x[k0 + u * stride] * w[k0 + u * stride, 0..cw]` (`w` offset to the
    /// task's first column, row stride `n`; `acc` in [`Weight::load32`] order).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn row_runs<W: Weight, const KU: usize>(
        x: *const f32,
        k0: usize,
        stride: usize,
        w: *const W,
        n: usize,
        cw: usize,
        acc: *mut f32,
    ) {
        let xs: [__m512; KU] = core::array::from_fn(|u| _mm512_set1_ps(*x.add(k0 + u * stride)));
        let rows: [*const W; KU] = core::array::from_fn(|u| w.add((k0 + u * stride) * n));
        let step = |j: usize, mk: __mmask32| {
            let p = acc.add(j);
            let mut a = [_mm512_load_ps(p), _mm512_load_ps(p.add(16))];
            for u in 0..KU {
                let wv = W::load32(rows[u].add(j), mk);
                a[0] = _mm512_fmadd_ps(xs[u], wv[0], a[0]);
                a[1] = _mm512_fmadd_ps(xs[u], wv[1], a[1]);
            }
            _mm512_store_ps(p, a[0]);
            _mm512_store_ps(p.add(16), a[1]);
        };
        let full = cw - cw % 32;
        for j in (0..full).step_by(32) {
            step(j, !0);
        }
        if full < cw {
            step(full, mask32(cw - full));
        }
    }

    /// Adds the `bands` one-row partial sums of the 32-column slice at `c` (in band order) and
    /// stores them into `y[c..]`, re-interleaved if `split`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn band_sum(partial: &[Line], bands: usize, np: usize, c: usize, n: usize, y: *mut f32, split: bool) {
        let src = (partial.as_ptr() as *const f32).add(c);
        let mut sum = [_mm512_setzero_ps(); 2];
        for b in 0..bands {
            sum[0] = _mm512_add_ps(sum[0], _mm512_load_ps(src.add(b * np)));
            sum[1] = _mm512_add_ps(sum[1], _mm512_load_ps(src.add(b * np + 16)));
        }
        let mut out = [Line([0; 16]); 2];
        let o = out.as_mut_ptr() as *mut f32;
        _mm512_store_ps(o, sum[0]);
        _mm512_store_ps(o.add(16), sum[1]);
        stream_store(o, 1, 32.min(n - c), y.add(c), n, split);
    }

    /// Zeroes the scratch sums of `m` rows x `cw` columns.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn stream_zero(acc: *mut f32, m: usize, cw: usize) {
        for i in (0..m * cw.next_multiple_of(32)).step_by(16) {
            _mm512_store_ps(acc.add(i), _mm512_setzero_ps());
        }
    }

    /// Copies the scratch sums into `y[:, 0..cw]` (row stride `n`), re-interleaving the even
    /// and odd column halves of each 32-column slice if `split`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn stream_store(
        acc: *const f32,
        m: usize,
        cw: usize,
        y: *mut f32,
        n: usize,
        split: bool,
    ) {
        let idx_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let idx_hi =
            _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for j in (0..cw).step_by(32) {
            for r in 0..m {
                let src = acc.add(j * m + r * 32);
                let (a, b) = (_mm512_load_ps(src), _mm512_load_ps(src.add(16)));
                let dst = y.add(r * n + j);
                let (lo, hi) = if split {
                    (
                        _mm512_permutex2var_ps(a, idx_lo, b),
                        _mm512_permutex2var_ps(a, idx_hi, b),
                    )
                } else {
                    (a, b)
                };
                _mm512_mask_storeu_ps(dst, mask16(cw - j), lo);
                _mm512_mask_storeu_ps(dst.add(16), mask16((cw - j).saturating_sub(16)), hi);
            }
        }
    }

    /// Adds `x[:, k0..k0 + KU] * w[k0..k0 + KU, 0..cw]` into the scratch sums (`w` offset to
    /// the task's first column, row stride `n`). A 32-column slice of a weight row is loaded
    /// as two f32 vectors ([`Weight::load32`]) and reused for all rows of `x`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn stream_rows<W: Weight, const KU: usize>(
        x: &[f32],
        m: usize,
        k: usize,
        k0: usize,
        w: *const W,
        n: usize,
        cw: usize,
        acc: *mut f32,
    ) {
        let x = x.as_ptr().add(k0);
        let slice_bytes = 32 * size_of::<W>();
        for j in (0..cw).step_by(32) {
            let mk = mask32(cw - j);
            if k0 + SPF + KU <= k {
                for u in 0..KU {
                    let p = w.add((k0 + SPF + u) * n + j) as *const i8;
                    for b in (0..slice_bytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(p.add(b));
                    }
                }
            }
            let wv: [[__m512; 2]; KU] =
                core::array::from_fn(|u| W::load32(w.add((k0 + u) * n + j), mk));
            let slice = acc.add(j * m);
            let mut r0 = 0;
            while r0 < m {
                let (xr, ar) = (x.add(r0 * k), slice.add(r0 * 32));
                match m - r0 {
                    1 => stream_fma::<KU, 1>(&wv, xr, k, ar),
                    2 => stream_fma::<KU, 2>(&wv, xr, k, ar),
                    3 => stream_fma::<KU, 3>(&wv, xr, k, ar),
                    _ => stream_fma::<KU, SRG>(&wv, xr, k, ar),
                }
                r0 += SRG;
            }
        }
    }

    /// `R` rows: `acc[r][0..32] += sum_u x[r, u] * wv[u]` (even/odd column order).
    #[inline(always)]
    unsafe fn stream_fma<const KU: usize, const R: usize>(
        wv: &[[__m512; 2]; KU],
        x: *const f32,
        k: usize,
        acc: *mut f32,
    ) {
        let mut a: [[__m512; 2]; R] = core::array::from_fn(|r| {
            let p = acc.add(r * 32);
            [_mm512_load_ps(p), _mm512_load_ps(p.add(16))]
        });
        for (u, wu) in wv.iter().enumerate() {
            for (r, ar) in a.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(r * k + u));
                ar[0] = _mm512_fmadd_ps(xv, wu[0], ar[0]);
                ar[1] = _mm512_fmadd_ps(xv, wu[1], ar[1]);
            }
        }
        for (r, ar) in a.iter().enumerate() {
            let p = acc.add(r * 32);
            _mm512_store_ps(p, ar[0]);
            _mm512_store_ps(p.add(16), ar[1]);
        }
    }

    // ------------------------------------------------- transposed streaming (small m)

    /// How a 32-element chunk of a row of `e` meets the matching chunk of a row of `x`. Rows of
    /// `x` are rewritten once per call into zero-padded rows of `k.next_multiple_of(32)`.
    trait RowDot {
        type X: Copy + Default + Sync;
        /// An element of `e`.
        type W: Copy + Sync;
        /// A chunk of `e`, ready to multiply.
        type E: Copy;
        /// A chunk of `x`.
        type Xv: Copy;
        /// Rewrites one row of `x` into `dst` (already zeroed, padded length).
        fn prep_x(row: &[Self::X], dst: &mut [Self::X]);
        unsafe fn load_e(p: *const Self::W, mk: __mmask32) -> Self::E;
        unsafe fn load_x(p: *const Self::X) -> Self::Xv;
        /// `acc + e . x`, folded into 16 f32 lanes.
        unsafe fn dot(acc: __m512, e: Self::E, x: Self::Xv) -> __m512;
    }

    /// bf16 activations: `x` copied as is, one `vdpbf16ps` per chunk.
    struct DotPairs;

    impl RowDot for DotPairs {
        type X = u16;
        type W = u16;
        type E = __m512bh;
        type Xv = __m512bh;

        fn prep_x(row: &[u16], dst: &mut [u16]) {
            dst[..row.len()].copy_from_slice(row);
        }

        #[inline(always)]
        unsafe fn load_e(p: *const u16, mk: __mmask32) -> __m512bh {
            core::mem::transmute(_mm512_maskz_loadu_epi16(mk, p as *const i16))
        }

        #[inline(always)]
        unsafe fn load_x(p: *const u16) -> __m512bh {
            core::mem::transmute(_mm512_loadu_si512(p as *const __m512i))
        }

        #[inline(always)]
        unsafe fn dot(acc: __m512, e: __m512bh, x: __m512bh) -> __m512 {
            _mm512_dpbf16_ps(acc, e, x)
        }
    }

    /// f32 activations: a chunk of `e` is loaded as two f32 vectors ([`Weight::load32`]); for
    /// bf16 `e` (even and odd elements) each 32-element chunk of `x` is stored as its 16 even
    /// elements followed by its 16 odd ones to match.
    struct DotWide<W>(PhantomData<W>);

    impl<W: Weight> RowDot for DotWide<W> {
        type X = f32;
        type W = W;
        type E = [__m512; 2];
        type Xv = [__m512; 2];

        fn prep_x(row: &[f32], dst: &mut [f32]) {
            if W::SPLIT {
                for (i, &v) in row.iter().enumerate() {
                    dst[i / 32 * 32 + i % 2 * 16 + i % 32 / 2] = v;
                }
            } else {
                dst[..row.len()].copy_from_slice(row);
            }
        }

        #[inline(always)]
        unsafe fn load_e(p: *const W, mk: __mmask32) -> [__m512; 2] {
            W::load32(p, mk)
        }

        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> [__m512; 2] {
            [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))]
        }

        #[inline(always)]
        unsafe fn dot(acc: __m512, e: [__m512; 2], x: [__m512; 2]) -> __m512 {
            _mm512_fmadd_ps(e[1], x[1], _mm512_fmadd_ps(e[0], x[0], acc))
        }
    }

    /// Small-m product with transposed weights. Each rayon task owns `TROWS` rows of `e`
    /// (output columns), split into `TER` equal runs that are streamed in lockstep, one row of
    /// each at a time; those rows stay in L1 while every row of `x` is dotted with them. (Rows
    /// from distant pages keep the hardware prefetcher at full bandwidth; adjacent rows,
    /// interleaved, halve it.) Leftover rows are done one by one. Prepared rows of `x` are one
    /// cache line longer than needed so that, with `e` rows a multiple of 4 KiB, they do not
    /// all map to the same L1 set as the rows of `e`.
    fn streaming_nt<D: RowDot>(x: &[D::X], e: &[D::W], m: usize, k: usize, n: usize) -> Vec<f32> {
        let kp = k.next_multiple_of(32) + 64 / size_of::<D::X>();
        let mut xp = vec![D::X::default(); m * kp];
        for r in 0..m {
            D::prep_x(&x[r * k..r * k + k], &mut xp[r * kp..r * kp + kp]);
        }
        let mut y = vec![0f32; m * n];
        let yp = SyncPtr(y.as_mut_ptr());
        (0..n.div_ceil(TROWS)).into_par_iter().for_each(|t| {
            let (j0, end) = (t * TROWS, n.min(t * TROWS + TROWS));
            let sp = (end - j0) / TER;
            // SAFETY: `e` holds `n * k` elements, `xp` `m * kp` and `y` `m * n`; this task
            // writes only columns `j0..end` of `y`; features were checked by the caller.
            unsafe {
                for j in j0..j0 + sp {
                    let (ej, yj) = (e.as_ptr().add(j * k), yp.get().add(j));
                    nt_rows::<D, TER>(ej, k, sp, &xp, kp, m, yj, n);
                }
                for j in j0 + TER * sp..end {
                    let (ej, yj) = (e.as_ptr().add(j * k), yp.get().add(j));
                    nt_rows::<D, 1>(ej, k, 1, &xp, kp, m, yj, n);
                }
            }
        });
        y
    }

    /// `y[r, u * sp] = e[u * sp, :] . x[r, :]` for `u < ER` (rows of `e` `sp` apart) and all `m`
    /// rows of `x` (prepared, row stride `kp`); `y` has row stride `n`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn nt_rows<D: RowDot, const ER: usize>(
        e: *const D::W,
        k: usize,
        sp: usize,
        x: &[D::X],
        kp: usize,
        m: usize,
        y: *mut f32,
        n: usize,
    ) {
        let mut r0 = 0;
        while r0 < m {
            let (xr, yr) = (x.as_ptr().add(r0 * kp), y.add(r0 * n));
            match m - r0 {
                1 => nt_tile::<D, ER, 1>(e, k, sp, xr, kp, yr, n),
                2 => nt_tile::<D, ER, 2>(e, k, sp, xr, kp, yr, n),
                3 => nt_tile::<D, ER, 3>(e, k, sp, xr, kp, yr, n),
                _ => nt_tile::<D, ER, TXR>(e, k, sp, xr, kp, yr, n),
            }
            r0 += TXR;
        }
    }

    /// `ER` rows of `e` x `XR` rows of `x`: one zmm of partial sums per pair, reduced at the end.
    #[inline(always)]
    unsafe fn nt_tile<D: RowDot, const ER: usize, const XR: usize>(
        e: *const D::W,
        k: usize,
        sp: usize,
        x: *const D::X,
        kp: usize,
        y: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); XR]; ER];
        for i in (0..k).step_by(32) {
            let mk = mask32(k - i);
            let ev: [D::E; ER] = core::array::from_fn(|u| D::load_e(e.add(u * sp * k + i), mk));
            for r in 0..XR {
                let xv = D::load_x(x.add(r * kp + i));
                for (acc_u, &evu) in acc.iter_mut().zip(&ev) {
                    acc_u[r] = D::dot(acc_u[r], evu, xv);
                }
            }
        }
        for (u, acc_u) in acc.iter().enumerate() {
            for (r, &a) in acc_u.iter().enumerate() {
                *y.add(r * n + u * sp) = _mm512_reduce_add_ps(a);
            }
        }
    }

    // ---------------------------------------------------------------- packed (large m)

    /// Reduction steps per k-block: the packed `w` slice of one panel (`KC * NR` words, 16 KiB)
    /// stays in L1 while the microkernel sweeps all row blocks.
    const KC: usize = 128;
    // `pack_transposed` writes whole 16-step blocks.
    const _: () = assert!(KC.is_multiple_of(16));
    /// Columns per rayon task (a multiple of `NR`); each k-block of packed `x` is reused across
    /// them from L2.
    const NC: usize = 4 * NR;

    /// Destination of a tile's final store: `rows` x `nc` elements at `y` with row stride `n`.
    struct Out<Y> {
        y: *mut Y,
        n: usize,
        rows: usize,
        nc: usize,
    }

    /// A packed-panel microkernel family. Both operands are packed into 32-bit words per
    /// "step" (`STEP` consecutive k): `x` row blocks as `[steps][MR]` (one broadcast word per
    /// row) and `w` column panels as `[steps][NR]` (two zmm per step).
    trait PanelKernel {
        type X: Copy + Sync;
        /// The element `w` is stored as: bf16 bits (`u16`) or f32.
        type W: Copy + Sync;
        type Y;
        /// k elements per step.
        const STEP: usize;
        /// Packs `x.len() / k` (at most `MR`) rows of `x` into `dst` (`[steps][MR]`, pre-zeroed).
        unsafe fn pack_x(x: &[Self::X], k: usize, dst: &mut [u32]);
        /// Packs `kr` rows and columns `0..nc` (at most `NC`) of `w` (row stride `n`) into
        /// `nc.div_ceil(NR)` panels `[steps][NR]`, `KC * NR` words apart, zero padding.
        unsafe fn pack_kn(w: *const Self::W, kr: usize, n: usize, nc: usize, dst: *mut u32);
        /// As `pack_kn` for one panel (`nc <= NR`) of transposed weights: column `j` is `kr`
        /// elements at `e + j * k`. `dst` must hold `steps` rounded up to 16 rows.
        unsafe fn pack_nk(e: *const Self::W, kr: usize, k: usize, nc: usize, dst: *mut u32);
        /// `MR` x `NR` tile over `steps` steps. Accumulators start at zero if `first`, else
        /// from `c` (f32, row stride `NC`); they end in `out` if given, else back in `c`.
        unsafe fn tile(
            steps: usize,
            a: *const u32,
            b: *const u32,
            c: *mut f32,
            first: bool,
            out: Option<Out<Self::Y>>,
        );
    }

    /// GotoBLAS-style blocking: `x` is packed once (row blocks in parallel); rayon tasks own
    /// `NC` columns. Per k-block the task's `KC x NC` block of `w` is packed into L2-sized
    /// scratch as `NR`-column panels, and the microkernel runs over all row blocks of one panel
    /// (then in L1) before the next, with partial sums kept in an f32 scratch tile. Meanwhile
    /// the source of the next block (in this task, else the first of the next task) is
    /// prefetched a slice per tile, so packing does not wait on memory.
    fn packed<K: PanelKernel>(
        x: &[K::X],
        w: &[K::W],
        layout: WeightLayout,
        m: usize,
        k: usize,
        n: usize,
        y: SyncPtr<K::Y>,
    ) {
        let steps = k.div_ceil(K::STEP);
        let block = steps * MR;
        let blocks = m.div_ceil(MR);
        let mut a = vec![0u32; blocks * block];
        if block > 0 {
            a.par_chunks_mut(block)
                .zip(x.par_chunks(MR * k))
                // SAFETY: features were checked by the caller.
                .for_each(|(dst, xs)| unsafe { K::pack_x(xs, k, dst) });
        }
        let a = &a;
        let wp = SyncPtr(w.as_ptr() as *mut K::W);
        let c_lines = if steps > KC { blocks * MR * NC / 16 } else { 0 };
        let tasks = n.div_ceil(NC);
        // The part of `w` that the block at step `s0`, columns `c0..c1` is packed from.
        let source = |s0: usize, c0: usize, c1: usize| {
            let k0 = s0 * K::STEP;
            let (kr, nc) = ((KC * K::STEP).min(k - k0), c1 - c0);
            match layout {
                WeightLayout::InOut => Source {
                    start: k0 * n + c0,
                    rows: kr,
                    stride: n,
                    len: nc,
                },
                WeightLayout::OutIn => Source {
                    start: c0 * k + k0,
                    rows: nc,
                    stride: k,
                    len: kr,
                },
            }
        };
        (0..tasks).into_par_iter().for_each(|t| {
            with_scratch(KC * NC / 16, c_lines, |panels, c| {
                let c = c as *mut f32;
                let (c0, c1) = (t * NC, n.min(t * NC + NC));
                let tiles = c1.div_ceil(NR) - c0 / NR;
                for s0 in (0..steps.max(1)).step_by(KC) {
                    let ks = KC.min(steps - s0);
                    let k0 = s0 * K::STEP;
                    let kr = (ks * K::STEP).min(k - k0);
                    let first = s0 == 0;
                    let last = s0 + KC >= steps;
                    let next = if !last {
                        Some(source(s0 + KC, c0, c1))
                    } else {
                        (t + 1 < tasks && steps > 0).then(|| source(0, c1, n.min(c1 + NC)))
                    };
                    // SAFETY: `w` covers `k * n` and `y` `m * n` elements; `panels` holds
                    // `KC * NC` words (`KC` is a multiple of 16), `c` holds `blocks * MR`
                    // rows of `NC` f32, `a` holds `steps * MR` words per row block; this
                    // task writes only its own columns; features were checked by the caller.
                    unsafe {
                        match layout {
                            WeightLayout::InOut => {
                                K::pack_kn(wp.get().add(k0 * n + c0), kr, n, c1 - c0, panels)
                            }
                            WeightLayout::OutIn => {
                                for (i, j) in (c0..c1).step_by(NR).enumerate() {
                                    let dst = panels.add(i * KC * NR);
                                    K::pack_nk(wp.get().add(j * k + k0), kr, k, NR.min(c1 - j), dst)
                                }
                            }
                        }
                        for (i, j) in (c0..c1).step_by(NR).enumerate() {
                            for blk in 0..blocks {
                                if let Some(s) = &next {
                                    s.prefetch(wp.get(), i * blocks + blk, tiles * blocks);
                                }
                                let r0 = blk * MR;
                                let out = last.then(|| Out {
                                    y: y.get().add(r0 * n + j),
                                    n,
                                    rows: MR.min(m - r0),
                                    nc: NR.min(c1 - j),
                                });
                                K::tile(
                                    ks,
                                    a.as_ptr().add(blk * block + s0 * MR),
                                    panels.add(i * KC * NR),
                                    c.wrapping_add(r0 * NC + j - c0),
                                    first,
                                    out,
                                );
                            }
                        }
                    }
                }
            });
        });
    }

    /// The part of `w` a block is packed from: `rows` runs of `len` elements, `stride` apart,
    /// from element `start`.
    struct Source {
        start: usize,
        rows: usize,
        stride: usize,
        len: usize,
    }

    impl Source {
        /// Prefetches part `part` of `parts` (a share of the rows) into all cache levels.
        #[inline(always)]
        unsafe fn prefetch<T>(&self, w: *const T, part: usize, parts: usize) {
            let bytes = size_of::<T>() * self.len;
            for r in self.rows * part / parts..self.rows * (part + 1) / parts {
                let p = w.add(self.start + r * self.stride) as *const i8;
                for off in (0..bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(off));
                }
                _mm_prefetch::<_MM_HINT_T0>(p.add(bytes - 1));
            }
        }
    }

    /// bf16 activations, `vdpbf16ps` on k-pairs: a word holds elements `2p` (low half) and
    /// `2p + 1` (high half, zero past the end) of a row of `x` or a column of `w`. The weights
    /// are `S`: bf16 bits (`u16`), or f32 rounded to bf16 as they are packed (no rounded copy of
    /// the weights is made). The result is stored as `Y`: bf16 bits (`u16`) or f32.
    struct Bf16Pairs<S, Y>(core::marker::PhantomData<(S, Y)>);

    /// What [`Bf16Pairs`] packs its weight panels from.
    trait PairSource: Copy + Sync + Sized {
        unsafe fn pack_kn(w: *const Self, kr: usize, n: usize, nc: usize, dst: *mut u32);
        unsafe fn pack_nk(e: *const Self, kr: usize, k: usize, nc: usize, dst: *mut u32);
    }

    impl PairSource for u16 {
        #[inline]
        unsafe fn pack_kn(w: *const u16, kr: usize, n: usize, nc: usize, dst: *mut u32) {
            pack_pairs(w, kr, n, nc, dst)
        }

        #[inline]
        unsafe fn pack_nk(e: *const u16, kr: usize, k: usize, nc: usize, dst: *mut u32) {
            pack_transposed::<Bf16Run>(e, kr, k, nc, dst)
        }
    }

    impl PairSource for f32 {
        #[inline]
        unsafe fn pack_kn(w: *const f32, kr: usize, n: usize, nc: usize, dst: *mut u32) {
            pack_rounded_pairs(w, kr, n, nc, dst)
        }

        #[inline]
        unsafe fn pack_nk(e: *const f32, kr: usize, k: usize, nc: usize, dst: *mut u32) {
            pack_transposed::<RoundedRun>(e, kr, k, nc, dst)
        }
    }

    impl<S: PairSource, Y: TileStore> PanelKernel for Bf16Pairs<S, Y> {
        type X = u16;
        type W = S;
        type Y = Y;
        const STEP: usize = 2;

        #[inline]
        unsafe fn pack_x(x: &[u16], k: usize, dst: &mut [u32]) {
            pack_x_pairs(x, k, dst)
        }

        #[inline]
        unsafe fn pack_kn(w: *const S, kr: usize, n: usize, nc: usize, dst: *mut u32) {
            S::pack_kn(w, kr, n, nc, dst)
        }

        #[inline]
        unsafe fn pack_nk(e: *const S, kr: usize, k: usize, nc: usize, dst: *mut u32) {
            S::pack_nk(e, kr, k, nc, dst)
        }

        #[inline]
        unsafe fn tile(
            steps: usize,
            a: *const u32,
            b: *const u32,
            c: *mut f32,
            first: bool,
            out: Option<Out<Y>>,
        ) {
            dp_tile(steps, a, b, c, first, out)
        }
    }

    /// `pack_kn` of f32 weights for [`Bf16Pairs`]: rows `2p` and `2p + 1` rounded to bf16, 16 columns at a time,
    /// and interleaved into words (the even row in the low half).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn pack_rounded_pairs(w: *const f32, kr: usize, n: usize, nc: usize, dst: *mut u32) {
        for p in 0..kr.div_ceil(2) {
            let (ra, rb) = (w.add(2 * p * n), w.add((2 * p + 1) * n));
            // Whole panels: the zero words past `nc` are the panel's padding.
            for j in (0..nc.next_multiple_of(NR)).step_by(16) {
                let mk = mask16(nc.saturating_sub(j));
                let a = round16(ra.add(j), mk);
                let b = if 2 * p + 1 < kr { round16(rb.add(j), mk) } else { _mm512_setzero_si512() };
                let d = dst.add((j - j % NR) * KC + p * NR + j % NR) as *mut __m512i;
                _mm512_store_si512(d, _mm512_or_si512(a, _mm512_slli_epi32::<16>(b)));
            }
        }
    }

    /// The first `mk` of 16 f32 rounded to bf16 (nearest-even), each in the low half of a word.
    #[inline(always)]
    unsafe fn round16(p: *const f32, mk: __mmask16) -> __m512i {
        let h: __m256i = core::mem::transmute(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, p)));
        _mm512_cvtepu16_epi32(h)
    }

    /// [`Bf16Pairs::pack_x`]: per 32 steps, 64 elements of each row are loaded as two
    /// registers (rows `r` and `8 + r` of a 16 x 16 word matrix) and transposed, giving steps
    /// `j` and `16 + j` of all rows in one register. Leftover steps are packed one by one.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn pack_x_pairs(x: &[u16], k: usize, dst: &mut [u32]) {
        const _: () = assert!(MR == 8);
        let rows = x.len() / k;
        let main = k / 64 * 32;
        let d = dst.as_mut_ptr();
        for p0 in (0..main).step_by(32) {
            let mut v = [_mm512_setzero_si512(); 16];
            for r in 0..rows {
                let src = x.as_ptr().add(r * k + 2 * p0) as *const __m512i;
                v[r] = _mm512_loadu_si512(src);
                v[MR + r] = _mm512_loadu_si512(src.add(1));
            }
            for (j, t) in transpose16(v).into_iter().enumerate() {
                let lo = d.add((p0 + j) * MR) as *mut __m256i;
                let hi = d.add((p0 + 16 + j) * MR) as *mut __m256i;
                _mm256_storeu_si256(lo, _mm512_castsi512_si256(t));
                _mm256_storeu_si256(hi, _mm512_extracti64x4_epi64::<1>(t));
            }
        }
        for p in main..k.div_ceil(2) {
            for r in 0..rows {
                let row = &x[r * k..r * k + k];
                let hi = row.get(2 * p + 1).copied().unwrap_or(0);
                dst[p * MR + r] = row[2 * p] as u32 | (hi as u32) << 16;
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn pack_pairs(w: *const u16, kr: usize, n: usize, nc: usize, dst: *mut u32) {
        let idx_a = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        let idx_b = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        let zero = _mm512_setzero_si512();
        for p in 0..kr.div_ceil(2) {
            let (ra, rb) = (w.add(2 * p * n), w.add((2 * p + 1) * n));
            for j in (0..nc).step_by(NR) {
                let mk = mask32(nc - j);
                let a = _mm512_maskz_loadu_epi16(mk, ra.add(j) as *const i16);
                let b = if 2 * p + 1 < kr {
                    _mm512_maskz_loadu_epi16(mk, rb.add(j) as *const i16)
                } else {
                    zero
                };
                // Per 128-bit lane: lo = columns 0..4 interleaved, hi = columns 4..8.
                let lo = _mm512_unpacklo_epi16(a, b);
                let hi = _mm512_unpackhi_epi16(a, b);
                let d = dst.add(j * KC + p * NR) as *mut __m512i;
                _mm512_store_si512(d, _mm512_permutex2var_epi64(lo, idx_a, hi));
                _mm512_store_si512(d.add(1), _mm512_permutex2var_epi64(lo, idx_b, hi));
            }
        }
    }

    /// How [`pack_transposed`] reads one column's run of 16 words (`STEP` elements each).
    trait Run {
        type T;
        const STEP: usize;
        /// The 16 words from `src`, where `left` elements of the column remain (zero past them).
        unsafe fn load(src: *const Self::T, left: usize) -> __m512i;
    }

    /// bf16 pairs as stored.
    struct Bf16Run;

    impl Run for Bf16Run {
        type T = u16;
        const STEP: usize = 2;
        #[inline(always)]
        unsafe fn load(src: *const u16, left: usize) -> __m512i {
            _mm512_maskz_loadu_epi16(mask32(left), src as *const i16)
        }
    }

    /// bf16 widened to f32, one per word.
    struct WideRun;

    impl Run for WideRun {
        type T = u16;
        const STEP: usize = 1;
        #[inline(always)]
        unsafe fn load(src: *const u16, left: usize) -> __m512i {
            u16::load16(src, mask16(left))
        }
    }

    /// f32 rounded to bf16 pairs (`vcvtne2ps2bf16`, to nearest even).
    struct RoundedRun;

    impl Run for RoundedRun {
        type T = f32;
        const STEP: usize = 2;
        #[inline(always)]
        unsafe fn load(src: *const f32, left: usize) -> __m512i {
            let lo = _mm512_maskz_loadu_ps(mask16(left), src);
            let hi = _mm512_maskz_loadu_ps(mask16(left.saturating_sub(16)), src.add(16));
            core::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo))
        }
    }

    /// Packs a transposed panel (see [`PanelKernel::pack_nk`]) whose words `R` reads. Blocks of
    /// 16 steps x 16 columns are loaded as one 16-word run per column and transposed in
    /// registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn pack_transposed<R: Run>(e: *const R::T, kr: usize, k: usize, nc: usize, dst: *mut u32) {
        for s0 in (0..kr.div_ceil(R::STEP)).step_by(16) {
            let (k0, left) = (s0 * R::STEP, kr - s0 * R::STEP);
            for h in 0..NR / 16 {
                let mut cols = [_mm512_setzero_si512(); 16];
                for (i, col) in cols.iter_mut().enumerate().take(nc.saturating_sub(16 * h)) {
                    *col = R::load(e.add((16 * h + i) * k + k0), left);
                }
                for (i, v) in transpose16(cols).into_iter().enumerate() {
                    _mm512_store_si512(dst.add((s0 + i) * NR + 16 * h) as *mut __m512i, v);
                }
            }
        }
    }

    /// Transposes a 16 x 16 matrix of 32-bit words held one row per register.
    #[inline(always)]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Within each 128-bit lane: 2 x 2 blocks of words, then 4 x 4 blocks.
        let mut a = r;
        for i in (0..16).step_by(2) {
            a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        let mut b = a;
        for i in (0..16).step_by(4) {
            b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
            b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
            b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
            b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
        }
        // `b[4q + c]` lane `l` holds rows `4q..4q + 4` of column `4l + c`: transpose the lanes.
        let mut out = b;
        for c in 0..4 {
            let d0 = _mm512_shuffle_i32x4::<0x44>(b[c], b[4 + c]);
            let d1 = _mm512_shuffle_i32x4::<0xee>(b[c], b[4 + c]);
            let d2 = _mm512_shuffle_i32x4::<0x44>(b[8 + c], b[12 + c]);
            let d3 = _mm512_shuffle_i32x4::<0xee>(b[8 + c], b[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(d0, d2);
            out[4 + c] = _mm512_shuffle_i32x4::<0xdd>(d0, d2);
            out[8 + c] = _mm512_shuffle_i32x4::<0x88>(d1, d3);
            out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(d1, d3);
        }
        out
    }

    /// Loads (or zeroes) the `MR x NR` f32 accumulators.
    #[inline(always)]
    unsafe fn acc_init(c: *const f32, first: bool) -> [[__m512; 2]; MR] {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if !first {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                acc_r[0] = _mm512_loadu_ps(c.add(r * NC));
                acc_r[1] = _mm512_loadu_ps(c.add(r * NC + 16));
            }
        }
        acc
    }

    /// Stores the accumulators back to the f32 scratch tile.
    #[inline(always)]
    unsafe fn acc_spill(acc: &[[__m512; 2]; MR], c: *mut f32) {
        for (r, acc_r) in acc.iter().enumerate() {
            _mm512_storeu_ps(c.add(r * NC), acc_r[0]);
            _mm512_storeu_ps(c.add(r * NC + 16), acc_r[1]);
        }
    }

    /// `MR` x 32 tile: per k-pair, two panel loads and `2 * MR` `vdpbf16ps` against the
    /// broadcast `(x[r, 2p], x[r, 2p + 1])` word.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn dp_tile<Y: TileStore>(
        steps: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        first: bool,
        out: Option<Out<Y>>,
    ) {
        let mut acc = acc_init(c, first);
        for s in 0..steps {
            let bs = b.add(s * NR) as *const __m512i;
            let b0: __m512bh = core::mem::transmute(_mm512_load_si512(bs));
            let b1: __m512bh = core::mem::transmute(_mm512_load_si512(bs.add(1)));
            let as_ = a.add(s * MR);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xv: __m512bh = core::mem::transmute(_mm512_set1_epi32(*as_.add(r) as i32));
                acc_r[0] = _mm512_dpbf16_ps(acc_r[0], xv, b0);
                acc_r[1] = _mm512_dpbf16_ps(acc_r[1], xv, b1);
            }
        }
        match out {
            Some(o) => Y::store(&acc, o),
            None => acc_spill(&acc, c),
        }
    }

    /// How a finished tile's accumulators are written to the result.
    trait TileStore: Sized {
        unsafe fn store(acc: &[[__m512; 2]; MR], o: Out<Self>);
    }

    /// Rounded to bf16 (nearest-even).
    impl TileStore for u16 {
        #[inline(always)]
        unsafe fn store(acc: &[[__m512; 2]; MR], o: Out<u16>) {
            let m0 = mask16(o.nc);
            let m1 = mask16(o.nc.saturating_sub(16));
            for (r, acc_r) in acc.iter().enumerate().take(o.rows) {
                let dst = o.y.add(r * o.n) as *mut i16;
                let h0: __m256i = core::mem::transmute(_mm512_cvtneps_pbh(acc_r[0]));
                let h1: __m256i = core::mem::transmute(_mm512_cvtneps_pbh(acc_r[1]));
                _mm256_mask_storeu_epi16(dst, m0, h0);
                _mm256_mask_storeu_epi16(dst.add(16), m1, h1);
            }
        }
    }

    /// As they are.
    impl TileStore for f32 {
        #[inline(always)]
        unsafe fn store(acc: &[[__m512; 2]; MR], o: Out<f32>) {
            let m0 = mask16(o.nc);
            let m1 = mask16(o.nc.saturating_sub(16));
            for (r, acc_r) in acc.iter().enumerate().take(o.rows) {
                let dst = o.y.add(r * o.n);
                _mm512_mask_storeu_ps(dst, m0, acc_r[0]);
                _mm512_mask_storeu_ps(dst.add(16), m1, acc_r[1]);
            }
        }
    }

    /// f32 FMA against operands widened to f32; a word is one f32. Activations `X` are f32 or
    /// bf16 bits (`u16`, widened exactly as `x` is packed); weights `S` are bf16 bits, or f32
    /// rounded to bf16 as they are packed; the result is stored as `Y`. With bf16 operands the
    /// products are exact in f32 as with `vdpbf16ps`, so this computes what [`Bf16Pairs`] does
    /// up to f32 rounding of the sums: it is the kernel for CPUs that issue f32 FMAs faster than
    /// `vdpbf16ps` (see [`crate::Bf16Products`]).
    struct WideFma<X, S, Y>(PhantomData<(X, S, Y)>);

    /// An activation element of [`WideFma`] as the f32 bits it packs to.
    trait WideActivation: Copy + Sync {
        fn bits(self) -> u32;
    }

    impl WideActivation for f32 {
        #[inline(always)]
        fn bits(self) -> u32 {
            self.to_bits()
        }
    }

    impl WideActivation for u16 {
        #[inline(always)]
        fn bits(self) -> u32 {
            (self as u32) << 16
        }
    }

    /// What [`WideFma`] packs its weight panels from.
    trait WideSource: Copy + Sync + Sized {
        unsafe fn pack_kn(w: *const Self, kr: usize, n: usize, nc: usize, dst: *mut u32);
        unsafe fn pack_nk(e: *const Self, kr: usize, k: usize, nc: usize, dst: *mut u32);
    }

    impl WideSource for u16 {
        #[inline]
        unsafe fn pack_kn(w: *const u16, kr: usize, n: usize, nc: usize, dst: *mut u32) {
            pack_wide::<u16>(w, kr, n, nc, dst)
        }

        #[inline]
        unsafe fn pack_nk(e: *const u16, kr: usize, k: usize, nc: usize, dst: *mut u32) {
            pack_transposed::<WideRun>(e, kr, k, nc, dst)
        }
    }

    impl WideSource for f32 {
        #[inline]
        unsafe fn pack_kn(w: *const f32, kr: usize, n: usize, nc: usize, dst: *mut u32) {
            pack_wide::<f32>(w, kr, n, nc, dst)
        }

        #[inline]
        unsafe fn pack_nk(e: *const f32, kr: usize, k: usize, nc: usize, dst: *mut u32) {
            pack_transposed::<RoundedWideRun>(e, kr, k, nc, dst)
        }
    }

    impl<X: WideActivation, S: WideSource, Y: TileStore> PanelKernel for WideFma<X, S, Y> {
        type X = X;
        type W = S;
        type Y = Y;
        const STEP: usize = 1;

        unsafe fn pack_x(x: &[X], k: usize, dst: &mut [u32]) {
            for (r, row) in x.chunks_exact(k).enumerate() {
                for (kk, v) in row.iter().enumerate() {
                    dst[kk * MR + r] = v.bits();
                }
            }
        }

        #[inline]
        unsafe fn pack_kn(w: *const S, kr: usize, n: usize, nc: usize, dst: *mut u32) {
            S::pack_kn(w, kr, n, nc, dst)
        }

        #[inline]
        unsafe fn pack_nk(e: *const S, kr: usize, k: usize, nc: usize, dst: *mut u32) {
            S::pack_nk(e, kr, k, nc, dst)
        }

        #[inline]
        unsafe fn tile(
            steps: usize,
            a: *const u32,
            b: *const u32,
            c: *mut f32,
            first: bool,
            out: Option<Out<Y>>,
        ) {
            fma_tile(steps, a, b, c, first, out)
        }
    }

    /// 16 weights as f32 words: bf16 bits shifted into the high half, or f32 rounded to bf16
    /// (nearest-even) and widened back.
    trait WideLoad: Copy {
        unsafe fn load16(p: *const Self, mk: __mmask16) -> __m512i;
    }

    impl WideLoad for u16 {
        #[inline(always)]
        unsafe fn load16(p: *const u16, mk: __mmask16) -> __m512i {
            let v = _mm256_maskz_loadu_epi16(mk, p as *const i16);
            _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v))
        }
    }

    impl WideLoad for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32, mk: __mmask16) -> __m512i {
            _mm512_slli_epi32::<16>(round16(p, mk))
        }
    }

    /// f32 rounded to bf16 and widened back, one per word.
    struct RoundedWideRun;

    impl Run for RoundedWideRun {
        type T = f32;
        const STEP: usize = 1;
        #[inline(always)]
        unsafe fn load(src: *const f32, left: usize) -> __m512i {
            f32::load16(src, mask16(left))
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn pack_wide<T: WideLoad>(w: *const T, kr: usize, n: usize, nc: usize, dst: *mut u32) {
        for kk in 0..kr {
            for j in (0..nc).step_by(NR) {
                let src = w.add(kk * n + j);
                let d = dst.add(j * KC + kk * NR) as *mut __m512i;
                _mm512_store_si512(d, T::load16(src, mask16(nc - j)));
                _mm512_store_si512(d.add(1), T::load16(src.add(16), mask16((nc - j).saturating_sub(16))));
            }
        }
    }

    /// `MR` x 32 tile of f32 FMAs against the widened panel.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn fma_tile<Y: TileStore>(
        steps: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        first: bool,
        out: Option<Out<Y>>,
    ) {
        let mut acc = acc_init(c, first);
        for s in 0..steps {
            let bs = b.add(s * NR) as *const f32;
            let b0 = _mm512_load_ps(bs);
            let b1 = _mm512_load_ps(bs.add(16));
            let as_ = a.add(s * MR) as *const f32;
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*as_.add(r));
                acc_r[0] = _mm512_fmadd_ps(xv, b0, acc_r[0]);
                acc_r[1] = _mm512_fmadd_ps(xv, b1, acc_r[1]);
            }
        }
        match out {
            Some(o) => Y::store(&acc, o),
            None => acc_spill(&acc, c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn lcg(seed: u64, len: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// f64 reference: `(y, sum_k |x * w|)` per output element.
    fn reference<W: Copy + Into<f64>>(
        x: &[f32],
        w: &[W],
        m: usize,
        k: usize,
        n: usize,
    ) -> Vec<(f64, f64)> {
        let mut out = vec![(0f64, 0f64); m * n];
        for i in 0..m {
            for kk in 0..k {
                let xv = x[i * k + kk] as f64;
                for j in 0..n {
                    let t = xv * w[kk * n + j].into();
                    out[i * n + j].0 += t;
                    out[i * n + j].1 += t.abs();
                }
            }
        }
        out
    }

    const MS: [usize; 6] = [1, 2, 7, 8, 33, 256];
    const KS: [usize; 5] = [1, 3, 64, 1023, 1024];
    const NS: [usize; 5] = [1, 17, 32, 1000, 1024];
    const MS_NT: [usize; 7] = [1, 2, 7, 16, 17, 33, 256];
    const MS_SMALL: [usize; 5] = [1, 2, 7, 8, 16];
    const NS_NT: [usize; 4] = [1, 17, 32, 1000];

    fn shapes_of(
        ms: &'static [usize],
        ns: &'static [usize],
    ) -> impl Iterator<Item = (usize, usize, usize)> {
        ms.iter().flat_map(move |&m| {
            KS.iter()
                .flat_map(move |&k| ns.iter().map(move |&n| (m, k, n)))
                // Keep the f64 reference cheap: skip the largest combinations.
                .filter(|&(m, k, n)| m * k * n <= 64 * 1024 * 1024)
        })
    }

    fn shapes() -> impl Iterator<Item = (usize, usize, usize)> {
        shapes_of(&MS, &NS)
    }

    /// `w[rows, cols]` -> `w^T[cols, rows]`.
    fn transpose<T: Copy>(w: &[T], rows: usize, cols: usize) -> Vec<T> {
        (0..cols * rows)
            .map(|i| w[(i % rows) * cols + i / rows])
            .collect()
    }

    fn inputs(m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<bf16>) {
        let x = lcg((m * 31 + k * 7 + n) as u64, m * k);
        let w = lcg((m + k * 13 + n * 5) as u64 ^ 0xabcd, k * n)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        (x, w)
    }

    /// The error bound of f32 arithmetic on `k` products summed in any order: each product and
    /// each of the `k` additions rounds once, at most 2^-24 relative, so the result is off by at
    /// most `(k + 1) * 2^-24 * sum |x * w|` (whatever the order: blocked, paired, SIMD lanes).
    fn f32_sum_bound(k: usize, abs_sum: f64) -> f64 {
        (k + 1) as f64 * f64::powi(2.0, -24) * abs_sum + 1e-30
    }

    /// bf16 results: one bf16 rounding of the exact value (relative 2^-9, allow 2^-8) plus the
    /// f32 accumulation error.
    fn check_bf16(got: &[bf16], refv: &[(f64, f64)], what: &str, shape: (usize, usize, usize)) {
        assert_eq!(got.len(), refv.len());
        for (i, (g, &(r, s))) in got.iter().zip(refv).enumerate() {
            let tol = r.abs() / 256.0 + f32_sum_bound(shape.1, s);
            let d = (g.to_f64() - r).abs();
            assert!(
                d <= tol,
                "{what} {shape:?} at {i}: got {g} want {r} (diff {d}, tol {tol})"
            );
        }
    }

    /// f32 results: within the f32 accumulation bound of the exact value.
    fn check_f32(got: &[f32], refv: &[(f64, f64)], what: &str, shape: (usize, usize, usize)) {
        assert_eq!(got.len(), refv.len());
        for (i, (&g, &(r, s))) in got.iter().zip(refv).enumerate() {
            let tol = f32_sum_bound(shape.1, s);
            let d = (g as f64 - r).abs();
            assert!(
                d <= tol,
                "{what} {shape:?} at {i}: got {g} want {r} (diff {d}, tol {tol})"
            );
        }
    }

    #[test]
    fn bf16_matches_reference() {
        for (m, k, n) in shapes() {
            let (x, w) = inputs(m, k, n);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let refv = reference(&xr, &w, m, k, n);
            check_bf16(&matmul_bf16(Kernels::default(), &xb, &w, WeightLayout::InOut, m, k, n), &refv, "fast", (m, k, n));
            check_bf16(
                &matmul_bf16_portable(&xb, &w, WeightLayout::InOut, m, k, n),
                &refv,
                "portable",
                (m, k, n),
            );
        }
    }

    #[test]
    fn bf16_with_f32_result_matches_reference() {
        for (m, k, n) in shapes_of(&MS_NT, &NS) {
            let (x, w) = inputs(m, k, n);
            let e = transpose(&w, k, n);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let refv = reference(&xr, &w, m, k, n);
            check_f32(&matmul_bf16_f32(Kernels::default(), &xb, &w, WeightLayout::InOut, m, k, n), &refv, "in-out", (m, k, n));
            check_f32(&matmul_bf16_f32(Kernels::default(), &xb, &e, WeightLayout::OutIn, m, k, n), &refv, "out-in", (m, k, n));
        }
    }

    /// Rounding the weights while packing gives the same bits as rounding them first.
    /// Both packed bf16 kernels (`vdpbf16ps` on pairs and widened FMA), whichever this CPU
    /// picks, against the reference, in both layouts, with bf16 and f32 results; f32 weights
    /// rounded as they are packed give what the pre-rounded ones give.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_packed_kernels_match_reference() {
        if !has_fast_path(Kernels::default()) {
            eprintln!("skipped: this CPU has no AVX-512 BF16, only the portable path runs");
            return;
        }
        for (m, k, n) in shapes_of(&[17, 33, 256], &NS) {
            let xb: Vec<bf16> = lcg((m * 31 + k * 7 + n) as u64, m * k).into_iter().map(bf16::from_f32).collect();
            let wf = lcg((m + k * 13 + n * 5) as u64 ^ 0x5678, k * n);
            let w: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
            let (e, ef) = (transpose(&w, k, n), transpose(&wf, k, n));
            let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let refv = reference(&xr, &w, m, k, n);
            for pairs in [true, false] {
                let what = if pairs { "pairs" } else { "widened" };
                for (layout, w, wf) in [(WeightLayout::InOut, &w, &wf), (WeightLayout::OutIn, &e, &ef)] {
                    // SAFETY: `has_fast_path` checked the CPU features.
                    let (yb, yf, yr) = unsafe {
                        (
                            avx512::matmul_bf16(&xb, w, layout, m, k, n, pairs),
                            avx512::matmul_bf16_f32(&xb, w, layout, m, k, n, pairs),
                            avx512::matmul_rounded(&xb, wf, layout, m, k, n, pairs),
                        )
                    };
                    check_bf16(&yb, &refv, &format!("{what} {layout:?}"), (m, k, n));
                    check_f32(&yf, &refv, &format!("{what} {layout:?} f32"), (m, k, n));
                    assert_eq!(yr, yf, "{what} {layout:?} rounded {:?}", (m, k, n));
                }
            }
        }
    }


    /// The two packed bf16 kernels give the same bf16 results within two units in the last
    /// place, at the shapes of the tiny model's training runs (24 decoding episodes, prefill of
    /// 300 and 1032 rows; hidden 64, head 32, MLP 128, vocabulary 512), in both layouts. Over
    /// every product of a whole bf16-base LoRA run they differ by at most one unit in the last
    /// place (BENCHMARKS.md, "the bf16-base LoRA test on Intel Xeons").
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_two_packed_kernels_agree_to_one_rounding() {
        if !has_fast_path(Kernels::default()) {
            eprintln!("skipped: this CPU has no AVX-512 BF16, only the portable path runs");
            return;
        }
        for (m, k, n) in [(24, 64, 32), (24, 64, 128), (24, 128, 64), (300, 64, 64), (300, 64, 512), (1032, 128, 64)] {
            let x: Vec<bf16> = lcg((m * 7 + k) as u64, m * k).into_iter().map(|v| bf16::from_f32(3.0 * v)).collect();
            let w: Vec<bf16> = lcg((k * 5 + n) as u64, k * n).into_iter().map(|v| bf16::from_f32(0.1 * v)).collect();
            for (layout, w) in [(WeightLayout::InOut, w.clone()), (WeightLayout::OutIn, transpose(&w, k, n))] {
                // SAFETY: `has_fast_path` checked the CPU features.
                let (pairs, widened) = unsafe {
                    (
                        avx512::matmul_bf16(&x, &w, layout, m, k, n, true),
                        avx512::matmul_bf16(&x, &w, layout, m, k, n, false),
                    )
                };
                let largest = pairs.iter().map(|v| v.to_f32().abs()).fold(0.0f32, f32::max);
                for (i, (a, b)) in pairs.iter().zip(&widened).enumerate() {
                    let (a, b) = (a.to_f32(), b.to_f32());
                    let rounding = a.abs().max(b.abs()) / 64.0 + largest * 1e-6;
                    assert!((a - b).abs() <= rounding, "{layout:?} {:?} at {i}: pairs {a}, widened {b}", (m, k, n));
                }
            }
        }
    }

    #[test]
    fn rounded_weights_equal_prerounded_ones() {
        for (m, k, n) in shapes_of(&MS_NT, &NS) {
            let x: Vec<bf16> = lcg((m * 31 + k * 7 + n) as u64, m * k).into_iter().map(bf16::from_f32).collect();
            let w = lcg((m + k * 13 + n * 5) as u64 ^ 0x5678, k * n);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            for (layout, w, wb) in [
                (WeightLayout::InOut, w.clone(), wb.clone()),
                (WeightLayout::OutIn, transpose(&w, k, n), transpose(&wb, k, n)),
            ] {
                let want = matmul_bf16_f32(Kernels::default(), &x, &wb, layout, m, k, n);
                assert_eq!(matmul_rounded(Kernels::default(), &x, &w, layout, m, k, n), want, "{layout:?} {:?}", (m, k, n));
            }
        }
    }

    #[test]
    fn f32_matches_reference() {
        for (m, k, n) in shapes() {
            let (x, w) = inputs(m, k, n);
            let refv = reference(&x, &w, m, k, n);
            check_f32(&matmul_f32_bf16(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n), &refv, "fast", (m, k, n));
            check_f32(
                &matmul_f32_bf16_portable(&x, &w, WeightLayout::InOut, m, k, n),
                &refv,
                "portable",
                (m, k, n),
            );
        }
    }

    #[test]
    fn bf16_nt_matches_reference() {
        for (m, k, n) in shapes_of(&MS_NT, &NS_NT) {
            let (x, w) = inputs(m, k, n);
            let e = transpose(&w, k, n);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let refv = reference(&xr, &w, m, k, n);
            check_bf16(
                &matmul_bf16(Kernels::default(), &xb, &e, WeightLayout::OutIn, m, k, n),
                &refv,
                "fast nt",
                (m, k, n),
            );
            check_bf16(
                &matmul_bf16_portable(&xb, &e, WeightLayout::OutIn, m, k, n),
                &refv,
                "portable nt",
                (m, k, n),
            );
        }
    }

    #[test]
    fn f32_nt_matches_reference() {
        for (m, k, n) in shapes_of(&MS_NT, &NS_NT) {
            let (x, w) = inputs(m, k, n);
            let e = transpose(&w, k, n);
            let refv = reference(&x, &w, m, k, n);
            check_f32(
                &matmul_f32_bf16(Kernels::default(), &x, &e, WeightLayout::OutIn, m, k, n),
                &refv,
                "fast nt",
                (m, k, n),
            );
            check_f32(
                &matmul_f32_bf16_portable(&x, &e, WeightLayout::OutIn, m, k, n),
                &refv,
                "portable nt",
                (m, k, n),
            );
        }
    }

    #[test]
    fn f32_small_matches_reference() {
        for (m, k, n) in shapes_of(&MS_SMALL, &NS) {
            let x = lcg((m * 31 + k * 7 + n) as u64, m * k);
            let w = lcg((m + k * 13 + n * 5) as u64 ^ 0x1234, k * n);
            let e = transpose(&w, k, n);
            let refv = reference(&x, &w, m, k, n);
            for (what, got) in [
                ("fast", matmul_f32_small(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n)),
                ("portable", matmul_f32_small_portable(&x, &w, WeightLayout::InOut, m, k, n)),
                ("fast nt", matmul_f32_small(Kernels::default(), &x, &e, WeightLayout::OutIn, m, k, n)),
                ("portable nt", matmul_f32_small_portable(&x, &e, WeightLayout::OutIn, m, k, n)),
            ] {
                check_f32(&got.expect("m <= SMALL_M"), &refv, what, (m, k, n));
            }
        }
    }

    #[test]
    fn f32_small_rejects_large_m() {
        let (m, k, n) = (SMALL_M + 1, 8, 8);
        let (x, w) = (vec![0f32; m * k], vec![0f32; k * n]);
        assert!(matmul_f32_small(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n).is_none());
        assert!(matmul_f32_small_portable(&x, &w, WeightLayout::InOut, m, k, n).is_none());
        assert!(matmul_f32_small(Kernels::default(), &x, &w, WeightLayout::OutIn, m, k, n).is_none());
        assert!(matmul_f32_small_portable(&x, &w, WeightLayout::OutIn, m, k, n).is_none());
    }

    #[test]
    fn nt_matches_nn_on_transpose() {
        for m in MS_NT {
            for (k, n) in [(1, 1), (3, 17), (64, 32), (1023, 100), (1024, 1000)] {
                // Small integers sum exactly in f32: every path agrees bit for bit.
                let x: Vec<bf16> = (0..m * k)
                    .map(|i| bf16::from_f32((i % 7) as f32 - 3.0))
                    .collect();
                let e: Vec<bf16> = (0..n * k)
                    .map(|i| bf16::from_f32((i % 5) as f32 - 2.0))
                    .collect();
                let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                let w = transpose(&e, n, k);
                assert_eq!(
                    matmul_bf16(Kernels::default(), &x, &e, WeightLayout::OutIn, m, k, n),
                    matmul_bf16(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n)
                );
                assert_eq!(
                    matmul_f32_bf16(Kernels::default(), &xf, &e, WeightLayout::OutIn, m, k, n),
                    matmul_f32_bf16(Kernels::default(), &xf, &w, WeightLayout::InOut, m, k, n)
                );
                // Arbitrary values: both layouts within the f32 bound of the exact product. The
                // portable loops sum the two layouts in different orders; the AVX-512 packed
                // path feeds the same panels to the same microkernel in both, so there they
                // agree bit for bit.
                if m > 16 {
                    let (xf, w) = inputs(m, k, n);
                    let x: Vec<bf16> = xf.iter().map(|&v| bf16::from_f32(v)).collect();
                    let e = transpose(&w, k, n);
                    let xr: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                    let (refb, reff) = (reference(&xr, &w, m, k, n), reference(&xf, &w, m, k, n));
                    let (nt, nn) = (
                        matmul_bf16(Kernels::default(), &x, &e, WeightLayout::OutIn, m, k, n),
                        matmul_bf16(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n),
                    );
                    let (nt_f, nn_f) = (
                        matmul_f32_bf16(Kernels::default(), &xf, &e, WeightLayout::OutIn, m, k, n),
                        matmul_f32_bf16(Kernels::default(), &xf, &w, WeightLayout::InOut, m, k, n),
                    );
                    check_bf16(&nt, &refb, "bf16 out-in", (m, k, n));
                    check_bf16(&nn, &refb, "bf16 in-out", (m, k, n));
                    check_f32(&nt_f, &reff, "f32 out-in", (m, k, n));
                    check_f32(&nn_f, &reff, "f32 in-out", (m, k, n));
                    if has_fast_path(Kernels::default()) {
                        assert_eq!(nt, nn, "packed bf16 {:?}", (m, k, n));
                        assert_eq!(nt_f, nn_f, "packed f32 {:?}", (m, k, n));
                    }
                }
            }
        }
    }

    #[test]
    fn all_sizes_near_thresholds() {
        for m in 1..=20 {
            for (k, n) in [(1, 1), (2, 31), (5, 33), (17, 65), (40, 95)] {
                let (x, w) = inputs(m, k, n);
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
                let (refb, reff) = (reference(&xr, &w, m, k, n), reference(&x, &w, m, k, n));
                let e = transpose(&w, k, n);
                check_bf16(&matmul_bf16(Kernels::default(), &xb, &w, WeightLayout::InOut, m, k, n), &refb, "fast", (m, k, n));
                check_bf16(
                    &matmul_bf16(Kernels::default(), &xb, &e, WeightLayout::OutIn, m, k, n),
                    &refb,
                    "fast nt",
                    (m, k, n),
                );
                check_f32(&matmul_f32_bf16(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n), &reff, "fast", (m, k, n));
                check_f32(
                    &matmul_f32_bf16(Kernels::default(), &x, &e, WeightLayout::OutIn, m, k, n),
                    &reff,
                    "fast nt",
                    (m, k, n),
                );
                let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
                let ef = transpose(&wf, k, n);
                let small = matmul_f32_small(Kernels::default(), &x, &wf, WeightLayout::InOut, m, k, n);
                let small_nt = matmul_f32_small(Kernels::default(), &x, &ef, WeightLayout::OutIn, m, k, n);
                if m <= SMALL_M {
                    check_f32(&small.unwrap(), &reff, "small", (m, k, n));
                    check_f32(&small_nt.unwrap(), &reff, "small nt", (m, k, n));
                } else {
                    assert!(small.is_none() && small_nt.is_none());
                }
            }
        }
    }

    #[test]
    fn one_row_does_not_depend_on_the_thread_count() {
        // The one-row kernel splits the reduction into bands; their sums must be added in the
        // same order whatever the pool's size (and whether bands are split by columns).
        for (k, n) in [(1, 5), (64, 1000), (1023, 1000), (3000, 40)] {
            let (x, w) = inputs(1, k, n);
            let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let refv = reference(&x, &w, 1, k, n);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    (
                        matmul_f32_bf16(Kernels::default(), &x, &w, WeightLayout::InOut, 1, k, n),
                        matmul_f32_small(Kernels::default(), &x, &wf, WeightLayout::InOut, 1, k, n).unwrap(),
                    )
                })
            };
            let one = run(1);
            check_f32(&one.0, &refv, "bf16 weights", (1, k, n));
            check_f32(&one.1, &refv, "f32 weights", (1, k, n));
            for threads in [2, 3, 8] {
                assert_eq!(run(threads), one, "{threads} threads, k {k}, n {n}");
            }
        }
    }

    #[test]
    fn exact_small_integers() {
        // Small integer products sum exactly in f32, so every path must agree bit for bit.
        let (m, k, n) = (37, 129, 70);
        let x: Vec<bf16> = (0..m * k)
            .map(|i| bf16::from_f32((i % 7) as f32 - 3.0))
            .collect();
        let w: Vec<bf16> = (0..k * n)
            .map(|i| bf16::from_f32((i % 5) as f32 - 2.0))
            .collect();
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = reference(&xf, &w, m, k, n)
            .iter()
            .map(|r| r.0 as f32)
            .collect();
        let want_b: Vec<bf16> = want.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(matmul_bf16(Kernels::default(), &x, &w, WeightLayout::InOut, m, k, n), want_b);
        assert_eq!(matmul_bf16_portable(&x, &w, WeightLayout::InOut, m, k, n), want_b);
        assert_eq!(matmul_f32_bf16(Kernels::default(), &xf, &w, WeightLayout::InOut, m, k, n), want);
        assert_eq!(matmul_f32_bf16(Kernels::default(), &xf[..3 * k], &w, WeightLayout::InOut, 3, k, n), want[..3 * n]);
    }
}

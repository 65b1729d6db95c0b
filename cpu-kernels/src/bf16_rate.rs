//! How fast this CPU multiplies in bf16 against f32: whether `MatmulPrecision::Bf16` pays.
//!
//! AVX-512 BF16's `vdpbf16ps` does 32 multiply-adds, an f32 FMA 16, but how often each issues
//! depends on the microarchitecture. On an AMD Zen 4 host bf16 products
//! ran at twice the f32 GEMM's rate; on an Intel Xeon (family 6, model 207) a `vdpbf16ps`
//! issues every other cycle and an FMA twice a cycle, so bf16 multiply-adds come at half the
//! f32 rate. Nothing in CPUID says which, so [`bf16_mac_ratio`] times both instructions on
//! independent register chains (about a millisecond each, no memory traffic). The packed
//! bf16 products use it to choose between `vdpbf16ps` and f32 FMAs on widened operands.

/// Multiply-adds per second of `vdpbf16ps` over those of an f32 FMA on this core, from the
/// faster of three timings each, measured once per process (so the kernels and whoever reports
/// on them see the same figure); `None` where the AVX-512 BF16 kernels do not run (the CPU
/// lacks them, or the level is capped below them, see [`mod@crate::isa`]).
pub fn bf16_mac_ratio() -> Option<f64> {
    static RATIO: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    if !crate::isa::avx512_bf16() {
        return None;
    }
    *RATIO.get_or_init(measure)
}

fn measure() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::host() >= crate::Isa::Avx512Bf16 {
        let best = |run: &dyn Fn() -> f32| {
            (0..3)
                .map(|_| {
                    let start = std::time::Instant::now();
                    std::hint::black_box(run());
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        // SAFETY: the host has AVX-512 F and BF16.
        let fma = best(&|| unsafe { avx512::fma_chains(ROUNDS) });
        let dot = best(&|| unsafe { avx512::dot_chains(ROUNDS) });
        // A dot product does twice the multiply-adds of an FMA.
        return Some(2.0 * fma / dot);
    }
    None
}

/// Rounds of 16 instructions per timing (a millisecond or less).
const ROUNDS: usize = 100_000;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use core::arch::x86_64::*;
    use std::hint::black_box;

    /// 16 independent chains of FMAs, `rounds` deep.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn fma_chains(rounds: usize) -> f32 {
        let (b, c) = (_mm512_set1_ps(black_box(0.999)), _mm512_set1_ps(black_box(1e-3)));
        let mut acc: [__m512; 16] = core::array::from_fn(|i| _mm512_set1_ps(black_box(i as f32)));
        for _ in 0..black_box(rounds) {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, b, c);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    /// 16 independent chains of `vdpbf16ps`, `rounds` deep.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot_chains(rounds: usize) -> f32 {
        let pair = |bits: i32| -> __m512bh { core::mem::transmute(_mm512_set1_epi32(black_box(bits))) };
        let (b, c) = (pair(0x3f80_3f80), pair(0x3a83_3a83));
        let mut acc: [__m512; 16] = core::array::from_fn(|i| _mm512_set1_ps(black_box(i as f32)));
        for _ in 0..black_box(rounds) {
            for a in acc.iter_mut() {
                *a = _mm512_dpbf16_ps(*a, b, c);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two hosts measured so far give 0.5 and about 2; anything far outside means the
    /// timing is broken (e.g. the compiler folded a chain away).
    #[test]
    fn ratio_is_a_plausible_rate() {
        match bf16_mac_ratio() {
            Some(ratio) => assert!((0.3..=4.0).contains(&ratio), "bf16 / f32 multiply-add ratio {ratio}"),
            None => assert!(!crate::has_bf16_kernels()),
        }
    }
}

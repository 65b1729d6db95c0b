//! bf16 ⇄ f32 conversions written without branches, so that loops using them vectorise. They
//! give the same bits as `half::bf16::{to_f32, from_f32}` (round to nearest, ties to even; NaN
//! stays NaN with its quiet bit set), except that widening keeps a signalling NaN's bits as they
//! are where `half` sets its quiet bit.

use half::bf16;

/// `x` as f32 (exact).
#[inline(always)]
pub fn widen(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// `x` rounded to bf16.
#[inline(always)]
pub fn narrow(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) | 0x40) as u16;
    bf16::from_bits(if x.is_nan() { quiet_nan } else { rounded })
}

/// `x` rounded to bf16 precision, as f32.
#[inline(always)]
pub fn round(x: f32) -> f32 {
    widen(narrow(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bits_as_half() {
        let special = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_8000),
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let random = (0..2_000_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f32::from_bits((state >> 32) as u32)
        });
        for x in special.into_iter().chain(random) {
            assert_eq!(narrow(x).to_bits(), bf16::from_f32(x).to_bits(), "{x:e} ({:#x})", x.to_bits());
            let h = bf16::from_bits(x.to_bits() as u16);
            if !h.is_nan() {
                assert_eq!(widen(h).to_bits(), h.to_f32().to_bits());
            }
        }
    }
}

//! Seeded permutations that stay the same across platforms and crate versions.
//!
//! SplitMix64 (Steele, Lea & Flood 2014) drives a Fisher–Yates shuffle; the bounded draw is
//! the widening multiply `(x · n) >> 64`, whose bias (below n / 2⁶⁴) is negligible here.

/// The SplitMix64 generator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A draw in `0..bound` (`bound > 0`).
    fn below(&mut self, bound: usize) -> usize {
        ((u128::from(self.next()) * bound as u128) >> 64) as usize
    }
}

/// The permutation of `0..len` for `epoch` of a run seeded with `seed`.
pub(crate) fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut seeder = SplitMix64(seed);
    let mut rng = SplitMix64(seeder.next() ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = rng.below(i + 1);
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_published_sequence() {
        // First outputs of SplitMix64 seeded with 0 (reference implementation by Vigna).
        let mut rng = SplitMix64(0);
        assert_eq!(rng.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn is_a_permutation_and_depends_on_seed_and_epoch() {
        let p = permutation(100, 7, 0);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(p, permutation(100, 7, 0));
        assert_ne!(p, permutation(100, 7, 1));
        assert_ne!(p, permutation(100, 8, 0));
        assert_ne!(p, (0..100).collect::<Vec<_>>());
        assert!(permutation(0, 1, 0).is_empty());
        assert_eq!(permutation(1, 1, 0), vec![0]);
    }
}

//! The instruction-set levels of the kernels' code paths: the host's best, and the cap that
//! `PROMPT_R1_CPU_ISA` names. Which level a model runs at is part of its [`crate::Kernels`].
//!
//! The kernels have code for three tiers: plain Rust loops compiled for the target's baseline
//! (x86-64: SSE2) and auto-vectorised; the same loops compiled with AVX-512 F/BW/VL, plus
//! AVX-512 attention tiles; and hand-written AVX-512 BF16 matrix products. Capping the level
//! makes a host run the paths a lesser host runs, so that one machine can test them all.
//! burn-flex's own f32 GEMM (the `gemm` crate) picks its instructions by itself and is not
//! capped: results may differ from a real lesser host's in the last bits of f32 sums, never more.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// The environment variable that caps the instruction-set level (see [`Isa`]).
pub const ISA_ENV: &str = "PROMPT_R1_CPU_ISA";

/// The environment variable that switches the kernels off (`1`, or `true`, `yes`, `on`; `0`,
/// `false`, `no` or `off` leave them on), see [`crate::Kernels::off`].
pub const PORTABLE_OPS_ENV: &str = "PROMPT_R1_PORTABLE_OPS";

/// An instruction-set level of the kernels' code paths, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// The plain loops, compiled for the target's baseline: what any CPU runs.
    Portable,
    /// An x86-64 CPU with AVX2 and FMA but no AVX-512 (e.g. AMD Zen 2/3). The kernels have no
    /// AVX2-specific code, so they run the portable loops here; the level names the host class
    /// that a capped run stands in for.
    Avx2,
    /// AVX-512 F, BW and VL (e.g. Intel Ice Lake): element-wise loops 16 lanes wide and
    /// AVX-512 attention tiles.
    Avx512,
    /// AVX-512 BF16 as well (AMD Zen 4, Intel Sapphire Rapids): the hand-written matrix
    /// products for bf16 weights, bf16-precision products and few-row f32 products.
    Avx512Bf16,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    /// The name used by `PROMPT_R1_CPU_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The highest level this CPU has.
    pub fn host() -> Isa {
        static HOST: OnceLock<Isa> = OnceLock::new();
        *HOST.get_or_init(detect)
    }

    /// The levels this CPU can run, lowest first.
    pub fn available() -> impl Iterator<Item = Isa> {
        Isa::ALL.into_iter().filter(|&level| level <= Isa::host())
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A `PROMPT_R1_CPU_ISA` value that names no level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownIsa(pub String);

impl fmt::Display for UnknownIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Isa::ALL.iter().map(|l| l.name()).collect();
        write!(f, "unknown instruction-set level '{}' (expected one of: {})", self.0, names.join(", "))
    }
}

impl std::error::Error for UnknownIsa {}

impl FromStr for Isa {
    type Err = UnknownIsa;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase();
        Isa::ALL
            .into_iter()
            .find(|level| level.name() == wanted)
            .ok_or_else(|| UnknownIsa(s.to_string()))
    }
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl");
        if avx512 && is_x86_feature_detected!("avx512bf16") {
            return Isa::Avx512Bf16;
        }
        if avx512 {
            return Isa::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// The cap from `PROMPT_R1_CPU_ISA`: `Ok(None)` when unset or empty.
pub fn isa_cap_from_env() -> Result<Option<Isa>, UnknownIsa> {
    crate::kernels::setting(&crate::kernels::environment, ISA_ENV)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_errors() {
        for level in Isa::ALL {
            assert_eq!(level.name().parse::<Isa>(), Ok(level));
            assert_eq!(level.name().to_uppercase().parse::<Isa>(), Ok(level));
        }
        let err = "avx1024".parse::<Isa>().unwrap_err().to_string();
        assert!(err.contains("avx1024") && err.contains("portable, avx2, avx512, avx512bf16"), "{err}");
    }

    /// A typo in `PROMPT_R1_CPU_ISA` (as CI sets it) must fail a test rather than let the
    /// kernels silently run at the host's level.
    #[test]
    fn the_environment_cap_parses() {
        match isa_cap_from_env() {
            Ok(cap) => println!("{ISA_ENV}: {cap:?}; host {}", Isa::host()),
            Err(e) => panic!("{ISA_ENV}: {e}"),
        }
    }

    #[test]
    fn levels_are_ordered_and_available_ones_end_at_the_host() {
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Avx512Bf16);
        let available: Vec<Isa> = Isa::available().collect();
        assert_eq!(available.first(), Some(&Isa::Portable));
        assert_eq!(available.last(), Some(&Isa::host()));
    }
}

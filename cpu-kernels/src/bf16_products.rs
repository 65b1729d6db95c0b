//! Which kernel the packed bf16 products run: `vdpbf16ps` on k-pairs, or f32 FMAs on operands
//! widened to f32. Both compute the same exact products and differ only in the order of the f32
//! sums; which is faster depends on the core. On AMD Zen 4 a `vdpbf16ps` issues as often as an
//! f32 FMA and does twice its multiply-adds; on Intel Xeons (Sapphire and Emerald Rapids) it
//! issues every other cycle while FMAs issue twice a cycle, so widening is twice as fast there.
//!
//! The choice is a rule on the CPU's vendor ([`Bf16Products::for_host`]: AMD pairs, every other
//! vendor widens), overridden by `PROMPT_R1_BF16_PRODUCTS=pairs|widened` or chosen in a model's
//! [`crate::Kernels`], so that a host always runs the same kernel and tests can force either
//! one. It is never timed: a timing taken on a
//! shared machine would let the numerics of a run depend on the load of the moment.

use std::fmt;
use std::str::FromStr;

/// The environment variable that forces one of the packed bf16 kernels (see [`Bf16Products`]).
pub const BF16_PRODUCTS_ENV: &str = "PROMPT_R1_BF16_PRODUCTS";

/// How the packed (many-row) bf16 products multiply, where the AVX-512 BF16 kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bf16Products {
    /// `vdpbf16ps` on pairs of bf16 elements: the faster kernel on AMD Zen 4 and 5.
    Pairs,
    /// Both operands widened to f32 (exactly) and multiplied with f32 FMAs: the faster kernel
    /// on Intel Xeons, which issue `vdpbf16ps` at half the rate of FMAs.
    Widened,
}

impl Bf16Products {
    /// Both kernels.
    pub const ALL: [Bf16Products; 2] = [Bf16Products::Pairs, Bf16Products::Widened];

    /// The name used by `PROMPT_R1_BF16_PRODUCTS`.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Pairs => "pairs",
            Bf16Products::Widened => "widened",
        }
    }

    /// The rule: pairs on AMD CPUs, widened on every other (`.ci/run` forces the other kernel
    /// by the same rule).
    pub fn for_host() -> Bf16Products {
        if cpu_vendor() == "AuthenticAMD" {
            Bf16Products::Pairs
        } else {
            Bf16Products::Widened
        }
    }
}

impl fmt::Display for Bf16Products {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A `PROMPT_R1_BF16_PRODUCTS` value that names no kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownBf16Products(pub String);

impl fmt::Display for UnknownBf16Products {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown bf16 product kernel '{}' (expected pairs or widened)", self.0)
    }
}

impl std::error::Error for UnknownBf16Products {}

impl FromStr for Bf16Products {
    type Err = UnknownBf16Products;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase();
        Bf16Products::ALL
            .into_iter()
            .find(|p| p.name() == wanted)
            .ok_or_else(|| UnknownBf16Products(s.to_string()))
    }
}

/// The kernel forced by `PROMPT_R1_BF16_PRODUCTS`: `Ok(None)` when unset or empty.
pub fn bf16_products_from_env() -> Result<Option<Bf16Products>, UnknownBf16Products> {
    crate::kernels::setting(&crate::kernels::environment, BF16_PRODUCTS_ENV)
}

/// The CPU's vendor string from CPUID (`AuthenticAMD`, `GenuineIntel`, ...); empty off x86_64.
pub fn cpu_vendor() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86_64 CPU.
        #[allow(unused_unsafe)]
        let id = unsafe { core::arch::x86_64::__cpuid(0) };
        let bytes: Vec<u8> = [id.ebx, id.edx, id.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    #[cfg(not(target_arch = "x86_64"))]
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_errors() {
        for p in Bf16Products::ALL {
            assert_eq!(p.name().parse::<Bf16Products>(), Ok(p));
            assert_eq!(p.name().to_uppercase().parse::<Bf16Products>(), Ok(p));
        }
        let err = "fast".parse::<Bf16Products>().unwrap_err().to_string();
        assert!(err.contains("'fast'") && err.contains("pairs or widened"), "{err}");
    }

    /// A typo in `PROMPT_R1_BF16_PRODUCTS` (as CI sets it) must fail a test rather than let the
    /// products silently run the host's default.
    #[test]
    fn the_environment_choice_parses_and_the_rule_is_stable() {
        match bf16_products_from_env() {
            Ok(forced) => println!(
                "{BF16_PRODUCTS_ENV}: {forced:?}; vendor {:?}; rule {}",
                cpu_vendor(),
                Bf16Products::for_host()
            ),
            Err(e) => panic!("{BF16_PRODUCTS_ENV}: {e}"),
        }
        assert_eq!(Bf16Products::for_host(), Bf16Products::for_host());
        #[cfg(target_arch = "x86_64")]
        assert_eq!(cpu_vendor().len(), 12);
    }
}

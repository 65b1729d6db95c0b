//! Which CPU kernels run: one value, chosen when a model is loaded and handed to every kernel
//! entry point (and kept by the autodiff nodes for their backward), never a process-wide switch.

use std::fmt;
use std::sync::OnceLock;

use burn::tensor::backend::Backend;

use crate::bf16_products::{Bf16Products, UnknownBf16Products, BF16_PRODUCTS_ENV};
use crate::isa::{Isa, UnknownIsa, ISA_ENV, PORTABLE_OPS_ENV};

/// The CPU kernels a computation uses on burn-flex: none (every op through burn's portable tensor
/// ops, the path the GPU backends take), or the kernels at an instruction-set level no higher
/// than the host's, with a packed bf16 product kernel. Other backends never run a CPU kernel,
/// whatever this says.
///
/// The level is capped at the host's by every constructor, so a value never asks for
/// instructions this CPU lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kernels {
    level: Option<Isa>,
    bf16_products: Bf16Products,
}

impl Kernels {
    /// The kernels at this CPU's best level, with the bf16 product kernel its vendor's rule picks.
    pub fn host() -> Kernels {
        Kernels { level: Some(Isa::host()), bf16_products: Bf16Products::for_host() }
    }

    /// No kernel: burn's portable tensor ops everywhere, so that the CPU runs (and tests, and
    /// benchmarks) the code path of the GPU backends.
    pub fn off() -> Kernels {
        Kernels { level: None, ..Kernels::host() }
    }

    /// The kernels at `level`, or at the host's where `level` is higher.
    pub fn at(level: Isa) -> Kernels {
        Kernels::host().capped(level)
    }

    /// The same kernels, on, at `level` or at the host's where `level` is higher; the product
    /// kernel stays.
    pub fn capped(self, level: Isa) -> Kernels {
        Kernels { level: Some(level.min(Isa::host())), ..self }
    }

    /// The same with the packed bf16 products multiplying as `products` says.
    pub fn with_bf16_products(self, products: Bf16Products) -> Kernels {
        Kernels { bf16_products: products, ..self }
    }

    /// The choice the environment makes: `PROMPT_R1_PORTABLE_OPS=1` switches the kernels off,
    /// `PROMPT_R1_CPU_ISA` caps their level, `PROMPT_R1_BF16_PRODUCTS` picks the product kernel;
    /// [`Kernels::host`] where none is set. The first variable that names nothing is the error.
    pub fn from_env() -> Result<Kernels, KernelsEnvError> {
        Kernels::first_error(true)
    }

    /// The kernels at the environment's cap with its product kernel, on whatever
    /// `PROMPT_R1_PORTABLE_OPS` says: for a reference that must run them.
    pub fn from_env_on() -> Result<Kernels, KernelsEnvError> {
        Kernels::first_error(false)
    }

    fn first_error(honour_portable_ops: bool) -> Result<Kernels, KernelsEnvError> {
        let mut error = None;
        let kernels = Kernels::read_env(&environment, honour_portable_ops, |e| {
            error.get_or_insert(e);
        });
        error.map_or(Ok(kernels), Err)
    }

    /// The choice the variables make as `lookup` reads them, each variable that names nothing
    /// handed to `bad` and left at the host's choice.
    fn read_env(lookup: &dyn Fn(&str) -> Option<String>, honour_portable_ops: bool, mut bad: impl FnMut(KernelsEnvError)) -> Kernels {
        let products = setting_or_reported::<Bf16Products>(lookup, BF16_PRODUCTS_ENV, &mut bad);
        let cap = setting_or_reported::<Isa>(lookup, ISA_ENV, &mut bad);
        let portable_ops = setting_or_reported::<PortableOps>(lookup, PORTABLE_OPS_ENV, &mut bad);
        let off = honour_portable_ops && portable_ops.is_some_and(|PortableOps(on)| on);
        let kernels = Kernels::host().with_bf16_products(products.unwrap_or_else(Bf16Products::for_host));
        match (off, cap) {
            (true, _) => Kernels { level: None, ..kernels },
            (false, Some(cap)) => kernels.capped(cap),
            (false, None) => kernels,
        }
    }

    /// The instruction-set level the kernels run at; `None` when they are off.
    pub fn level(self) -> Option<Isa> {
        self.level
    }

    /// Whether any kernel runs.
    pub fn is_on(self) -> bool {
        self.level.is_some()
    }

    /// How the packed bf16 products multiply where the AVX-512 BF16 kernels run.
    pub fn bf16_products(self) -> Bf16Products {
        self.bf16_products
    }

    /// Whether a kernel stands in on backend `B`: burn-flex (plain or under autodiff) with the
    /// kernels on.
    pub fn run_on<B: Backend>(self) -> bool {
        self.is_on() && crate::is_flex_backend::<B>()
    }

    /// Whether the element-wise loops and attention run their AVX-512 variants.
    pub(crate) fn avx512(self) -> bool {
        self.level >= Some(Isa::Avx512)
    }

    /// Whether the hand-written AVX-512 BF16 matrix products run.
    pub(crate) fn avx512_bf16(self) -> bool {
        self.level >= Some(Isa::Avx512Bf16)
    }

    /// Whether those products multiply k-pairs with `vdpbf16ps` rather than widen both operands.
    pub(crate) fn pairs(self) -> bool {
        self.bf16_products == Bf16Products::Pairs
    }
}

/// [`Kernels::from_env`], read once per process; a variable there that names nothing is reported
/// once on stderr and left at the host's choice, the others kept (the `prompt-r1` binary refuses
/// it before any model is loaded).
impl Default for Kernels {
    fn default() -> Kernels {
        static FROM_ENV: OnceLock<Kernels> = OnceLock::new();
        *FROM_ENV.get_or_init(|| Kernels::read_env(&environment, true, |e| eprintln!("warning: {e}; the host's choice stands for it")))
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.level {
            None => f.write_str("off (burn's portable ops)"),
            Some(level) => write!(f, "{level}"),
        }
    }
}

/// The process environment's value of variable `name` (none where unset or not UTF-8).
pub(crate) fn environment(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Variable `name` parsed, as `lookup` reads it; `None` where it is unset or blank.
pub(crate) fn setting<T: std::str::FromStr>(lookup: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<T>, T::Err> {
    match lookup(name) {
        Some(value) if !value.trim().is_empty() => value.parse().map(Some),
        _ => Ok(None),
    }
}

/// [`setting`], a value that names nothing handed to `bad` and read as unset.
fn setting_or_reported<T>(lookup: &dyn Fn(&str) -> Option<String>, name: &str, bad: &mut impl FnMut(KernelsEnvError)) -> Option<T>
where
    T: std::str::FromStr,
    KernelsEnvError: From<T::Err>,
{
    setting::<T>(lookup, name).unwrap_or_else(|e| {
        bad(e.into());
        None
    })
}

/// `PROMPT_R1_PORTABLE_OPS`: whether the kernels are off, in the words clap's boolish flags
/// take (`bench --portable-ops` reads the same variable), so that one value means the same to
/// every command.
struct PortableOps(bool);

impl std::str::FromStr for PortableOps {
    type Err = UnknownPortableOps;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "y" | "t" | "on" => Ok(PortableOps(true)),
            "0" | "false" | "no" | "n" | "f" | "off" => Ok(PortableOps(false)),
            _ => Err(UnknownPortableOps(text.to_owned())),
        }
    }
}

/// A `PROMPT_R1_PORTABLE_OPS` value that is neither on nor off.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("\"{0}\" is neither 1 (the kernels off) nor 0 (on); true/false, yes/no and on/off are taken too")]
pub struct UnknownPortableOps(String);

/// An environment variable that names no kernel choice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelsEnvError {
    #[error("{ISA_ENV}: {0}")]
    Isa(#[from] UnknownIsa),
    #[error("{BF16_PRODUCTS_ENV}: {0}")]
    Bf16Products(#[from] UnknownBf16Products),
    #[error("{PORTABLE_OPS_ENV}: {0}")]
    PortableOps(#[from] UnknownPortableOps),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_capped_at_the_host_and_off_runs_nothing() {
        for level in Isa::ALL {
            let kernels = Kernels::at(level);
            assert_eq!(kernels.level(), Some(level.min(Isa::host())));
            assert_eq!(kernels.avx512(), level.min(Isa::host()) >= Isa::Avx512);
            assert_eq!(kernels.avx512_bf16(), level.min(Isa::host()) >= Isa::Avx512Bf16);
        }
        let off = Kernels::off();
        assert!(!off.is_on() && !off.avx512() && !off.avx512_bf16());
        assert!(!off.run_on::<burn::backend::Flex>());
        assert!(Kernels::host().run_on::<burn::backend::Flex>());
        assert_eq!(Kernels::off().to_string(), "off (burn's portable ops)");
        let forced = Kernels::host().with_bf16_products(Bf16Products::Widened);
        assert_eq!((forced.bf16_products(), forced.level()), (Bf16Products::Widened, Some(Isa::host())));
    }

    /// Each call runs what its own value names, whatever other threads ask for at the same
    /// time (a process-wide switch could not give this): the kernel, or `None` for burn's ops.
    #[test]
    fn each_call_runs_the_kernels_it_is_handed() {
        use burn::backend::Flex;
        use burn::tensor::{Distribution, Tensor};
        let device = Default::default();
        let x = Tensor::<Flex, 2>::random([4, 64], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<Flex, 1>::random([64], Distribution::Normal(0.0, 1.0), &device);
        std::thread::scope(|scope| {
            for kernels in std::iter::once(Kernels::off()).chain(Isa::available().map(Kernels::at)) {
                let (x, w) = (x.clone(), w.clone());
                scope.spawn(move || {
                    for _ in 0..50 {
                        let fused = crate::ops::rms_norm(kernels, &x, &w, 1e-6);
                        assert_eq!(fused.is_some(), kernels.is_on(), "{kernels}");
                    }
                });
            }
        });
    }

    /// The variables as a map would hold them: a cap and a product kernel are kept, portable ops
    /// switch the kernels off (but not for [`Kernels::from_env_on`]'s reference), and a variable
    /// that names nothing is reported while the others stand.
    #[test]
    fn the_variables_choose_the_kernels_each_on_its_own() {
        let read = |vars: &[(&str, &str)], honour_portable_ops: bool| {
            let vars: std::collections::HashMap<String, String> = vars.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect();
            let mut errors = Vec::new();
            let kernels = Kernels::read_env(&|name| vars.get(name).cloned(), honour_portable_ops, |e| errors.push(e.to_string()));
            (kernels, errors)
        };
        let (kernels, errors) = read(&[], true);
        assert_eq!((kernels, errors.len()), (Kernels::host(), 0));
        let chosen = [(ISA_ENV, " Portable "), (BF16_PRODUCTS_ENV, "widened")];
        let (kernels, _) = read(&chosen, true);
        assert_eq!(kernels, Kernels::at(Isa::Portable).with_bf16_products(Bf16Products::Widened));
        let off = [chosen[0], chosen[1], (PORTABLE_OPS_ENV, "1")];
        let (kernels, _) = read(&off, true);
        assert!(!kernels.is_on() && kernels.bf16_products() == Bf16Products::Widened);
        let (reference, _) = read(&off, false);
        assert_eq!(reference, Kernels::at(Isa::Portable).with_bf16_products(Bf16Products::Widened), "the reference keeps the cap");
        let (kernels, errors) = read(&[(ISA_ENV, "avx9"), (BF16_PRODUCTS_ENV, "widened"), (PORTABLE_OPS_ENV, "1")], true);
        assert!(!kernels.is_on() && kernels.bf16_products() == Bf16Products::Widened, "the valid variables stand");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains(ISA_ENV) && errors[0].contains("avx9"), "{errors:?}");
        let (_, errors) = read(&[(BF16_PRODUCTS_ENV, "  ")], true);
        assert!(errors.is_empty(), "a blank variable is unset");
        for (value, on) in [("true", false), ("Yes", false), ("0", true), ("off", true)] {
            let (kernels, errors) = read(&[(PORTABLE_OPS_ENV, value)], true);
            assert_eq!((kernels.is_on(), errors.len()), (on, 0), "{PORTABLE_OPS_ENV}={value}");
        }
        let (kernels, errors) = read(&[(PORTABLE_OPS_ENV, "2")], true);
        assert!(kernels.is_on() && errors.len() == 1 && errors[0].contains(PORTABLE_OPS_ENV), "{errors:?}");
    }

    /// A typo in the variables CI sets must fail a test rather than let the kernels silently run
    /// the host's choice.
    #[test]
    fn the_environment_choice_parses() {
        match Kernels::from_env() {
            Ok(kernels) => println!("from the environment: {kernels}, bf16 products {}", kernels.bf16_products()),
            Err(e) => panic!("{e}"),
        }
    }
}

//! Kernels a GPU backend lends the model, found by the backend's type (as the autodiff
//! attention nodes are): the model stays generic over its backend and never names a GPU crate.
//! A binary registers what its backends offer ([`register_paged_attention`]; the
//! `prompt-r1-device-kernels` crate has one for CubeCL's backends, fused or not); where nothing
//! is registered, or a pass is not one a kernel takes, the model computes with burn's ops.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

/// One pass's attention over a paged KV cache, a decoding step's or a prefill chunk's: each
/// row's queries attend to the slots its read table names, with no gather of
/// `[rows, kv_heads, width, head_dim]`. A row's queries are its last `queries` columns, causal:
/// query `i` sees the valid columns up to `width − queries + i`.
#[derive(Debug, Clone)]
pub struct PagedAttention<B: Backend> {
    /// `[rows, queries, heads, head_dim]`, after RoPE; query head `h` reads key-value head
    /// `h / (heads / kv_heads)`.
    pub query: Tensor<B, 4>,
    /// A layer's pool of keys, `[kv_heads, slots, head_dim]`, in the query's dtype.
    pub keys: Tensor<B, 3>,
    /// A layer's pool of values, `[kv_heads, slots, head_dim]`.
    pub values: Tensor<B, 3>,
    /// `[rows · width]`: column `c` of row `r` reads slot `read[r · width + c]`.
    pub read: Tensor<B, 1, Int>,
    /// `[rows, width]`, f32: 1 where a column is a key the row attends to, 0 where it is
    /// padding. A query with no key to see (a padding query of a left-padded prefill) gets
    /// zeros, which only its scratch slot receives.
    pub valid: Tensor<B, 2>,
    /// The factor on `q · k` (`head_dim^-0.5`).
    pub scale: f32,
}

/// A kernel computing [`PagedAttention`]: `softmax(q · Kᵀ · scale) V` over each query's
/// columns, `[rows, queries, heads, head_dim]` in the query's dtype.
pub type PagedAttentionFn<B> = fn(PagedAttention<B>) -> Tensor<B, 4>;

/// The passes over the KV cache a registered [`PagedAttention`] kernel takes; burn's ops
/// (over the gathered cache) take the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPasses {
    /// Decoding steps: one query a row.
    Decode,
    /// Every pass, prefill chunks too.
    All,
}

impl KernelPasses {
    /// A `--device-kernels` setting (`PROMPT_R1_DEVICE_KERNELS`), case and surrounding spaces
    /// ignored: `decode` (or on, true, 1, yes, y, t), `all`, or off (off, false, 0, no, n, f) as
    /// `Some(None)`; `None` for anything else.
    pub fn parse_setting(value: &str) -> Option<Option<KernelPasses>> {
        match value.trim().to_ascii_lowercase().as_str() {
            "decode" | "on" | "true" | "1" | "yes" | "y" | "t" => Some(Some(KernelPasses::Decode)),
            "all" => Some(Some(KernelPasses::All)),
            "off" | "false" | "0" | "no" | "n" | "f" => Some(None),
            _ => None,
        }
    }

    /// Whether a pass of `queries` queries a row is one of these.
    pub fn take(self, queries: usize) -> bool {
        self == KernelPasses::All || queries == 1
    }
}

/// Lets `kernel` compute [`PagedAttention`] for `passes` on backend `B` from now on, for the
/// whole process (replacing an earlier one).
pub fn register_paged_attention<B: Backend>(kernel: PagedAttentionFn<B>, passes: KernelPasses) {
    let entry: Box<dyn Any + Send + Sync> = Box::new((kernel, passes));
    registry().write().expect("registry lock").insert(TypeId::of::<B>(), entry);
}

/// The [`PagedAttention`] kernel registered for backend `B`, and the passes it takes.
pub fn registered_paged_attention<B: Backend>() -> Option<(PagedAttentionFn<B>, KernelPasses)> {
    registry()
        .read()
        .expect("registry lock")
        .get(&TypeId::of::<B>())
        .and_then(|entry| entry.downcast_ref::<(PagedAttentionFn<B>, KernelPasses)>().copied())
}

/// The [`PagedAttention`] kernel registered for backend `B` if it takes passes of `queries`
/// queries a row.
pub fn paged_attention<B: Backend>(queries: usize) -> Option<PagedAttentionFn<B>> {
    registered_paged_attention::<B>().and_then(|(kernel, passes)| passes.take(queries).then_some(kernel))
}

/// Kernels by the backend's type; each value is a `PagedAttentionFn` of that backend with its
/// [`KernelPasses`].
fn registry() -> &'static RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>> {
    static REGISTRY: OnceLock<RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};

    /// Settings name the passes, and the old on/off spellings still say decode or off.
    #[test]
    fn settings_name_the_passes() {
        for (value, passes) in [("decode", Some(KernelPasses::Decode)), (" On ", Some(KernelPasses::Decode)), ("1", Some(KernelPasses::Decode)), ("y", Some(KernelPasses::Decode)), ("All", Some(KernelPasses::All)), ("off", None), ("0", None), ("f", None)] {
            assert_eq!(KernelPasses::parse_setting(value), Some(passes), "{value}");
        }
        assert_eq!(KernelPasses::parse_setting("prefill"), None);
    }

    fn zeros<B: Backend>(pass: PagedAttention<B>) -> Tensor<B, 4> {
        pass.query.zeros_like()
    }

    /// A kernel is found by the backend it was registered for, and only by that one, for the
    /// passes it was registered for. (A backend no other test computes on: the registry is the
    /// process's.)
    #[test]
    fn kernels_are_found_by_the_backend_type() {
        type Other = Autodiff<Autodiff<Flex>>;
        assert!(paged_attention::<Other>(1).is_none());
        register_paged_attention::<Other>(zeros::<Other>, KernelPasses::Decode);
        assert!(paged_attention::<Other>(1).is_some());
        assert!(paged_attention::<Other>(7).is_none(), "a decoding kernel takes no prefill");
        register_paged_attention::<Other>(zeros::<Other>, KernelPasses::All);
        assert!(paged_attention::<Other>(7).is_some());
        assert!(paged_attention::<Flex>(1).is_none());
    }
}

//! Kernels a GPU backend lends the model, found by the backend's type (as the autodiff
//! attention nodes are): the model stays generic over its backend and never names a GPU crate.
//! A binary registers what its backends offer ([`register_paged_attention`],
//! [`register_norms`], [`register_silu_mul`], [`register_token_choice`]; the
//! `prompt-r1-device-kernels` crate has them for CubeCL's backends, fused or not); where nothing
//! is registered, or a pass is not one a kernel takes, the model computes with burn's ops.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

/// One pass's attention over a paged KV cache, a decoding step's, a prefill chunk's, or a
/// ragged pass's (rows of different lengths, see [`RaggedRows`]): each row's queries attend to
/// the slots its read table names, with no gather of `[rows, kv_heads, width, head_dim]`. A
/// row's queries are its last `queries` columns, causal: query `i` sees the valid columns up to
/// `width − queries + i`.
#[derive(Debug, Clone)]
pub struct PagedAttention<B: Backend> {
    /// The queries a token a row, `[rows · queries, heads · head_dim]`, after RoPE, as the GPU's
    /// norm kernel leaves them (so that a fused backend's stream needs no reshape on either
    /// side of the kernel); query head `h` reads key-value head `h / (heads / kv_heads)`.
    pub query: Tensor<B, 2>,
    /// The query's `[rows, queries, heads, head_dim]` (`[1, tokens, heads, head_dim]` in a
    /// ragged pass).
    pub shape: [usize; 4],
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
    /// Where each row's queries lie in a ragged pass; `None` when every row has `queries`.
    pub ragged: Option<RaggedRows<B>>,
}

/// The rows of a ragged pass, whose queries are the pass's tokens one row after another
/// (vLLM's flattened batch, FlashAttention's `cu_seqlens_q`): a decoding step's rows (one token
/// each) beside the prefill chunks of rows joining, in one pass.
#[derive(Debug, Clone)]
pub struct RaggedRows<B: Backend> {
    /// `[rows + 1]`: row `r`'s queries are tokens `starts[r]..starts[r + 1]`.
    pub starts: Tensor<B, 1, Int>,
    /// Their lengths as the host counts them.
    pub lens: RowLens,
}

/// A ragged pass's rows as the host counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLens {
    /// The most queries a row has.
    pub longest: usize,
    /// Rows of one query (a decoding step's rows), which a kernel made for decoding may take
    /// apart from the others.
    pub single: usize,
}

impl RowLens {
    /// The counts of rows of `lens[r]` queries each.
    pub fn of(lens: &[usize]) -> Self {
        Self { longest: lens.iter().copied().max().unwrap_or(0), single: lens.iter().filter(|&&n| n == 1).count() }
    }
}

/// A kernel computing [`PagedAttention`]: `softmax(q · Kᵀ · scale) V` over each query's
/// columns, a token a row as the query (`[rows · queries, heads · head_dim]`), in its dtype.
pub type PagedAttentionFn<B> = fn(PagedAttention<B>) -> Tensor<B, 2>;

/// The attention of a pass without a KV cache (scoring; a training step's forward, whose
/// backward recomputes the probabilities from the log-sum-exp): each row's queries over its own
/// tokens' keys and values, causal, padded keys masked (`qwen3::attention::memory_efficient`'s
/// operands, handed to a kernel where a GPU backend lends one). A row's queries are its last
/// columns: query `i` sees the valid keys up to `width − queries + i`.
#[derive(Debug, Clone)]
pub struct FreshAttention<B: Backend> {
    /// `[rows, queries, heads, head_dim]`, after RoPE; query head `h` reads key-value head
    /// `h / (heads / kv_heads)`.
    pub query: Tensor<B, 4>,
    /// `[rows, width, kv_heads, head_dim]`, after RoPE.
    pub key: Tensor<B, 4>,
    /// `[rows, width, kv_heads, head_dim]`.
    pub value: Tensor<B, 4>,
    /// `[rows, width]`, f32: 1 for a key, 0 for padding.
    pub valid: Tensor<B, 2>,
    /// The factor on `q · k` (`head_dim^-0.5`).
    pub scale: f32,
}

/// A kernel computing [`FreshAttention`]: `softmax(q · kᵀ · scale) v` over each query's keys,
/// the scores `q · k` rounded to the operands' dtype before the scale (as burn's product in that
/// dtype, which the backward recomputes them with) and the softmax in f32. Returns the output
/// (`[rows, queries, heads, head_dim]`, the query's dtype) and each query's log-sum-exp of its
/// scores (`[rows, queries, heads]`, f32).
pub type FreshAttentionFn<B> = fn(FreshAttention<B>) -> (Tensor<B, 4>, Tensor<B, 3>);

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

/// A kernel computing `Qwen3RMSNorm` over the last axis of `x` (`[rows, hidden]`) with
/// `weight` (`[hidden]`, `x`'s dtype) and `eps`: `weight · cast(x / sqrt(mean(x²) + eps))`,
/// the statistics in f32, as HF computes it; `[rows, hidden]` in `x`'s dtype.
pub type RmsNormFn<B> = fn(x: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> Tensor<B, 2>;

/// [`RmsNormFn`] of `residual + delta` (`[rows, hidden]`, rounded to their dtype as burn's
/// addition rounds it), returning that sum too: `(residual + delta, norm(residual + delta))`,
/// the residual addition before a decoder layer's `input_layernorm`,
/// `post_attention_layernorm` or the final norm in one kernel.
pub type AddRmsNormFn<B> = fn(residual: Tensor<B, 2>, delta: Tensor<B, 2>, weight: Tensor<B, 1>, eps: f64) -> (Tensor<B, 2>, Tensor<B, 2>);

/// One pass's `q_norm` and `k_norm` with RoPE, its keys and values written to a layer's pools
/// (see [`QkNormRopeWriteFn`]). Floats of one dtype.
#[derive(Debug, Clone)]
pub struct QkNormRopeWrite<B: Backend> {
    /// The pass's query, key and value projections.
    pub qkv: Qkv<B>,
    /// Query heads a token (the pools say how many key-value heads).
    pub heads: usize,
    /// `q_norm`'s and `k_norm`'s weights, `[head_dim]`.
    pub q_weight: Tensor<B, 1>,
    pub k_weight: Tensor<B, 1>,
    /// RoPE's tables at each token, `[tokens, head_dim]` (see `qwen3::rotary`).
    pub cos: Tensor<B, 2>,
    pub signed_sin: Tensor<B, 2>,
    /// `[tokens]`: the slot of the pools each token's key and value go to.
    pub slots: Tensor<B, 1, Int>,
    /// A layer's pools, `[kv_heads, pool slots, head_dim]`.
    pub keys: Tensor<B, 3>,
    pub values: Tensor<B, 3>,
    /// The norms' epsilon.
    pub eps: f64,
}

/// A pass's query, key and value projections (`q_proj`'s, `k_proj`'s and `v_proj`'s outputs), a
/// token a row; rows may lie further apart than their width.
#[derive(Debug, Clone)]
pub enum Qkv<B: Backend> {
    /// Side by side, `[tokens, (heads + 2 · kv_heads) · head_dim]`: one product of a stacked
    /// `qkv_proj`, as vLLM's, a token's query heads, then its key heads, then its value heads.
    Stacked(Tensor<B, 2>),
    /// One each, `[tokens, heads or kv_heads · head_dim]`.
    Separate([Tensor<B, 2>; 3]),
}

/// SwiGLU's operands (`gate_proj`'s and `up_proj`'s outputs), a row each; rows may lie further
/// apart than their width.
#[derive(Debug, Clone)]
pub enum GateUp<B: Backend> {
    /// Side by side, `[rows, 2 · width]`: one product of a stacked `gate_up_proj`, as vLLM's.
    Stacked(Tensor<B, 2>),
    /// One each, `[rows, width]`.
    Separate(Tensor<B, 2>, Tensor<B, 2>),
}

/// A kernel computing [`QkNormRopeWrite`]: each head normalised as [`RmsNormFn`] does, then
/// RoPE at its token, `y · cos + swap_halves(y) · signed_sin` (HF's
/// `apply_rotary_pos_emb(q_norm(q), k_norm(k))`), the rotated keys and the values written to
/// their tokens' slots. Returns `(rotated query, keys, values)`: the query `[tokens, heads ·
/// head_dim]`, the pools written (in place where nothing else holds them).
pub type QkNormRopeWriteFn<B> = fn(QkNormRopeWrite<B>) -> (Tensor<B, 2>, Tensor<B, 3>, Tensor<B, 3>);

/// A kernel choosing each row's token from `logits` (`[rows, vocab]`, any float dtype), as
/// `crate::device_sampling::choose_tokens` does with burn's ops: with `temperatures[row]` 0 the
/// first column of the maximum, otherwise the first column whose running sum of
/// `exp(logits / T − max)` exceeds `uniforms[row]` of the row's total (the last where none
/// does), sums in f32 in an order of the kernel's own; each token beside its log-probability
/// under `log_softmax(logits / T)` (T 1 when greedy), `[rows, 2]` f32. `temperatures` and
/// `uniforms` are `[rows]` f32.
pub type ChooseTokensFn<B> = fn(logits: Tensor<B, 2>, temperatures: Tensor<B, 1>, uniforms: Tensor<B, 1>) -> Tensor<B, 2>;

/// Lets `kernel` choose tokens on backend `B` from now on, for the whole process.
pub fn register_token_choice<B: Backend>(kernel: ChooseTokensFn<B>) {
    register::<B, _>("choose_tokens", kernel);
}

/// The token-choice kernel registered for backend `B`.
pub fn token_choice<B: Backend>() -> Option<ChooseTokensFn<B>> {
    registered::<B, ChooseTokensFn<B>>("choose_tokens")
}

/// A kernel computing SwiGLU's `silu(gate) · up` (`[rows, width]`) from operands of one dtype, as
/// HF does in a dtype of 16 bits: `silu` in f32 rounded to the dtype, then the product.
pub type SiluMulFn<B> = fn(GateUp<B>) -> Tensor<B, 2>;

/// Lets `kernel` compute SwiGLU's element-wise step on backend `B` from now on, for the whole
/// process (taken by the passes over a KV cache, as the norm kernels are).
pub fn register_silu_mul<B: Backend>(kernel: SiluMulFn<B>) {
    register::<B, _>("silu_mul", kernel);
}

/// The SwiGLU kernel registered for backend `B`.
pub fn silu_mul<B: Backend>() -> Option<SiluMulFn<B>> {
    registered::<B, SiluMulFn<B>>("silu_mul")
}

/// The norm kernels a backend lends, taken by the passes over a KV cache (see
/// `Qwen3RMSNorm::forward` and `add_and_forward` with a `PassKernels` over the cache, and the
/// attention's write to the cache).
pub struct NormKernels<B: Backend> {
    pub rms_norm: RmsNormFn<B>,
    pub add_rms_norm: AddRmsNormFn<B>,
    pub qk_norm_rope_write: QkNormRopeWriteFn<B>,
}

impl<B: Backend> Clone for NormKernels<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for NormKernels<B> {}

/// Lets `kernel` compute [`PagedAttention`] for `passes` on backend `B` from now on, for the
/// whole process (replacing an earlier one).
pub fn register_paged_attention<B: Backend>(kernel: PagedAttentionFn<B>, passes: KernelPasses) {
    register::<B, _>("paged_attention", (kernel, passes));
}

/// The [`PagedAttention`] kernel registered for backend `B`, and the passes it takes.
pub fn registered_paged_attention<B: Backend>() -> Option<(PagedAttentionFn<B>, KernelPasses)> {
    registered::<B, (PagedAttentionFn<B>, KernelPasses)>("paged_attention")
}

/// Lets `kernel` compute [`FreshAttention`] on backend `B` from now on, for the whole process
/// (`None`: burn's ops again). Scoring and a training step's forward both take it, so that
/// their log-probs stay equal (the first PPO ratio of a step exactly 1).
pub fn register_fresh_attention<B: Backend>(kernel: Option<FreshAttentionFn<B>>) {
    register::<B, _>("fresh_attention", kernel);
}

/// The [`FreshAttention`] kernel registered for backend `B`.
pub fn fresh_attention<B: Backend>() -> Option<FreshAttentionFn<B>> {
    registered::<B, Option<FreshAttentionFn<B>>>("fresh_attention").flatten()
}

/// Lets `kernels` compute the RMS norms on backend `B` from now on, for the whole process.
pub fn register_norms<B: Backend>(kernels: NormKernels<B>) {
    register::<B, _>("norms", kernels);
}

/// The norm kernels registered for backend `B`.
pub fn norms<B: Backend>() -> Option<NormKernels<B>> {
    registered::<B, NormKernels<B>>("norms")
}

fn register<B: Backend, K: Any + Send + Sync>(name: &'static str, kernel: K) {
    registry().write().expect("registry lock").insert((TypeId::of::<B>(), name), Box::new(kernel));
}

fn registered<B: Backend, K: Any + Copy>(name: &'static str) -> Option<K> {
    registry()
        .read()
        .expect("registry lock")
        .get(&(TypeId::of::<B>(), name))
        .and_then(|entry| entry.downcast_ref::<K>().copied())
}

/// The [`PagedAttention`] kernel registered for backend `B` if it takes passes of `queries`
/// queries a row.
pub fn paged_attention<B: Backend>(queries: usize) -> Option<PagedAttentionFn<B>> {
    registered_paged_attention::<B>().and_then(|(kernel, passes)| passes.take(queries).then_some(kernel))
}

/// Kernels by the backend's type and the kernel's name: a `PagedAttentionFn` of that backend
/// with its [`KernelPasses`], a [`FreshAttentionFn`] or none, [`NormKernels`], a [`SiluMulFn`]
/// or a [`ChooseTokensFn`].
type Registry = HashMap<(TypeId, &'static str), Box<dyn Any + Send + Sync>>;

fn registry() -> &'static RwLock<Registry> {
    static REGISTRY: OnceLock<RwLock<Registry>> = OnceLock::new();
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

    fn zeros<B: Backend>(pass: PagedAttention<B>) -> Tensor<B, 2> {
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
        assert!(norms::<Other>().is_none(), "kernels are found by their name too");
        register_norms::<Other>(NormKernels { rms_norm: |x, _, _| x, add_rms_norm: |r, d, _, _| (r, d), qk_norm_rope_write: |p| (p.q_weight.unsqueeze(), p.keys, p.values) });
        assert!(norms::<Other>().is_some() && paged_attention::<Other>(7).is_some());
    }
}

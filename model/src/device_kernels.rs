//! Kernels a GPU backend lends the model, found by the backend's type (as the autodiff
//! attention nodes are): the model stays generic over its backend and never names a GPU crate.
//! A binary registers what its backends offer ([`register_paged_attention`],
//! [`register_fresh_attention`], [`register_norms`], [`register_silu_mul`], [`register_skinny_matmul`],
//! [`register_token_choice`]; the `prompt-r1-device-kernels` crate has them for CubeCL's
//! backends, fused or not), with no settings: which of them a model runs, and how, is its
//! [`DeviceKernelChoice`] (part of [`crate::Compute`], chosen at load as the attention
//! implementation is), through whose methods every lookup goes. Where nothing is registered, or
//! the choice leaves a pass to burn's ops, the model computes with burn's ops.

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
    /// How rows of one query (a decoding step's) are computed.
    pub decoding: Decoding,
    /// Whether blocks of several queries a row (prefill chunks) multiply on the tensor cores
    /// (see [`DeviceKernelChoice::tensor_cores`]).
    pub tensor_cores: bool,
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
    /// Whether its products run on the tensor cores (see [`DeviceKernelChoice::tensor_cores`]).
    pub tensor_cores: bool,
}

/// A kernel computing [`FreshAttention`]: `softmax(q · kᵀ · scale) v` over each query's keys,
/// the scores `q · k` rounded to the operands' dtype before the scale (as burn's product in that
/// dtype, which the backward recomputes them with) and the softmax in f32. Returns the output
/// (`[rows, queries, heads, head_dim]`, the query's dtype) and each query's log-sum-exp of its
/// scores (`[rows, queries, heads]`, f32).
pub type FreshAttentionFn<B> = fn(FreshAttention<B>) -> (Tensor<B, 4>, Tensor<B, 3>);

/// The passes over the KV cache a model's [`DeviceKernelChoice`] hands a registered
/// [`PagedAttention`] kernel; burn's ops (over the gathered cache) take the others.
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

    /// The setting that names these passes.
    pub fn name(self) -> &'static str {
        match self {
            KernelPasses::Decode => "decode",
            KernelPasses::All => "all",
        }
    }

    /// Whether a pass of `queries` queries a row is one of these.
    pub fn take(self, queries: usize) -> bool {
        self == KernelPasses::All || queries == 1
    }
}

/// Which of the kernels a GPU backend lends a model runs, and how: part of the model's
/// [`crate::Compute`], chosen at load (the binary fills it from `--device-kernels`,
/// `--split-decoding` and `--decoding-kernel` for the device it runs on). The default takes
/// the kernels for decoding steps, split where the device would sit idle, through the kernel
/// made for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceKernelChoice {
    /// The passes over a KV cache the paged attention takes (with [`KernelPasses::All`] also the
    /// passes without a cache, through the [`FreshAttention`] kernel); the norm, SwiGLU and
    /// token-choice kernels run in every pass over a KV cache. `None`: none of the lent kernels
    /// runs, burn's ops compute everything.
    pub passes: Option<KernelPasses>,
    /// How rows of one query are computed.
    pub decoding: Decoding,
    /// Whether the projections of passes over a KV cache with at most [`SKINNY_MATMUL_ROWS`]
    /// rows (decoding steps) run through the [`SkinnyMatmulFn`] kernel rather than burn's
    /// matmul, where any kernel runs.
    pub skinny_matmul: bool,
    /// Whether the attention kernels multiply blocks of several queries a row (prefill chunks,
    /// scoring, a training step's forward) by their keys and values on the GPU's tensor cores
    /// (16 × 16 × 16 products of 16-bit operands summed in f32), where the device has them for
    /// the dtype and the kernel takes the heads (16-bit floats, heads of 16 to 128 in steps of
    /// 16); else, and when off, on the CUDA cores.
    pub tensor_cores: bool,
}

/// The most rows of a product that a [`SkinnyMatmulFn`] kernel takes: decoding steps up to the
/// paper's generation batch of 64. Longer passes give burn's tiled matmul cubes enough.
pub const SKINNY_MATMUL_ROWS: usize = 64;

/// A kernel computing a bias-free projection of few rows, `x · weight` (`[rows, k] · [k,
/// columns]`, one float dtype, the weight's columns possibly a view of a stacked weight's),
/// its sums in f32 rounded once to the dtype: `[rows, columns]`.
pub type SkinnyMatmulFn<B> = fn(x: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2>;

/// Lends backend `B` `kernel` for the projections of decoding steps (passes over a KV cache of at
/// most [`SKINNY_MATMUL_ROWS`] rows).
pub fn register_skinny_matmul<B: Backend>(kernel: SkinnyMatmulFn<B>) {
    register::<B, _>("skinny_matmul", kernel);
}

/// How the paged attention computes rows of one query (a decoding step's, or a ragged pass's
/// decoding rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoding {
    /// Whether a decoding step's columns are split into spans where its blocks of threads
    /// alone would leave the GPU's multiprocessors idle (FlashDecoding); off, one block walks
    /// all of a row's columns.
    pub split: bool,
    /// The kernel that takes them.
    pub kernel: DecodingKernel,
}

/// The kernel that takes rows of one query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodingKernel {
    /// One made for them, where its cut fits (else the general one).
    Own,
    /// The general paged-attention kernel, which takes prefill chunks too (for comparisons).
    General,
}

impl DecodingKernel {
    /// Both, the default first.
    pub const ALL: [DecodingKernel; 2] = [DecodingKernel::Own, DecodingKernel::General];

    /// The setting that names it (`--decoding-kernel`).
    pub fn name(self) -> &'static str {
        match self {
            DecodingKernel::Own => "own",
            DecodingKernel::General => "general",
        }
    }
}

impl Default for Decoding {
    fn default() -> Self {
        Self { split: true, kernel: DecodingKernel::Own }
    }
}

impl Default for DeviceKernelChoice {
    fn default() -> Self {
        Self { passes: Some(KernelPasses::Decode), decoding: Decoding::default(), skinny_matmul: true, tensor_cores: false }
    }
}

impl DeviceKernelChoice {
    /// None of the lent kernels: burn's ops compute everything.
    pub const OFF: DeviceKernelChoice = DeviceKernelChoice { passes: None, decoding: Decoding { split: true, kernel: DecodingKernel::Own }, skinny_matmul: true, tensor_cores: false };

    /// The default's decoding with these passes.
    pub fn with_passes(passes: Option<KernelPasses>) -> Self {
        Self { passes, ..Self::default() }
    }

    /// Whether backend `B` was lent the kernels (the paged attention, which every choice but
    /// none runs), whatever a model chooses of them.
    pub fn lent_to<B: Backend>() -> bool {
        registered::<B, PagedAttentionFn<B>>("paged_attention").is_some()
    }

    /// The [`PagedAttention`] kernel registered for backend `B` where this choice hands it passes
    /// of `queries` queries a row.
    pub fn paged_attention<B: Backend>(self, queries: usize) -> Option<PagedAttentionFn<B>> {
        self.passes.filter(|passes| passes.take(queries)).and(registered::<B, PagedAttentionFn<B>>("paged_attention"))
    }

    /// The [`FreshAttention`] kernel registered for backend `B` where this choice hands it the
    /// passes without a cache ([`KernelPasses::All`]).
    pub fn fresh_attention<B: Backend>(self) -> Option<FreshAttentionFn<B>> {
        (self.passes == Some(KernelPasses::All)).then(|| registered::<B, FreshAttentionFn<B>>("fresh_attention")).flatten()
    }

    /// The norm kernels registered for backend `B`, where this choice runs any kernel.
    pub fn norms<B: Backend>(self) -> Option<NormKernels<B>> {
        self.passes.and(registered::<B, NormKernels<B>>("norms"))
    }

    /// The SwiGLU kernel registered for backend `B`, where this choice runs any kernel.
    pub fn silu_mul<B: Backend>(self) -> Option<SiluMulFn<B>> {
        self.passes.and(registered::<B, SiluMulFn<B>>("silu_mul"))
    }

    /// The skinny-matmul kernel registered for backend `B` for a product of `rows` rows, where
    /// this choice runs any kernel and that one, and `rows` is at most [`SKINNY_MATMUL_ROWS`].
    pub fn skinny_matmul<B: Backend>(self, rows: usize) -> Option<SkinnyMatmulFn<B>> {
        let wanted = self.passes.is_some() && self.skinny_matmul && (1..=SKINNY_MATMUL_ROWS).contains(&rows);
        wanted.then(|| registered::<B, SkinnyMatmulFn<B>>("skinny_matmul")).flatten()
    }

    /// The token-choice kernel registered for backend `B`, where this choice runs any kernel.
    pub fn token_choice<B: Backend>(self) -> Option<ChooseTokensFn<B>> {
        self.passes.and(registered::<B, ChooseTokensFn<B>>("choose_tokens"))
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

/// Lends backend `B` `kernel` to choose tokens with (replacing an earlier one).
pub fn register_token_choice<B: Backend>(kernel: ChooseTokensFn<B>) {
    register::<B, _>("choose_tokens", kernel);
}

/// A kernel computing SwiGLU's `silu(gate) · up` (`[rows, width]`) from operands of one dtype, as
/// HF does in a dtype of 16 bits: `silu` in f32 rounded to the dtype, then the product.
pub type SiluMulFn<B> = fn(GateUp<B>) -> Tensor<B, 2>;

/// Lends backend `B` `kernel` for SwiGLU's element-wise step (taken by the passes over a KV
/// cache, as the norm kernels are).
pub fn register_silu_mul<B: Backend>(kernel: SiluMulFn<B>) {
    register::<B, _>("silu_mul", kernel);
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

/// Lends backend `B` `kernel` for [`PagedAttention`] (replacing an earlier one); a model's
/// [`DeviceKernelChoice`] says which passes it takes.
pub fn register_paged_attention<B: Backend>(kernel: PagedAttentionFn<B>) {
    register::<B, _>("paged_attention", kernel);
}

/// Lends backend `B` `kernel` for [`FreshAttention`], which scoring and a training step's
/// forward both take where a model's choice is [`KernelPasses::All`], so that their log-probs
/// stay equal (the first PPO ratio of a step exactly 1).
pub fn register_fresh_attention<B: Backend>(kernel: FreshAttentionFn<B>) {
    register::<B, _>("fresh_attention", kernel);
}

/// Lends backend `B` `kernels` for the RMS norms.
pub fn register_norms<B: Backend>(kernels: NormKernels<B>) {
    register::<B, _>("norms", kernels);
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

/// Kernels by the backend's type and the kernel's name: a [`PagedAttentionFn`], a
/// [`FreshAttentionFn`], [`NormKernels`], a [`SiluMulFn`], a [`SkinnyMatmulFn`] or a
/// [`ChooseTokensFn`] of that backend.
type Registry = HashMap<(TypeId, &'static str), Box<dyn Any + Send + Sync>>;

fn registry() -> &'static RwLock<Registry> {
    static REGISTRY: OnceLock<RwLock<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// Whether backend `B` was lent any kernel.
    fn lends<B: Backend>() -> bool {
        let key = TypeId::of::<B>();
        registry().read().expect("registry lock").keys().any(|(backend, _)| *backend == key)
    }

    /// Settings name the passes, and the old on/off spellings still say decode or off.
    #[test]
    fn settings_name_the_passes() {
        for (value, passes) in [("decode", Some(KernelPasses::Decode)), (" On ", Some(KernelPasses::Decode)), ("1", Some(KernelPasses::Decode)), ("y", Some(KernelPasses::Decode)), ("All", Some(KernelPasses::All)), ("off", None), ("0", None), ("f", None)] {
            assert_eq!(KernelPasses::parse_setting(value), Some(passes), "{value}");
        }
        assert_eq!(KernelPasses::parse_setting("prefill"), None);
        for passes in [KernelPasses::Decode, KernelPasses::All] {
            assert_eq!(KernelPasses::parse_setting(passes.name()), Some(Some(passes)), "a name is a setting");
        }
    }

    fn zeros<B: Backend>(pass: PagedAttention<B>) -> Tensor<B, 2> {
        pass.query.zeros_like()
    }

    /// A kernel is found by the backend it was registered for, and only by that one, for the
    /// passes a model's choice hands it. (A backend no other test computes on: the registry is
    /// the process's.)
    #[test]
    fn kernels_are_found_by_the_backend_type_and_taken_as_the_choice_says() {
        type Other = Autodiff<Autodiff<Flex>>;
        let (decode, all, off) = (DeviceKernelChoice::default(), DeviceKernelChoice::with_passes(Some(KernelPasses::All)), DeviceKernelChoice::OFF);
        let in_use = |choice| crate::Compute::default().with_device_kernels(choice).kernels_on::<Other>();
        assert!(!lends::<Other>() && !DeviceKernelChoice::lent_to::<Other>());
        assert!(all.paged_attention::<Other>(1).is_none());
        assert_eq!(in_use(decode).gpu, None, "no kernel lent, none recorded");
        register_paged_attention::<Other>(zeros::<Other>);
        assert!(lends::<Other>() && DeviceKernelChoice::lent_to::<Other>());
        assert_eq!(in_use(decode), crate::qwen3::KernelsInUse { cpu: None, gpu: Some(crate::qwen3::GpuKernelsInUse { passes: "decode", split_decoding: Some(true), decoding_kernel: Some("own"), skinny_matmul: Some(true), tensor_core_attention: Some(false) }) });
        let whole = DeviceKernelChoice { passes: Some(KernelPasses::All), decoding: Decoding { split: false, kernel: DecodingKernel::General }, skinny_matmul: true, tensor_cores: true };
        assert_eq!(in_use(whole).gpu, Some(crate::qwen3::GpuKernelsInUse { passes: "all", split_decoding: Some(false), decoding_kernel: Some("general"), skinny_matmul: Some(true), tensor_core_attention: Some(true) }));
        assert_eq!(in_use(off).gpu, Some(crate::qwen3::GpuKernelsInUse { passes: "off", split_decoding: None, decoding_kernel: None, skinny_matmul: None, tensor_core_attention: None }));
        assert!(decode.paged_attention::<Other>(1).is_some());
        assert!(decode.paged_attention::<Other>(7).is_none(), "decoding steps only: no prefill");
        assert!(all.paged_attention::<Other>(7).is_some());
        assert!(off.paged_attention::<Other>(1).is_none(), "off runs no kernel");
        assert!(all.paged_attention::<Flex>(1).is_none(), "only the backend it was lent to");
        assert!(all.norms::<Other>().is_none(), "kernels are found by their name too");
        register_norms::<Other>(NormKernels { rms_norm: |x, _, _| x, add_rms_norm: |r, d, _, _| (r, d), qk_norm_rope_write: |p| (p.q_weight.unsqueeze(), p.keys, p.values) });
        assert!(decode.norms::<Other>().is_some() && off.norms::<Other>().is_none());
        register_fresh_attention::<Other>(|pass| (pass.query, pass.valid.unsqueeze()));
        assert!(all.fresh_attention::<Other>().is_some());
        assert!(decode.fresh_attention::<Other>().is_none(), "passes without a cache only with all");
        assert!(decode.skinny_matmul::<Other>(1).is_none(), "not lent yet");
        register_skinny_matmul::<Other>(|x, _| x);
        assert!(decode.skinny_matmul::<Other>(1).is_some() && all.skinny_matmul::<Other>(SKINNY_MATMUL_ROWS).is_some());
        assert!(decode.skinny_matmul::<Other>(SKINNY_MATMUL_ROWS + 1).is_none(), "longer passes keep burn's matmul");
        assert!(decode.skinny_matmul::<Other>(0).is_none() && off.skinny_matmul::<Other>(1).is_none());
        assert!(DeviceKernelChoice { skinny_matmul: false, ..decode }.skinny_matmul::<Other>(1).is_none(), "switched off");
    }

    /// The passes of one kind a counting kernel took (see [`counting`]).
    static DECODING_CALLS: AtomicUsize = AtomicUsize::new(0);
    static PREFILL_CALLS: AtomicUsize = AtomicUsize::new(0);
    /// How each pass the counting kernel took was to compute its rows of one query.
    static DECODINGS: Mutex<Vec<Decoding>> = Mutex::new(Vec::new());

    /// A paged-attention "kernel" that counts the passes it takes (rows of one query, or
    /// prefills) and returns zeros.
    fn counting(pass: PagedAttention<Counted>) -> Tensor<Counted, 2> {
        let decoding = pass.ragged.as_ref().map_or(pass.shape[1] == 1, |rows| rows.lens.longest == 1);
        if decoding { &DECODING_CALLS } else { &PREFILL_CALLS }.fetch_add(1, Ordering::Relaxed);
        DECODINGS.lock().unwrap().push(pass.decoding);
        pass.query.zeros_like()
    }

    /// The trainer's checkpointing backend, on which no other test of this crate decodes.
    type Counted = Autodiff<Flex, burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing>;

    /// Models of one process take the kernel lent to their backend in the passes each one's
    /// [`DeviceKernelChoice`] names: none, decoding steps, or every pass (the prefill then one
    /// ragged pass), a call a layer; and each pass hands the kernel its choice's [`Decoding`].
    #[test]
    fn each_model_runs_the_kernels_its_choice_names() {
        use crate::checkpoint::StorageDtype;
        use crate::{load_pretrained, Compute, Decoder, DecoderLimits, LoadOptions, Preset};
        register_paged_attention::<Counted>(counting);
        let config = Preset::Tiny.config(64, vec![2]);
        let dir = tempfile::tempdir().unwrap();
        crate::init::write_random_checkpoint(&config, dir.path(), 5, StorageDtype::F32).unwrap();
        let layers = config.num_hidden_layers;
        let steps = 3;
        let whole = Decoding { split: false, kernel: DecodingKernel::General };
        let cases = [
            (None, Decoding::default(), [0, 0]),
            (Some(KernelPasses::Decode), Decoding::default(), [0, layers * (steps - 1)]),
            (Some(KernelPasses::Decode), whole, [0, layers * (steps - 1)]),
            (Some(KernelPasses::All), whole, [layers, layers * (steps - 1)]),
        ];
        for (passes, decoding, want) in cases {
            let choice = DeviceKernelChoice { passes, decoding, skinny_matmul: true, tensor_cores: false };
            let compute = Compute::default().with_cpu_kernels(cpu_kernels::Kernels::off()).with_device_kernels(choice);
            DECODINGS.lock().unwrap().clear();
            let model = load_pretrained::<Counted>(dir.path(), &Default::default(), LoadOptions { compute, ..LoadOptions::default() }).unwrap();
            let before = [PREFILL_CALLS.load(Ordering::Relaxed), DECODING_CALLS.load(Ordering::Relaxed)];
            let mut decoder = Decoder::new(DecoderLimits::default());
            decoder.add(&model, 0, (1..9).collect()).unwrap();
            for _ in 0..steps {
                let out = decoder.step(&model).unwrap().expect("a running row");
                decoder.accept(out.ids[0], 7).unwrap();
            }
            let calls = [PREFILL_CALLS.load(Ordering::Relaxed) - before[0], DECODING_CALLS.load(Ordering::Relaxed) - before[1]];
            assert_eq!(calls, want, "{passes:?}: [prefill, decoding] passes through the kernel");
            let seen = DECODINGS.lock().unwrap();
            assert_eq!(seen.len(), calls[0] + calls[1]);
            assert!(seen.iter().all(|&seen| seen == decoding), "{choice:?}: the kernel was handed another decoding: {seen:?}");
        }
    }
}

//! The named points where the model lets backend-specific kernels stand in for its own
//! computation, as transformers' kernel hub does for its modules: the embedding lookup,
//! RMSNorm, the projections, RoPE, attention (also over the paged KV cache), SwiGLU and the
//! chosen-token log-probability (plus helpers: f32 → bf16 rounding to nearest even, and the
//! paged KV cache's writes in place and gathers, which compute nothing and also run with the
//! portable ops).
//! Each takes the [`cpu_kernels::Kernels`] of the model's [`crate::Compute`] and returns `None`
//! where no kernel applies (any backend but burn-flex, the kernels off, a dtype they do not
//! handle), and the caller computes the reference with burn's ops. The
//! kernels live in the `prompt-r1-cpu-kernels` crate; see its README for what each gains.

pub(crate) use cpu_kernels::ops::{
    cast, chosen_logprobs, embedding, entropy, grouped_attention, grouped_attention_paged, linear, linear_bf16, rms_norm, rotary,
    gather_slots, silu_mul, write_slots,
};
pub(crate) use cpu_kernels::{transpose_into, WeightLayout};

/// Whether backend `B` adds a broadcast operand much more slowly than one of equal shape
/// (burn-flex, plain or under autodiff), so that the model materialises a mask's bias at the
/// scores' shape there and lets the other backends broadcast it.
pub(crate) fn broadcasts_slowly<B: burn::tensor::backend::Backend>() -> bool {
    cpu_kernels::is_flex_backend::<B>()
}

//! Hand-written CPU kernels that speed up burn-flex, burn's pure-Rust CPU backend, at the few
//! points where the Qwen3 model asks for them (see [`ops`]); everything else, and every other
//! backend, runs burn's own ops. What they replace:
//! - matmuls with bf16 weights: burn-flex 0.21 upcasts both operands of a bf16 matmul to fresh
//!   f32 buffers on every call, i.e. the whole weight matrix per generated token;
//! - matmuls of a few rows (decode) with f32 weights: memory-bound, so a streaming kernel reads
//!   the weights at full bandwidth where a general GEMM does not;
//! - f32 matmuls at bf16 precision: operands rounded to bf16 and multiplied with `vdpbf16ps`
//!   where the CPU has AVX-512 BF16, otherwise rounded and handed to burn-flex's f32 GEMM;
//!   the same products forward, backward and when scoring, at every level;
//! - RMSNorm, the SwiGLU product and RoPE: several single-threaded passes (and strided
//!   broadcasts in bf16) become one parallel pass;
//! - the log-probability of chosen tokens: one parallel reduction per row of logits instead of
//!   six single-threaded passes over `[b, n, vocab]`;
//! - attention: scores, mask, softmax and the weighted sum of values in one parallel pass over
//!   the strided query/key/value views, where burn's ops copy, upcast and broadcast each step.
//!
//! Under autodiff the chosen-token log-probability, the embedding lookup, RMSNorm, SwiGLU, RoPE,
//! attention and the bf16-precision matmul are each recorded as one node of burn's graph with
//! a hand-written backward (see `tracked`).
//!
//! [`mod@isa`] says which code paths run: the host's best instruction-set level, or a lower one
//! (`PROMPT_R1_CPU_ISA=portable|avx2|avx512|avx512bf16`), or none at all
//! (`PROMPT_R1_PORTABLE_OPS=1`: burn's ops everywhere, the path GPU backends take).
//!
//! On Linux, [`large_alloc`] is a global allocator for the binary that keeps the large buffers
//! the CPU backend's tensors live in for reuse instead of handing them back to the kernel.

/// Evaluates `$body` in a copy compiled with AVX-512 enabled when the kernels run at that level
/// (see [`isa`]), so that the loops inlined into it vectorise 16 lanes wide; otherwise as
/// compiled for the baseline.
macro_rules! wide_simd {
    ($body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if $crate::isa::avx512() {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: the CPU has the features `run` is compiled for.
                unsafe { run(#[inline(always)] || $body) }
            } else {
                $body
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $body
        }
    }};
}

mod attention;
mod attention_backward;
mod bf16_bits;
mod bf16_products;
mod flex;
mod fused;
pub mod isa;
#[cfg(target_os = "linux")]
pub mod large_alloc;
pub mod ops;
mod tracked;
mod transpose;
mod weight_matmul;

pub use bf16_products::{bf16_products, bf16_products_from_env, set_bf16_products, Bf16Products, BF16_PRODUCTS_ENV};
pub use flex::is_flex_backend;
pub use isa::{active, isa, portable_ops, set_isa_cap, set_portable_ops, Isa};
pub use ops::{has_bf16_kernels, WeightLayout};
pub use transpose::transpose_into;

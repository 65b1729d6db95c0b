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
//! Which code paths run is a [`Kernels`] value that every entry point takes: the host's best
//! instruction-set level, a lower one (see [`mod@isa`]), or none at all ([`Kernels::off`]:
//! burn's ops everywhere, the path GPU backends take). A model chooses it at load;
//! [`Kernels::from_env`] reads `PROMPT_R1_CPU_ISA`, `PROMPT_R1_BF16_PRODUCTS` and
//! `PROMPT_R1_PORTABLE_OPS`.
//!
//! On Linux, [`large_alloc`] is a global allocator for the binary that keeps the large buffers
//! the CPU backend's tensors live in for reuse instead of handing them back to the kernel.

/// Evaluates `$body` in a copy compiled with AVX-512 enabled when `$kernels` (a [`Kernels`])
/// run at that level, so that the loops inlined into it vectorise 16 lanes wide; otherwise as
/// compiled for the baseline.
macro_rules! wide_simd {
    ($kernels:expr, $body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if $crate::Kernels::avx512($kernels) {
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
            let _ = $kernels;
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
mod kernels;
#[cfg(target_os = "linux")]
pub mod large_alloc;
pub mod ops;
mod tracked;
mod transpose;
mod weight_matmul;

pub use bf16_products::{bf16_products_from_env, Bf16Products, BF16_PRODUCTS_ENV};
pub use flex::{is_flex_backend, is_plain_flex};
pub use isa::Isa;
pub use kernels::{Kernels, KernelsEnvError};
pub use ops::{has_bf16_kernels, WeightLayout};
pub use transpose::transpose_into;

//! What the update's forward pass keeps for its backward pass, tensor by tensor, read off the
//! model's code (`model/src/qwen3/*`, `model/src/logprobs.rs`, the CPU kernels' autodiff nodes in
//! `cpu-kernels/src/tracked.rs`) and burn-autodiff 0.21's rules: a product keeps each operand
//! whose partner takes a gradient, an element-wise product both operands, `exp` its output,
//! `sigmoid` its input, sums, reshapes, casts and additions nothing. Counts are f32 values per
//! token (a bf16 copy counts half).

use model::MatmulPrecision;

use super::ComputePath;

/// The model's dimensions that activations scale with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub hidden: f64,
    /// Query width, `heads · head_dim`.
    pub q: f64,
    /// Key (and value) width, `kv_heads · head_dim`.
    pub kv: f64,
    pub intermediate: f64,
    pub heads: f64,
    pub head_dim: f64,
    pub vocab: f64,
}

/// How a layer's attention keeps what its backward pass needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeptAttention {
    /// The CPU kernel's node: its operands, output and two floats per query row and head.
    CpuKernel,
    /// HF's eager formula as tensor ops: the regrouped queries and `[b, heads, q, k]`
    /// exponentials and probabilities.
    Eager,
    /// The memory-efficient attention's node: its operands, output and each query row's
    /// log-sum-exp (one f32 per head), no scores.
    MemoryEfficient,
}

/// The LoRA adapters' share of a layer's activations.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LoraActivations {
    /// `Σ rank` over the adapted projections: each keeps `x · A` for `B`'s gradient.
    pub rank_sum: f64,
    /// `Σ in_features` over the adapted projections: with a bf16 base each adapter keeps its
    /// own f32 copy of its input (PEFT's cast to the adapter's dtype).
    pub inputs: f64,
    /// Whether dropout is on: each adapter then keeps its dropout mask and its dropped-out
    /// input, `2 · in_features` more.
    pub dropout: bool,
}

/// One decoder layer's kept activations: `per_token` values for each of the micro-batch's
/// tokens, plus `per_token_key` for each (token, key) pair (attention scores).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct LayerKept {
    pub per_token: f64,
    pub per_token_key: f64,
}

/// The tensors one decoder layer keeps under autodiff (its input excluded: that is the
/// previous layer's output), and the attention's per-(token, key) values.
pub(super) fn layer_kept(
    dims: Dims,
    path: ComputePath,
    attention: KeptAttention,
    products: MatmulPrecision,
    lora: LoraActivations,
) -> LayerKept {
    let Dims {
        hidden: h,
        q,
        kv,
        intermediate: i,
        heads,
        ..
    } = dims;
    // The inputs of the seven projections where a product is what keeps them: at f32 precision
    // the product keeps the tensor itself (shared by q/k/v, and by gate/up); at bf16 precision
    // each product keeps its own bf16 copy and the f32 tensor is freed.
    let product_inputs = |shared_qkv: f64, shared_gate_up: f64, attention_out: f64, swiglu: f64| {
        if products == MatmulPrecision::Bf16 {
            (3.0 * h + q + 2.0 * h + i) / 2.0
        } else {
            shared_qkv + shared_gate_up + attention_out + swiglu
        }
    };
    let (per_token, per_token_key) = match path {
        ComputePath::CpuKernels => {
            // RMSNorm, RoPE, SwiGLU and attention are single nodes keeping only their inputs
            // (RoPE its tables); attention keeps no scores, two floats per query row and head.
            // Kept by the nodes: q_proj's output (q_norm's input) and the queries after RoPE;
            // k_proj's output, the keys after RoPE and the values; the attention's output (also
            // o_proj's input) and its softmax maximum and sum; the residual after attention
            // (post_attention_layernorm's input); gate_proj's and up_proj's outputs (SwiGLU's
            // inputs); the layer's output.
            let nodes = 2.0 * q + 3.0 * kv + q + 2.0 * heads + h + 2.0 * i + h;
            // Kept by the products: both norms' outputs and SwiGLU's output (the attention
            // output is the attention node's already; at bf16 o_proj keeps its own copy).
            (nodes + product_inputs(h, h, 0.0, i), 0.0)
        }
        ComputePath::Portable => {
            // Tensor ops: RMSNorm keeps x·rsqrt(mean x²) for the weight's gradient (input and
            // post-attention norms, q_norm, k_norm); RoPE keeps only its tables; eager attention
            // keeps the regrouped queries (a copy to [b, kv, groups·q, d]), exp(scores − max)
            // and the probabilities; SiLU keeps sigmoid(gate) and silu(gate) besides gate.
            let norms = 2.0 * h + q + kv;
            let attention_kept = q + q + q + kv + kv + kv; // q and k projections and after RoPE, regrouped q, v
            let mlp = 4.0 * i;
            let residual_and_output = 2.0 * h;
            // Kept by the products: both norms' outputs, the attention output (a copy to
            // [b, q, heads·d]) and SwiGLU's output. The memory-efficient node keeps its output
            // where eager keeps the regrouped queries, and a log-sum-exp per head instead of
            // the two [b, heads, q, k] tensors.
            let (lse, per_key) = match attention {
                KeptAttention::MemoryEfficient => (heads, 0.0),
                KeptAttention::Eager | KeptAttention::CpuKernel => (0.0, 2.0 * heads),
            };
            (
                norms + attention_kept + mlp + residual_and_output + product_inputs(h, h, q, i) + lse,
                per_key,
            )
        }
        ComputePath::PortableBf16 => {
            // A bf16 frozen base under LoRA, through tensor ops (the CPU kernels' autodiff nodes
            // take f32 only): every norm keeps its f32 copy of its input; RoPE's outputs, the
            // regrouped queries and the values stay bf16; the softmax keeps exp(scores − max) in
            // f32 and the probabilities cast back to bf16; SiLU's four tensors are bf16. The
            // frozen products keep nothing of their inputs; each adapter keeps an f32 copy.
            // The memory-efficient node keeps its bf16 output in place of the regrouped
            // queries, and an f32 log-sum-exp per head in place of the softmax's tensors.
            let norms = 2.0 * h + q + kv;
            let attention_kept = 0.5 * (2.0 * q + 2.0 * kv);
            let mlp = 0.5 * 4.0 * i;
            let output = 0.5 * h;
            let (lse, per_key) = match attention {
                KeptAttention::MemoryEfficient => (heads, 0.0),
                KeptAttention::Eager | KeptAttention::CpuKernel => (0.0, 1.5 * heads),
            };
            (norms + attention_kept + mlp + output + lora.inputs + lse, per_key)
        }
    };
    let dropout = if lora.dropout { 2.0 * lora.inputs } else { 0.0 };
    LayerKept {
        per_token: per_token + lora.rank_sum + dropout,
        per_token_key,
    }
}

/// Values per token kept once per forward pass and shared by every layer: the RoPE tables
/// `cos` and `sin`, expanded to every query and key head where the CPU kernels may run
/// (`repeated`), one head wide (broadcast by burn's ops) elsewhere.
pub(super) fn rotary_tables(dims: Dims, repeated: bool) -> f64 {
    if repeated {
        2.0 * (dims.q + dims.kv)
    } else {
        2.0 * dims.head_dim
    }
}

/// What the head keeps per scored token of the whole micro-batch: the final norm's output (a
/// copy laid out for the product) or, as tensor ops, its f32 `x·rsqrt` and output.
pub(super) fn head_kept_per_token(dims: Dims, path: ComputePath) -> f64 {
    match path {
        ComputePath::CpuKernels | ComputePath::PortableBf16 => dims.hidden,
        ComputePath::Portable => 3.0 * dims.hidden,
    }
}

/// Logits-sized f32 values the head keeps per position of the one chunk whose graph exists at a
/// time (the update forms and differentiates the head a chunk at a time, see
/// `trainer::grpo::head`): the logits (kept by the CPU kernel's log-prob node) or
/// `exp(logits − max)` (by the log-sum-exp as tensor ops), plus `exp` and `logits − max` for an
/// entropy that takes a gradient.
pub(super) fn head_kept_per_chunk_row(dims: Dims, entropy_tracked: bool) -> f64 {
    let logits = if entropy_tracked { 3.0 } else { 1.0 };
    logits * dims.vocab
}

/// Logits-sized f32 tensors of one chunk alive at once beside the kept ones, at the worst
/// moment of the head's forward or backward pass: the product's output and its contiguous
/// copy (the tied head computes `(embed · xᵀ)ᵀ`), or the gradient and its copy, on the CPU
/// kernels' path; the logits, `logits − max`, `exp` and their gradients as tensor ops.
pub(super) fn head_transient_chunks(path: ComputePath) -> f64 {
    match path {
        ComputePath::CpuKernels => 2.0,
        ComputePath::Portable | ComputePath::PortableBf16 => 4.0,
    }
}

/// Values per token alive at once inside one layer's backward pass (the gradients of its
/// widest activations) or its forward pass without autodiff (its temporaries).
pub(super) fn layer_transient(dims: Dims) -> f64 {
    2.0 * dims.hidden + 2.0 * dims.q + 2.0 * dims.kv + 3.0 * dims.intermediate
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-0.6B.
    fn dims() -> Dims {
        Dims {
            hidden: 1024.0,
            q: 2048.0,
            kv: 1024.0,
            intermediate: 3072.0,
            heads: 16.0,
            head_dim: 128.0,
            vocab: 151_936.0,
        }
    }

    #[test]
    fn kernel_path_keeps_four_hidden_three_query_three_kv_three_mlp_widths() {
        let kept = layer_kept(
            dims(),
            ComputePath::CpuKernels,
            KeptAttention::CpuKernel,
            MatmulPrecision::F32,
            LoraActivations::default(),
        );
        // 4·1024 + 3·2048 + 3·1024 + 3·3072 + 2·16 = 22,560 values: 90 KB a token and layer.
        assert_eq!(
            kept,
            LayerKept {
                per_token: 22_560.0,
                per_token_key: 0.0
            }
        );
        let bf16 = layer_kept(
            dims(),
            ComputePath::CpuKernels,
            KeptAttention::CpuKernel,
            MatmulPrecision::Bf16,
            LoraActivations::default(),
        );
        // n1 (1024) → three bf16 copies (1536); n2 (1024) → two (1024); SwiGLU out (3072) → 1536;
        // o_proj's own copy of the attention output +1024.
        assert_eq!(bf16.per_token, 22_560.0 + 512.0 - 1536.0 + 1024.0);
    }

    #[test]
    fn portable_path_keeps_more_and_the_attention_probabilities() {
        let kept = layer_kept(
            dims(),
            ComputePath::Portable,
            KeptAttention::Eager,
            MatmulPrecision::F32,
            LoraActivations::default(),
        );
        // 6·1024 + 5·2048 + 4·1024 + 5·3072 = 35,840; two [b, heads, q, k] tensors.
        assert_eq!(
            kept,
            LayerKept {
                per_token: 35_840.0,
                per_token_key: 32.0
            }
        );
        let lora = LoraActivations {
            rank_sum: 56.0,
            inputs: 0.0,
            dropout: false,
        };
        let with = layer_kept(dims(), ComputePath::Portable, KeptAttention::Eager, MatmulPrecision::F32, lora);
        assert_eq!(with.per_token, 35_840.0 + 56.0);
        // The memory-efficient node: a log-sum-exp per head, no per-key tensor.
        let blocks = layer_kept(dims(), ComputePath::Portable, KeptAttention::MemoryEfficient, MatmulPrecision::F32, lora);
        assert_eq!(blocks, LayerKept { per_token: 35_840.0 + 56.0 + 16.0, per_token_key: 0.0 });
    }

    #[test]
    fn a_bf16_base_keeps_f32_copies_for_the_norms_and_adapters() {
        // All seven projections adapted at rank 8: inputs 3·1024 + 2048 + 2·1024 + 3072.
        let lora = LoraActivations {
            rank_sum: 56.0,
            inputs: 10_240.0,
            dropout: false,
        };
        let kept = layer_kept(
            dims(),
            ComputePath::PortableBf16,
            KeptAttention::Eager,
            MatmulPrecision::F32,
            lora,
        );
        // norms 5120, attention 3072, SiLU 6144, output 512, adapters 10,240 + 56.
        assert_eq!(
            kept,
            LayerKept {
                per_token: 25_144.0,
                per_token_key: 24.0
            }
        );
        let dropout = LoraActivations {
            dropout: true,
            ..lora
        };
        let with = layer_kept(
            dims(),
            ComputePath::PortableBf16,
            KeptAttention::Eager,
            MatmulPrecision::F32,
            dropout,
        );
        assert_eq!(with.per_token, 25_144.0 + 2.0 * 10_240.0);
    }

    #[test]
    fn the_head_keeps_its_input_per_token_and_logits_per_chunk_row() {
        assert_eq!(head_kept_per_token(dims(), ComputePath::CpuKernels), 1024.0);
        assert_eq!(head_kept_per_token(dims(), ComputePath::Portable), 3.0 * 1024.0);
        assert_eq!(head_kept_per_chunk_row(dims(), false), 151_936.0);
        assert_eq!(head_kept_per_chunk_row(dims(), true), 3.0 * 151_936.0);
    }
}

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
    pub vocab: f64,
}

/// The LoRA adapters' share of a layer's activations.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LoraActivations {
    /// `Σ rank` over the adapted projections: each keeps `x · A` for `B`'s gradient.
    pub rank_sum: f64,
    /// `Σ in_features` over the adapted projections when dropout is on: each keeps its own
    /// dropped-out input for `A`'s gradient.
    pub dropout_inputs: f64,
}

/// One decoder layer's kept activations: `per_token` values for each of the micro-batch's
/// tokens, plus `per_token_key` for each (token, key) pair (attention scores).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct LayerKept {
    pub per_token: f64,
    pub per_token_key: f64,
}

/// The tensors one decoder layer keeps under autodiff (its input excluded: that is the
/// previous layer's output), as `(what, values per token)`, and the attention's per-(token,
/// key) values.
pub(super) fn layer_kept(
    dims: Dims,
    path: ComputePath,
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
    let bf16 = products == MatmulPrecision::Bf16;
    // The inputs of the seven projections, when a product is the only thing that keeps them:
    // at f32 precision the product keeps the tensor itself (shared by q/k/v and by gate/up);
    // at bf16 precision each product keeps its own bf16 copy and the f32 tensor is freed.
    let product_inputs = |shared_qkv: f64, shared_gate_up: f64, attention_out: f64, swiglu: f64| {
        if bf16 {
            (3.0 * h + q + 2.0 * h + i) / 2.0
        } else {
            shared_qkv + shared_gate_up + attention_out + swiglu
        }
    };
    let (per_token, per_token_key) = match path {
        ComputePath::CpuKernels => {
            // RMSNorm, RoPE, SwiGLU and attention are single nodes keeping only their inputs
            // (RoPE its tables); attention keeps no scores, two floats per query row and head.
            let kept_by_nodes = q // q_proj output (q_norm's input)
                + q // queries after RoPE (attention's input)
                + kv // k_proj output
                + kv // keys after RoPE
                + kv // values
                + q // attention output (also o_proj's input)
                + 2.0 * heads // softmax maximum and sum
                + h // residual after attention (post_attention_layernorm's input)
                + 2.0 * i // gate_proj and up_proj outputs (the SwiGLU node's inputs)
                + h; // the layer's output
                     // input_layernorm and post_attention_layernorm outputs, SwiGLU output; the
                     // attention output is kept by the attention node either way (0 here, Q/2 more at
                     // bf16 for o_proj's own copy).
            let inputs = if bf16 {
                product_inputs(0.0, 0.0, 0.0, 0.0)
            } else {
                product_inputs(h, h, 0.0, i)
            };
            (kept_by_nodes + inputs, 0.0)
        }
        ComputePath::Portable => {
            // RMSNorm as tensor ops keeps x·rsqrt(mean x²) for the weight's gradient; RoPE as
            // tensor ops keeps only its tables; eager attention keeps the regrouped queries
            // (a copy), exp(scores − max) and the probabilities; SiLU keeps sigmoid(gate) and
            // silu(gate) besides gate.
            let kept = h // input_layernorm: x·rsqrt
                + q + q + q // q_proj output, q_norm's x·rsqrt, queries after RoPE
                + q // queries regrouped [b, kv, groups·q, d] for QKᵀ
                + kv + kv + kv // k_proj output, k_norm's x·rsqrt, keys after RoPE
                + kv // values
                + h // residual after attention
                + h // post_attention_layernorm: x·rsqrt
                + 2.0 * i // gate_proj and up_proj outputs
                + 2.0 * i // sigmoid(gate), silu(gate)
                + h; // the layer's output
                     // input_layernorm output, post_attention_layernorm output, the attention output
                     // (a copy to [b, q, heads·d]), SwiGLU output.
            let inputs = product_inputs(h, h, q, i);
            (kept + inputs, 2.0 * heads)
        }
    };
    LayerKept {
        per_token: per_token + lora.rank_sum + lora.dropout_inputs,
        per_token_key,
    }
}

/// Values per token kept once per forward pass and shared by every layer: the RoPE tables,
/// `cos` and `sin` expanded to every query and key head.
pub(super) fn rotary_tables(dims: Dims) -> f64 {
    2.0 * (dims.q + dims.kv)
}

/// What the head keeps per scored token: the final norm's output (a copy, laid out for the
/// product; the portable norm keeps `x·rsqrt` and its output too) and logits-sized tensors — the
/// logits themselves (kept by the CPU kernel's log-prob node) or `exp(logits − max)` (kept by
/// the log-sum-exp as tensor ops), plus `exp` and `logits − max` for an entropy that takes a
/// gradient. Every chunk's share stays alive until the backward pass.
pub(super) fn head_kept(dims: Dims, path: ComputePath, entropy_tracked: bool) -> f64 {
    let hidden = match path {
        ComputePath::CpuKernels => dims.hidden,
        ComputePath::Portable => 3.0 * dims.hidden,
    };
    let logits = if entropy_tracked { 3.0 } else { 1.0 };
    hidden + logits * dims.vocab
}

/// Logits-sized tensors of one chunk alive at once beside the kept ones, at the worst moment of
/// the head's forward or backward pass: the product's output and its contiguous copy (the tied
/// head computes `(embed · xᵀ)ᵀ`) or the gradient and its copy on the CPU; the logits, `logits −
/// max`, `exp` and their gradients as tensor ops.
pub(super) fn head_transient_chunks(path: ComputePath) -> f64 {
    match path {
        ComputePath::CpuKernels => 2.0,
        ComputePath::Portable => 4.0,
    }
}

/// Values per (token, key) alive at once while one layer's attention runs as tensor ops, beside
/// the kept ones: the scores and their scaled, masked and shifted successors (forward), their
/// gradients (backward). The CPU kernels compute attention a block of rows at a time.
pub(super) fn attention_transient_per_key(dims: Dims, path: ComputePath) -> f64 {
    match path {
        ComputePath::CpuKernels => 0.0,
        ComputePath::Portable => 3.0 * dims.heads,
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
            vocab: 151_936.0,
        }
    }

    #[test]
    fn kernel_path_keeps_four_hidden_three_query_three_kv_three_mlp_widths() {
        let kept = layer_kept(
            dims(),
            ComputePath::CpuKernels,
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
            dropout_inputs: 0.0,
        };
        let with = layer_kept(dims(), ComputePath::Portable, MatmulPrecision::F32, lora);
        assert_eq!(with.per_token, 35_840.0 + 56.0);
    }

    #[test]
    fn the_head_keeps_a_logits_row_per_token() {
        assert_eq!(
            head_kept(dims(), ComputePath::CpuKernels, false),
            1024.0 + 151_936.0
        );
        assert_eq!(
            head_kept(dims(), ComputePath::Portable, true),
            3.0 * 1024.0 + 3.0 * 151_936.0
        );
    }
}

//! Activation checkpointing per decoder layer: the forward pass keeps only each layer's input,
//! and the backward pass recomputes one layer at a time.
//!
//! burn 0.21's own checkpointing (`BalancedCheckpointing`) recomputes only the operations it
//! marks memory-bound (element-wise ones) and keeps every matrix product's operands, so it does
//! not drop a layer's activations. Here the chain rule is applied layer by layer instead, with
//! plain burn calls and one small autodiff graph at a time (never nested):
//!
//! 1. the embedding and every layer run with no parameter taking a gradient (no graph), keeping
//!    the layers' inputs `x_0 … x_{L−1}` and the last layer's output `x_L`;
//! 2. the final norm runs with autodiff from `x_L` as a leaf, the head and the loss a chunk of
//!    positions at a time ([`super::head`]); their backward gives the head's and the norm's
//!    gradients and `g_L = ∂loss/∂x_L`;
//! 3. for `l = L−1 … 0`: the layer runs again with autodiff from the leaf `x_l`, and the backward
//!    of `Σ layer(x_l) ⊙ g_{l+1}` (a vector-Jacobian product) gives the layer's parameter
//!    gradients and `g_l`; `x_l` is dropped;
//! 4. the embedding runs again with autodiff and the backward of `Σ embed(ids) ⊙ g_0` gives the
//!    table's gradient (with tied embeddings it adds to the head's).
//!
//! Peak activation memory is then the layers' inputs plus one layer's activations (or the
//! head's, whichever is larger) instead of every layer's; the price is a second forward pass of
//! every layer. The head and the loss are the same code as without checkpointing
//! ([`super::head::head_gradients`]), so the gradients are those of the same function.

use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use model::lora::CausalLm;
use model::qwen3::AttentionMask;
use model::{LoraModel, TokenBatch};

use super::batch::PolicySequence;
use super::error::GrpoError;
use super::loss::LossStats;
use super::head::head_gradients;
use super::step::{token_batch, LearnConfig};

/// Why dropout and checkpointing do not go together.
pub const DROPOUT: &str = "activation checkpointing needs lora.dropout = 0: a recomputed layer would draw other \
                           dropout masks than its forward pass (set grpo.activation_checkpointing = false to keep dropout)";

/// The gradients of `weight · loss(micro)` of `policy` for every parameter of `module` (the
/// policy's model, or its LoRA adapters), and the loss terms, computed with one decoder
/// layer's activations alive at a time (see the module docs). The same gradients as
/// `backward()` of the micro-batch's loss, up to the rounding of recomputed sums. The
/// embedding's pass is left out when its table takes no gradient (a frozen LoRA base).
pub fn checkpointed_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    policy: &LoraModel<'_, B>,
    module: &M,
    micro: &[PolicySequence],
    weight: f32,
    config: &LearnConfig,
) -> Result<(GradientsParams, LossStats), GrpoError> {
    let (model, adapters) = (policy.base(), policy.adapters());
    if adapters.is_some_and(|a| a.config().dropout > 0.0) {
        return Err(GrpoError::Config(DROPOUT.into()));
    }
    let device = model.device();
    let batch = token_batch::<B>(micro, &device)?;
    let mut inputs = layer_inputs(policy, &batch);
    let mut accumulator = GradientsAccumulator::<M>::new();

    // The head and the loss, from the last layer's output.
    let last = inputs.pop().expect("the embeddings are always there");
    let dtype = last.dtype();
    let leaf = last.require_grad();
    // The final norm over a token a row, as the model's forward (and so scoring) takes it: the
    // same operations on the same shapes, so that the first ratios stay exactly 1 on every backend.
    let [rows, len, width] = leaf.dims();
    let pass = model.compute().pass(false);
    let hidden = model.model.norm.forward(leaf.clone().reshape([rows * len, width]), pass).reshape([rows, len, width]);
    let head = head_gradients(model, module, &hidden, &batch, micro, weight, config)?;
    let stats = head.stats;
    let mut grads = (hidden * head.hidden_grad).sum().backward();
    let mut upstream = leaf.grad(&grads).ok_or_else(no_gradient)?;
    accumulator.accumulate(module, GradientsParams::from_module(&mut grads, module));
    accumulator.accumulate(module, head.grads);
    drop(grads);

    // Each layer again, from the top, as a vector-Jacobian product with the gradient above it.
    let [b, len] = batch.input_ids.dims();
    let mask = AttentionMask::new(batch.mask(), b, 0, len, &device);
    let attention = model.model.attention_inputs(batch.position_ids.clone(), mask, dtype);
    let layers = model.model.layers.iter().enumerate().zip(inputs.drain(..));
    for ((i, layer), input) in layers.rev() {
        let leaf = input.require_grad();
        let layer_adapters = adapters.map(|a| &a.layers[i]);
        let output = layer.forward_with_adapters(leaf.clone(), &attention, None, &model.model.compute, layer_adapters);
        let mut grads = (output * Tensor::from_inner(upstream)).sum().backward();
        upstream = leaf.grad(&grads).ok_or_else(no_gradient)?;
        accumulator.accumulate(module, GradientsParams::from_module(&mut grads, module));
    }

    // The embedding, as the model computes it (the CPU kernels' lookup where they run), and its
    // backward: each position's gradient added into its token's row of a fresh table (with tied
    // embeddings, added in place to the head's gradient).
    let embed = &model.model.embed_tokens;
    let table = embed.weight.val();
    if table.is_require_grad() {
        let ids = batch.input_ids.clone();
        let rows =
            model::cpu_kernels::ops::embedding(pass.cpu, &table, &ids).unwrap_or_else(|| embed.forward(ids));
        let mut grads = (rows * Tensor::from_inner(upstream)).sum().backward();
        accumulator.accumulate(module, GradientsParams::from_module(&mut grads, module));
    }
    Ok((accumulator.grads(), stats))
}

/// The forward pass without a graph: the embeddings (the first layer's input), every other
/// layer's input, and the last layer's output, in order. It runs on the autodiff backend with
/// no parameter taking a gradient, so no operation keeps anything, and each value is computed
/// exactly as the recomputation and the plain backward pass compute it (the inner backend may
/// take other kernels, e.g. the CPU's bf16 ones, and round differently).
fn layer_inputs<B: AutodiffBackend>(
    policy: &LoraModel<'_, B>,
    batch: &TokenBatch<B>,
) -> Vec<Tensor<B, 3>> {
    let base = policy.base().clone().no_grad();
    let adapters = policy.adapters().map(|a| a.clone().no_grad());
    let output = base.model.forward_with_adapters(
        batch.input_ids.clone(),
        batch.position_ids.clone(),
        batch.mask(),
        None,
        true,
        adapters.as_ref(),
    );
    output
        .hidden_states
        .expect("asked for every layer's output")
}

/// A leaf that got no gradient: the loss does not depend on it, which cannot happen for a
/// decoder's hidden states.
fn no_gradient() -> GrpoError {
    GrpoError::Input("activation checkpointing: a layer's input got no gradient".into())
}

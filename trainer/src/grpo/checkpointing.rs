//! Activation checkpointing per decoder layer: the forward pass keeps only each layer's input,
//! and the backward pass recomputes one layer at a time.
//!
//! burn 0.21's own checkpointing (`BalancedCheckpointing`) recomputes only the operations it
//! marks memory-bound (element-wise ones) and keeps every matrix product's operands, so it does
//! not drop a layer's activations. Here the chain rule is applied layer by layer instead, with
//! plain burn calls and one small autodiff graph at a time (never nested):
//!
//! 1. the embedding and every layer run on the inner backend (no graph), keeping the layers'
//!    inputs `x_0 … x_{L−1}` and the last layer's output `x_L`;
//! 2. the final norm, the head and the loss run with autodiff from `x_L` as a leaf; their
//!    backward gives the head's and the norm's gradients and `g_L = ∂loss/∂x_L`;
//! 3. for `l = L−1 … 0`: the layer runs again with autodiff from the leaf `x_l`, and the backward
//!    of `Σ layer(x_l) ⊙ g_{l+1}` (a vector-Jacobian product) gives the layer's parameter
//!    gradients and `g_l`; `x_l` is dropped;
//! 4. the embedding runs again with autodiff and the backward of `Σ embed(ids) ⊙ g_0` gives the
//!    table's gradient (with tied embeddings it adds to the head's).
//!
//! Peak activation memory is then the layers' inputs plus one layer's activations (or the
//! head's, whichever is larger) instead of every layer's; the price is a second forward pass of
//! every layer. The loss is the same code as without checkpointing
//! ([`super::step::loss_from_hidden`]), so the gradients are those of the same function.

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use model::qwen3::{attention_bias, AttentionInputs};
use model::Qwen3ForCausalLM;

use super::batch::PolicySequence;
use super::error::GrpoError;
use super::loss::LossStats;
use super::step::{loss_from_hidden, token_batch, LearnConfig};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// The gradients of `weight · loss(micro)` for every parameter of `model` that takes one, and
/// the loss terms, computed with one decoder layer's activations alive at a time (see the
/// module docs). The same gradients as `backward()` of the micro-batch's loss, up to the
/// rounding of recomputed sums.
pub fn checkpointed_gradients<B: AutodiffBackend>(
    model: &Qwen3ForCausalLM<B>,
    micro: &[PolicySequence],
    weight: f32,
    config: &LearnConfig,
) -> Result<(GradientsParams, LossStats), GrpoError> {
    let device = model.device();
    let batch = token_batch::<B>(micro, &device)?;
    let mut inputs = layer_inputs(model, micro)?;
    let mut accumulator = GradientsAccumulator::<Qwen3ForCausalLM<B>>::new();

    // The head and the loss, from the last layer's output.
    let last = inputs.pop().expect("the embeddings are always there");
    let dtype = last.dtype();
    let leaf = Tensor::<B, 3>::from_inner(last).require_grad();
    let hidden = model.model.norm.forward(leaf.clone());
    let (loss, stats) = loss_from_hidden(model, hidden, &batch, micro, config)?;
    let mut grads = loss.mul_scalar(weight).backward();
    let mut upstream = leaf.grad(&grads).ok_or_else(no_gradient)?;
    accumulator.accumulate(model, GradientsParams::from_module(&mut grads, model));
    drop(grads);

    // Each layer again, from the top, as a vector-Jacobian product with the gradient above it.
    let [b, len] = batch.input_ids.dims();
    let attention = model.model.layers.first().map(|first| {
        let bias = attention_bias(batch.mask(), b, 0, len, dtype, &device);
        let attn = &first.self_attn;
        AttentionInputs::new(
            &model.model.rotary_emb,
            batch.position_ids.clone(),
            bias,
            attn.num_heads,
            attn.num_key_value_heads,
        )
    });
    for (layer, input) in model.model.layers.iter().zip(inputs.drain(..)).rev() {
        let attention = attention.as_ref().expect("built when there are layers");
        let leaf = Tensor::<B, 3>::from_inner(input).require_grad();
        let output = layer.forward(leaf.clone(), attention, None, model.model.matmul);
        let mut grads = (output * Tensor::from_inner(upstream)).sum().backward();
        upstream = leaf.grad(&grads).ok_or_else(no_gradient)?;
        accumulator.accumulate(model, GradientsParams::from_module(&mut grads, layer));
    }

    // The embedding, as the model computes it (the CPU kernels' lookup where they run), and its
    // backward: each position's gradient added into its token's row of a fresh table (with tied
    // embeddings, added in place to the head's gradient).
    let embed = &model.model.embed_tokens;
    let table = embed.weight.val();
    if table.is_require_grad() {
        let ids = batch.input_ids.clone();
        let rows =
            model::cpu_kernels::ops::embedding(&table, &ids).unwrap_or_else(|| embed.forward(ids));
        let mut grads = (rows * Tensor::from_inner(upstream)).sum().backward();
        accumulator.accumulate(model, GradientsParams::from_module(&mut grads, embed));
    }
    Ok((accumulator.grads(), stats))
}

/// The forward pass without autodiff: the embeddings (the first layer's input), every other
/// layer's input, and the last layer's output, in order.
fn layer_inputs<B: AutodiffBackend>(
    model: &Qwen3ForCausalLM<B>,
    micro: &[PolicySequence],
) -> Result<Vec<Tensor<Inner<B>, 3>>, GrpoError> {
    let inner = model.valid();
    let batch = token_batch::<Inner<B>>(micro, &inner.device())?;
    let output = inner.model.forward(
        batch.input_ids.clone(),
        batch.position_ids.clone(),
        batch.mask(),
        None,
        true,
    );
    Ok(output
        .hidden_states
        .expect("asked for every layer's output"))
}

/// A leaf that got no gradient: the loss does not depend on it, which cannot happen for a
/// decoder's hidden states.
fn no_gradient() -> GrpoError {
    GrpoError::Input("activation checkpointing: a layer's input got no gradient".into())
}

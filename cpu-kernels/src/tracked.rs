//! Kernels under autodiff: operations recorded in burn's graph as one node with a hand-written
//! backward, for burn-flex wrapped in `Autodiff` (the training backend on the CPU): the
//! chosen-token log-probability, the embedding lookup, RMSNorm, the SwiGLU product, RoPE,
//! grouped-query attention and matmuls at bf16 precision. Also the entropy of the logits as a
//! value outside the graph (the trainer's metric).
//!
//! RMSNorm takes burn's ops seven single-threaded passes forward (square, mean, add, sqrt,
//! reciprocal, two broadcast products) and more backward, each keeping its temporaries for the
//! backward; SwiGLU takes four each way, and RoPE five (two halves, their concatenation, two
//! products and a sum). As nodes, each is one parallel pass each way that keeps only its inputs
//! (RoPE only its tables: its backward is the opposite rotation).
//!
//! The chosen-token log-probability of a training step's logits (`[b, n, vocab]`, 78M elements
//! for 2 × 256 tokens of Qwen3) takes burn's ops about eight single-threaded passes and as many
//! logits-sized temporaries forward and as many again backward. Here it is one parallel pass
//! each way; the node keeps the logits and each row's `logsumexp` for the backward.
//!
//! Attention under burn's ops is a matmul, a scale, the mask's addition, a five-pass softmax and
//! a matmul, each keeping a `[b, heads, q, k]` result for the backward, with copies to
//! broadcast the mask and lay out the operands. As a node it runs the inference kernel forward
//! (keeping two floats per query row) and one parallel pass backward.

use std::any::Any;
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind, OpsPrep};
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, bf16, Bytes, DType, Shape, Tensor, TensorPrimitive};
use burn_flex::{FlexTensor, Layout};

use rayon::prelude::*;

use crate::attention::{self, AttentionShape, SoftmaxStats};
use crate::flex::{flex_contiguous, narrow_all, rows_contiguous};
use crate::ops::{attention_views, WeightLayout};
use crate::transpose::transpose;
use crate::{attention_backward, fused, weight_matmul, Kernels};

type TrackedFlex = Autodiff<Flex>;

/// [`fused::chosen_logprobs`] as one autodiff node when `B` is `Autodiff<Flex>` and the logits
/// are f32; `None` otherwise. `ids` are the targets (already checked against `vocab`).
pub(super) fn chosen_logprobs<B: Backend>(
    kernels: Kernels,
    logits: &Tensor<B, 3>,
    ids: Vec<usize>,
    [b, n, vocab]: [usize; 3],
) -> Option<Tensor<B, 2>> {
    let tracked = as_tracked(logits)?;
    let values = flex_contiguous(&tracked.primitive);
    if values.dtype() != DType::F32 {
        return None;
    }
    let (logprobs, lse) = fused::chosen_logprobs(kernels, values.as_slice::<f32>()?, vocab, &ids, |x| x);
    let output = f32_tensor(logprobs, [b, n]);
    let state = || ChosenState { logits: values, targets: Arc::new(ids), lse: Arc::new(lse) };
    from_tracked(record(ChosenLogprobs(kernels).prepare([tracked.node.clone()]), state, output))
}

/// `weight[ids]`, `[b, s, hidden]`, as one autodiff node, for the table of an `Autodiff<Flex>`
/// tensor (see [`as_tracked`]) when it is f32; `None` otherwise. `ids` (`b · s` of them) are
/// already checked against `vocab`. Its backward adds each position's gradient row into a zeroed table in one
/// pass, where burn-flex fills a table with zeros, copies it to realign it and copies it again
/// inside `select_add` (three table-sized passes; Qwen3-0.6B's table is 622 MB).
pub(super) fn embedding<B: Backend>(
    tracked: FloatTensor<TrackedFlex>,
    ids: Vec<usize>,
    [b, s]: [usize; 2],
) -> Option<Tensor<B, 3>> {
    let table = flex_contiguous(&tracked.primitive);
    if table.dtype() != DType::F32 {
        return None;
    }
    let [vocab, hidden]: [usize; 2] = table.layout().shape().dims();
    let rows = table.as_slice::<f32>()?;
    let mut out = vec![0.0f32; ids.len() * hidden];
    out.par_chunks_mut(hidden)
        .zip(ids.par_iter())
        .for_each(|(out, &id)| out.copy_from_slice(&rows[id * hidden..(id + 1) * hidden]));
    let output = f32_tensor(out, [b, s, hidden]);
    let state = || EmbeddingState { ids: Arc::new(ids), vocab };
    from_tracked(record(EmbeddingRows.prepare([tracked.node.clone()]), state, output))
}

/// [`fused::row_entropy`] of f32 logits when `B` is `Autodiff<Flex>`, as a tensor outside the
/// graph (no gradient flows back through it); `None` otherwise.
pub(super) fn untracked_entropy<B: Backend>(
    kernels: Kernels,
    logits: &Tensor<B, 3>,
    [b, n, vocab]: [usize; 3],
) -> Option<Tensor<B, 2>> {
    let tracked = as_tracked(logits)?;
    let values = flex_contiguous(&tracked.primitive);
    let entropy = fused::row_entropy(kernels, values.as_slice::<f32>()?, vocab);
    let inner = f32_tensor(entropy, [b, n]);
    let outside = Tensor::<TrackedFlex, 2>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(inner)));
    from_tracked(outside.into_primitive().tensor())
}

/// HF's RMSNorm (see [`fused::rms_norm_f32`]) as one autodiff node when `x` and `weight` are
/// f32 tensors of `Autodiff<Flex>`; `None` otherwise.
pub(super) fn rms_norm<B: Backend, const D: usize>(
    kernels: Kernels,
    x: &Tensor<B, D>,
    weight: &Tensor<B, 1>,
    eps: f32,
) -> Option<Tensor<B, D>> {
    let (x, weight) = (as_tracked(x)?, as_tracked(weight)?);
    let (xs, ws) = (flex_contiguous(&x.primitive), flex_contiguous(&weight.primitive));
    let y = fused::rms_norm_f32(kernels, xs.as_slice::<f32>()?, ws.as_slice::<f32>()?, eps);
    let output = f32_tensor(y, xs.layout().shape().clone());
    let parents = [x.node.clone(), weight.node.clone()];
    from_tracked(record(RmsNorm(kernels).prepare(parents), || RmsNormState { x: xs, weight: ws, eps }, output))
}

/// `silu(gate) * up` (see [`fused::silu_mul_f32`]) as one autodiff node when both are f32
/// tensors of `Autodiff<Flex>` of one shape; `None` otherwise.
pub(super) fn silu_mul<B: Backend, const D: usize>(kernels: Kernels, gate: &Tensor<B, D>, up: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    let (gate, up) = (as_tracked(gate)?, as_tracked(up)?);
    let (gs, us) = (flex_contiguous(&gate.primitive), flex_contiguous(&up.primitive));
    let y = fused::silu_mul_f32(kernels, gs.as_slice::<f32>()?, us.as_slice::<f32>()?);
    let output = f32_tensor(y, gs.layout().shape().clone());
    let parents = [gate.node.clone(), up.node.clone()];
    from_tracked(record(SiluMul(kernels).prepare(parents), || SiluMulState { gate: gs, up: us }, output))
}

/// RoPE (see [`fused::rotary_f32`]) as one autodiff node when `x` and both tables are f32
/// tensors of `Autodiff<Flex>` of one shape; `None` otherwise. The tables take no gradient.
pub(super) fn rotary<B: Backend>(
    kernels: Kernels,
    x: &Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    signed_sin: &Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    let (x, cos, signed_sin) = (as_tracked(x)?, as_tracked(cos)?, as_tracked(signed_sin)?);
    if [&x, &cos, &signed_sin].iter().any(|t| t.primitive.dtype() != DType::F32) {
        return None;
    }
    let [xs, cos, sin] = [&x, &cos, &signed_sin].map(|t| flex_contiguous(&t.primitive));
    let dims: [usize; 4] = xs.layout().shape().dims();
    let y = fused::rotary_f32(kernels, xs.as_slice::<f32>()?, cos.as_slice::<f32>()?, sin.as_slice::<f32>()?, dims[3]);
    let output = f32_tensor(y, dims);
    from_tracked(record(Rotary(kernels).prepare([x.node.clone()]), || RotaryState { cos, signed_sin: sin }, output))
}

/// Grouped-query attention (see [`attention::grouped_attention`]) as one autodiff node when
/// `query`, `key`, `value` and `bias` are f32 tensors of `Autodiff<Flex>`; `None` otherwise.
/// Layouts as for [`super::grouped_attention`]; the bias takes no gradient. The node keeps its
/// operands (views, not copies), its output and each query row's softmax maximum and sum; the
/// backward recomputes the probabilities from them (see [`attention_backward`]).
pub(super) fn grouped_attention<B: Backend>(
    kernels: Kernels,
    query: &Tensor<B, 4>,
    key: &Tensor<B, 4>,
    value: &Tensor<B, 4>,
    bias: &Tensor<B, 4>,
    shape: AttentionShape,
    scale: f32,
) -> Option<Tensor<B, 3>> {
    let [query, key, value, bias] = [query, key, value, bias].map(as_tracked);
    let (query, key, value, bias) = (query?, key?, value?, bias?);
    if [&query, &key, &value, &bias].iter().any(|t| t.primitive.dtype() != DType::F32) {
        return None;
    }
    let [q, k, v, m] = [&query, &key, &value, &bias].map(|t| rows_contiguous(t.primitive.clone()));
    let (qv, kv, vv, mv) = attention_views::<f32>([&q, &k, &v, &m]);
    let (out, stats) = attention::grouped_attention_with_stats(kernels, qv, kv, vv, mv, shape, scale);
    let AttentionShape { batch, queries, heads, head_dim, .. } = shape;
    let output = f32_tensor(out, [batch, queries, heads * head_dim]);
    let parents = [query.node.clone(), key.node.clone(), value.node.clone()];
    let out = output.clone();
    let state = || AttentionState { operands: [q, k, v, m], out, stats: Arc::new(stats), shape, scale };
    from_tracked(record(Attention(kernels).prepare(parents), state, output))
}

/// `x · w` (or `x · wᵀ`) with bf16 operands and f32 sums (see [`super::bf16_matmul`]) as one
/// autodiff node when `x` and `w` are f32 tensors of `Autodiff<Flex>`; `None` otherwise. `w`
/// gives `y[m, n] = x[m, k] · w` as `layout` says. Both gradients are bf16 products too (the
/// output gradient, `x` and `w` rounded, f32 sums), as under PyTorch's bf16 autocast. The
/// weight is rounded as the kernel packs it, never copied; the node keeps `x` rounded to bf16
/// and `w` as it is.
pub(super) fn bf16_matmul<B: Backend, const D: usize>(
    kernels: Kernels,
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
    layout: WeightLayout,
    k: usize,
    n: usize,
) -> Option<Tensor<B, D>> {
    let (x, w) = (as_tracked(x)?, as_tracked(w)?);
    let (xs, ws) = (flex_contiguous(&x.primitive), w.primitive.clone());
    let xb = narrow_all(kernels, xs.as_slice::<f32>()?);
    let m = xb.len() / k;
    let y = weight_matmul::matmul_rounded(kernels, &xb, ws.as_slice::<f32>()?, layout, m, k, n);
    let mut dims: [usize; D] = xs.layout().shape().dims();
    dims[D - 1] = n;
    let output = f32_tensor(y, dims);
    let parents = [x.node.clone(), w.node.clone()];
    let state = || Bf16MatmulState { x: Arc::new(xb), weight: ws, x_shape: xs.layout().shape().clone(), layout, m, k, n };
    from_tracked(record(Bf16Matmul(kernels).prepare(parents), state, output))
}

/// Records a compute-bound node with output `output`; its backward's `state` is built (and kept)
/// only when some parent takes a gradient.
fn record<Op, S, const N: usize>(
    prep: OpsPrep<Op, Flex, S, NoCheckpointing, N>,
    state: impl FnOnce() -> S,
    output: FlexTensor,
) -> FloatTensor<TrackedFlex>
where
    Op: Backward<Flex, N, State = S>,
    S: Clone + Send + std::fmt::Debug + 'static,
{
    match prep.compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state(), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

/// The `Autodiff<Flex>` tensor behind `t`, when `B` is `Autodiff<Flex>`.
pub(super) fn as_tracked<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Option<FloatTensor<TrackedFlex>> {
    let primitive: Box<dyn Any> = Box::new(t.clone().into_primitive().tensor());
    primitive.downcast::<FloatTensor<TrackedFlex>>().ok().map(|t| *t)
}

/// `t` as a tensor of `B` (which is `Autodiff<Flex>` when this is reached).
fn from_tracked<B: Backend, const D: usize>(t: FloatTensor<TrackedFlex>) -> Option<Tensor<B, D>> {
    let primitive: Box<dyn Any> = Box::new(t);
    let primitive = *primitive.downcast::<B::FloatTensorPrimitive>().ok()?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(primitive)))
}

/// f32 `values` as a contiguous tensor of `shape`.
fn f32_tensor(values: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::new(Bytes::from_elems(values), Layout::contiguous(shape.into()), DType::F32)
}

/// Registers the gradients of a node's inputs for those inputs that take one.
fn register_each<const N: usize>(parents: [Option<NodeId>; N], grads: &mut Gradients, values: [FlexTensor; N]) {
    for (parent, grad) in parents.into_iter().zip(values) {
        if let Some(parent) = parent {
            grads.register::<Flex>(parent, grad);
        }
    }
}

/// The node: `logprobs = logits[target] - logsumexp(logits)` per row.
#[derive(Debug)]
struct ChosenLogprobs(Kernels);

/// What the backward needs: the contiguous f32 logits, the targets and each row's `logsumexp`.
#[derive(Debug, Clone)]
struct ChosenState {
    logits: FlexTensor,
    targets: Arc<Vec<usize>>,
    lse: Arc<Vec<f32>>,
}

impl Backward<Flex, 1> for ChosenLogprobs {
    type State = ChosenState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let kernels = self.0;
        let ChosenState { logits, targets, lse } = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            let grad = flex_contiguous(&grad);
            let dims: [usize; 3] = logits.layout().shape().dims();
            let values = match (logits.as_slice::<f32>(), grad.as_slice::<f32>()) {
                (Some(logits), Some(grad)) => fused::chosen_logprobs_backward(kernels, logits, dims[2], &targets, &lse, grad),
                _ => unreachable!("the forward pass only records f32 logits, and its gradient is f32"),
            };
            f32_tensor(values, dims)
        });
    }
}

/// The node: rows of an embedding table.
#[derive(Debug)]
struct EmbeddingRows;

/// What the backward needs: the row of each position and the table's height.
#[derive(Debug, Clone)]
struct EmbeddingState {
    ids: Arc<Vec<usize>>,
    vocab: usize,
}

impl Backward<Flex, 1> for EmbeddingRows {
    type State = EmbeddingState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let EmbeddingState { ids, vocab } = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            let grad = flex_contiguous(&grad);
            let hidden = grad.layout().shape().dims::<3>()[2];
            let Some(grad) = grad.as_slice::<f32>() else {
                unreachable!("the forward pass only records an f32 table, and its gradient is f32")
            };
            let mut table = vec![0.0f32; vocab * hidden];
            for (&id, row) in ids.iter().zip(grad.chunks_exact(hidden)) {
                for (t, &g) in table[id * hidden..(id + 1) * hidden].iter_mut().zip(row) {
                    *t += g;
                }
            }
            f32_tensor(table, [vocab, hidden])
        });
    }
}

/// The node: `weight ⊙ x / sqrt(mean(x²) + eps)` over the last axis.
#[derive(Debug)]
struct RmsNorm(Kernels);

/// What the backward needs: the contiguous f32 input and weight, and `eps`.
#[derive(Debug, Clone)]
struct RmsNormState {
    x: FlexTensor,
    weight: FlexTensor,
    eps: f32,
}

impl Backward<Flex, 2> for RmsNorm {
    type State = RmsNormState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let RmsNormState { x, weight, eps } = ops.state;
        let grad = flex_contiguous(&grads.consume::<Flex>(&ops.node));
        let (Some(xv), Some(wv), Some(gv)) = (x.as_slice::<f32>(), weight.as_slice::<f32>(), grad.as_slice::<f32>())
        else {
            unreachable!("the forward pass only records f32 inputs, and its gradient is f32")
        };
        let (dx, dweight) = fused::rms_norm_backward_f32(self.0, xv, wv, gv, eps);
        let pair = [f32_tensor(dx, x.layout().shape().clone()), f32_tensor(dweight, weight.layout().shape().clone())];
        register_each(ops.parents.map(|p| p.map(|p| p.id)), grads, pair);
    }
}

/// The node: `silu(gate) ⊙ up`.
#[derive(Debug)]
struct SiluMul(Kernels);

/// What the backward needs: both contiguous f32 inputs.
#[derive(Debug, Clone)]
struct SiluMulState {
    gate: FlexTensor,
    up: FlexTensor,
}

impl Backward<Flex, 2> for SiluMul {
    type State = SiluMulState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let SiluMulState { gate, up } = ops.state;
        let grad = flex_contiguous(&grads.consume::<Flex>(&ops.node));
        let (Some(gv), Some(uv), Some(yv)) = (gate.as_slice::<f32>(), up.as_slice::<f32>(), grad.as_slice::<f32>())
        else {
            unreachable!("the forward pass only records f32 inputs, and its gradient is f32")
        };
        let (dgate, dup) = fused::silu_mul_backward_f32(self.0, gv, uv, yv);
        let shape = gate.layout().shape();
        register_each(ops.parents.map(|p| p.map(|p| p.id)), grads, [f32_tensor(dgate, shape.clone()), f32_tensor(dup, shape.clone())]);
    }
}

/// The node: `y = x · w` with bf16 operands and f32 sums.
#[derive(Debug)]
struct Bf16Matmul(Kernels);

/// What the backward needs: `x` rounded to bf16 (`[m, k]`), the f32 weight and the shapes.
#[derive(Debug, Clone)]
struct Bf16MatmulState {
    x: Arc<Vec<bf16>>,
    weight: FlexTensor,
    x_shape: Shape,
    layout: WeightLayout,
    m: usize,
    k: usize,
    n: usize,
}

impl Backward<Flex, 2> for Bf16Matmul {
    type State = Bf16MatmulState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let kernels = self.0;
        let Bf16MatmulState { x, weight, x_shape, layout, m, k, n } = ops.state;
        let grad = flex_contiguous(&grads.consume::<Flex>(&ops.node));
        let (Some(gv), Some(wv)) = (grad.as_slice::<f32>(), weight.as_slice::<f32>()) else {
            unreachable!("the forward pass only records f32 inputs, and its gradient is f32")
        };
        let [x_parent, w_parent] = ops.parents.map(|p| p.map(|p| p.id));
        let gb = narrow_all(kernels, gv);
        if let Some(parent) = x_parent {
            // dx[m, k] = dy[m, n] · wᵀ: the weight read the other way round.
            let flipped = match layout {
                WeightLayout::InOut => WeightLayout::OutIn,
                WeightLayout::OutIn => WeightLayout::InOut,
            };
            let dx = weight_matmul::matmul_rounded(kernels, &gb, wv, flipped, m, n, k);
            grads.register::<Flex>(parent, f32_tensor(dx, x_shape));
        }
        if let Some(parent) = w_parent {
            let dw = match layout {
                // dw[k, n] = xᵀ · dy
                WeightLayout::InOut => {
                    drop(gb);
                    weight_matmul::matmul_rounded(kernels, &transpose(&x, m, k), gv, WeightLayout::InOut, k, m, n)
                }
                // dw[n, k] = dyᵀ · x (for the head, dy is the largest tensor of the step: free
                // it before its transpose is allocated)
                WeightLayout::OutIn => {
                    drop(grad);
                    let gt = transpose(&gb, m, n);
                    drop(gb);
                    weight_matmul::matmul_bf16_f32(kernels, &gt, &x, WeightLayout::InOut, n, m, k)
                }
            };
            grads.register::<Flex>(parent, f32_tensor(dw, weight.layout().shape().clone()));
        }
    }
}

/// The node: RoPE's rotation of each pair of a row's halves.
#[derive(Debug)]
struct Rotary(Kernels);

/// What the backward needs: the contiguous f32 tables.
#[derive(Debug, Clone)]
struct RotaryState {
    cos: FlexTensor,
    signed_sin: FlexTensor,
}

impl Backward<Flex, 1> for Rotary {
    type State = RotaryState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let kernels = self.0;
        let RotaryState { cos, signed_sin } = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            let grad = flex_contiguous(&grad);
            let dims: [usize; 4] = grad.layout().shape().dims();
            let (Some(g), Some(c), Some(s)) = (grad.as_slice::<f32>(), cos.as_slice::<f32>(), signed_sin.as_slice::<f32>())
            else {
                unreachable!("the forward pass only records f32 tables, and its gradient is f32")
            };
            f32_tensor(fused::rotary_backward_f32(kernels, g, c, s, dims[3]), dims)
        });
    }
}

/// The node: `softmax(Q Kᵀ · scale + bias) V` over grouped key/value heads.
#[derive(Debug)]
struct Attention(Kernels);

/// What the backward needs: the f32 query, key, value and bias views, the output and each query
/// row's softmax statistics.
#[derive(Debug, Clone)]
struct AttentionState {
    operands: [FlexTensor; 4],
    out: FlexTensor,
    stats: Arc<Vec<SoftmaxStats>>,
    shape: AttentionShape,
    scale: f32,
}

impl Backward<Flex, 3> for Attention {
    type State = AttentionState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let AttentionState { operands: [q, k, v, m], out, stats, shape, scale } = ops.state;
        let grad = flex_contiguous(&grads.consume::<Flex>(&ops.node));
        let (Some(out), Some(grad)) = (out.as_slice::<f32>(), grad.as_slice::<f32>()) else {
            unreachable!("the forward pass only records f32 operands, and its gradient is f32")
        };
        let (qv, kv, vv, mv) = attention_views::<f32>([&q, &k, &v, &m]);
        let g = attention_backward::grouped_attention_backward(
            self.0,
            qv,
            kv,
            vv,
            mv,
            out,
            &stats,
            grad,
            shape,
            scale,
        );
        let AttentionShape { batch, queries, keys, heads, kv_heads, head_dim } = shape;
        let values = [
            f32_tensor(g.query, [batch, queries, heads, head_dim]),
            f32_tensor(g.key, [batch, kv_heads, keys, head_dim]),
            f32_tensor(g.value, [batch, kv_heads, keys, head_dim]),
        ];
        register_each(ops.parents.map(|p| p.map(|p| p.id)), grads, values);
    }
}

#[cfg(test)]
mod tests {
    use crate::Kernels;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Int, Tensor, TensorData};

    use super::AttentionShape;

    /// The node's value and gradient equal those of burn's ops on the same formula.
    #[test]
    fn value_and_gradient_match_the_tensor_formula() {
        type B = Autodiff<Flex>;
        let device = Default::default();
        let (b, n, vocab) = (2, 3, 50);
        let values: Vec<f32> = (0..b * n * vocab).map(|i| (i as f32 * 0.377).sin() * 4.0).collect();
        let logits = || Tensor::<B, 3>::from_data(TensorData::new(values.clone(), [b, n, vocab]), &device).require_grad();
        let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![0i64, 7, 49, 12, 3, 30], [b, n]), &device);
        let weights = Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32, -0.5, 2.0, 0.25, -1.5, 0.75], [b, n]), &device);

        let fused_in = logits();
        let fused = crate::ops::chosen_logprobs(Kernels::default(), &fused_in, &targets).expect("Autodiff<Flex> f32 is handled");
        let plain_in = logits();
        let max = plain_in.clone().max_dim(2).detach();
        let lse = (plain_in.clone() - max.clone()).exp().sum_dim(2).log() + max;
        let plain = (plain_in.clone().gather(2, targets.clone().reshape([b, n, 1])) - lse).reshape([b, n]);

        let close = |a: Vec<f32>, b: Vec<f32>| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5);
        assert!(close(fused.clone().into_data().to_vec().unwrap(), plain.clone().into_data().to_vec().unwrap()));
        let fused_grads = (fused * weights.clone()).sum().backward();
        let plain_grads = (plain * weights).sum().backward();
        let fused_grad = fused_in.grad(&fused_grads).unwrap().into_data().to_vec().unwrap();
        let plain_grad = plain_in.grad(&plain_grads).unwrap().into_data().to_vec().unwrap();
        assert!(close(fused_grad, plain_grad));
    }

    /// Rows and the table's gradient (a repeated id accumulates) equal burn's `embedding`.
    #[test]
    fn embedding_rows_and_gradient_match_burn() {
        type B = Autodiff<Flex>;
        let device = Default::default();
        let (vocab, hidden) = (11, 6);
        let values: Vec<f32> = (0..vocab * hidden).map(|i| (i as f32 * 0.61).cos()).collect();
        let table = || Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [vocab, hidden]), &device).require_grad();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![3i64, 10, 3, 0, 7, 3], [2, 3]), &device);
        let weights: Vec<f32> = (0..2 * 3 * hidden).map(|i| i as f32 * 0.1 - 1.0).collect();
        let weights = Tensor::<B, 3>::from_data(TensorData::new(weights, [2, 3, hidden]), &device);

        let fused_in = table();
        let fused = crate::ops::embedding(Kernels::default(), &fused_in, &ids).expect("Autodiff<Flex> f32 is handled");
        let plain_in = table();
        let plain = burn::tensor::module::embedding(plain_in.clone(), ids.clone());
        let values = |t: Tensor<Flex, 3>| t.into_data().to_vec::<f32>().unwrap();
        assert_eq!(values(fused.clone().inner()), values(plain.clone().inner()));
        let fused_grads = (fused * weights.clone()).sum().backward();
        let plain_grads = (plain * weights).sum().backward();
        let grad = |t: &Tensor<B, 2>, g| t.grad(g).unwrap().into_data().to_vec::<f32>().unwrap();
        assert_eq!(grad(&fused_in, &fused_grads), grad(&plain_in, &plain_grads));
    }

    /// The RMSNorm and SwiGLU nodes' values and their gradients for both inputs equal those of
    /// burn's ops on the same formulas (the model's fallbacks).
    #[test]
    fn rms_norm_and_silu_mul_nodes_match_burn() {
        type B = Autodiff<Flex>;
        let device = Default::default();
        let (rows, d) = (5, 24);
        let series = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin() * 2.0).collect() };
        let tensor = |v: &Vec<f32>, dims: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(v.clone(), dims), &device).require_grad();
        let grad = |t: &Tensor<B, 2>, g| t.grad(g).unwrap().into_data().to_vec::<f32>().unwrap();
        let values = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();
        let close = |a: Vec<f32>, b: Vec<f32>| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4 * y.abs().max(1.0));
        let cotangent = Tensor::<B, 2>::from_data(TensorData::new(series(rows * d, 0.77), [rows, d]), &device);

        let (x, w) = (series(rows * d, 0.31), series(d, 0.53));
        let weight = || Tensor::<B, 1>::from_data(TensorData::new(w.clone(), [d]), &device).require_grad();
        let (fx, fw) = (tensor(&x, [rows, d]), weight());
        let fused = crate::ops::rms_norm(Kernels::default(), &fx, &fw, 1e-6).expect("Autodiff<Flex> f32 is handled");
        let (px, pw) = (tensor(&x, [rows, d]), weight());
        let variance = px.clone().square().mean_dim(1);
        let plain = px.clone() * (variance + 1e-6).sqrt().recip() * pw.clone().unsqueeze();
        assert!(close(values(fused.clone()), values(plain.clone())));
        let (fg, pg) = ((fused * cotangent.clone()).sum().backward(), (plain * cotangent.clone()).sum().backward());
        assert!(close(grad(&fx, &fg), grad(&px, &pg)), "d x");
        let grad_1d = |t: &Tensor<B, 1>, g| t.grad(g).unwrap().into_data().to_vec::<f32>().unwrap();
        assert!(close(grad_1d(&fw, &fg), grad_1d(&pw, &pg)), "d weight");

        let (gate, up) = (series(rows * d, 0.9), series(rows * d, 0.2));
        let (fgate, fup) = (tensor(&gate, [rows, d]), tensor(&up, [rows, d]));
        let fused = crate::ops::silu_mul(Kernels::default(), &fgate, &fup).expect("Autodiff<Flex> f32 is handled");
        let (pgate, pup) = (tensor(&gate, [rows, d]), tensor(&up, [rows, d]));
        let plain = burn::tensor::activation::silu(pgate.clone()) * pup.clone();
        assert!(close(values(fused.clone()), values(plain.clone())));
        let (fg, pg) = ((fused * cotangent.clone()).sum().backward(), (plain * cotangent).sum().backward());
        assert!(close(grad(&fgate, &fg), grad(&pgate, &pg)), "d gate");
        assert!(close(grad(&fup, &fg), grad(&pup, &pg)), "d up");
    }

    /// The attention node's output and the gradients of query, key and value equal burn's ops
    /// on `repeat_kv` attention, for strided query and key views, two query blocks and a
    /// left-padded causal mask (queries that attend to nothing included).
    #[test]
    fn attention_node_matches_burn() {
        type B = Autodiff<Flex>;
        let device = Default::default();
        let (b, n, h, kv, d) = (2, 37, 4, 2, 16);
        let series = |len: usize, f: f32| -> Vec<f32> { (0..len).map(|i| (i as f32 * f).sin()).collect() };
        let leaf = |v: Vec<f32>, dims: [usize; 4]| Tensor::<B, 4>::from_data(TensorData::new(v, dims), &device).require_grad();
        let mask: Vec<f32> = (0..b * n * n)
            .map(|x| {
                let (row, i, j) = (x / (n * n), x / n % n, x % n);
                if j > i || (row == 1 && j < 3) { -1.0e9 } else { 0.0 }
            })
            .collect();
        let bias = Tensor::<B, 4>::from_data(TensorData::new(mask, [b, 1, n, n]), &device);
        let cotangent = Tensor::<B, 3>::from_data(TensorData::new(series(b * n * h * d, 0.41), [b, n, h * d]), &device);
        let scale = (d as f32).powf(-0.5);
        let inputs = || {
            let q = leaf(series(b * h * n * d, 0.37), [b, h, n, d]);
            let k = leaf(series(b * n * kv * d, 0.23), [b, n, kv, d]);
            let v = leaf(series(b * kv * n * d, 0.61), [b, kv, n, d]);
            (q, k, v)
        };

        let (fq, fk, fv) = inputs();
        let shape = AttentionShape { batch: b, queries: n, keys: n, heads: h, kv_heads: kv, head_dim: d };
        let fused = super::grouped_attention(Kernels::default(), &fq.clone().swap_dims(1, 2), &fk.clone().swap_dims(1, 2), &fv, &bias, shape, scale)
            .expect("Autodiff<Flex> f32 is handled");
        let (pq, pk, pv) = inputs();
        let repeat = |t: Tensor<B, 4>| t.reshape([b, kv, 1, n, d]).repeat_dim(2, h / kv).reshape([b, h, n, d]);
        let scores = pq.clone().matmul(repeat(pk.clone().swap_dims(1, 2)).swap_dims(2, 3)).mul_scalar(scale) + bias.clone();
        let plain = burn::tensor::activation::softmax(scores, 3)
            .matmul(repeat(pv.clone()))
            .swap_dims(1, 2)
            .reshape([b, n, h * d]);

        let values = |t: Tensor<B, 3>| t.into_data().to_vec::<f32>().unwrap();
        let close = |a: Vec<f32>, b: Vec<f32>| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4 * y.abs().max(1.0));
        assert!(close(values(fused.clone()), values(plain.clone())), "output");
        let fg = (fused * cotangent.clone()).sum().backward();
        let pg = (plain * cotangent).sum().backward();
        let grad = |t: &Tensor<B, 4>, g| t.grad(g).unwrap().into_data().to_vec::<f32>().unwrap();
        for (name, f, p) in [("query", &fq, &pq), ("key", &fk, &pk), ("value", &fv, &pv)] {
            let (got, want) = (grad(f, &fg), grad(p, &pg));
            assert_eq!(got.len(), want.len(), "{name}");
            assert!(close(got, want), "d {name}");
        }
    }

    /// The RoPE node's value and gradient equal burn's ops on HF's formula with tables laid out
    /// as HF's (both halves of a row hold the same angles).
    #[test]
    fn rotary_node_matches_burn() {
        type B = Autodiff<Flex>;
        let device = Default::default();
        let (b, n, h, d) = (2, 5, 3, 8);
        let rows = b * n * h;
        let angles: Vec<f32> = (0..rows * d / 2).map(|i| i as f32 * 0.13).collect();
        let table = |f: fn(f32) -> f32, first_sign: f32| {
            let values: Vec<f32> = (0..rows * d)
                .map(|i| {
                    let (row, j) = (i / d, i % d);
                    let sign = if j < d / 2 { first_sign } else { 1.0 };
                    sign * f(angles[row * d / 2 + j % (d / 2)])
                })
                .collect();
            Tensor::<B, 4>::from_data(TensorData::new(values, [b, n, h, d]), &device)
        };
        let (cos, sin) = (table(f32::cos, 1.0), table(f32::sin, -1.0));
        let values: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.71).sin() * 2.0).collect();
        let input = || Tensor::<B, 4>::from_data(TensorData::new(values.clone(), [b, n, h, d]), &device).require_grad();
        let cotangent: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.29).cos()).collect();
        let cotangent = Tensor::<B, 4>::from_data(TensorData::new(cotangent, [b, n, h, d]), &device);

        let fx = input();
        let fused = crate::ops::rotary(Kernels::default(), &fx, &cos, &sin).expect("Autodiff<Flex> f32 is handled");
        let px = input();
        let swapped = Tensor::cat(vec![px.clone().narrow(3, d / 2, d / 2), px.clone().narrow(3, 0, d / 2)], 3);
        let plain = px.clone() * cos.clone() + swapped * sin.clone();
        let values = |t: Tensor<B, 4>| t.into_data().to_vec::<f32>().unwrap();
        assert_eq!(values(fused.clone()), values(plain.clone()));
        let (fg, pg) = ((fused * cotangent.clone()).sum().backward(), (plain * cotangent).sum().backward());
        let grad = |t: &Tensor<B, 4>, g| t.grad(g).unwrap().into_data().to_vec::<f32>().unwrap();
        let (got, want) = (grad(&fx, &fg), grad(&px, &pg));
        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "{got:?} vs {want:?}");
    }

    /// The bf16-product node, both layouts, against burn's f32 ops on the operands and the
    /// output gradient rounded to bf16 beforehand: values and both gradients agree up to f32
    /// summation order (relative 1e-4: sums of at most 70 products of size ~4). Plain burn-flex
    /// gives the node's forward values bit for bit, at whatever level the kernels run.
    #[test]
    fn bf16_matmul_node_matches_f32_ops_on_rounded_operands() {
        use crate::bf16_bits::round;
        use crate::ops::{linear_bf16 as bf16_matmul, WeightLayout};
        type B = Autodiff<Flex>;
        let device = Default::default();
        let series = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin() * 2.0 + 0.01).collect() };
        let rounded = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| round(x)).collect() };
        let tensor = |v: &[f32], dims: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), dims), &device).require_grad();
        let to_vec = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();
        fn grad(t: &Tensor<B, 2>, g: &super::Gradients) -> Vec<f32> {
            t.grad(g).unwrap().into_data().to_vec::<f32>().unwrap()
        }
        let close = |got: Vec<f32>, want: Vec<f32>, what: &str| {
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{what} at {i}: {a} vs {b}");
            }
        };
        for (m, k, n) in [(37, 70, 45), (3, 33, 20)] {
            let (x, g) = (series(m * k, 0.31), series(m * n, 0.77));
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let w_dims = match layout {
                    WeightLayout::InOut => [k, n],
                    WeightLayout::OutIn => [n, k],
                };
                let w = series(k * n, 0.53);
                let (fx, fw) = (tensor(&x, [m, k]), tensor(&w, w_dims));
                let fused = bf16_matmul(Kernels::default(), &fx, &fw, layout).expect("Autodiff<Flex> f32 is handled");
                let (px, pw) = (tensor(&rounded(&x), [m, k]), tensor(&rounded(&w), w_dims));
                let plain = match layout {
                    WeightLayout::InOut => px.clone().matmul(pw.clone()),
                    WeightLayout::OutIn => px.clone().matmul(pw.clone().transpose()),
                };
                let what = format!("{m}x{k}x{n} {layout:?}");
                close(to_vec(fused.clone()), to_vec(plain.clone()), &format!("{what} y"));
                let inner = bf16_matmul(Kernels::default(), &fx.clone().inner(), &fw.clone().inner(), layout).expect("Flex f32 is handled");
                assert_eq!(inner.into_data().to_vec::<f32>().unwrap(), to_vec(fused.clone()), "{what}: plain Flex");
                let cotangent = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [m, n]), &device);
                let fg = (fused * cotangent(g.clone())).sum().backward();
                let pg = (plain * cotangent(rounded(&g))).sum().backward();
                close(grad(&fx, &fg), grad(&px, &pg), &format!("{what} dx"));
                close(grad(&fw, &fg), grad(&pw, &pg), &format!("{what} dw"));
            }
        }
    }
}

//! The memory-efficient attention as one node of burn's autodiff graph: the forward runs on the
//! inner backend and the node keeps the operands, the output and the log-sum-exp (and the
//! probabilities of a pass that is one block pair); its backward
//! is [`super::memory_efficient::backward`]. Recorded op by op instead, autodiff would keep every
//! block's probabilities, `[b, heads, q, k]` in all.
//!
//! The model is generic over its backend, and burn records a node only through the concrete
//! `Autodiff<I, C>` type, so nodes are found by the backend's type: [`register_autodiff_attention`]
//! adds an autodiff backend (the trainer registers the one it trains on; `Autodiff<Flex>` is
//! always there). On an autodiff backend that was never registered the blocks are recorded op by
//! op (the same values, more memory) and a warning says so once.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Once, OnceLock, RwLock};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};

use super::memory_efficient::{self, Blocks, Forward, Operands};
use crate::qwen3::mask::AttentionMask;

/// The attention of `x` under `mask` on backend `B`, as one autodiff node where `B` is a
/// registered autodiff backend; `None` where `B` is not an autodiff backend.
pub(super) fn attention<B: Backend>(x: Operands<B>, mask: &AttentionMask<B>, blocks: Blocks) -> Option<Tensor<B, 4>> {
    if !B::ad_enabled(&x.query.device()) {
        return None;
    }
    match node_of::<B>() {
        Some(node) => Some(node(x, mask, blocks)),
        None => {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                eprintln!(
                    "warning: memory-efficient attention has no autodiff node for {}: its blocks are recorded op by op \
                     (the same values, far more memory); call model::qwen3::register_autodiff_attention for this backend",
                    std::any::type_name::<B>()
                )
            });
            None
        }
    }
}

/// Makes the memory-efficient attention one autodiff node on backend `B` (whatever its
/// checkpointing strategy). Idempotent and cheap; `Autodiff<Flex>` needs no call.
pub fn register_autodiff_attention<B: AutodiffBackend>() {
    register::<B::InnerBackend, NoCheckpointing>();
    register::<B::InnerBackend, BalancedCheckpointing>();
}

/// A node's entry point, typed by the autodiff backend it records on.
type NodeFn<B> = fn(Operands<B>, &AttentionMask<B>, Blocks) -> Tensor<B, 4>;

/// Entry points by the autodiff backend's type; each value is a `NodeFn` of that backend.
fn registry() -> &'static RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>> {
    static REGISTRY: OnceLock<RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut map: HashMap<TypeId, Box<dyn Any + Send + Sync>> = HashMap::new();
        map.insert(TypeId::of::<Autodiff<Flex>>(), Box::new(record::<Flex, NoCheckpointing> as NodeFn<Autodiff<Flex>>));
        RwLock::new(map)
    })
}

fn register<I: Backend, C: CheckpointStrategy>() {
    let key = TypeId::of::<Autodiff<I, C>>();
    if registry().read().expect("registry lock").contains_key(&key) {
        return;
    }
    let entry: Box<dyn Any + Send + Sync> = Box::new(record::<I, C> as NodeFn<Autodiff<I, C>>);
    registry().write().expect("registry lock").insert(key, entry);
}

fn node_of<B: Backend>() -> Option<NodeFn<B>> {
    registry()
        .read()
        .expect("registry lock")
        .get(&TypeId::of::<B>())
        .and_then(|entry| entry.downcast_ref::<NodeFn<B>>().copied())
}

/// Runs the forward on the inner backend and records the node.
fn record<I: Backend, C: CheckpointStrategy>(
    x: Operands<Autodiff<I, C>>,
    mask: &AttentionMask<Autodiff<I, C>>,
    blocks: Blocks,
) -> Tensor<Autodiff<I, C>, 4> {
    let parents = [&x.query, &x.key, &x.value].map(|t| t.clone().into_primitive().tensor().node);
    let inner = Operands { query: x.query.inner(), key: x.key.inner(), value: x.value.inner() };
    let mask = mask.inner();
    let forward = memory_efficient::forward_for_backward(&inner, &mask, blocks);
    let output = forward.output.clone().into_primitive().tensor();
    let recorded = match AttentionNode::<I>(PhantomData).prepare::<C>(parents).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(NodeState { operands: inner, mask, blocks, forward }, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(recorded))
}

/// The node; its state is [`NodeState`].
#[derive(Debug)]
struct AttentionNode<I>(PhantomData<I>);

/// What the backward needs: the operands, the mask, the block settings, the output and the
/// log-sum-exp of every query row.
#[derive(Debug, Clone)]
struct NodeState<I: Backend> {
    operands: Operands<I>,
    mask: AttentionMask<I>,
    blocks: Blocks,
    forward: Forward<I>,
}

impl<I: Backend> Backward<I, 3> for AttentionNode<I> {
    type State = NodeState<I>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(grads.consume::<I>(&ops.node)));
        let NodeState { operands, mask, blocks, forward } = ops.state;
        let g = memory_efficient::backward(&operands, &mask, blocks, &forward, grad);
        for (parent, value) in ops.parents.into_iter().zip([g.query, g.key, g.value]) {
            if let Some(parent) = parent {
                grads.register::<I>(parent.id, value.into_primitive().tensor());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Autodiff<Flex>` has its node from the start; another autodiff backend gets one when
    /// registered; a plain backend never asks.
    #[test]
    fn nodes_are_found_by_the_backend_type() {
        assert!(node_of::<Autodiff<Flex>>().is_some());
        assert!(node_of::<Flex>().is_none());
        type Balanced = Autodiff<Flex, BalancedCheckpointing>;
        register_autodiff_attention::<Balanced>();
        assert!(node_of::<Balanced>().is_some());
    }
}

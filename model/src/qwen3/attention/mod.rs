//! `Qwen3Attention`: grouped-query attention with a per-head RMSNorm on queries and keys
//! (`q_norm`, `k_norm`) applied before RoPE, and the attention implementations it can run
//! ([`AttnImplementation`], chosen at load in the model's [`Compute`]): HF's eager formula
//! ([`eager`]) and FlashAttention-2's blocks ([`memory_efficient`], one autodiff node through
//! [`autodiff`]). On burn-flex with the CPU kernels on, the fused CPU kernel stands in for both;
//! a pass over the paged KV cache takes the kernel a GPU backend is lent
//! ([`crate::device_kernels`]) where the model's [`crate::DeviceKernelChoice`] hands it that
//! pass, and so does the memory-efficient forward of a pass without one (scoring, a training
//! step's forward) where the choice takes every pass.

pub mod autodiff;
pub mod eager;
pub mod memory_efficient;

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, DType, Int, Tensor};

use super::cache::{CachedKv, KvWrite, LayerKvCache, PoolLike};
use super::compute::{AttnImplementation, Compute, PassKernels};
use super::linear::{lora_linear, pass_product};
use super::stacked::split_columns;
use super::mask::AttentionMask;
use super::rms_norm::Qwen3RMSNorm;
use super::rotary::{Qwen3RotaryEmbedding, RotaryTables};
use crate::device_kernels::{DeviceKernelChoice, QkNormRopeWrite, Qkv};
use crate::kernels;
use crate::lora::{LoraLayer, LoraLinear};
use memory_efficient::{Blocks, Operands};

/// Self-attention of one decoder layer. Projections have no bias.
#[derive(Module, Debug)]
pub struct Qwen3Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: Qwen3RMSNorm<B>,
    pub k_norm: Qwen3RMSNorm<B>,
    pub num_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// vLLM's `qkv_proj`: `q_proj`'s, `k_proj`'s and `v_proj`'s weights side by side,
    /// `[hidden, (heads + 2 · kv_heads) · head_dim]`, those three being views of its columns;
    /// set by [`crate::Qwen3ForCausalLM::with_stacked_projections`] for inference, `None`
    /// otherwise. Not a parameter.
    #[module(skip)]
    pub qkv_proj: Option<Tensor<B, 2>>,
}

/// What every layer's attention takes from one forward pass, built once and shared by all
/// layers: RoPE tables for the query and the key heads, and the mask. Only where they are used is
/// the mask also materialised as an additive bias: `[b, 1, q, k]` for the CPU kernel, and
/// repeated to the eager formula's grouped layout `[b, kv, groups * q, k]`.
#[derive(Debug, Clone)]
pub struct AttentionInputs<B: Backend> {
    pub rotary_q: RotaryTables<B>,
    pub rotary_k: RotaryTables<B>,
    /// The one-head tables' cos and signed sin a token a row (`[b · q, head_dim]`), as a GPU
    /// backend's norm kernel takes them, made once for the pass's layers; `None` where the
    /// tables hold every head (the CPU kernels').
    pub rotary_rows: Option<[Tensor<B, 2>; 2]>,
    pub mask: AttentionMask<B>,
    /// For the CPU kernel (burn-flex with the kernels on) and the eager formula.
    pub bias: Option<Tensor<B, 4>>,
    /// For the eager formula.
    pub grouped_bias: Option<Tensor<B, 4>>,
}

impl<B: Backend> AttentionInputs<B> {
    /// The pass's `[b, q]`: its rows and the new positions a row (a ragged pass's `[1, tokens]`).
    pub fn pass_shape(&self) -> [usize; 2] {
        let [b, q, ..] = self.rotary_q.cos.dims();
        [b, q]
    }

    /// The inputs of one pass at `position_ids` under `mask`, for a model computing as `compute`
    /// says; `dtype` is the activations'.
    pub fn new(
        rotary: &Qwen3RotaryEmbedding,
        position_ids: Tensor<B, 2, Int>,
        mask: AttentionMask<B>,
        dtype: DType,
        (num_heads, num_key_value_heads): (usize, usize),
        compute: &Compute,
    ) -> Self {
        let cpu_kernels = compute.cpu_kernels.run_on::<B>();
        let eager = compute.attn_implementation == AttnImplementation::Eager;
        let bias = (cpu_kernels || eager).then(|| mask.bias(dtype));
        let grouped_bias = eager.then(|| eager::grouped_bias(bias.as_ref().expect("built for eager"), num_heads, num_key_value_heads));
        let tables = rotary.tables(position_ids, dtype, compute.cpu_kernels);
        // The CPU kernels take tables of the projections' shape; burn's ops broadcast one head.
        let (rotary_q, rotary_k, rotary_rows) = if cpu_kernels {
            (tables.repeat_heads(num_heads), tables.repeat_heads(num_key_value_heads), None)
        } else {
            let [b, q, _, d] = tables.cos.dims();
            let rows = |t: &Tensor<B, 4>| t.clone().reshape([b * q, d]);
            let rotary_rows = [rows(&tables.cos), rows(&tables.signed_sin)];
            (tables.clone(), tables, Some(rotary_rows))
        };
        Self { rotary_q, rotary_k, rotary_rows, mask, bias, grouped_bias }
    }
}

impl<B: Backend> Qwen3Attention<B> {
    /// `hidden_states` `[b, q, hidden]`; `inputs` built for these positions, with `k` counting
    /// cached plus new positions. Returns `[b, q, hidden]`.
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        compute: &Compute,
    ) -> Tensor<B, 3> {
        self.forward_with_adapters(hidden_states, inputs, cache, compute, None)
    }

    /// [`Self::forward`] with the layer's LoRA adapters on the projections that have one.
    pub fn forward_with_adapters(
        &self,
        hidden_states: Tensor<B, 3>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        compute: &Compute,
        adapters: Option<&LoraLayer<B>>,
    ) -> Tensor<B, 3> {
        let [b, q_len, hidden] = hidden_states.dims();
        self.forward_rows(hidden_states.reshape([b * q_len, hidden]), inputs, cache, compute, adapters)
            .reshape([b, q_len, hidden])
    }

    /// [`Self::forward_with_adapters`] on the pass's tokens a row: `x` `[b · q, hidden]` (the
    /// decoder layers' residual stream) to `[b · q, hidden]`.
    pub fn forward_rows(
        &self,
        x: Tensor<B, 2>,
        inputs: &AttentionInputs<B>,
        cache: Option<&mut LayerKvCache<B>>,
        compute: &Compute,
        adapters: Option<&LoraLayer<B>>,
    ) -> Tensor<B, 2> {
        let [b, q_len] = inputs.pass_shape();
        assert_eq!(x.dims()[0], b * q_len, "a row per token of the pass's [{b}, {q_len}] positions");
        let (h, kv, d) = (self.num_heads, self.num_key_value_heads, self.head_dim);

        // The projections, `[tokens, heads · d]` each: one product of the stacked `qkv_proj`
        // where none of the three has an adapter. All of them come before the norms and RoPE
        // (q's, then k's): CubeCL's fusion builds its kernels from runs of operations of one
        // shape, and k's operations (kv_heads) or a projection between q's (heads) and k's left
        // many of them single kernels on a GPU where burn's ops normalise (169 kernels per
        // decoding step of the small shape instead of 205, scripts/kernel_census.sh).
        let adapter = |pick: fn(&LoraLayer<B>) -> Option<&LoraLinear<B>>| adapters.and_then(pick);
        let unadapted = adapter(|a| a.q_proj.as_ref()).is_none() && adapter(|a| a.k_proj.as_ref()).is_none() && adapter(|a| a.v_proj.as_ref()).is_none();
        let pass = compute.pass(cache.is_some());
        let projections = match self.qkv_proj.as_ref().filter(|_| unadapted) {
            Some(qkv_proj) => Qkv::Stacked(pass_product(x, qkv_proj.clone(), compute, pass)),
            None => Qkv::Separate([
                lora_linear(&self.q_proj, adapter(|a| a.q_proj.as_ref()), x.clone(), compute, pass),
                lora_linear(&self.k_proj, adapter(|a| a.k_proj.as_ref()), x.clone(), compute, pass),
                lora_linear(&self.v_proj, adapter(|a| a.v_proj.as_ref()), x, compute, pass),
            ]),
        };
        // apply_rotary_pos_emb(q_norm(q), k_norm(k)), and the keys and values to the cache:
        // one kernel where a GPU backend lends it.
        let written = match cache {
            Some(cache) => match self.norm_rope_and_write(projections, inputs, cache, pass) {
                Ok(written) => Ok(written),
                Err(projections) => Err((projections, Some(cache))),
            },
            None => Err((projections, None)),
        };
        let (query, attended) = match written {
            Ok((query_states, cached)) => (Query::Rows(query_states), Attended::Cached(cached)),
            Err((projections, cache)) => {
                let [query_states, key_states, value_states] = projections.separate([h * d, kv * d, kv * d]);
                let heads = |x: Tensor<B, 2>, heads| x.reshape([b, q_len, heads, d]);
                let query_states = self.q_norm.forward_rotated(heads(query_states, h), &inputs.rotary_q, pass);
                let key_states = heads_first(self.k_norm.forward_rotated(heads(key_states, kv), &inputs.rotary_k, pass));
                let value_states = heads_first(heads(value_states, kv));
                let attended = match cache {
                    Some(cache) => Attended::Cached(cache.append(key_states, value_states)),
                    None => Attended::Fresh(key_states, value_states),
                };
                (Query::Heads(query_states), attended)
            }
        };

        let shape = [b, q_len, h, d];
        let scaling = (d as f64).powf(-0.5);
        let attn_output = match Self::attention_by_kernel(query, &attended, inputs, compute, shape, scaling) {
            Ok(output) => output,
            Err(query) => {
                let (key_states, value_states) = match attended {
                    Attended::Cached(cached) => cached.gather(),
                    Attended::Fresh(k, v) => (k, v),
                };
                let query_states = heads_first(query.heads(shape));
                let output = match compute.attn_implementation {
                    AttnImplementation::Eager => {
                        let bias = inputs.grouped_bias.as_ref().expect("AttentionInputs builds it for eager");
                        eager::eager_attention_forward(query_states, key_states, value_states, bias, scaling)
                    }
                    AttnImplementation::MemoryEfficient => {
                        let x = Operands { query: query_states, key: key_states, value: value_states };
                        memory_efficient_attention(x, &inputs.mask, compute.attention_block_size, scaling as f32, compute.device_kernels)
                    }
                };
                heads_last(output).reshape([b * q_len, h * d])
            }
        };
        lora_linear(&self.o_proj, adapters.and_then(|a| a.o_proj.as_ref()), attn_output, compute, pass)
    }
}

impl<B: Backend> Qwen3Attention<B> {
    /// The attention of a pass (`query` of `shape` `[b, q, heads, d]`) by a kernel where one
    /// takes it, a token a row (`[b · q, heads · d]`): with a cache, the CPU kernel and a GPU's
    /// paged-attention kernel read its pools where they lie (burn's ops take them gathered);
    /// without one, the CPU kernel. The query back where none does.
    fn attention_by_kernel(query: Query<B>, attended: &Attended<B>, inputs: &AttentionInputs<B>, compute: &Compute, shape: [usize; 4], scaling: f64) -> Result<Tensor<B, 2>, Query<B>> {
        let [b, q_len, h, d] = shape;
        let by_token = |o: Tensor<B, 3>| o.reshape([b * q_len, h * d]);
        match (attended, &inputs.bias) {
            (Attended::Cached(cached), _) if cached.is_ragged() => Ok(cached
                .paged_attention(compute.device_kernels, query.rows(), shape, &inputs.mask, scaling as f32)
                .unwrap_or_else(|_| panic!("a ragged pass runs only where a paged-attention kernel takes prefills (Qwen3ForCausalLM::takes_ragged_passes)"))),
            (Attended::Cached(cached), Some(bias)) => {
                let query = query.heads(shape);
                cached.attention(compute.cpu_kernels, &query, bias, scaling as f32).map(by_token).ok_or(Query::Heads(query))
            }
            (Attended::Fresh(k, v), Some(bias)) => {
                let query = query.heads(shape);
                kernels::grouped_attention(compute.cpu_kernels, &query, k, v, bias, scaling as f32).map(by_token).ok_or(Query::Heads(query))
            }
            // A backend that lent a paged-attention kernel (a GPU's) reads the pools in place
            // too, in the passes the model's device kernel choice hands it; the eager formula
            // stays burn's ops, the reference.
            (Attended::Cached(cached), None)
                if compute.attn_implementation == AttnImplementation::MemoryEfficient && cached.takes_paged_attention(compute.device_kernels, q_len) =>
            {
                cached.paged_attention(compute.device_kernels, query.rows(), shape, &inputs.mask, scaling as f32).map_err(Query::Rows)
            }
            _ => Err(query),
        }
    }

    /// `q_norm` and `k_norm` with RoPE by the pass's tables (`inputs`) of its projections, the
    /// keys and values written to `cache`, as one kernel where a GPU backend lends it
    /// ([`crate::device_kernels::NormKernels::qk_norm_rope_write`], which reads a stacked product
    /// or three where they lie): the rotated queries (`[tokens, heads · d]`)
    /// and what the rows attend to. The projections come back where none is lent or the
    /// operands do not suit it (dtypes other than the norms', tables of more than one head a
    /// token).
    fn norm_rope_and_write(
        &self,
        projections: Qkv<B>,
        inputs: &AttentionInputs<B>,
        cache: &mut LayerKvCache<B>,
        pass: PassKernels,
    ) -> Result<(Tensor<B, 2>, CachedKv<B>), Qkv<B>> {
        let d = self.head_dim;
        let (q_weight, k_weight) = (self.q_norm.weight.val(), self.k_norm.weight.val());
        let dtype = q_weight.dtype();
        // One head's tables a token a row, and every operand of the norms' dtype.
        let tables = inputs.rotary_rows.as_ref().filter(|[cos, signed_sin]| {
            let dtypes = projections.dtypes().into_iter().chain([k_weight.dtype(), cos.dtype(), signed_sin.dtype()]);
            cos.dims() == [projections.tokens(), d] && dtypes.into_iter().all(|t| t == dtype)
        });
        let same_eps = self.q_norm.variance_epsilon == self.k_norm.variance_epsilon;
        let (Some([cos, signed_sin]), Some(kernels)) = (tables.filter(|_| same_eps).cloned(), pass.device.norms::<B>()) else {
            return Err(projections);
        };
        let (eps, heads) = (self.q_norm.variance_epsilon, self.num_heads);
        let like = match &projections {
            Qkv::Stacked(qkv) => PoolLike::of(qkv),
            Qkv::Separate([query, ..]) => PoolLike::of(query),
        };
        Ok(cache.append_with(like, d, |write| {
            let KvWrite { keys, values, slots } = write;
            (kernels.qk_norm_rope_write)(QkNormRopeWrite { qkv: projections, heads, q_weight, k_weight, cos, signed_sin, slots, keys, values, eps })
        }))
    }
}

impl<B: Backend> Qkv<B> {
    fn tokens(&self) -> usize {
        match self {
            Qkv::Stacked(qkv) => qkv.dims()[0],
            Qkv::Separate([query, ..]) => query.dims()[0],
        }
    }

    fn dtypes(&self) -> Vec<DType> {
        match self {
            Qkv::Stacked(qkv) => vec![qkv.dtype()],
            Qkv::Separate(each) => each.iter().map(Tensor::dtype).collect(),
        }
    }

    /// One by one, of `widths` (columns of a stacked product, taken where they lie).
    fn separate(self, widths: [usize; 3]) -> [Tensor<B, 2>; 3] {
        match self {
            Qkv::Stacked(qkv) => split_columns(qkv, widths),
            Qkv::Separate(each) => each,
        }
    }
}

/// A pass's queries after `q_norm` and RoPE: a token a row (`[b · q, heads · d]`), as the GPU's
/// norm kernel leaves them and its paged-attention kernel takes them, or by head
/// (`[b, q, heads, d]`), as burn's ops and the CPU kernels leave and take them. Each is
/// reshaped to the other only where a path needs it: on a fused GPU backend a reshape is an
/// operation of the fusion stream, on the host, whether or not it copies anything.
enum Query<B: Backend> {
    Rows(Tensor<B, 2>),
    Heads(Tensor<B, 4>),
}

impl<B: Backend> Query<B> {
    fn rows(self) -> Tensor<B, 2> {
        match self {
            Query::Rows(rows) => rows,
            Query::Heads(heads) => {
                let [b, q, h, d] = heads.dims();
                heads.reshape([b * q, h * d])
            }
        }
    }

    fn heads(self, shape: [usize; 4]) -> Tensor<B, 4> {
        match self {
            Query::Rows(rows) => rows.reshape(shape),
            Query::Heads(heads) => heads,
        }
    }
}

/// The keys and values a pass attends to: its own (`[b, kv_heads, q, d]`), or a KV cache's.
enum Attended<B: Backend> {
    Fresh(Tensor<B, 4>, Tensor<B, 4>),
    Cached(CachedKv<B>),
}

/// `[b, q, heads, d]` as `[b, heads, q, d]`. A decoding step's single query needs no transpose,
/// only a reshape, so the tensor stays contiguous and later reshapes copy nothing.
fn heads_first<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    match x.dims() {
        [b, 1, heads, d] => x.reshape([b, heads, 1, d]),
        _ => x.swap_dims(1, 2),
    }
}

/// The inverse of [`heads_first`]: `[b, heads, q, d]` as `[b, q, heads, d]`.
fn heads_last<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    match x.dims() {
        [b, heads, 1, d] => x.reshape([b, 1, heads, d]),
        _ => x.swap_dims(1, 2),
    }
}

/// The memory-efficient attention of `x` (`query` `[b, heads, q, d]`, `key` and `value`
/// `[b, kv_heads, k, d]`) under `mask`, in blocks of `block_size` queries: `[b, heads, q, d]`,
/// by the fresh-attention kernel a GPU backend lends where `device_kernels` hands it these
/// passes. On an autodiff backend it is one node (see [`autodiff`]).
pub fn memory_efficient_attention<B: Backend>(x: Operands<B>, mask: &AttentionMask<B>, block_size: usize, scale: f32, device_kernels: DeviceKernelChoice) -> Tensor<B, 4> {
    let blocks = Blocks::new(&x, block_size, scale, device_kernels);
    match autodiff::attention(x.clone(), mask, blocks) {
        Some(output) => output,
        None => memory_efficient::forward(&x, mask, blocks).output,
    }
}

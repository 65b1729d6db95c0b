//! The memory plan of a training run, worked out before anything big is loaded: from the
//! model's `config.json` (its shape; no weights are read) and the run's settings, the bytes each
//! part of a GRPO step holds, phase by phase, and whether the peak fits a device.
//!
//! A step has three phases, and the peak is the largest of them on top of what lives throughout
//! (the weights, the optimiser's moments, the KL reference):
//! - **rollouts**: the rollout copy of the policy (bf16 rollouts; with LoRA and
//!   `rollout.merge_lora`, the adapted weights with the adapters merged), the KV cache and one prefill
//!   pass, as `model::Decoder` runs them: each episode's cache is kept across its turns in
//!   blocks of a paged pool that grows by an eighth ([`grown_capacity`]), so the episodes in
//!   flight (`generation_batch`: those decoding and those waiting on the environment, whose
//!   caches are kept; fewer decode at once under `rollout.max_num_seqs`) hold at most their
//!   number × the full context in blocks, the pool grown by an eighth, or `rollout.kv_budget`
//!   when that is smaller (sequences then wait or are preempted rather than go past it); on
//!   burn's ops a pass gathers one layer's keys and values for its rows (rows × the full
//!   context at most: a GPU's prefill passes, unless `--device-kernels all`);
//!   a turn prefills only its new tokens, in
//!   chunks of at most `rollout.max_num_batched_tokens` positions (rows × chunk) attending over
//!   up to the full context of keys. With `rollout.engine = "servers"` the rollouts run on the
//!   workers of `[rollout.servers]`: the trainer holds none of this (the phase has no terms and
//!   names the workers; their memory is planned as a local run's, or by the server's limits);
//! - **scoring**: the old and reference log-probs, a micro-batch at a time without autodiff;
//! - **update**: a micro-batch's forward and backward pass (what the forward keeps is counted
//!   tensor by tensor in `activations`, with and without activation checkpointing), the
//!   gradients, and the optimiser step. Its peak is the larger of the start of the backward
//!   pass (every activation kept, the head's gradients made) and its end (every gradient made).
//!
//! Attention follows `attn_implementation`: the eager formula's `[b, heads, q, k]` scores, masks
//! and probabilities, or the memory-efficient attention's block pairs (their sizes from
//! [`block_sizes`], the model's own choice) and causal blocks; the CPU kernel keeps a `[b, 1, q,
//! k]` bias. The head forms its logits a chunk of positions at a time in every phase, the
//! update's backward pass included (`crate::grpo::head`).
//!
//! On CUDA ([`PlanSettings::cuda_memory`]) each phase also counts the whole pages CubeCL's pool
//! reserves around its largest tensors ([`CudaPages`]): the KV pools, a micro-batch's
//! intermediate-wide temporaries, the checkpointed layer inputs.
//!
//! The step's episodes ([`MemoryPlan::host_episodes`]) are held on the host from the rollouts
//! to the update: a term of the scoring and update phases where the device is the host (the
//! CPU), checked against the machine's RAM beside the plan on a GPU.
//!
//! All arithmetic; `prompt-r1 plan` prints it and `prompt-r1 train` refuses to start a run whose
//! peak does not fit. `rollout.kv_budget = "auto"` is the largest budget whose rollouts fit
//! ([`auto_kv_budget`]); [`ServingSettings`] counts a server's memory the same way, for `prompt-r1
//! serve --kv-cache-memory auto` ([`auto_serving_kv_budget`]).

mod activations;
mod pages;
mod serving;
mod size;

use burn::tensor::DType;
use model::logprobs::LOGITS_CHUNK_ELEMENTS;
use model::lora::{LoraConfig, LoraTarget};
use model::qwen3::attention::memory_efficient::block_sizes;
use model::qwen3::{grown_capacity, BLOCK_SIZE};
use model::{AttnImplementation, MatmulPrecision, Qwen3Config};

use crate::run::{RolloutEngineKind, TrainConfig};
use activations::{Dims, LoraActivations};
pub use pages::{CudaPages, TensorGroup, TooLarge};
pub use serving::{auto_serving_kv_budget, ServingSettings};
pub use size::{format_size, parse_size};

/// Tokens assumed for the system prompt and the question when the context is derived from the
/// episode limits (`episode.max_response_tokens` more follow them).
pub const PROMPT_ALLOWANCE: usize = 1024;

/// Where the run computes, which decides what the forward pass keeps and what the fit allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanDevice {
    /// burn-flex with the project's CPU kernels (the default on the CPU).
    CpuKernels,
    /// burn-flex through burn's portable tensor ops (`PROMPT_R1_PORTABLE_OPS=1`).
    CpuPortable,
    /// A GPU backend (CUDA, wgpu): burn's portable tensor ops on CubeCL, prompt-r1's
    /// paged-attention kernel in decoding steps (`--device-kernels decode`, wgpu's default) or
    /// nowhere (`off`): a pass with a prefill gathers its rows' keys and values out of the KV
    /// cache a layer at a time.
    Gpu,
    /// A GPU backend with `--device-kernels all` (CUDA's default): every pass over the KV cache
    /// reads it in place through prompt-r1's kernel, prefill chunks too.
    GpuPagedPrefill,
}

/// How the forward pass computes its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputePath {
    /// RMSNorm, RoPE, SwiGLU, attention and the chosen-token log-prob as single autodiff nodes
    /// that keep only their inputs; attention keeps no scores.
    CpuKernels,
    /// burn's tensor ops: eager attention keeps `[b, heads, q, k]` tensors.
    Portable,
    /// burn's tensor ops on bf16 activations (a bf16 frozen base under LoRA, on any device):
    /// norms and softmax in f32, each adapter's input copied to f32.
    PortableBf16,
}

impl PlanDevice {
    /// The forward pass's path on this device.
    pub fn path(self) -> ComputePath {
        match self {
            PlanDevice::CpuKernels => ComputePath::CpuKernels,
            PlanDevice::CpuPortable | PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => ComputePath::Portable,
        }
    }

    /// Whether the device's memory is the host's (the CPU backends).
    pub fn is_host(self) -> bool {
        matches!(self, PlanDevice::CpuKernels | PlanDevice::CpuPortable)
    }

    /// The share of the device's memory kept free: on the CPU the caching allocator may hold
    /// freed buffers up to a quarter above the peak in use (`cpu_kernels::large_alloc`), so
    /// the peak may use 1/1.25 = 80% of RAM; on a GPU, CubeCL's memory pools reserve whole pages
    /// per size class (on CUDA pages of 1/4096 to 1/16 of the GPU's memory for tensors up to
    /// 1/32 of it, a quarter of it for larger ones; the phases count those around their largest
    /// tensors where [`PlanSettings::cuda_memory`] is known, packed at best) and fragment, 10%
    /// (not yet measured on a GPU). The trainer gives unused pages back between a step's phases,
    /// so one phase's pages do not stay reserved beside the next's.
    pub fn margin(self) -> f64 {
        match self {
            PlanDevice::CpuKernels | PlanDevice::CpuPortable => 0.2,
            PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => 0.1,
        }
    }

    /// Bytes of `memory` the plan may fill: less [`Self::margin`].
    pub fn usable(self, memory: u64) -> u64 {
        (memory as f64 * (1.0 - self.margin())) as u64
    }

    /// What the process holds besides tensors: its code, stacks and small allocations on the
    /// CPU (measured: a training step of 16 tokens of the `small` preset peaks at 32 MB, 10 MiB
    /// of it weights and AdamW moments), the CUDA context on a GPU (typically 300–500 MiB).
    fn runtime(self) -> u64 {
        match self {
            PlanDevice::CpuKernels | PlanDevice::CpuPortable => 20 << 20,
            PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => 512 << 20,
        }
    }
}

/// LoRA adapters: rank, adapted projections and whether dropout is on.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPlan {
    pub rank: usize,
    pub targets: Vec<LoraTarget>,
    pub dropout: bool,
}

impl LoraPlan {
    /// The adapters of a `[lora]` section.
    pub fn from_config(config: &LoraConfig) -> Self {
        Self {
            rank: config.rank,
            targets: config.target_modules.clone(),
            dropout: config.dropout > 0.0,
        }
    }

    /// `rank` on every linear projection (PEFT's "all-linear"), without dropout.
    pub fn all_linear(rank: usize) -> Self {
        Self {
            rank,
            targets: LoraTarget::ALL.to_vec(),
            dropout: false,
        }
    }
}

/// Everything the plan depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanSettings {
    /// The model's shape (`config.json`).
    pub model: Qwen3Config,
    /// `None`: full fine-tuning (f32 weights).
    pub lora: Option<LoraPlan>,
    /// The frozen base's dtype with LoRA (`model_dtype`); full fine-tuning trains f32 weights.
    pub base_dtype: DType,
    /// `rollout.dtype`: the rollout copy's and the KL reference's weights.
    pub rollout_dtype: DType,
    /// `rollout.merge_lora`: with LoRA, the rollouts sample from a copy of the base with the
    /// adapters merged into the weights they adapt.
    pub merge_lora: bool,
    /// Whether the loss has a KL term (`grpo.loss.kl_coef ≠ 0`).
    pub kl: bool,
    /// Whether the entropy takes a gradient (`grpo.loss.entropy_coef ≠ 0`).
    pub entropy_grad: bool,
    pub micro_batch: usize,
    pub mini_batch: usize,
    /// Episodes in flight at once (`rollout.generation_batch`, at most the step's episodes).
    pub generation_batch: usize,
    /// Episodes of one step (`rollout.batch_size × rollout.n`): the host holds them all, with
    /// their tokens and texts, from the rollouts to the update ([`MemoryPlan::host_episodes`]).
    pub step_episodes: usize,
    /// How the rollouts' decoder is limited (`rollout.max_num_seqs`,
    /// `rollout.max_num_batched_tokens`, `rollout.kv_budget`).
    pub rollout: RolloutLimits,
    /// Tokens of the longest episode: training sequences and rollout contexts.
    pub context: usize,
    pub checkpointing: bool,
    pub matmul: MatmulPrecision,
    /// Attention's implementation (`attn_implementation`) and block size.
    pub attention: AttnImplementation,
    pub attention_block: usize,
    pub device: PlanDevice,
    /// The GPU's memory where the run trains on CUDA: CubeCL's pool there reserves whole pages
    /// of size classes that follow it ([`CudaPages`]), which the phases then count
    /// ([`MemoryPlan::new`]). `None` elsewhere: the CPU has no such pool, and wgpu's pages follow
    /// its adapter's limits.
    pub cuda_memory: Option<u64>,
}

/// Where the rollouts run, and the limits of their decoder (`model::DecoderLimits`, from the
/// `[rollout]` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutLimits {
    /// Most episodes decoding at once (`rollout.max_num_seqs`); `None`: `generation_batch`.
    pub max_num_seqs: Option<usize>,
    /// Most positions of one prefill pass, rows × chunk (`rollout.max_num_batched_tokens`).
    pub max_batched_tokens: usize,
    /// Most bytes of KV cache the rollouts hold (`rollout.kv_budget`); `None`: no limit.
    pub kv_budget: Option<u64>,
    /// `None`: the rollouts run here (`rollout.engine = "local"`); `Some(n)`: on the `n` workers
    /// of `[rollout.servers]` (`engine = "servers"`), which hold their weights and KV cache
    /// themselves, so none of the limits above is the trainer's.
    pub workers: Option<usize>,
}

impl Default for RolloutLimits {
    /// The `[rollout]` defaults: local rollouts, `generation_batch` episodes at once, prefill
    /// passes of 8,192 positions, no KV budget.
    fn default() -> Self {
        Self {
            max_num_seqs: None,
            max_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            kv_budget: None,
            workers: None,
        }
    }
}

/// Host bytes a step holds per token of each of its episodes, at the full context: the
/// trajectory's token ids, loss mask and sampled log-probs (9), the learner's sequence with its
/// old and reference log-probs (13), and the texts (the context's and the turn records', about 4
/// bytes a token each), with room for the vectors' growth.
pub const HOST_BYTES_PER_EPISODE_TOKEN: f64 = 48.0;

/// The default `rollout.max_num_batched_tokens` (vLLM's default with chunked prefill).
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 8192;

/// Bytes of one KV-cache position of `model` in `dtype`, over every layer: keys and values of
/// every key/value head, `2 · layers · kv_heads · head_dim` values (what
/// `model::DecoderLimits::kv_budget` counts positions of).
pub fn kv_position_bytes(model: &Qwen3Config, dtype: DType) -> u64 {
    (2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * dtype.size()) as u64
}

impl PlanSettings {
    /// The settings of a run: `config` (its `[grpo]`, `[rollout]` and `[episode]` sections),
    /// the model's shape, the device, and the context (default: [`PROMPT_ALLOWANCE`] plus
    /// `episode.max_response_tokens`).
    pub fn from_config(
        config: &TrainConfig,
        model: Qwen3Config,
        device: PlanDevice,
        context: Option<usize>,
    ) -> Self {
        let episodes = config.rollout.batch_size * config.rollout.n;
        Self {
            model,
            lora: config.lora.as_ref().map(LoraPlan::from_config),
            base_dtype: config.model_dtype.dtype(),
            rollout_dtype: config.rollout.dtype.dtype(),
            merge_lora: config.rollout.merge_lora,
            kl: config.grpo.loss.uses_kl(),
            entropy_grad: config.grpo.loss.uses_entropy(),
            micro_batch: config
                .grpo
                .micro_batch_size
                .min(config.grpo.mini_batch_size),
            mini_batch: config.grpo.mini_batch_size,
            generation_batch: config.rollout.generation_batch.min(episodes),
            step_episodes: episodes,
            rollout: RolloutLimits {
                max_num_seqs: config.rollout.max_num_seqs,
                max_batched_tokens: config.rollout.max_num_batched_tokens,
                // Validated with the configuration (`TrainConfig::validate`); "auto" is none until
                // settled against the device ([`auto_kv_budget`]).
                kv_budget: config.rollout.kv_budget.as_deref().and_then(|size| parse_size(size).ok()),
                workers: match config.rollout.engine {
                    RolloutEngineKind::Local => None,
                    RolloutEngineKind::Servers => Some(config.rollout.servers.as_ref().map_or(0, |s| s.urls.len())),
                },
            },
            context: context.unwrap_or(PROMPT_ALLOWANCE + config.episode.max_response_tokens),
            checkpointing: config.grpo.activation_checkpointing,
            matmul: config.grpo.matmul,
            attention: config.attn_implementation,
            attention_block: config.attention_block_size,
            device,
            cuda_memory: None,
        }
    }

    /// Episodes decoding at once: `rollout.max_num_seqs` within `generation_batch`, and no
    /// more than `rollout.max_num_batched_tokens` (a decoding pass runs a token a row).
    pub fn rollout_rows(&self) -> usize {
        self.rollout
            .max_num_seqs
            .map_or(self.generation_batch, |m| m.min(self.generation_batch))
            .min(self.rollout.max_batched_tokens)
            .max(1)
    }

    /// The dtype of the rollouts' activations and KV cache: bf16 for bf16 rollouts, else the
    /// weights' they sample from.
    pub fn rollout_cache_dtype(&self) -> DType {
        if self.rollout_dtype == DType::BF16 {
            DType::BF16
        } else {
            self.weights_dtype()
        }
    }

    /// KV positions one episode at the full context holds: its blocks.
    pub fn episode_kv_positions(&self) -> usize {
        self.context.div_ceil(BLOCK_SIZE) * BLOCK_SIZE
    }

    /// KV positions the rollouts hold at most: every episode in flight (`generation_batch`,
    /// decoding or waiting on the environment with its cache kept) at the full context and the
    /// pool's scratch block, the pool grown by an eighth, or `rollout.kv_budget` when that is
    /// smaller; and whether the budget bounds it.
    pub fn rollout_kv_positions(&self) -> (usize, bool) {
        let every = grown_capacity(self.generation_batch.max(1) * self.episode_kv_positions() + BLOCK_SIZE);
        match self.kv_budget_positions() {
            Some(budget) if budget < every => (budget, true),
            _ => (every, false),
        }
    }

    /// The least `rollout.kv_budget` in bytes: one episode at the full context and the pool's
    /// scratch block (the decoder refuses less before any episode starts).
    pub fn least_kv_budget(&self) -> u64 {
        (self.episode_kv_positions() + BLOCK_SIZE) as u64 * kv_position_bytes(&self.model, self.rollout_cache_dtype())
    }

    /// `rollout.kv_budget` in positions of the rollouts' cache (as `model::DecoderLimits` takes it).
    fn kv_budget_positions(&self) -> Option<usize> {
        let per_position = kv_position_bytes(&self.model, self.rollout_cache_dtype());
        self.rollout
            .kv_budget
            .map(|bytes| usize::try_from(bytes / per_position.max(1)).unwrap_or(usize::MAX))
    }

    /// How the update's forward pass runs: a bf16 base under LoRA takes burn's tensor ops on
    /// every device (the CPU kernels' autodiff nodes take f32 only).
    pub fn path(&self) -> ComputePath {
        if self.lora.is_some() && self.base_dtype != DType::F32 {
            ComputePath::PortableBf16
        } else {
            self.device.path()
        }
    }

    /// The dtype of the weights the policy's inference runs on (scoring, and rollouts unless
    /// `rollout.dtype` asks for a bf16 copy): the frozen base's under LoRA, else f32.
    fn weights_dtype(&self) -> DType {
        if self.lora.is_some() {
            self.base_dtype
        } else {
            DType::F32
        }
    }

    fn dims(&self) -> Dims {
        let m = &self.model;
        Dims {
            hidden: m.hidden_size as f64,
            q: (m.num_attention_heads * m.head_dim) as f64,
            kv: (m.num_key_value_heads * m.head_dim) as f64,
            intermediate: m.intermediate_size as f64,
            heads: m.num_attention_heads as f64,
            head_dim: m.head_dim as f64,
            vocab: m.vocab_size as f64,
        }
    }

    /// Whether the rollouts' prefill passes attend through the GPU's paged-attention kernel
    /// (the memory-efficient attention on a GPU with `--device-kernels all`).
    fn paged_attention_kernel(&self) -> bool {
        self.device == PlanDevice::GpuPagedPrefill && self.attention == AttnImplementation::MemoryEfficient
    }

    /// Where attention runs on a pass taking `path`: the CPU kernel, or one of the
    /// implementations as burn's tensor ops. Inference passes take the device's path
    /// ([`PlanDevice::path`]: the CPU kernel serves bf16 activations there), the update
    /// [`Self::path`].
    fn attention_path(&self, path: ComputePath) -> AttentionPath {
        match (path, self.attention) {
            (ComputePath::CpuKernels, _) => AttentionPath::CpuKernel,
            (_, AttnImplementation::Eager) => AttentionPath::Eager,
            (_, AttnImplementation::MemoryEfficient) => AttentionPath::MemoryEfficient,
        }
    }

    /// Queries and keys per block of the memory-efficient attention for `rows` sequences of
    /// `queries` new tokens over `keys` keys (the model's choice, [`block_sizes`]).
    fn attention_blocks(&self, rows: f64, queries: f64, keys: f64) -> (f64, f64) {
        let (q, k) = block_sizes(
            rows as usize,
            self.model.num_attention_heads,
            queries as usize,
            keys as usize,
            self.attention_block,
        );
        (q as f64, k as f64)
    }

    /// f32 values of attention's transients at once for `rows` sequences of `queries` new tokens
    /// over `keys` keys (the cached ones and their own; `queries = keys` without a cache) in one
    /// layer on a pass taking `path`: the eager formula's `[b, heads, q, k]` scores and their
    /// successors (3 forward, their gradients backward), or `blocks` block-pair-sized tensors of
    /// the memory-efficient attention (a query block against its widest span of keys: scores
    /// and exponentials forward, probabilities and their gradient backward, most of burn's
    /// element-wise ops working in place) and the causal triangle repeated to a diagonal block's
    /// scores. The CPU kernel works a block of rows at a time.
    fn attention_transient(&self, path: ComputePath, rows: f64, queries: f64, keys: f64, blocks: f64) -> f64 {
        let heads = self.model.num_attention_heads as f64;
        match self.attention_path(path) {
            AttentionPath::CpuKernel => 0.0,
            AttentionPath::Eager => rows * queries * keys * 3.0 * heads,
            AttentionPath::MemoryEfficient => {
                let (q, k) = self.attention_blocks(rows, queries, keys);
                // The last query block sees every key before its diagonal.
                let widest_span = k.min(q.max(keys - q));
                let diagonal_bias = if q > 1.0 { rows * heads * q * q } else { 0.0 };
                blocks * rows * heads * q * widest_span + diagonal_bias
            }
        }
    }

    /// Bytes of the masks one pass builds for `rows` sequences of `queries` new tokens over
    /// `keys` keys with activations of `act` bytes: where the CPU kernels may run, the bias
    /// `[b, 1, q, k]` they take; for the eager formula the bias and its per-head copy; for the
    /// memory-efficient attention on a pass it runs (`path`), its causal blocks.
    fn masks(&self, path: ComputePath, rows: f64, queries: f64, keys: f64, act: f64) -> f64 {
        let heads = self.model.num_attention_heads as f64;
        let kernels = self.device == PlanDevice::CpuKernels;
        let bias = rows * queries * keys * act;
        match self.attention_path(path) {
            _ if self.attention == AttnImplementation::Eager => bias * (1.0 + heads),
            AttentionPath::CpuKernel => bias,
            _ => f64::from(u8::from(kernels)) * bias + self.causal_blocks(rows, queries, keys),
        }
    }

    /// What of [`Self::masks`] the update keeps for its backward pass: the CPU kernel's node
    /// keeps its bias, the memory-efficient node its causal blocks; the eager formula's addition
    /// keeps nothing.
    fn masks_kept(&self, rows: f64, len: f64, act: f64) -> f64 {
        match self.attention_path(self.path()) {
            AttentionPath::CpuKernel => rows * len * len * act,
            AttentionPath::Eager => 0.0,
            AttentionPath::MemoryEfficient => self.causal_blocks(rows, len, len),
        }
    }

    /// Parameters of the adapters: `rank · (in + out)` per adapted projection and layer.
    pub fn adapter_parameters(&self) -> u64 {
        self.lora.as_ref().map_or(0, |lora| {
            let per_layer: usize = lora
                .targets
                .iter()
                .map(|t| {
                    let (i, o) = t.features(&self.model);
                    lora.rank * (i + o)
                })
                .sum();
            (per_layer * self.model.num_hidden_layers) as u64
        })
    }

    /// Parameters of the weights the adapters adapt (`None` without LoRA): what a merged
    /// rollout copy holds again.
    pub fn adapted_parameters(&self) -> Option<u64> {
        let lora = self.lora.as_ref()?;
        let per_layer: usize = lora
            .targets
            .iter()
            .map(|t| {
                let (i, o) = t.features(&self.model);
                i * o
            })
            .sum();
        Some((per_layer * self.model.num_hidden_layers) as u64)
    }

    /// Parameters that take gradients and optimiser state.
    pub fn trainable_parameters(&self) -> u64 {
        match self.lora {
            Some(_) => self.adapter_parameters(),
            None => self.model.num_parameters() as u64,
        }
    }

    fn lora_activations(&self) -> LoraActivations {
        self.lora
            .as_ref()
            .map_or_else(LoraActivations::default, |lora| LoraActivations {
                rank_sum: (lora.rank * lora.targets.len()) as f64,
                inputs: lora
                    .targets
                    .iter()
                    .map(|t| t.features(&self.model).0 as f64)
                    .sum(),
                dropout: lora.dropout,
            })
    }

    /// The memory-efficient attention's causal masks of one pass of `queries` new tokens over
    /// `keys` keys: the triangle of a query block's own keys at its scores' shape,
    /// `rows · heads · block²` f32, shared by every query block, and the last block's smaller one
    /// when the new tokens are not a multiple of the block.
    fn causal_blocks(&self, rows: f64, queries: f64, keys: f64) -> f64 {
        let (q, _) = self.attention_blocks(rows, queries, keys);
        let heads = self.model.num_attention_heads as f64;
        let last = queries % q;
        let triangles = if q > 1.0 { q * q } else { 0.0 } + if queries > q && last > 1.0 { last * last } else { 0.0 };
        rows * heads * triangles * F32
    }
}

/// Where attention runs (see [`PlanSettings::attention_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttentionPath {
    CpuKernel,
    Eager,
    MemoryEfficient,
}

/// One named amount of memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Term {
    pub name: String,
    pub bytes: u64,
}

impl Term {
    fn new(name: impl Into<String>, bytes: f64) -> Self {
        Self {
            name: name.into(),
            bytes: bytes.max(0.0).round() as u64,
        }
    }
}

/// A phase of a step, at its worst moment: what it holds beside the persistent terms.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub name: String,
    pub terms: Vec<Term>,
}

impl Phase {
    pub fn total(&self) -> u64 {
        self.terms.iter().map(|t| t.bytes).sum()
    }
}

/// The plan: persistent terms, the phases of a step, and the update's activations per
/// micro-batch both ways.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub settings: PlanSettings,
    /// Held for the whole run: weights, adapters, optimiser state, the KL reference, the runtime.
    pub persistent: Vec<Term>,
    /// Rollouts, scoring, update.
    pub phases: Vec<Phase>,
    /// The update's activation memory per micro-batch (kept tensors and the largest transient
    /// ones, no gradients): without and with activation checkpointing.
    pub activations: Activations,
}

/// The update's activation memory per micro-batch, without and with checkpointing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activations {
    pub without_checkpointing: u64,
    pub with_checkpointing: u64,
}

impl MemoryPlan {
    /// Works out the plan of `settings`.
    pub fn new(settings: PlanSettings) -> Self {
        let persistent = persistent_terms(&settings);
        let update = update_phase(&settings, settings.checkpointing);
        let activations = Activations {
            without_checkpointing: update_activations(&settings, false),
            with_checkpointing: update_activations(&settings, true),
        };
        let mut phases = vec![rollout_phase(&settings), scoring_phase(&settings), update];
        if let Some(memory) = settings.cuda_memory {
            let pages = CudaPages::new(memory);
            let groups = [rollout_tensors(&settings), scoring_tensors(&settings), update_tensors(&settings)];
            for (phase, groups) in phases.iter_mut().zip(groups) {
                phase.terms.extend(page_term(&pages, memory, &groups));
            }
        }
        if settings.device.is_host() {
            // The step's episodes, made by the rollouts, are held until the update ends.
            let episodes = host_episodes_term(&settings);
            for phase in &mut phases[1..] {
                phase.terms.push(episodes.clone());
            }
        }
        Self {
            settings,
            persistent,
            phases,
            activations,
        }
    }

    /// The host memory the step's episodes take (held from the rollouts to the update): part of
    /// the phases on the CPU, beside the device's memory on a GPU.
    pub fn host_episodes(&self) -> Term {
        host_episodes_term(&self.settings)
    }

    /// The bytes held throughout.
    pub fn persistent_total(&self) -> u64 {
        self.persistent.iter().map(|t| t.bytes).sum()
    }

    /// The phase with the most memory.
    pub fn peak_phase(&self) -> &Phase {
        self.phases
            .iter()
            .max_by_key(|p| p.total())
            .expect("three phases")
    }

    /// The predicted peak: the persistent terms plus the largest phase.
    pub fn peak(&self) -> u64 {
        self.persistent_total() + self.peak_phase().total()
    }

    /// The predicted peak of the rollouts: the persistent terms and the rollout phase.
    pub fn rollout_peak(&self) -> u64 {
        self.persistent_total() + self.phases[0].total()
    }

    /// The predicted peak of scoring and the update (one phase to a GPU's memory pool, which
    /// the trainer cleans after the update only): the persistent terms and the larger of the two.
    pub fn learn_peak(&self) -> u64 {
        self.persistent_total() + self.phases[1..].iter().map(Phase::total).max().unwrap_or(0)
    }

    /// The update phase alone on top of the persistent terms but the KL reference: what one
    /// learning step of an already loaded policy holds (what `prompt-r1 bench --train-step`
    /// measures: on the CPU the process's RSS, the runtime term included).
    pub fn update_peak(&self) -> u64 {
        let update = self
            .phases
            .iter()
            .find(|p| p.name.starts_with("update"))
            .expect("an update phase");
        let persistent: u64 = self
            .persistent
            .iter()
            .filter(|t| !t.name.starts_with("KL reference"))
            .map(|t| t.bytes)
            .sum();
        persistent + update.total()
    }

    /// [`Self::update_peak`] less the runtime term: what a GPU's memory pool holds for it (the
    /// CUDA context lies outside the pool).
    pub fn update_pool_peak(&self) -> u64 {
        let runtime: u64 = self.persistent.iter().filter(|t| t.name == "runtime").map(|t| t.bytes).sum();
        self.update_peak() - runtime
    }

    /// Whether the peak fits `device_memory` bytes less the device's margin, and if not, what
    /// to change.
    pub fn check(&self, device_memory: u64) -> Verdict {
        let usable = self.settings.device.usable(device_memory);
        let fits = self.peak() <= usable;
        Verdict {
            usable,
            fits,
            advice: if fits {
                Vec::new()
            } else {
                self.advice(usable)
            },
        }
    }

    /// The largest terms at the peak (persistent and the peak phase's), largest first.
    pub fn largest_terms(&self, n: usize) -> Vec<&Term> {
        let mut terms: Vec<&Term> = self
            .persistent
            .iter()
            .chain(&self.peak_phase().terms)
            .collect();
        terms.sort_by(|a, b| b.bytes.cmp(&a.bytes));
        terms.truncate(n);
        terms
    }

    /// Changes that lower the peak: each one alone with the peak it gives, most effective
    /// first; then, when none alone fits `usable`, the most effective changes applied one
    /// after another (micro-batch, generation batch and KV budget halved as often as it helps) until the
    /// peak fits or nothing lowers it further.
    pub fn advice(&self, usable: u64) -> Vec<String> {
        let mut singles: Vec<(u64, String)> = candidate_changes(&self.settings)
            .into_iter()
            .map(|changed| {
                (
                    MemoryPlan::new(changed.clone()).peak(),
                    describe_changes(&self.settings, &changed),
                )
            })
            .filter(|(peak, _)| *peak < self.peak())
            .collect();
        singles.sort_by_key(|(peak, _)| *peak);
        let mut advice: Vec<String> = singles
            .iter()
            .map(|(peak, what)| format!("{what}: peak {}", format_size(*peak)))
            .collect();
        if singles.first().is_some_and(|(peak, _)| *peak <= usable) {
            return advice;
        }
        let mut current = self.settings.clone();
        let mut peak = self.peak();
        while peak > usable {
            let best = candidate_changes(&current)
                .into_iter()
                .map(|changed| (MemoryPlan::new(changed.clone()).peak(), changed))
                .min_by_key(|(peak, _)| *peak);
            match best {
                Some((lower, changed)) if lower < peak => (peak, current) = (lower, changed),
                _ => break,
            }
        }
        if current != self.settings {
            let verdict = if peak <= usable {
                "fits"
            } else {
                "still does not fit"
            };
            advice.push(format!(
                "together, {}: peak {} ({verdict})",
                describe_changes(&self.settings, &current),
                format_size(peak)
            ));
        }
        advice
    }
}

/// The settings one change away from `s` that may lower its peak.
fn candidate_changes(s: &PlanSettings) -> Vec<PlanSettings> {
    let mut out = Vec::new();
    if !s.checkpointing {
        out.push(PlanSettings {
            checkpointing: true,
            ..s.clone()
        });
    }
    if s.micro_batch > 1 {
        out.push(PlanSettings {
            micro_batch: s.micro_batch / 2,
            ..s.clone()
        });
    }
    if s.lora.is_none() {
        out.push(PlanSettings {
            lora: Some(LoraPlan::all_linear(8)),
            base_dtype: DType::BF16,
            ..s.clone()
        });
    }
    if s.rollout_dtype != DType::BF16 {
        out.push(PlanSettings {
            rollout_dtype: DType::BF16,
            ..s.clone()
        });
    }
    if s.rollout.workers.is_some() {
        // The rollouts' limits are the workers' business.
        return out;
    }
    if s.lora.is_some() && s.merge_lora {
        out.push(PlanSettings {
            merge_lora: false,
            ..s.clone()
        });
    }
    // A KV budget lets episodes wait or be preempted instead of every one holding the full
    // context: half of what the cache holds now, in whole GiB (MiB below 1 GiB), while it
    // still holds one episode at the full context.
    let per_position = kv_position_bytes(&s.model, s.rollout_cache_dtype());
    let (positions, _) = s.rollout_kv_positions();
    let budget = round_size_down(positions as u64 * per_position / 2);
    if budget >= s.least_kv_budget() && budget / per_position < positions as u64 {
        out.push(PlanSettings {
            rollout: RolloutLimits {
                kv_budget: Some(budget),
                ..s.rollout
            },
            ..s.clone()
        });
    }
    // Fewer episodes in flight: each may hold its cache, decoding or not.
    if s.generation_batch > 1 {
        out.push(PlanSettings {
            generation_batch: s.generation_batch / 2,
            ..s.clone()
        });
    }
    out
}

/// The value of `rollout.kv_budget` that sizes the budget from the device's memory
/// ([`auto_kv_budget`]), as vLLM sizes its KV cache from `gpu_memory_utilization`.
pub const AUTO_KV_BUDGET: &str = "auto";

/// What `rollout.kv_budget = "auto"` comes to on a device of `device_memory` bytes: the largest
/// budget, in whole MiB, with which the rollouts' peak (what lives throughout and the rollout
/// phase, [`MemoryPlan::rollout_peak`]) fits the device less its margin; `None` where every
/// episode in flight keeps its full context within that room (no budget needed), or where the
/// rollouts run on workers. The error says what is short where not even one episode at the
/// full context fits. The other phases are [`MemoryPlan::check`]'s business.
pub fn auto_kv_budget(settings: &PlanSettings, device_memory: u64) -> Result<Option<u64>, String> {
    if settings.rollout.workers.is_some() {
        return Ok(None);
    }
    let usable = settings.device.usable(device_memory);
    let unbounded = PlanSettings { rollout: RolloutLimits { kv_budget: None, ..settings.rollout }, ..settings.clone() };
    let rollout_peak = |budget: Option<u64>| {
        MemoryPlan::new(PlanSettings { rollout: RolloutLimits { kv_budget: budget, ..settings.rollout }, ..settings.clone() })
            .rollout_peak()
    };
    if rollout_peak(None) <= usable {
        return Ok(None);
    }
    let least = settings.least_kv_budget();
    let least_peak = rollout_peak(Some(least));
    if least_peak > usable {
        return Err(format!(
            "rollout.kv_budget = \"{AUTO_KV_BUDGET}\": the rollouts need {} with the KV cache of one episode at the \
             full context ({}), more than the {} usable of {}: the rest of the rollout phase leaves no room for the \
             cache (`prompt-r1 plan` shows its terms)",
            format_size(least_peak),
            format_size(least),
            format_size(usable),
            format_size(device_memory)
        ));
    }
    let per_position = kv_position_bytes(&settings.model, settings.rollout_cache_dtype());
    let every = unbounded.rollout_kv_positions().0 as u64 * per_position;
    Ok(Some(largest_fitting(least, every, |budget| rollout_peak(Some(budget)) <= usable)))
}

/// The largest budget between `fits` (which fits) and `over` (which does not), in whole MiB
/// above `fits`, for which `fit` holds (`fit` turns false, and stays so, as the budget grows).
fn largest_fitting(mut fits: u64, mut over: u64, fit: impl Fn(u64) -> bool) -> u64 {
    const MIB: u64 = 1 << 20;
    loop {
        let middle = (fits + over) / 2 / MIB * MIB;
        if middle <= fits {
            return fits;
        }
        if fit(middle) {
            fits = middle;
        } else {
            over = middle;
        }
    }
}

/// `bytes` rounded down to whole GiB, or to whole MiB below 1 GiB (a size to write in a
/// configuration, see [`size_text`]).
fn round_size_down(bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes >= GIB {
        bytes / GIB * GIB
    } else {
        bytes / MIB * MIB
    }
}

/// `bytes` as a configuration writes it: `24GiB`, `512MiB`, else a number of bytes.
fn size_text(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{}GiB", bytes / GIB)
    } else if bytes >= MIB && bytes % MIB == 0 {
        format!("{}MiB", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

/// The configuration keys that turn `from` into `to`.
fn describe_changes(from: &PlanSettings, to: &PlanSettings) -> String {
    let mut keys = Vec::new();
    if to.checkpointing != from.checkpointing {
        keys.push(format!(
            "grpo.activation_checkpointing = {}",
            to.checkpointing
        ));
    }
    if to.micro_batch != from.micro_batch {
        keys.push(format!("grpo.micro_batch_size = {}", to.micro_batch));
    }
    if to.lora.is_some() && from.lora.is_none() {
        keys.push("LoRA ([lora], rank 8) with model_dtype = \"bf16\"".to_owned());
    }
    if to.rollout_dtype != from.rollout_dtype {
        keys.push(format!(
            "rollout.dtype = \"{}\"",
            dtype_name(to.rollout_dtype)
        ));
    }
    if to.merge_lora != from.merge_lora && to.lora.is_some() && from.lora.is_some() {
        keys.push(format!("rollout.merge_lora = {}", to.merge_lora));
    }
    if to.generation_batch != from.generation_batch {
        keys.push(format!(
            "rollout.generation_batch = {}",
            to.generation_batch
        ));
    }
    if to.rollout.max_num_seqs != from.rollout.max_num_seqs {
        if let Some(rows) = to.rollout.max_num_seqs {
            keys.push(format!("rollout.max_num_seqs = {rows}"));
        }
    }
    if to.rollout.kv_budget != from.rollout.kv_budget {
        if let Some(budget) = to.rollout.kv_budget {
            keys.push(format!("rollout.kv_budget = \"{}\"", size_text(budget)));
        }
    }
    keys.join(", ")
}

/// Whether a plan fits a device.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The device's memory less the margin.
    pub usable: u64,
    pub fits: bool,
    /// What to change when it does not fit (empty when it does).
    pub advice: Vec<String>,
}

const F32: f64 = 4.0;

fn dtype_bytes(dtype: DType) -> f64 {
    dtype.size() as f64
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// Weights, adapters, AdamW's moments, the KL reference and the runtime.
fn persistent_terms(s: &PlanSettings) -> Vec<Term> {
    let params = s.model.num_parameters() as f64;
    let trainable = s.trainable_parameters() as f64;
    let mut terms = Vec::new();
    match &s.lora {
        None => terms.push(Term::new("policy weights (f32, trained)", params * F32)),
        Some(lora) => {
            let base = format!("base weights ({}, frozen)", dtype_name(s.base_dtype));
            terms.push(Term::new(base, params * dtype_bytes(s.base_dtype)));
            terms.push(Term::new(
                format!("LoRA adapters (f32, rank {})", lora.rank),
                trainable * F32,
            ));
        }
    }
    terms.push(Term::new("AdamW moments (2 × f32)", trainable * 2.0 * F32));
    if s.kl && s.lora.is_none() {
        let name = format!(
            "KL reference (the initial policy in {})",
            dtype_name(s.rollout_dtype)
        );
        terms.push(Term::new(name, params * dtype_bytes(s.rollout_dtype)));
    }
    terms.push(Term::new("runtime", s.device.runtime() as f64));
    terms
}

/// The rollouts as `model::Decoder` runs them (see the module docs): the rollout copy (or the
/// merged adapted weights), the KV
/// cache of the episodes decoding at once at the full context (or the KV budget), and one
/// chunked prefill pass. None of them with rollouts on workers: the phase then only names them.
fn rollout_phase(s: &PlanSettings) -> Phase {
    if let Some(workers) = s.rollout.workers {
        return Phase {
            name: format!(
                "rollouts: on {workers} worker{} ([rollout.servers]); their memory is the workers' \
                 (plan them with `plan --config` of a local run, or the server's own limits)",
                if workers == 1 { "" } else { "s" }
            ),
            terms: Vec::new(),
        };
    }
    let mut terms = rollout_weight_terms(s);
    terms.extend(decoder_terms(s));
    Phase {
        name: "rollouts".into(),
        terms,
    }
}

/// The weights the rollouts sample from beside the policy's: a bf16 copy, or the adapted
/// weights with the LoRA merged.
fn rollout_weight_terms(s: &PlanSettings) -> Vec<Term> {
    let params = s.model.num_parameters() as f64;
    let mut terms = Vec::new();
    // `rollout.dtype = "bf16"` samples from a bf16 copy of the weights made for the rollouts
    // (none when they are bf16 already); "f32" from the policy's weights as they are.
    let bf16_copy = s.rollout_dtype == DType::BF16 && s.weights_dtype() != DType::BF16;
    if bf16_copy {
        terms.push(Term::new(
            "rollout copy of the weights (bf16)",
            params * 2.0,
        ));
    }
    // `rollout.merge_lora` merges the adapters into new weights of the base's dtype, which live
    // beside the base while the rollouts run. Where a bf16 copy is made, the merged weights are
    // part of it (merged in f32, then cast with the rest, before any KV cache is taken).
    if let Some(adapted) = s.adapted_parameters().filter(|_| s.merge_lora && !bf16_copy) {
        let dtype = s.weights_dtype();
        terms.push(Term::new(
            format!("adapted weights with the LoRA merged ({})", dtype_name(dtype)),
            adapted as f64 * dtype_bytes(dtype),
        ));
    }
    terms
}

/// What the rollouts' decoder holds beside the weights: the KV cache (every episode in flight
/// at the full context, or the budget), one layer's keys and values gathered where burn's ops
/// attend, and one chunked prefill pass.
fn decoder_terms(s: &PlanSettings) -> Vec<Term> {
    let per_position = kv_position_bytes(&s.model, s.rollout_cache_dtype()) as f64;
    let (positions, budgeted) = s.rollout_kv_positions();
    let name = match s.rollout.kv_budget {
        Some(budget) if budgeted => format!("KV cache (budget {})", format_size(budget)),
        _ => format!(
            "KV cache ({} episodes × {} positions, the pool grown by an eighth)",
            s.generation_batch.max(1),
            grouped(s.episode_kv_positions())
        ),
    };
    let mut terms = vec![Term::new(name, positions as f64 * per_position)];
    terms.extend(decoder_step_terms(s));
    terms
}

/// What a step of the rollouts' decoder holds beside its KV cache: one layer's keys and values
/// gathered where burn's ops attend, and one chunked prefill pass.
fn decoder_step_terms(s: &PlanSettings) -> Vec<Term> {
    let m = &s.model;
    let mut terms = Vec::new();
    let cache_dtype = s.rollout_cache_dtype();
    let act = dtype_bytes(cache_dtype);
    let per_position = kv_position_bytes(m, cache_dtype) as f64;
    let rows = s.rollout_rows();
    // Burn's ops gather a pass's rows' keys and values one layer at a time (it has no paged
    // attention), and a GPU's prefill passes take them unless `--device-kernels all`; the CPU
    // kernels and the GPU's paged-attention kernel read them where they lie.
    let paged_kernel = s.paged_attention_kernel();
    if s.device != PlanDevice::CpuKernels && !paged_kernel {
        terms.push(Term::new(
            format!("keys and values of one layer gathered for {rows} × {} positions", grouped(s.context)),
            (rows * s.context) as f64 * per_position / m.num_hidden_layers.max(1) as f64,
        ));
    }
    // The decoder cuts a prefill into chunks of `max_batched_tokens / rows` new positions a row;
    // the last chunk of the longest turn attends over the whole context. The GPU's kernel
    // (`--device-kernels all`) holds no scores and no mask beyond a row of valid keys.
    let chunk = (s.rollout.max_batched_tokens / rows).clamp(1, s.context.max(1));
    let (rows_f, chunk_f) = (rows as f64, chunk as f64);
    let prefill = if paged_kernel {
        forward_activations(s, rows_f, chunk_f, act)
    } else {
        inference_forward(s, rows_f, chunk_f, s.context as f64, act)
    };
    terms.push(Term::new(
        format!(
            "prefill pass of {rows} × {} new tokens over {} positions",
            grouped(chunk),
            grouped(s.context)
        ),
        prefill,
    ));
    terms
}

/// The rollouts' largest tensors alive at once, for [`CudaPages`]: each layer's pools of keys
/// and of values at the plan's KV positions, and a prefill pass's three intermediate-wide
/// temporaries ([`activations::layer_transient`]). None with rollouts on workers.
fn rollout_tensors(s: &PlanSettings) -> Vec<TensorGroup> {
    if s.rollout.workers.is_some() {
        return Vec::new();
    }
    decoder_tensors(s, s.rollout_kv_positions().0)
}

/// [`rollout_tensors`] with a KV pool of `positions`.
fn decoder_tensors(s: &PlanSettings, positions: usize) -> Vec<TensorGroup> {
    let m = &s.model;
    let dtype = s.rollout_cache_dtype();
    let pool = positions * m.num_key_value_heads * m.head_dim * dtype.size();
    let rows = s.rollout_rows();
    let pass = rows * (s.rollout.max_batched_tokens / rows).clamp(1, s.context.max(1));
    vec![
        TensorGroup { bytes: pool as u64, count: 2 * m.num_hidden_layers as u64 },
        TensorGroup { bytes: (pass * m.intermediate_size * dtype.size()) as u64, count: 3 },
    ]
}

/// Scoring's largest tensors: a micro-batch's three intermediate-wide temporaries in a layer,
/// in the weights' dtype.
fn scoring_tensors(s: &PlanSettings) -> Vec<TensorGroup> {
    let tokens = s.micro_batch * s.context;
    let bytes = tokens * s.model.intermediate_size * s.weights_dtype().size();
    vec![TensorGroup { bytes: bytes as u64, count: 3 }]
}

/// The update's largest tensors, as [`activations`] reads them: the layer inputs checkpointing
/// keeps, the MLP's four intermediate-wide activations each kept layer holds (f32, or bf16 on a
/// bf16 base with an f32 copy of `down_proj`'s input for its adapter), and the three f32
/// intermediate-wide tensors of a layer's pass in flight.
fn update_tensors(s: &PlanSettings) -> Vec<TensorGroup> {
    let m = &s.model;
    let tokens = (s.micro_batch * s.context) as u64;
    let wide = tokens * m.intermediate_size as u64;
    let layers = m.num_hidden_layers as u64;
    let kept_layers = if s.checkpointing { 1 } else { layers };
    let mut groups = vec![TensorGroup { bytes: wide * 4, count: 3 }];
    if s.checkpointing {
        let act = if s.path() == ComputePath::PortableBf16 { 2 } else { 4 };
        groups.push(TensorGroup { bytes: tokens * m.hidden_size as u64 * act, count: layers });
    }
    match (s.path(), &s.lora) {
        (ComputePath::PortableBf16, Some(lora)) => {
            groups.push(TensorGroup { bytes: wide * 2, count: 4 * kept_layers });
            let down = lora.targets.contains(&LoraTarget::DownProj);
            groups.push(TensorGroup { bytes: wide * 4, count: u64::from(down) * kept_layers });
        }
        _ => groups.push(TensorGroup { bytes: wide * 4, count: 4 * kept_layers }),
    }
    groups
}

/// What CubeCL's whole pages add on CUDA to a phase's largest tensors `groups`, as a term; a
/// tensor no page takes makes a term of the whole `memory`, so that the run cannot fit.
fn page_term(pages: &CudaPages, memory: u64, groups: &[TensorGroup]) -> Option<Term> {
    // Tensors of one size counted together, largest first.
    let mut counts: Vec<(u64, u64)> = Vec::new();
    for g in groups.iter().filter(|g| g.count > 0) {
        match counts.iter_mut().find(|(bytes, _)| *bytes == g.bytes) {
            Some((_, count)) => *count += g.count,
            None => counts.push((g.bytes, g.count)),
        }
    }
    counts.sort_unstable_by(|a, b| b.cmp(a));
    let sizes = counts.iter().map(|(bytes, count)| format!("{count} × {}", format_size(*bytes))).collect::<Vec<_>>().join(", ");
    match pages.reserved(groups) {
        Ok(reserved) => {
            let tensors: u64 = groups.iter().map(|g| g.bytes * g.count).sum();
            (reserved > tensors).then(|| {
                Term::new(format!("CubeCL's pages on CUDA around {sizes}"), (reserved - tensors) as f64)
            })
        }
        Err(TooLarge { bytes, largest_page }) => Some(Term::new(
            format!(
                "a tensor of {} that CubeCL cannot allocate on CUDA (its largest page, a quarter of the GPU's memory, is {})",
                format_size(bytes),
                format_size(largest_page)
            ),
            memory as f64,
        )),
    }
}

/// `n` with its thousands grouped: `9,216`.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The step's episodes on the host, at the full context ([`HOST_BYTES_PER_EPISODE_TOKEN`]).
fn host_episodes_term(s: &PlanSettings) -> Term {
    Term::new(
        format!("the step's {} episodes on the host (tokens, log-probs, texts)", grouped(s.step_episodes)),
        s.step_episodes as f64 * s.context as f64 * HOST_BYTES_PER_EPISODE_TOKEN,
    )
}

/// The old and reference log-probs: a micro-batch at a time, without autodiff, on the
/// policy's weights.
fn scoring_phase(s: &PlanSettings) -> Phase {
    let (b, c) = (s.micro_batch as f64, s.context as f64);
    let dims = s.dims();
    let act = dtype_bytes(s.weights_dtype());
    let chunk = logits_chunk_rows(s) * dims.vocab * act;
    let terms = vec![
        Term::new(
            format!(
                "forward of {} × {} tokens without autodiff",
                s.micro_batch, s.context
            ),
            inference_forward(s, b, c, c, act),
        ),
        Term::new("a chunk of logits and its copy", 2.0 * chunk),
    ];
    Phase {
        name: "old and reference log-probs".into(),
        terms,
    }
}

/// The transient memory of a forward pass without autodiff over `rows × queries` new tokens
/// attending over `keys` keys (cached and new; `queries = keys` without a cache) with
/// activations of `act` bytes: the masks (built once per pass), the RoPE tables, one layer's
/// temporaries, and attention's transients.
fn inference_forward(s: &PlanSettings, rows: f64, queries: f64, keys: f64, act: f64) -> f64 {
    let path = s.device.path();
    s.masks(path, rows, queries, keys, act)
        + forward_activations(s, rows, queries, act)
        + s.attention_transient(path, rows, queries, keys, 2.0) * F32
}

/// What [`inference_forward`] holds besides attention's masks and transients: the RoPE tables
/// and one layer's temporaries for `rows × queries` new tokens.
fn forward_activations(s: &PlanSettings, rows: f64, queries: f64, act: f64) -> f64 {
    let dims = s.dims();
    let tokens = rows * queries;
    let tables = tokens * activations::rotary_tables(dims, s.device == PlanDevice::CpuKernels) * act;
    tables + tokens * activations::layer_transient(dims) * act
}

/// Rows of one chunk of logits (`model::logprobs` forms `LOGITS_CHUNK_ELEMENTS` at most).
fn logits_chunk_rows(s: &PlanSettings) -> f64 {
    let (b, vocab) = (s.micro_batch, s.model.vocab_size);
    let positions = (LOGITS_CHUNK_ELEMENTS / (b * vocab))
        .max(1)
        .min(s.context.saturating_sub(1).max(1));
    (b * positions) as f64
}

/// The pieces of one micro-batch's update, in bytes.
struct UpdateParts {
    /// Every layer's kept activations.
    layers: f64,
    /// One layer's kept activations.
    one_layer: f64,
    /// The RoPE tables, kept for the backward pass.
    shared: f64,
    /// The attention masks of a pass (see [`PlanSettings::masks`]).
    masks: f64,
    /// What the backward pass keeps of them.
    masks_kept: f64,
    /// Kept by the head: the final norm's output, the gradient at it (its chunks and their
    /// concatenation) and the logits-sized tensors of the one chunk whose graph exists.
    head: f64,
    /// Logits-sized tensors of one chunk in flight.
    head_transient: f64,
    /// A layer's gradients and temporaries in flight, attention's included.
    layer_transient: f64,
    /// One hidden-state tensor `[b, len, hidden]`.
    hidden: f64,
    /// Gradients of the head's trained weights (embedding or `lm_head`).
    head_grads: f64,
    /// Gradients of every trained parameter.
    grads: f64,
    /// Gradients accumulated over earlier micro-batches of the mini-batch.
    accumulated: f64,
    /// The embedding's gradient table in flight, when the embedding is trained.
    embedding_grad: f64,
    /// The optimiser's temporaries.
    optimizer: f64,
}

fn update_parts(s: &PlanSettings) -> UpdateParts {
    let m = &s.model;
    let dims = s.dims();
    let path = s.path();
    let (b, len) = (s.micro_batch as f64, s.context as f64);
    let tokens = b * len;
    let layers = m.num_hidden_layers as f64;
    let attention = match s.attention_path(path) {
        AttentionPath::CpuKernel => activations::KeptAttention::CpuKernel,
        AttentionPath::Eager => activations::KeptAttention::Eager,
        AttentionPath::MemoryEfficient => activations::KeptAttention::MemoryEfficient,
    };
    let kept = activations::layer_kept(dims, path, attention, s.matmul, s.lora_activations());
    // A pass that is one block pair of the memory-efficient attention keeps its probabilities.
    let one_pair = attention == activations::KeptAttention::MemoryEfficient && {
        let (q, k) = s.attention_blocks(b, len, len);
        q >= len && k >= len
    };
    let per_token_key = kept.per_token_key + if one_pair { m.num_attention_heads as f64 } else { 0.0 };
    let one_layer = (tokens * kept.per_token + tokens * len * per_token_key) * F32;
    // Hidden states, RoPE tables and masks are in the activations' dtype.
    let act = match path {
        ComputePath::PortableBf16 => 2.0,
        ComputePath::CpuKernels | ComputePath::Portable => F32,
    };
    let table = dims.vocab * dims.hidden * F32;
    let full = s.lora.is_none();
    let grads = s.trainable_parameters() as f64 * F32;
    let largest_trained = if full { table } else { 0.0 };
    UpdateParts {
        layers: layers * one_layer,
        one_layer,
        shared: tokens * activations::rotary_tables(dims, s.device == PlanDevice::CpuKernels) * act,
        masks: s.masks(path, b, len, len, act),
        masks_kept: s.masks_kept(b, len, act),
        head: tokens * activations::head_kept_per_token(dims, path) * F32
            + logits_chunk_rows(s) * activations::head_kept_per_chunk_row(dims, s.entropy_grad) * F32
            + 2.0 * tokens * dims.hidden * act,
        head_transient: activations::head_transient_chunks(path)
            * logits_chunk_rows(s)
            * dims.vocab
            * F32,
        layer_transient: (tokens * activations::layer_transient(dims) + s.attention_transient(path, b, len, len, 1.0)) * F32,
        hidden: tokens * dims.hidden * act,
        head_grads: if full { table } else { 0.0 },
        grads,
        accumulated: if s.mini_batch > s.micro_batch {
            grads
        } else {
            0.0
        },
        embedding_grad: if full {
            embedding_grad_transient(s, table)
        } else {
            0.0
        },
        optimizer: match s.device {
            PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => 5.0 * largest_trained.max(grads / layers.max(1.0)),
            _ => 0.0,
        },
    }
}

/// The embedding's gradient table in flight at the end of the backward pass, beyond the
/// gradients. The CPU kernel's backward adds rows into a fresh zeroed table, whose pages the
/// kernel only maps where it writes (the input tokens' rows); with tied embeddings burn adds
/// the head's gradient into that fresh table, writing all of it, while the checkpointed path
/// adds the fresh table into the head's gradient in place. burn's own backward (the portable
/// path) copies a zeroed table in `select_add`; on a GPU the zeroed table is memory too.
fn embedding_grad_transient(s: &PlanSettings, table: f64) -> f64 {
    match s.device {
        PlanDevice::CpuKernels if s.model.tie_word_embeddings && !s.checkpointing => table,
        PlanDevice::CpuKernels => 0.0,
        PlanDevice::CpuPortable => table,
        PlanDevice::Gpu | PlanDevice::GpuPagedPrefill => 2.0 * table,
    }
}

/// The update's worst moment (see the module docs), as terms.
fn update_phase(s: &PlanSettings, checkpointing: bool) -> Phase {
    let (name, terms) = update_moments(s, checkpointing)
        .into_iter()
        .max_by_key(|(_, terms)| terms.iter().map(|t| t.bytes).sum::<u64>())
        .expect("moments");
    Phase { name, terms }
}

/// The update's moments of highest memory, each with what it holds.
fn update_moments(s: &PlanSettings, checkpointing: bool) -> Vec<(String, Vec<Term>)> {
    let p = update_parts(s);
    let layers = s.model.num_hidden_layers as f64;
    let acc = || Term::new("gradients accumulated over the mini-batch", p.accumulated);
    if checkpointing {
        vec![
            (
                "update, head's backward pass (checkpointed)".into(),
                vec![
                    acc(),
                    Term::new(
                        "layer inputs kept by checkpointing",
                        (layers + 1.0) * p.hidden,
                    ),
                    Term::new("head: final norm output, its gradient, one chunk's logits", p.head),
                    Term::new("head: a chunk of logits in flight", p.head_transient),
                    Term::new("head's gradients", p.head_grads),
                ],
            ),
            (
                "update, top layer recomputed (checkpointed)".into(),
                vec![
                    acc(),
                    Term::new("head's gradients", p.head_grads),
                    Term::new("layer inputs kept by checkpointing", layers * p.hidden),
                    Term::new("one layer's activations", p.one_layer),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks),
                    Term::new(
                        "the layer's gradients in flight",
                        p.layer_transient + 2.0 * p.hidden,
                    ),
                ],
            ),
            (
                "update, forward pass without autodiff (checkpointed)".into(),
                vec![
                    acc(),
                    Term::new(
                        "layer inputs kept by checkpointing",
                        (layers + 1.0) * p.hidden,
                    ),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks),
                    Term::new("one layer's temporaries", p.layer_transient),
                ],
            ),
            end_of_backward(&p),
        ]
    } else {
        vec![
            (
                "update, head's backward pass".into(),
                vec![
                    acc(),
                    Term::new("every layer's activations", p.layers),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks_kept),
                    Term::new("head: final norm output, its gradient, one chunk's logits", p.head),
                    Term::new("head: a chunk of logits in flight", p.head_transient),
                    Term::new("head's gradients", p.head_grads),
                ],
            ),
            (
                "update, last layer's forward pass".into(),
                vec![
                    acc(),
                    Term::new("every layer's activations", p.layers),
                    Term::new("RoPE tables and attention masks", p.shared + p.masks),
                    Term::new("one layer's temporaries", p.layer_transient),
                ],
            ),
            end_of_backward(&p),
        ]
    }
}

/// The end of the backward pass, then the optimiser step.
fn end_of_backward(p: &UpdateParts) -> (String, Vec<Term>) {
    (
        "update, end of the backward pass".into(),
        vec![
            Term::new("gradients accumulated over the mini-batch", p.accumulated),
            Term::new("gradients (f32)", p.grads),
            Term::new("the embedding's gradient table in flight", p.embedding_grad),
            Term::new("optimiser step temporaries", p.optimizer),
        ],
    )
}

/// The update's activation memory for one micro-batch: its largest moment, gradients left out.
fn update_activations(s: &PlanSettings, checkpointing: bool) -> u64 {
    let gradients = [
        "gradients",
        "head's gradients",
        "the embedding's gradient table",
        "optimiser step",
    ];
    let one_micro_batch = PlanSettings {
        mini_batch: s.micro_batch,
        ..s.clone()
    };
    update_moments(&one_micro_batch, checkpointing)
        .iter()
        .map(|(_, terms)| {
            terms
                .iter()
                .filter(|t| !gradients.iter().any(|g| t.name.starts_with(g)))
                .map(|t| t.bytes)
                .sum()
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::Preset;

    fn settings(preset: Preset) -> PlanSettings {
        PlanSettings {
            model: preset.config(512, vec![2]),
            lora: None,
            base_dtype: DType::F32,
            rollout_dtype: DType::F32,
            merge_lora: true,
            kl: false,
            entropy_grad: false,
            micro_batch: 2,
            mini_batch: 2,
            generation_batch: 2,
            step_episodes: 2,
            rollout: RolloutLimits::default(),
            context: 256,
            checkpointing: false,
            matmul: MatmulPrecision::F32,
            attention: AttnImplementation::MemoryEfficient,
            attention_block: model::qwen3::compute::DEFAULT_ATTENTION_BLOCK_SIZE,
            device: PlanDevice::CpuKernels,
            cuda_memory: None,
        }
    }

    const GIB: f64 = (1u64 << 30) as f64;

    #[test]
    fn full_fine_tuning_holds_sixteen_bytes_a_parameter() {
        let plan = MemoryPlan::new(settings(Preset::Qwen3_0_6B));
        let params = Preset::Qwen3_0_6B.config(0, vec![]).num_parameters() as u64;
        let weights = plan
            .persistent
            .iter()
            .find(|t| t.name.starts_with("policy weights"))
            .unwrap();
        assert_eq!(weights.bytes, 4 * params);
        let moments = plan
            .persistent
            .iter()
            .find(|t| t.name.starts_with("AdamW"))
            .unwrap();
        assert_eq!(moments.bytes, 8 * params);
        // 2 × 256 tokens: the peak is at the end of the backward pass (every gradient made).
        assert_eq!(plan.peak_phase().name, "update, end of the backward pass");
        assert_eq!(
            plan.peak_phase()
                .terms
                .iter()
                .find(|t| t.name == "gradients (f32)")
                .unwrap()
                .bytes,
            4 * params
        );
    }

    #[test]
    fn lora_trains_only_the_adapters_and_needs_no_reference_copy() {
        let mut s = settings(Preset::Qwen3_4B);
        s.kl = true;
        let full = MemoryPlan::new(s.clone());
        assert!(full
            .persistent
            .iter()
            .any(|t| t.name.starts_with("KL reference")));
        s.lora = Some(LoraPlan::all_linear(8));
        s.base_dtype = DType::BF16;
        // Qwen3-4B, rank 8, all linear: 36 · 8 · (2560+4096 + 2·(2560+1024) + 4096+2560 + 2·(2560+9728) + 9728+2560).
        assert_eq!(
            s.adapter_parameters(),
            36 * 8 * (6656 + 7168 + 6656 + 24576 + 12288)
        );
        let lora = MemoryPlan::new(s);
        assert!(!lora
            .persistent
            .iter()
            .any(|t| t.name.starts_with("KL reference")));
        assert!(
            lora.persistent_total() * 5 < full.persistent_total(),
            "{} vs {}",
            lora.persistent_total(),
            full.persistent_total()
        );
    }

    #[test]
    fn checkpointing_keeps_a_fraction_of_the_activations() {
        let mut s = settings(Preset::Qwen3_0_6B);
        s.micro_batch = 8;
        s.context = 2048;
        let plan = MemoryPlan::new(s);
        let Activations {
            without_checkpointing,
            with_checkpointing,
        } = plan.activations;
        assert!(
            with_checkpointing * 3 < without_checkpointing,
            "{with_checkpointing} vs {without_checkpointing}"
        );
        // Without: 28 layers × 16,384 tokens × 22,560 values × 4 bytes ≈ 38.6 GiB of layers.
        assert!(
            without_checkpointing as f64 > 38.0 * GIB,
            "{without_checkpointing}"
        );
    }

    #[test]
    fn eager_attention_on_the_portable_path_keeps_attention_probabilities() {
        let mut s = settings(Preset::Qwen3_4B);
        s.micro_batch = 1;
        s.context = 8192;
        s.attention = AttnImplementation::Eager;
        let cpu = MemoryPlan::new(s.clone()).activations.without_checkpointing;
        s.device = PlanDevice::Gpu;
        let gpu = MemoryPlan::new(s.clone()).activations.without_checkpointing;
        // Two [1, 32, 8192, 8192] f32 tensors a layer, 36 layers: 576 GiB more.
        assert!((gpu - cpu) as f64 > 570.0 * GIB, "{gpu} vs {cpu}");
        // The memory-efficient attention keeps a log-sum-exp per head instead: the GPU path then
        // keeps about what the CPU kernels keep (the portable path's norms and SiLU keep more).
        s.attention = AttnImplementation::MemoryEfficient;
        let blocks = MemoryPlan::new(s).activations.without_checkpointing;
        assert!((blocks as f64) < 1.5 * cpu as f64, "{blocks} vs {cpu}");
    }

    /// Memory grows linearly with the context on the GPU path with the memory-efficient
    /// attention (4k tokens keep at most 5× what 1k keep), quadratically with eager.
    #[test]
    fn memory_efficient_activations_grow_linearly_with_the_context() {
        let mut s = settings(Preset::Qwen3_4B);
        s.device = PlanDevice::Gpu;
        s.micro_batch = 1;
        let at = |s: &PlanSettings, context: usize| {
            MemoryPlan::new(PlanSettings { context, ..s.clone() }).activations.without_checkpointing as f64
        };
        let ratio = at(&s, 4096) / at(&s, 1024);
        assert!(ratio <= 5.0, "memory-efficient: 4k / 1k = {ratio}");
        s.attention = AttnImplementation::Eager;
        let eager = at(&s, 4096) / at(&s, 1024);
        assert!(eager > 8.0, "eager: 4k / 1k = {eager}");
    }

    /// The paper's run (Qwen3-4B, LoRA rank 8 on a bf16 base, activation checkpointing,
    /// micro-batch 8 of 9,216-token sequences, bf16 rollouts) fits one 80 GiB GPU with 16
    /// episodes per rollout batch; with eager attention it is hundreds of GiB over (the scoring
    /// pass's and the update's `[8, 32, 9216, 9216]` scores; the rollouts' prefill is chunked).
    #[test]
    fn the_papers_run_fits_one_80_gib_gpu_at_generation_batch_16() {
        let s = PlanSettings { generation_batch: 16, ..papers_run_at_64() };
        let plan = MemoryPlan::new(s.clone());
        println!(
            "generation batch 16: peak {} ({}); rollouts {}",
            format_size(plan.peak()),
            plan.peak_phase().name,
            format_size(plan.phases[0].total())
        );
        assert!(plan.check(80 << 30).fits, "peak {}", format_size(plan.peak()));
        let eager = MemoryPlan::new(PlanSettings { attention: AttnImplementation::Eager, ..s });
        println!("eager: peak {} ({})", format_size(eager.peak()), eager.peak_phase().name);
        assert!(eager.peak() > 400 << 30, "eager peak {}", format_size(eager.peak()));
    }

    /// The step's episodes are held on the host from the rollouts to the update: on the CPU
    /// they count in the scoring and update phases, on a GPU beside them; an absurd
    /// `rollout.n` does not fit.
    #[test]
    fn the_step_episodes_take_host_memory() {
        let s = PlanSettings { step_episodes: 640, context: 9216, ..settings(Preset::Qwen3_0_6B) };
        let plan = MemoryPlan::new(s.clone());
        let host = plan.host_episodes();
        assert_eq!(host.bytes, (640.0 * 9216.0 * HOST_BYTES_PER_EPISODE_TOKEN) as u64);
        assert!(host.name.contains("640 episodes"), "{}", host.name);
        let holds = |p: &MemoryPlan, phase: usize| p.phases[phase].terms.iter().any(|t| t.name == host.name);
        assert!(!holds(&plan, 0) && holds(&plan, 1) && holds(&plan, 2));
        let gpu = MemoryPlan::new(PlanSettings { device: PlanDevice::Gpu, ..s.clone() });
        assert!((0..3).all(|phase| !holds(&gpu, phase)));
        assert_eq!(gpu.host_episodes(), host);
        // rollout.n = 100,000,000 on two questions: petabytes, which no machine holds.
        let absurd = MemoryPlan::new(PlanSettings { step_episodes: 200_000_000, ..s });
        assert!(!absurd.check(1 << 40).fits);
        assert!(absurd.largest_terms(1)[0].name.contains("200,000,000 episodes"));
    }

    #[test]
    fn the_verdict_names_what_to_change() {
        let mut s = settings(Preset::Qwen3_4B);
        s.micro_batch = 8;
        s.mini_batch = 64;
        s.context = 4096;
        s.kl = true;
        let plan = MemoryPlan::new(s);
        let verdict = plan.check(80 << 30);
        assert!(!verdict.fits);
        assert_eq!(verdict.usable, ((80u64 << 30) as f64 * 0.8) as u64);
        assert!(
            verdict
                .advice
                .iter()
                .any(|a| a.starts_with("grpo.activation_checkpointing = true")),
            "{:?}",
            verdict.advice
        );
        // No single change is enough; together, with LoRA's smaller weights and optimiser
        // state, they fit.
        let together = verdict.advice.last().unwrap();
        assert!(
            together.starts_with("together, ") && together.contains("LoRA") && together.ends_with("(fits)"),
            "{together}"
        );
        let small = MemoryPlan::new(settings(Preset::Tiny)).check(1 << 30);
        assert!(small.fits && small.advice.is_empty());
    }

    fn kv_term(plan: &MemoryPlan) -> &Term {
        plan.phases[0].terms.iter().find(|t| t.name.starts_with("KV cache")).unwrap()
    }

    fn prefill_term(plan: &MemoryPlan) -> &Term {
        plan.phases[0].terms.iter().find(|t| t.name.starts_with("prefill")).unwrap()
    }

    #[test]
    fn the_kv_pool_grows_by_an_eighth() {
        let mut s = settings(Preset::Qwen3_0_6B);
        s.generation_batch = 4;
        s.context = 1000;
        s.device = PlanDevice::Gpu;
        let plan = MemoryPlan::new(s.clone());
        // 1,000 positions take 63 blocks of 16 (1,008); 4 episodes and the scratch block hold
        // 4,048, grown by an eighth (506) and rounded up to 4,576 (a multiple of 32).
        assert_eq!(grown_capacity(4 * 1008 + 16), 4576);
        // 28 layers × (keys + values) × 8 heads × 128 × 4,576 positions × 4 bytes.
        let kv = kv_term(&plan);
        assert_eq!(kv.bytes, 28 * 2 * 1024 * 4576 * 4);
        assert_eq!(kv.name, "KV cache (4 episodes × 1,008 positions, the pool grown by an eighth)");
        // burn's ops gather one layer's keys and values for 4 rows × 1,000 positions in a
        // prefill pass.
        let gathers = |plan: &MemoryPlan| plan.phases[0].terms.iter().find(|t| t.name.starts_with("keys and values of one layer")).map(|t| t.bytes);
        assert_eq!(gathers(&plan), Some(4 * 1000 * 2 * 1024 * 4));
        // The GPU's paged-attention kernel in every pass and the CPU kernels read the pool
        // where it lies.
        let paged = MemoryPlan::new(PlanSettings { device: PlanDevice::GpuPagedPrefill, ..s.clone() });
        assert_eq!(gathers(&paged), None);
        assert_eq!(gathers(&MemoryPlan::new(PlanSettings { device: PlanDevice::CpuKernels, ..s })), None);
    }

    /// The paper's run at generation batch 64 (the reference's): Qwen3-4B, LoRA rank 8 on a
    /// bf16 base, bf16 rollouts, checkpointing, 9,216-token episodes.
    fn papers_run_at_64() -> PlanSettings {
        PlanSettings {
            lora: Some(LoraPlan::all_linear(8)),
            base_dtype: DType::BF16,
            rollout_dtype: DType::BF16,
            kl: true,
            micro_batch: 8,
            mini_batch: 64,
            generation_batch: 64,
            context: PROMPT_ALLOWANCE + 8192,
            checkpointing: true,
            device: PlanDevice::Gpu,
            ..settings(Preset::Qwen3_4B)
        }
    }

    /// `rollout.merge_lora` holds the adapted weights once more, in the base's dtype, while the
    /// rollouts run: Qwen3-4B's seven projections a layer in bf16 (inside the bf16 rollout copy
    /// where one is made). Without it, or without LoRA, no such term; the plan offers turning it
    /// off.
    #[test]
    fn merged_lora_holds_the_adapted_weights_again_during_the_rollouts() {
        let s = papers_run_at_64();
        let m = &s.model;
        let (h, q, kv, i) = (m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, m.intermediate_size);
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i;
        assert_eq!(s.adapted_parameters(), Some((per_layer * m.num_hidden_layers) as u64));
        let merged_term = |s: &PlanSettings| {
            MemoryPlan::new(s.clone()).phases[0].terms.iter().find(|t| t.name.starts_with("adapted weights with the LoRA merged")).cloned()
        };
        let term = merged_term(&s).expect("a merged copy");
        assert_eq!(term.name, "adapted weights with the LoRA merged (bf16)");
        assert_eq!(term.bytes, 2 * (per_layer * m.num_hidden_layers) as u64);
        assert!(merged_term(&PlanSettings { merge_lora: false, ..s.clone() }).is_none());
        // An f32 base: the merged weights in f32; with bf16 rollouts they are the bf16 copy's.
        let f32_base = PlanSettings { base_dtype: DType::F32, rollout_dtype: DType::F32, ..s.clone() };
        assert_eq!(merged_term(&f32_base).unwrap().bytes, 4 * (per_layer * m.num_hidden_layers) as u64);
        let bf16_copy = PlanSettings { base_dtype: DType::F32, ..s.clone() };
        assert!(merged_term(&bf16_copy).is_none());
        assert!(MemoryPlan::new(bf16_copy).phases[0].terms.iter().any(|t| t.name == "rollout copy of the weights (bf16)"));
        assert!(merged_term(&PlanSettings { lora: None, ..s.clone() }).is_none());
        assert_eq!(settings(Preset::Qwen3_4B).adapted_parameters(), None);
        let unmerged = PlanSettings { merge_lora: false, ..s.clone() };
        assert_eq!(describe_changes(&s, &unmerged), "rollout.merge_lora = false");
    }

    /// Without a budget every episode of the rollout batch holds the full context in the pool,
    /// grown by an eighth: 663,584 positions of 144 KiB (36 layers × 2 × 8 heads × 128 × bf16),
    /// 91 GiB, more than the device; the prefill is one pass of at most 8,192 new positions.
    #[test]
    fn generation_batch_64_without_a_budget_holds_every_episode_at_the_full_context() {
        let s = papers_run_at_64();
        let plan = MemoryPlan::new(s.clone());
        let per_position = kv_position_bytes(&s.model, DType::BF16);
        assert_eq!(per_position, 2 * 36 * 8 * 128 * 2);
        let pool = grown_capacity(64 * 9216 + 16);
        assert_eq!(pool, 663_584);
        let kv = kv_term(&plan);
        assert_eq!(kv.bytes, pool as u64 * per_position);
        assert_eq!(kv.name, "KV cache (64 episodes × 9,216 positions, the pool grown by an eighth)");
        let prefill = prefill_term(&plan);
        assert_eq!(prefill.name, "prefill pass of 64 × 128 new tokens over 9,216 positions");
        assert!(prefill.bytes < 4 << 30, "prefill {}", format_size(prefill.bytes));
        let verdict = plan.check(80 << 30);
        println!(
            "generation batch 64, no budget: peak {} ({}), KV {}, prefill {}; advice {:?}",
            format_size(plan.peak()),
            plan.peak_phase().name,
            format_size(kv.bytes),
            format_size(prefill.bytes),
            verdict.advice
        );
        assert!(!verdict.fits);
        // A KV budget is one lever, half the episodes another.
        assert!(verdict.advice.iter().any(|a| a.starts_with("rollout.kv_budget = \"45GiB\"")), "{:?}", verdict.advice);
        assert!(verdict.advice.iter().any(|a| a.starts_with("rollout.generation_batch = 32")), "{:?}", verdict.advice);
        // `max_num_seqs` bounds the episodes decoding at once, not the caches: the episodes
        // waiting on the environment keep theirs.
        let fewer_rows = MemoryPlan::new(PlanSettings {
            rollout: RolloutLimits { max_num_seqs: Some(16), ..s.rollout },
            ..s.clone()
        });
        assert_eq!(kv_term(&fewer_rows).bytes, kv.bytes);
        assert_eq!(kv_term(&fewer_rows).name, kv.name);
        assert!(prefill_term(&fewer_rows).name.starts_with("prefill pass of 16 × 512 new tokens"), "{}", prefill_term(&fewer_rows).name);
        let fewer = MemoryPlan::new(PlanSettings { generation_batch: 16, ..s });
        assert_eq!(kv_term(&fewer).bytes, grown_capacity(16 * 9216 + 16) as u64 * per_position);
    }

    /// With `rollout.kv_budget = "24GiB"` generation batch 64 fits one 80 GiB GPU: the cache
    /// holds at most the budget, the prefill runs in passes of 8,192 positions.
    #[test]
    fn the_papers_run_fits_one_80_gib_gpu_at_generation_batch_64() {
        let budget: u64 = 24 << 30;
        let s = PlanSettings {
            rollout: RolloutLimits { kv_budget: Some(budget), ..RolloutLimits::default() },
            ..papers_run_at_64()
        };
        let plan = MemoryPlan::new(s.clone());
        let kv = kv_term(&plan);
        let per_position = kv_position_bytes(&s.model, DType::BF16);
        // The budget in whole positions (the decoder counts positions).
        assert_eq!(kv.bytes, budget / per_position * per_position);
        assert!(budget - kv.bytes < per_position);
        assert_eq!(kv.name, "KV cache (budget 24.0 GiB)");
        println!(
            "generation batch 64, kv_budget 24 GiB: peak {} ({}); rollouts {}, KV {}, prefill {}",
            format_size(plan.peak()),
            plan.peak_phase().name,
            format_size(plan.phases[0].total()),
            format_size(kv.bytes),
            format_size(prefill_term(&plan).bytes)
        );
        assert!(plan.check(80 << 30).fits, "peak {}", format_size(plan.peak()));
    }

    /// `rollout.kv_budget = "auto"` on the paper's run at generation batch 64 (an 80 GiB GPU):
    /// the largest budget, in whole MiB, whose rollouts fit the device less its margin, so a MiB
    /// more does not; the run's plan then fits. More memory than every episode needs: no budget.
    /// Too little for one episode at the full context: an error naming the key. On workers:
    /// nothing local to size.
    #[test]
    fn an_auto_kv_budget_is_the_most_the_device_leaves_the_rollouts() {
        let s = papers_run_at_64();
        let device: u64 = 80 << 30;
        let usable = (device as f64 * 0.9) as u64;
        let budget = auto_kv_budget(&s, device).unwrap().expect("a budget: every episode does not fit");
        assert_eq!(budget % (1 << 20), 0, "whole MiB");
        let with = |bytes: u64| MemoryPlan::new(PlanSettings { rollout: RolloutLimits { kv_budget: Some(bytes), ..s.rollout }, ..s.clone() });
        let plan = with(budget);
        assert!(plan.rollout_peak() <= usable);
        assert!(with(budget + (1 << 20)).rollout_peak() > usable, "a MiB more would fit too");
        assert!(plan.check(device).fits, "peak {} ({})", format_size(plan.peak()), plan.peak_phase().name);
        // Above the 24 GiB the test above fits with, below the 91 GiB every episode would hold.
        assert!(budget > 24 << 30 && budget < kv_term(&MemoryPlan::new(s.clone())).bytes, "{}", format_size(budget));
        println!("paper's run at generation batch 64 on 80 GiB: kv_budget = \"auto\" is {}", format_size(budget));
        // On a GPU with room for every episode at the full context: no budget.
        assert_eq!(auto_kv_budget(&s, 400 << 30), Ok(None));
        // Too little room for one episode: the error names the key and what is short.
        let err = auto_kv_budget(&s, 20 << 30).unwrap_err();
        assert!(err.contains("rollout.kv_budget = \"auto\"") && err.contains("one episode"), "{err}");
        // A budget already set is not the starting point: auto sizes from the device alone.
        let set = PlanSettings { rollout: RolloutLimits { kv_budget: Some(1 << 30), ..s.rollout }, ..s.clone() };
        assert_eq!(auto_kv_budget(&set, device), Ok(Some(budget)));
        let on_workers = PlanSettings { rollout: RolloutLimits { workers: Some(2), ..s.rollout }, ..s };
        assert_eq!(auto_kv_budget(&on_workers, 20 << 30), Ok(None));
    }

    /// With `rollout.engine = "servers"` the rollouts are the workers': the paper's run at
    /// generation batch 64 without a KV budget (over 80 GiB with local rollouts) keeps no rollout
    /// copy, KV cache or prefill pass on the trainer, names the workers instead, and fits; the
    /// scoring, the update and the KL reference stay.
    #[test]
    fn rollouts_on_workers_hold_nothing_on_the_trainer() {
        let local = MemoryPlan::new(papers_run_at_64());
        let on_workers = |s: PlanSettings, n| PlanSettings { rollout: RolloutLimits { workers: Some(n), ..s.rollout }, ..s };
        let servers = MemoryPlan::new(on_workers(papers_run_at_64(), 2));
        let rollouts = &servers.phases[0];
        assert!(rollouts.terms.is_empty(), "{:?}", rollouts.terms);
        assert_eq!(rollouts.total(), 0);
        assert!(rollouts.name.starts_with("rollouts: on 2 workers ([rollout.servers])"), "{}", rollouts.name);
        let all_terms = |plan: &MemoryPlan| -> Vec<String> {
            plan.persistent.iter().chain(plan.phases.iter().flat_map(|p| &p.terms)).map(|t| t.name.clone()).collect()
        };
        for absent in ["KV cache", "prefill pass"] {
            assert!(all_terms(&local).iter().any(|t| t.starts_with(absent)), "{absent} with local rollouts");
            assert!(!all_terms(&servers).iter().any(|t| t.starts_with(absent)), "{absent} with servers");
        }
        // Full fine-tuning with bf16 rollouts: no bf16 rollout copy either; the KL reference stays.
        let full = PlanSettings { rollout_dtype: DType::BF16, kl: true, ..settings(Preset::Qwen3_0_6B) };
        let (full_local, full_servers) =
            (MemoryPlan::new(full.clone()), MemoryPlan::new(on_workers(full, 1)));
        assert!(all_terms(&full_local).iter().any(|t| t.starts_with("rollout copy")));
        assert!(!all_terms(&full_servers).iter().any(|t| t.starts_with("rollout copy")));
        assert!(all_terms(&full_servers).iter().any(|t| t.starts_with("KL reference")));
        assert!(full_servers.phases[0].name.starts_with("rollouts: on 1 worker ("), "{}", full_servers.phases[0].name);
        assert_eq!(servers.persistent, local.persistent, "the weights, adapters, moments and runtime stay");
        assert_eq!(servers.phases[1..], local.phases[1..], "the scoring and the update stay");
        println!(
            "paper's 4B at generation batch 64: local peak {} ({}); servers peak {} ({})",
            format_size(local.peak()),
            local.peak_phase().name,
            format_size(servers.peak()),
            servers.peak_phase().name
        );
        assert!(servers.peak() < local.peak());
        assert!(!local.check(80 << 30).fits && servers.check(80 << 30).fits);
        // No advice touches the rollouts' limits: they are not the trainer's.
        let tight = MemoryPlan::new(PlanSettings { micro_batch: 64, checkpointing: false, ..servers.settings.clone() });
        let advice = tight.check(80 << 30).advice;
        assert!(!advice.is_empty() && advice.iter().all(|a| !a.contains("rollout.")), "{advice:?}");
        // `from_config` takes the engine and the workers' number.
        let mut config: TrainConfig = toml::from_str("model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n").unwrap();
        let shape = Preset::Tiny.config(512, vec![2]);
        assert_eq!(PlanSettings::from_config(&config, shape.clone(), PlanDevice::Gpu, None).rollout.workers, None);
        config.rollout.engine = RolloutEngineKind::Servers;
        config.rollout.servers = Some(crate::rollout::ServerSettings {
            urls: vec!["http://a:8000".into(), "http://b:8000".into(), "http://c:8000".into()],
            ..Default::default()
        });
        let plan = MemoryPlan::new(PlanSettings::from_config(&config, shape, PlanDevice::Gpu, None));
        assert!(plan.phases[0].name.starts_with("rollouts: on 3 workers"), "{}", plan.phases[0].name);
    }

    /// A prefill pass of `max_num_batched_tokens` positions costs what its chunk attends over,
    /// not the whole context squared: with eager attention the scores are rows × chunk ×
    /// context, so halving the pass halves them.
    #[test]
    fn the_prefill_is_one_chunk_over_the_whole_context() {
        let mut s = papers_run_at_64();
        s.attention = AttnImplementation::Eager;
        let at = |tokens: usize| {
            let plan = MemoryPlan::new(PlanSettings {
                rollout: RolloutLimits { max_batched_tokens: tokens, ..s.rollout },
                ..s.clone()
            });
            prefill_term(&plan).bytes as f64
        };
        let (full, half) = (at(8192), at(4096));
        assert!((full / half - 2.0).abs() < 0.01, "{full} vs {half}");
        // Scores, their successors and the mask: 3 × 32 heads × f32 + (1 + 32) × bf16 per
        // (query, key) pair, 8,192 × 9,216 pairs.
        let pairs = 8192.0 * 9216.0;
        assert!(full > pairs * (3.0 * 32.0 * 4.0 + 33.0 * 2.0), "{full}");
        // Below the rows, a pass runs a position each of at most that many rows (the decoder
        // runs no more).
        let plan = MemoryPlan::new(PlanSettings {
            rollout: RolloutLimits { max_batched_tokens: 10, ..s.rollout },
            ..s.clone()
        });
        assert_eq!(plan.settings.rollout_rows(), 10);
        assert!(prefill_term(&plan).name.starts_with("prefill pass of 10 × 1 new tokens"), "{}", prefill_term(&plan).name);
    }

    /// On an 80 GiB CUDA GPU the paper's run counts CubeCL's pages: in the update, four f32
    /// `[73,728 × 9,728]` tensors (2.7 GiB, above 1/32 of the memory) share a page of 20 GiB,
    /// and four bf16 ones with the 36 checkpointed layer inputs fill four pages of 5 GiB. With a
    /// KV budget of 45 GiB it still fits; a micro-batch whose widest tensor outgrows a quarter of
    /// the memory cannot.
    #[test]
    fn on_cuda_the_phases_count_cubecls_whole_pages() {
        let memory = 80u64 << 30;
        let papers = papers_run_at_64();
        let s = PlanSettings {
            cuda_memory: Some(memory),
            device: PlanDevice::GpuPagedPrefill,
            rollout: RolloutLimits { kv_budget: Some(45 << 30), ..papers.rollout },
            ..papers
        };
        let plain = MemoryPlan::new(PlanSettings { cuda_memory: None, ..s.clone() });
        let plan = MemoryPlan::new(s.clone());
        let pages = |phase: &Phase| phase.terms.iter().find(|t| t.name.starts_with("CubeCL's pages")).map(|t| t.bytes);
        assert!(plain.phases.iter().all(|p| pages(p).is_none()));
        let wide = 8 * 9216 * 9728u64;
        let inputs = 8 * 9216 * 2560 * 2u64;
        let expected = (20u64 << 30) - 4 * wide * 4 + (4 * (5u64 << 30) - 4 * wide * 2 - 36 * inputs);
        assert_eq!(pages(&plan.phases[2]), Some(expected));
        assert_eq!(plan.phases[2].total(), plain.phases[2].total() + expected);
        assert!(plan.check(memory).fits, "peak {}", format_size(plan.peak()));
        // 64 sequences a micro-batch: a 21.4 GiB f32 tensor no page takes.
        let large = MemoryPlan::new(PlanSettings { micro_batch: 64, ..s });
        let update = &large.phases[2];
        let blocker = update.terms.iter().find(|t| t.name.contains("cannot allocate")).expect("a term for it");
        assert!(blocker.name.starts_with("a tensor of 21.4 GiB"), "{}", blocker.name);
        let verdict = large.check(memory);
        assert!(!verdict.fits);
        assert!(verdict.advice.iter().any(|a| a.contains("micro_batch_size")), "{:?}", verdict.advice);
        // What the pool holds in a learning step leaves the CUDA context out.
        assert_eq!(plan.update_pool_peak(), plan.update_peak() - (512 << 20));
    }
}

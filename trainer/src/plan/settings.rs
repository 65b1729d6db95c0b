//! What a plan depends on: the device and the path its forward pass takes, the LoRA adapters,
//! the run's settings ([`PlanSettings`]) with the rollouts' limits, and what follows from them
//! alone (the rollouts' rows and KV positions, the parameters the run trains).

use burn::tensor::DType;
use model::lora::{LoraConfig, LoraTarget};
use model::decode::positions_to_hold;
use model::qwen3::{grown_capacity, BLOCK_SIZE};
use model::{AttnImplementation, MatmulPrecision, Qwen3Config};

use crate::run::{RolloutEngineKind, TrainConfig};
use super::activations::{Dims, LoraActivations};
use super::parse_size;

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

impl std::fmt::Display for PlanDevice {
    /// How the plan's header names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PlanDevice::CpuKernels => "CPU with prompt-r1's kernels",
            PlanDevice::CpuPortable => "CPU through burn's portable ops",
            PlanDevice::Gpu => "GPU, prefill over gathered keys and values",
            PlanDevice::GpuPagedPrefill => "GPU, every pass over the paged KV cache in place",
        })
    }
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
    pub(super) fn runtime(self) -> u64 {
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
    /// their tokens and texts, from the rollouts to the update ([`MemoryPlan::host_episodes`](super::MemoryPlan::host_episodes)).
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
    /// of size classes that follow it ([`CudaPages`](super::CudaPages)), which the phases then count
    /// ([`MemoryPlan::new`](super::MemoryPlan::new)). `None` elsewhere: the CPU has no such pool, and wgpu's pages follow
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
    /// `episode.max_response_tokens`, within the model's `max_position_embeddings`, past which
    /// `train` refuses an episode).
    pub fn from_config(
        config: &TrainConfig,
        model: Qwen3Config,
        device: PlanDevice,
        context: Option<usize>,
    ) -> Self {
        let episodes = config.rollout.batch_size * config.rollout.n;
        let longest = PROMPT_ALLOWANCE.saturating_add(config.episode.max_response_tokens).min(model.max_position_embeddings);
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
            context: context.unwrap_or(longest),
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

    /// Why `train` refuses this run before any episode, whatever its data: episodes of
    /// `max_response_tokens` responses after the shortest first prompt (one token) would pass the
    /// model's context, or `rollout.kv_budget` cannot hold one of them (the rollouts run here).
    /// `None` when neither.
    pub fn refusal(&self, max_response_tokens: usize) -> Option<String> {
        let context = self.model.max_position_embeddings;
        if max_response_tokens >= context {
            return Some(format!(
                "episode.max_response_tokens = {max_response_tokens} leaves no room for a first prompt in the model's \
                 context of {context} tokens (max_position_embeddings): `train` refuses a run whose episodes may \
                 outgrow it; lower episode.max_response_tokens"
            ));
        }
        let budget = self.kv_budget_positions().filter(|_| self.rollout.workers.is_none())?;
        let needed = positions_to_hold(max_response_tokens + 2);
        (budget < needed).then(|| {
            format!(
                "rollout.kv_budget holds {budget} KV positions of this model, fewer than the {needed} that even an \
                 episode with a one-token first prompt and episode.max_response_tokens = {max_response_tokens} may \
                 need: `train` refuses it; raise rollout.kv_budget or lower episode.max_response_tokens"
            )
        })
    }

    /// A note where `rollout.kv_budget` holds less than one episode at the plan's context (its
    /// longest first prompt and responses): `train` refuses the budget if the data's longest
    /// first prompt is that long. `None` otherwise, or where the rollouts run on workers.
    pub fn kv_budget_note(&self) -> Option<String> {
        let budget = self.rollout.kv_budget.filter(|_| self.rollout.workers.is_none())?;
        let least = self.least_kv_budget();
        (budget < least).then(|| {
            format!(
                "note: rollout.kv_budget ({}) holds less than one episode at the plan's context of {} tokens ({}): \
                 `train` refuses it if the data's longest first prompt and episode.max_response_tokens come to that",
                super::format_size(budget),
                self.context,
                super::format_size(least)
            )
        })
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
    pub(super) fn weights_dtype(&self) -> DType {
        if self.lora.is_some() {
            self.base_dtype
        } else {
            DType::F32
        }
    }

    pub(super) fn dims(&self) -> Dims {
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
    pub(super) fn paged_attention_kernel(&self) -> bool {
        self.device == PlanDevice::GpuPagedPrefill && self.attention == AttnImplementation::MemoryEfficient
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

    pub(super) fn lora_activations(&self) -> LoraActivations {
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
}

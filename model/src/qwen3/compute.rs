//! How the model computes, one value chosen at load (as transformers' `attn_implementation`):
//! the attention implementation, its block size, the precision of products with f32 weights,
//! the CPU kernels that stand in for burn's ops on burn-flex ([`cpu_kernels::Kernels`]), and
//! which kernels a GPU backend lends it runs ([`DeviceKernelChoice`]).
//! The model keeps it ([`super::Qwen3Model::compute`]) and every layer reads it from
//! there; the trainer's activation checkpointing recomputes with it, and the memory plan counts
//! what it holds.
//!
//! Where each implementation runs:
//!
//! | backend | `eager` | `memory_efficient` (default) |
//! |---|---|---|
//! | burn-flex, CPU kernels on (plain or under autodiff, f32/bf16) | the fused CPU kernel | the fused CPU kernel |
//! | burn-flex with the kernels off ([`Compute::cpu_kernels`] `off`), CUDA, wgpu | HF's formula in burn's ops, `[b, heads, q, k]` scores, probabilities and mask | blocks of queries and keys with an online softmax ([`super::attention`]); under autodiff one node that keeps `O` and the log-sum-exp |
//!
//! The CPU kernel (`cpu_kernels::ops::grouped_attention`) is one parallel pass that keeps two
//! floats per query row and is faster on the CPU than either formula in burn's ops; it takes the
//! mask as a `[b, 1, q, k]` bias. With `memory_efficient`, where [`Compute::device_kernels`]
//! says so (`--device-kernels`), a decoding step over the paged KV cache (one query per row)
//! runs instead through the kernel a GPU backend is lent ([`crate::device_kernels`]; the
//! binary's CUDA and wgpu backends lend CubeCL's), which reads the cache in place, and so do
//! prefill chunks and the passes without a cache where the choice takes every pass.

use std::fmt;
use std::str::FromStr;

use cpu_kernels::Kernels;
use serde::{Deserialize, Serialize};

use super::linear::MatmulPrecision;
use crate::device_kernels::{DeviceKernelChoice, KernelPasses};

/// Attention's implementation (HF's `attn_implementation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnImplementation {
    /// HF's eager formula, `softmax(Q·Kᵀ / sqrt(d) + mask)·V` with the scores, the probabilities
    /// and the mask materialised for every head, `[b, heads, q, k]`, and kept for the backward:
    /// the reference for parity.
    Eager,
    /// FlashAttention-2's algorithm in burn's tensor ops: blocks of queries and keys with an
    /// online softmax; under autodiff one node whose backward recomputes each block's
    /// probabilities. No `[b, heads, q, k]` tensor exists; at most one block pair's scores.
    #[default]
    MemoryEfficient,
}

impl AttnImplementation {
    /// Both, reference first.
    pub const ALL: [AttnImplementation; 2] = [AttnImplementation::Eager, AttnImplementation::MemoryEfficient];

    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            AttnImplementation::Eager => "eager",
            AttnImplementation::MemoryEfficient => "memory_efficient",
        }
    }
}

impl fmt::Display for AttnImplementation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AttnImplementation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase().replace('-', "_");
        AttnImplementation::ALL
            .into_iter()
            .find(|a| a.name() == wanted)
            .ok_or_else(|| format!("unknown attention implementation '{s}' (expected eager or memory_efficient)"))
    }
}

/// How the model computes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Compute {
    pub attn_implementation: AttnImplementation,
    /// Queries per block of the memory-efficient attention, and the fewest keys per block
    /// (more while one block pair's scores stay within [`SCORE_BLOCK_ELEMENTS`]).
    pub attention_block_size: usize,
    /// The precision of products with f32 weights.
    pub matmul: MatmulPrecision,
    /// The CPU kernels that stand in for burn's ops on burn-flex (off: the GPU backends' path
    /// on the CPU). Not part of a config file: the default is what the environment says
    /// ([`Kernels::from_env`]), and the binary's commands choose it from their flags.
    #[serde(skip)]
    pub cpu_kernels: Kernels,
    /// Which of the kernels a GPU backend lends run, and how. Not part of a config file: the
    /// binary chooses it from its flags for the device it runs on.
    #[serde(skip)]
    pub device_kernels: DeviceKernelChoice,
}

/// The kernels that may stand in for burn's ops in one forward pass (see [`Compute::pass`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassKernels {
    /// The CPU kernels (burn-flex only).
    pub cpu: Kernels,
    /// The kernels a GPU backend lent ([`crate::device_kernels`]) this pass may run: the
    /// model's choice in a pass over a KV cache, none elsewhere.
    pub device: DeviceKernelChoice,
}

/// The kernels a model runs on its backend ([`Compute::kernels_on`]), named as the binary's
/// flags name them: what a run records beside its settings, since neither is a config key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KernelsInUse {
    /// On burn-flex, the CPU kernels; `None` on other backends, which never run them.
    pub cpu: Option<CpuKernelsInUse>,
    /// On a backend that lends GPU kernels, which of them run (`--device-kernels`,
    /// `--split-decoding`, `--decoding-kernel`); `None` where none is lent.
    pub gpu: Option<GpuKernelsInUse>,
}

/// The CPU kernels of a model on burn-flex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuKernelsInUse {
    /// Their instruction-set level (`PROMPT_R1_CPU_ISA`), or `off` where burn's portable ops
    /// compute everything (`PROMPT_R1_PORTABLE_OPS=1`, `bench --portable-ops`).
    pub level: &'static str,
    /// How the packed bf16 products multiply (`PROMPT_R1_BF16_PRODUCTS`), where the kernels run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_products: Option<&'static str>,
}

/// The GPU kernels a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GpuKernelsInUse {
    /// The passes they take: `off`, `decode` or `all`.
    pub passes: &'static str,
    /// Whether decoding steps are split across the GPU, where any pass runs them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_decoding: Option<bool>,
    /// The kernel of decoding steps (`own` or `general`), where any pass runs them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decoding_kernel: Option<&'static str>,
    /// Whether decoding steps' projections run through the skinny-matmul kernel, where any pass
    /// runs the kernels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skinny_matmul: Option<bool>,
    /// Whether the attention's blocks of several queries multiply on the tensor cores (where the
    /// device has them), where any pass runs the kernels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor_core_attention: Option<bool>,
}

/// The default [`Compute::attention_block_size`]: a 256-token pass is one block (no more work
/// than the eager formula), and at 8k tokens a micro-batch of 8 Qwen3-4B sequences (32 query
/// heads) keeps 512 MiB of f32 scores per block pair instead of 64 GiB.
pub const DEFAULT_ATTENTION_BLOCK_SIZE: usize = 512;

/// Scores of one block pair of the memory-efficient attention may reach this many elements
/// before key blocks stop growing past [`Compute::attention_block_size`]: a decoding step
/// (a few query rows) then sees its whole cache in one block, as the eager formula does.
pub const SCORE_BLOCK_ELEMENTS: usize = 1 << 26;

impl Default for Compute {
    fn default() -> Self {
        Self {
            attn_implementation: AttnImplementation::default(),
            attention_block_size: DEFAULT_ATTENTION_BLOCK_SIZE,
            matmul: MatmulPrecision::default(),
            cpu_kernels: Kernels::default(),
            device_kernels: DeviceKernelChoice::default(),
        }
    }
}

impl Compute {
    /// The same with `cpu_kernels`.
    pub fn with_cpu_kernels(self, cpu_kernels: Kernels) -> Compute {
        Compute { cpu_kernels, ..self }
    }

    /// The same with `device_kernels`.
    pub fn with_device_kernels(self, device_kernels: DeviceKernelChoice) -> Compute {
        Compute { device_kernels, ..self }
    }

    /// The kernels one pass may use: the CPU kernels, and a GPU backend's only in a pass
    /// `over_cache` (generation's prefill and decoding steps over a KV cache). Passes without a
    /// cache (scoring, the update) keep burn's ops there for the norms and SwiGLU, so that old
    /// log-probs and the update's forward agree to the last bit (their attention takes the
    /// fresh-attention kernel, both of them, where [`Self::device_kernels`] says so).
    pub fn pass(&self, over_cache: bool) -> PassKernels {
        PassKernels { cpu: self.cpu_kernels, device: if over_cache { self.device_kernels } else { DeviceKernelChoice::OFF } }
    }

    /// The kernels a model with this value runs on backend `B`, as a run's settings file records
    /// them: the CPU kernels on burn-flex, the GPU kernels on a backend that lends them.
    pub fn kernels_on<B: burn::tensor::backend::Backend>(&self) -> KernelsInUse {
        let level = self.cpu_kernels.level();
        let cpu = cpu_kernels::is_flex_backend::<B>().then(|| CpuKernelsInUse {
            level: level.map_or("off", |level| level.name()),
            bf16_products: level.map(|_| self.cpu_kernels.bf16_products().name()),
        });
        let choice = self.device_kernels;
        let gpu = DeviceKernelChoice::lent_to::<B>().then(|| GpuKernelsInUse {
            passes: choice.passes.map_or("off", KernelPasses::name),
            split_decoding: choice.passes.map(|_| choice.decoding.split),
            decoding_kernel: choice.passes.map(|_| choice.decoding.kernel.name()),
            skinny_matmul: choice.passes.map(|_| choice.skinny_matmul),
            tensor_core_attention: choice.passes.map(|_| choice.tensor_cores),
        });
        KernelsInUse { cpu, gpu }
    }

    /// Checks the settings: a block holds at least one query.
    pub fn validate(&self) -> Result<(), crate::SettingError> {
        if self.attention_block_size == 0 {
            return Err("attention_block_size must be at least 1 (the queries per block of the memory-efficient attention)".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use cpu_kernels::{Isa, Kernels};

    use super::*;

    /// On burn-flex, plain or under autodiff, the record names the CPU kernels (their product
    /// kernel only where they run) and no GPU kernel, none being lent to it.
    #[test]
    fn the_cpu_kernels_are_recorded_on_burn_flex() {
        let off = Compute::default().with_cpu_kernels(Kernels::off());
        let want = KernelsInUse { cpu: Some(CpuKernelsInUse { level: "off", bf16_products: None }), gpu: None };
        assert_eq!(off.kernels_on::<Flex>(), want);
        assert_eq!(off.kernels_on::<Autodiff<Flex>>(), want);
        let portable = Compute::default().with_cpu_kernels(Kernels::at(Isa::Portable)).kernels_on::<Flex>();
        let cpu = portable.cpu.expect("burn-flex runs the CPU kernels");
        assert_eq!(cpu.level, "portable");
        assert_eq!(cpu.bf16_products, Some(Kernels::host().bf16_products().name()));
        let json = serde_json::to_value(off.kernels_on::<Flex>()).unwrap();
        assert_eq!(json, serde_json::json!({"cpu": {"level": "off"}, "gpu": null}));
    }
}

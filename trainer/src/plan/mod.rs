//! The memory plan of a training run, worked out before anything big is loaded: from the
//! model's `config.json` (its shape; no weights are read) and the run's settings, the bytes each
//! part of a GRPO step holds, phase by phase, and whether the peak fits a device.
//!
//! A step has three phases, and the peak is the largest of them on top of what lives throughout
//! (the weights, the optimiser's moments, the KL reference):
//! - **rollouts**: the rollout copy of the policy (bf16 rollouts; with LoRA and
//!   `rollout.merge_lora`, the adapted weights with the adapters merged), the KV cache and one prefill
//!   pass, as `model::Decoder` runs them: each episode's cache is kept across its turns in
//!   blocks of a paged pool that grows by an eighth ([`grown_capacity`](model::qwen3::grown_capacity)), so the episodes in
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
//! [`block_sizes`](model::qwen3::attention::memory_efficient::block_sizes), the model's own
//! choice) and causal blocks; the CPU kernel keeps a `[b, 1, q, k]` bias. The head forms its logits a chunk of positions at a time in every phase, the
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
mod attention;
mod fit;
mod pages;
mod phases;
mod serving;
mod settings;
mod size;

use burn::tensor::DType;

use phases::{
    host_episodes_term, page_term, persistent_terms, rollout_phase, rollout_tensors, scoring_phase, scoring_tensors,
    update_activations, update_phase, update_tensors,
};
pub use fit::{auto_kv_budget, Verdict, AUTO_KV_BUDGET};
pub use pages::{CudaPages, TensorGroup, TooLarge};
pub use serving::{auto_serving_kv_budget, ServingSettings};
pub use settings::{
    kv_position_bytes, ComputePath, LoraPlan, PlanDevice, PlanSettings, RolloutLimits, DEFAULT_MAX_NUM_BATCHED_TOKENS,
    HOST_BYTES_PER_EPISODE_TOKEN, PROMPT_ALLOWANCE,
};
pub use size::{format_size, parse_device_memory, parse_size};

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

#[cfg(test)]
mod tests {
    use super::*;
    use super::fit::describe_changes;
    use crate::run::{RolloutEngineKind, TrainConfig};
    use model::qwen3::grown_capacity;
    use model::{AttnImplementation, MatmulPrecision, Preset};

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
        assert_eq!(gathers(&MemoryPlan::new(PlanSettings { device: PlanDevice::CpuKernels, ..s.clone() })), None);
        // Scoring through the kernel holds neither the memory-efficient attention's block pairs
        // nor its causal blocks: only the forward's activations.
        let scoring = |plan: &MemoryPlan| plan.phases.iter().find(|p| p.name == "old and reference log-probs").expect("a scoring phase").terms[0].bytes;
        let act = dtype_bytes(s.weights_dtype());
        let activations = phases::forward_activations(&s, s.micro_batch as f64, s.context as f64, act).round() as u64;
        assert_eq!(scoring(&paged), activations);
        assert!(scoring(&plan) > activations, "burn's ops hold the attention's blocks beside the activations");
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
        assert!(err.0.contains("rollout.kv_budget = \"auto\"") && err.0.contains("one episode"), "{err}");
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

    /// What `train` refuses whatever the data, `plan` refuses too: responses that leave no room
    /// for a first prompt in the model's context, a KV budget that cannot hold one episode of them
    /// (unless the rollouts run on workers); a budget below one episode at the plan's context is
    /// a note, since `train` measures the data's prompts.
    #[test]
    fn what_train_refuses_whatever_the_data() {
        let s = papers_run_at_64();
        assert_eq!(s.refusal(8192), None);
        assert_eq!(s.kv_budget_note(), None);
        let err = s.refusal(s.model.max_position_embeddings).unwrap();
        assert!(err.contains("episode.max_response_tokens = 40960") && err.contains("context of 40960"), "{err}");
        let per_position = kv_position_bytes(&s.model, s.rollout_cache_dtype());
        let with_budget = |positions: u64| PlanSettings {
            rollout: RolloutLimits { kv_budget: Some(positions * per_position), ..s.rollout },
            ..s.clone()
        };
        // As the rollouts' engine counts an episode: its first prompt (one token at the least),
        // its responses, and the position after them.
        let needed = model::decode::positions_to_hold(1 + 8192 + 1) as u64;
        let err = with_budget(needed - 1).refusal(8192).unwrap();
        assert!(err.contains(&format!("holds {} KV positions", needed - 1)) && err.contains(&needed.to_string()), "{err}");
        assert_eq!(with_budget(0).refusal(8192).map(|e| e.contains("holds 0 KV positions")), Some(true));
        let short = with_budget(needed);
        assert_eq!(short.refusal(8192), None);
        let note = short.kv_budget_note().expect("below one episode of the plan's 9,216 tokens");
        assert!(note.contains("9216 tokens"), "{note}");
        assert_eq!(with_budget(s.least_kv_budget() / per_position).kv_budget_note(), None);
        let on_workers = PlanSettings { rollout: RolloutLimits { workers: Some(2), ..with_budget(0).rollout }, ..s.clone() };
        assert_eq!((on_workers.refusal(8192), on_workers.kv_budget_note()), (None, None));
    }

    /// The default context (1,024 prompt tokens and the responses) stops at the model's context.
    #[test]
    fn the_default_context_is_within_the_models() {
        let mut config: TrainConfig = toml::from_str("model = \"m\"\n[data]\ntrain = [\"t.csv\"]\n").unwrap();
        let mut shape = Preset::Tiny.config(512, vec![2]);
        shape.max_position_embeddings = 4096;
        config.episode.max_response_tokens = 2048;
        assert_eq!(PlanSettings::from_config(&config, shape.clone(), PlanDevice::Gpu, None).context, 3072);
        config.episode.max_response_tokens = 3500;
        assert_eq!(PlanSettings::from_config(&config, shape.clone(), PlanDevice::Gpu, None).context, 4096);
        config.episode.max_response_tokens = usize::MAX;
        assert_eq!(PlanSettings::from_config(&config, shape.clone(), PlanDevice::Gpu, Some(100)).context, 100);
        assert_eq!(PlanSettings::from_config(&config, shape, PlanDevice::Gpu, None).context, 4096);
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

//! The memory of a served model (`prompt-r1 serve`), for `--kv-cache-memory auto`: the weights,
//! the adapted weights each merged LoRA adapter holds again, the runtime, the KV cache at its
//! budget (the pool may fill it: running requests, the prefix cache's and free blocks), and a
//! decoder step, counted as the rollout phase of a run counts it ([`decoder_step_terms`]).

use burn::tensor::DType;
use model::{AttnImplementation, MatmulPrecision, Qwen3Config};

use super::fit::largest_fitting;
use super::phases::{decoder_step_terms, decoder_tensors, page_term};
use super::{
    dtype_bytes, dtype_name, format_size, kv_position_bytes, CudaPages, LoraPlan, PlanDevice, PlanSettings,
    RolloutLimits, Term,
};

/// What a server's memory depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct ServingSettings {
    /// The model's shape; its `max_position_embeddings` is the longest request.
    pub model: Qwen3Config,
    /// The weights' dtype (f32 or bf16), which the KV cache and the activations take.
    pub dtype: DType,
    /// Most requests decoding at once (`--max-batch`).
    pub max_rows: usize,
    /// Most tokens one decoder step runs (`--max-num-batched-tokens`).
    pub max_batched_tokens: usize,
    /// LoRA adapters that may each hold a merged copy of the weights they adapt (`--merge-lora`:
    /// `--max-loras`; otherwise 0), counted as adapting every linear projection.
    pub merged_adapters: usize,
    pub attention: AttnImplementation,
    pub attention_block: usize,
    pub device: PlanDevice,
    /// The GPU's memory on CUDA, where CubeCL's pool reserves whole pages ([`CudaPages`]).
    pub cuda_memory: Option<u64>,
}

impl ServingSettings {
    /// The settings of a run whose rollouts decode as this server does.
    fn as_rollouts(&self) -> PlanSettings {
        PlanSettings {
            model: self.model.clone(),
            lora: None,
            base_dtype: self.dtype,
            rollout_dtype: self.dtype,
            merge_lora: false,
            kl: false,
            entropy_grad: false,
            micro_batch: 1,
            mini_batch: 1,
            generation_batch: self.max_rows,
            step_episodes: self.max_rows,
            rollout: RolloutLimits {
                max_num_seqs: Some(self.max_rows),
                max_batched_tokens: self.max_batched_tokens,
                kv_budget: None,
                workers: None,
            },
            context: self.model.max_position_embeddings,
            checkpointing: false,
            matmul: MatmulPrecision::F32,
            attention: self.attention,
            attention_block: self.attention_block,
            device: self.device,
            cuda_memory: self.cuda_memory,
        }
    }

    /// What the server holds with a KV cache of `kv_budget` bytes, term by term.
    pub fn terms(&self, kv_budget: u64) -> Vec<Term> {
        let params = self.model.num_parameters() as f64;
        let mut terms = vec![
            Term::new("runtime", self.device.runtime() as f64),
            Term::new(format!("weights ({})", dtype_name(self.dtype)), params * dtype_bytes(self.dtype)),
        ];
        if self.merged_adapters > 0 {
            let every_linear = PlanSettings { lora: Some(LoraPlan::all_linear(1)), ..self.as_rollouts() };
            let adapted = every_linear.adapted_parameters().unwrap_or(0) as f64;
            terms.push(Term::new(
                format!("{} merged LoRA copies of the adapted weights", self.merged_adapters),
                self.merged_adapters as f64 * adapted * dtype_bytes(self.dtype),
            ));
        }
        let per_position = kv_position_bytes(&self.model, self.dtype).max(1);
        let positions = usize::try_from(kv_budget / per_position).unwrap_or(usize::MAX);
        terms.push(Term::new(format!("KV cache (budget {})", format_size(kv_budget)), (positions as u64 * per_position) as f64));
        let rollouts = self.as_rollouts();
        terms.extend(decoder_step_terms(&rollouts));
        if let Some(memory) = self.cuda_memory {
            terms.extend(page_term(&CudaPages::new(memory), memory, &decoder_tensors(&rollouts, positions)));
        }
        terms
    }

    /// [`Self::terms`] summed.
    pub fn peak(&self, kv_budget: u64) -> u64 {
        self.terms(kv_budget).iter().map(|t| t.bytes).sum()
    }
}

/// `serve --kv-cache-memory auto`: the largest KV budget, in whole MiB, with which the server
/// fits `device_memory` less the device's margin (vLLM sizes its cache so from
/// `--gpu-memory-utilization`). The cache grows with the requests running within it, so a large
/// budget costs nothing until used. The error says what is short where the weights and a decoder
/// step leave no room for a cache of one block a request.
pub fn auto_serving_kv_budget(s: &ServingSettings, device_memory: u64) -> Result<u64, model::SettingError> {
    let usable = s.device.usable(device_memory);
    let per_position = kv_position_bytes(&s.model, s.dtype).max(1);
    // A block a request and the pool's scratch block.
    let least = ((s.max_rows + 1) * model::qwen3::BLOCK_SIZE) as u64 * per_position;
    let least_peak = s.peak(least);
    if least_peak > usable {
        return Err(format!(
            "--kv-cache-memory auto: the weights, the runtime and a decoder step of {} tokens need {}, more than the {} \
             usable of {} (after a {:.0}% margin): lower --max-num-batched-tokens or --max-batch, or give a size",
            s.max_batched_tokens,
            format_size(least_peak),
            format_size(usable),
            format_size(device_memory),
            s.device.margin() * 100.0
        ).into());
    }
    // The whole usable memory as a budget cannot fit beside the weights: the search's top.
    Ok(largest_fitting(least, usable.max(least + 1), |budget| s.peak(budget) <= usable))
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::Preset;

    fn qwen3_0_6b(device: PlanDevice) -> ServingSettings {
        ServingSettings {
            model: Preset::Qwen3_0_6B.config(151_936, vec![]),
            dtype: DType::BF16,
            max_rows: 8,
            max_batched_tokens: 8192,
            merged_adapters: 0,
            attention: AttnImplementation::MemoryEfficient,
            attention_block: model::qwen3::compute::DEFAULT_ATTENTION_BLOCK_SIZE,
            device,
            cuda_memory: None,
        }
    }

    /// On an 80 GiB GPU the 0.6B shape in bf16 leaves most of the device to the cache: the
    /// budget is the largest whole MiB whose server fits 90% of it (a MiB more does not), and
    /// it is the device less the weights, the runtime and a step, to a MiB. Merged adapters'
    /// copies come out of it; a device that cannot hold the weights is refused, naming the flags.
    #[test]
    fn an_auto_budget_is_what_the_device_leaves_the_cache() {
        let s = qwen3_0_6b(PlanDevice::GpuPagedPrefill);
        let device: u64 = 80 << 30;
        let usable = (device as f64 * 0.9) as u64;
        let budget = auto_serving_kv_budget(&s, device).unwrap();
        assert_eq!(budget % (1 << 20), 0);
        assert!(s.peak(budget) <= usable && s.peak(budget + (1 << 20)) > usable);
        let others: u64 = s.terms(budget).iter().filter(|t| !t.name.starts_with("KV cache")).map(|t| t.bytes).sum();
        assert!(usable - others - budget < 2 << 20, "budget {} others {}", format_size(budget), format_size(others));
        let weights = s.model.num_parameters() as u64 * 2;
        assert!(others > weights && others < weights + (4 << 30), "others {}", format_size(others));
        println!("Qwen3-0.6B bf16 on 80 GiB: --kv-cache-memory auto is {} beside {}", format_size(budget), format_size(others));
        let h200 = ServingSettings { cuda_memory: Some(143_771 << 20), ..s.clone() };
        let h200_budget = auto_serving_kv_budget(&h200, 143_771 << 20).unwrap();
        println!(
            "on an H200 (143,771 MiB, CubeCL's pages counted): {} ({} positions); {:?}",
            format_size(h200_budget),
            h200_budget / kv_position_bytes(&s.model, DType::BF16),
            h200.terms(h200_budget)
        );

        // Four merged adapters hold the 0.6B shape's linear weights four times more.
        let merged = ServingSettings { merged_adapters: 4, ..s.clone() };
        let merged_budget = auto_serving_kv_budget(&merged, device).unwrap();
        let linear = (s.model.num_parameters() - s.model.vocab_size * s.model.hidden_size) as u64;
        let copies = merged.terms(merged_budget).iter().find(|t| t.name.starts_with("4 merged LoRA copies")).unwrap().bytes;
        assert!(copies > 4 * 2 * linear * 9 / 10 && copies <= 4 * 2 * linear, "{}", format_size(copies));
        assert!((budget - merged_budget).abs_diff(copies) < 2 << 20);
        // The weights alone outgrow a 1 GiB device.
        let err = auto_serving_kv_budget(&s, 1 << 30).unwrap_err();
        assert!(err.0.contains("--kv-cache-memory auto") && err.0.contains("--max-num-batched-tokens"), "{err}");
    }
}

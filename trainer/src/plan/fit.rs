//! Whether a plan fits a device ([`MemoryPlan::check`]), what to change when it does not
//! ([`MemoryPlan::advice`]), and the largest KV budget whose rollouts fit ([`auto_kv_budget`]).

use burn::tensor::DType;

use super::{dtype_name, format_size, kv_position_bytes, LoraPlan, MemoryPlan, PlanSettings, RolloutLimits};

impl MemoryPlan {
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

    /// Changes that lower the peak: each one alone with the peak it gives (marked where that
    /// still does not fit `usable`), most effective first; then, when none alone fits, the most
    /// effective changes applied one after another (micro-batch, generation batch and KV budget
    /// halved as often as it helps) until the peak fits or nothing lowers it further.
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
            .map(|(peak, what)| {
                let short = if *peak > usable { " (still does not fit)" } else { "" };
                format!("{what}: peak {}{short}", format_size(*peak))
            })
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
pub fn auto_kv_budget(settings: &PlanSettings, device_memory: u64) -> Result<Option<u64>, model::SettingError> {
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
        ).into());
    }
    let per_position = kv_position_bytes(&settings.model, settings.rollout_cache_dtype());
    let every = unbounded.rollout_kv_positions().0 as u64 * per_position;
    Ok(Some(largest_fitting(least, every, |budget| rollout_peak(Some(budget)) <= usable)))
}

/// The largest budget between `fits` (which fits) and `over` (which does not), in whole MiB
/// above `fits`, for which `fit` holds (`fit` turns false, and stays so, as the budget grows).
pub(super) fn largest_fitting(mut fits: u64, mut over: u64, fit: impl Fn(u64) -> bool) -> u64 {
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
pub(super) fn describe_changes(from: &PlanSettings, to: &PlanSettings) -> String {
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

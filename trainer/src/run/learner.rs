//! What a run trains, with its optimiser: every weight, or LoRA adapters beside a frozen base.
//! Made from the initial model or a checkpoint, and written into a checkpoint. GRPO runs
//! ([`super::Trainer`]) and SFT runs (`crate::sft::SftRun`) share it.

use std::path::Path;

use burn::module::{AutodiffModule, Module};
use burn::optim::Optimizer;
use burn::record::{BinFileRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use model::checkpoint::StorageDtype;
use model::lora::{is_adapter_dir, load_adapter, save_adapter, AdapterWeights};
use model::{
    load_pretrained, save_pretrained, LoadOptions, LoraAdapters, LoraConfig, LoraModel,
    Compute, Qwen3ForCausalLM,
};

use model::generation::row_seed;

use super::checkpoint::OPTIMIZER_FILE;
use super::config::ModelDtype;
use super::error::TrainError;
use crate::grpo::Trainable;
use crate::optim::{AdamWOptimizer, OptimizerConfig};

type Policy<B> = Qwen3ForCausalLM<B>;

/// The settings a learner is made from (the `model`, `model_dtype` and `[lora]` keys of both
/// run configurations, with the products' precision and the optimiser).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LearnerSettings<'a> {
    /// The initial model (an HF directory): the whole policy, or LoRA's frozen base.
    pub model: &'a Path,
    /// The dtype LoRA's frozen base is held in (full fine-tuning is f32).
    pub model_dtype: ModelDtype,
    /// LoRA adapters instead of every weight.
    pub lora: Option<&'a LoraConfig>,
    /// How the models compute (attention, precision of products).
    pub compute: Compute,
    pub optimizer: &'a OptimizerConfig,
    /// Seeds the initialisation of fresh adapters.
    pub seed: u64,
}

/// What a run trains, with its AdamW state.
pub(crate) enum Learner<B: AutodiffBackend> {
    /// Every weight (f32).
    Full {
        /// Absent only inside a step.
        policy: Option<Policy<B>>,
        optimizer: AdamWOptimizer<Policy<B>, B>,
    },
    /// LoRA adapters (f32, with the only optimiser state) beside the frozen base (no gradients,
    /// in `model_dtype`).
    Lora {
        base: Policy<B>,
        /// Absent only inside a step.
        adapters: Option<LoraAdapters<B>>,
        optimizer: AdamWOptimizer<LoraAdapters<B>, B>,
    },
}

impl<B: AutodiffBackend> Learner<B> {
    /// The learner of a run starting from `settings.model`, or continuing `checkpoint` (a
    /// checkpoint directory of the same kind: a whole model, or a PEFT adapter directory whose
    /// rank, alpha and targets are the settings').
    pub fn start(
        settings: &LearnerSettings<'_>,
        device: &B::Device,
        checkpoint: Option<&Path>,
    ) -> Result<Self, TrainError> {
        // The update records the memory-efficient attention as one node on this backend.
        model::qwen3::register_autodiff_attention::<B>();
        match settings.lora {
            None => Self::start_full(settings, device, checkpoint),
            Some(lora) => Self::start_lora(settings, lora, device, checkpoint),
        }
    }

    fn start_full(
        settings: &LearnerSettings<'_>,
        device: &B::Device,
        checkpoint: Option<&Path>,
    ) -> Result<Self, TrainError> {
        let mut optimizer = settings.optimizer.init::<B, Policy<B>>()?;
        let policy = match checkpoint {
            Some(dir) => {
                if is_adapter_dir(dir) {
                    return Err(TrainError::Mismatch {
                        path: dir.to_path_buf(),
                        reason: "it holds LoRA adapters but the config has no [lora] section"
                            .into(),
                    });
                }
                optimizer = optimizer.load_record(load_optimizer_record(dir, device)?);
                load_pretrained::<B>(dir, device, LoadOptions { compute: settings.compute, ..Default::default() })?
            }
            None => load_pretrained::<B>(settings.model, device, LoadOptions { compute: settings.compute, ..Default::default() })?,
        };
        Ok(Learner::Full {
            policy: Some(policy),
            optimizer,
        })
    }

    fn start_lora(
        settings: &LearnerSettings<'_>,
        lora: &LoraConfig,
        device: &B::Device,
        checkpoint: Option<&Path>,
    ) -> Result<Self, TrainError> {
        let options = LoadOptions { dtype: settings.model_dtype.dtype(), compute: settings.compute };
        let base = load_pretrained::<B>(settings.model, device, options)?.no_grad();
        let mut optimizer = settings.optimizer.init::<B, LoraAdapters<B>>()?;
        let adapters = match checkpoint {
            Some(dir) => {
                if !is_adapter_dir(dir) {
                    return Err(TrainError::Mismatch {
                        path: dir.to_path_buf(),
                        reason: "it holds a whole model, not LoRA adapters, but the config has a [lora] section".into(),
                    });
                }
                let (adapters, saved) = load_adapter::<B>(dir, &base.config, device)?;
                let same = |a: &LoraConfig| (a.rank, a.alpha, a.target_modules.clone());
                if same(&saved.lora) != same(lora) {
                    return Err(TrainError::Mismatch {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "its adapters (rank {}, alpha {}, target_modules {}) differ from the config's [lora] (rank {}, alpha {}, target_modules {})",
                            saved.lora.rank, saved.lora.alpha, target_names(&saved.lora), lora.rank, lora.alpha, target_names(lora)
                        ),
                    });
                }
                optimizer = optimizer.load_record(load_optimizer_record(dir, device)?);
                // The config's dropout applies (PEFT's file records it too, but a resumed run
                // follows the run's settings).
                LoraAdapters::from_weights(lora, &base.config, device, |layer, target, _| {
                    let a = adapters.layers[layer]
                        .get(target)
                        .expect("same targets, checked above");
                    AdapterWeights {
                        lora_A: a.lora_A.val().into_data(),
                        lora_B: a.lora_B.val().into_data(),
                    }
                })
            }
            None => LoraAdapters::init(lora, &base.config, settings.seed, device),
        };
        Ok(Learner::Lora {
            base,
            adapters: Some(adapters),
            optimizer,
        })
    }

    /// Applies one `update` (GRPO's or SFT's step) to what this learner trains: the whole model,
    /// or the adapters beside the frozen base. With LoRA dropout the backend's generator is
    /// first seeded from the run's `seed` and the `step`, so a resumed run draws the masks an
    /// uninterrupted one would.
    pub fn update<U: Update<B>>(
        &mut self,
        update: U,
        seed: u64,
        step: u64,
        device: &B::Device,
    ) -> Result<U::Stats, TrainError> {
        match self {
            Learner::Full { policy, optimizer } => {
                let model = policy.take().expect("the policy is present between steps");
                let (model, stats) = update.apply(model, &(), optimizer)?;
                *policy = Some(model);
                Ok(stats)
            }
            Learner::Lora { base, adapters, optimizer } => {
                let trained = adapters.take().expect("the adapters are present between steps");
                if trained.config().dropout > 0.0 {
                    B::seed(device, row_seed(seed, step));
                }
                let (trained, stats) = update.apply(trained, base, optimizer)?;
                *adapters = Some(trained);
                Ok(stats)
            }
        }
    }

    /// The whole policy in full fine-tuning, the frozen base with LoRA.
    pub fn model(&self) -> &Policy<B> {
        match self {
            Learner::Full { policy, .. } => policy
                .as_ref()
                .expect("the policy is only absent inside a step"),
            Learner::Lora { base, .. } => base,
        }
    }

    /// The adapters being trained, in a LoRA run.
    pub fn adapters(&self) -> Option<&LoraAdapters<B>> {
        match self {
            Learner::Full { .. } => None,
            Learner::Lora { adapters, .. } => Some(
                adapters
                    .as_ref()
                    .expect("the adapters are only absent inside a step"),
            ),
        }
    }

    /// The current policy: the model with its adapters.
    pub fn policy(&self) -> LoraModel<'_, B> {
        LoraModel::new(self.model(), self.adapters())
    }

    /// Writes what is trained into the checkpoint staging directory `dir`: the model in f32 (HF
    /// layout), or the adapters as a PEFT directory naming `initial` as their base; with the
    /// optimiser's state.
    pub fn save_into(&self, dir: &Path, initial: &Path) -> Result<(), TrainError> {
        match self {
            Learner::Full { optimizer, .. } => {
                save_pretrained(&self.model().valid(), dir, StorageDtype::F32)?;
                save_optimizer_record(optimizer.to_record(), dir)
            }
            Learner::Lora { optimizer, .. } => {
                let adapters = self
                    .adapters()
                    .expect("a LoRA learner has adapters")
                    .valid();
                // Absolute: the adapter directory is read from elsewhere than the run's cwd.
                let base = std::path::absolute(initial).unwrap_or_else(|_| initial.to_path_buf());
                save_adapter(&adapters, dir, &base.to_string_lossy())?;
                save_optimizer_record(optimizer.to_record(), dir)
            }
        }
    }
}

/// One optimiser step of a run (GRPO's or SFT's), written once for both kinds of [`Learner`]:
/// `module` is the whole model (`frozen` = `()`) or the LoRA adapters (`frozen` = the base).
pub(crate) trait Update<B: AutodiffBackend> {
    /// What the step reports.
    type Stats;
    fn apply<M: Trainable<B>>(
        self,
        module: M,
        frozen: &M::Frozen,
        optimizer: &mut AdamWOptimizer<M, B>,
    ) -> Result<(M, Self::Stats), TrainError>;
}

fn save_optimizer_record<B: Backend, R: Record<B>>(
    record: R,
    dir: &Path,
) -> Result<(), TrainError> {
    BinFileRecorder::<FullPrecisionSettings>::new()
        .record(record, dir.join(OPTIMIZER_FILE))
        .map_err(|e| {
            // burn's error holds the I/O error only as its debug text.
            let detail = e.to_string();
            let cause = if detail.contains("StorageFull") { "no space left on the device".to_owned() } else { detail };
            TrainError::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("cannot write the optimiser state ({OPTIMIZER_FILE}.bin): {cause}"),
            }
        })
}

/// Loads the optimiser state of checkpoint `dir`. A file that does not decode is reported as
/// damaged, by name and size, in place of burn's message (an escaped I/O error, or a data format
/// changed since burn 0.14, which misleads).
fn load_optimizer_record<B: Backend, R: Record<B>>(
    dir: &Path,
    device: &B::Device,
) -> Result<R, TrainError> {
    let file = dir.join(format!("{OPTIMIZER_FILE}.bin"));
    BinFileRecorder::<FullPrecisionSettings>::new()
        .load(dir.join(OPTIMIZER_FILE), device)
        .map_err(|_| {
            let reason = match std::fs::metadata(&file) {
                Err(_) => format!("{} is missing", file.display()),
                Ok(meta) => format!(
                    "{} ({} bytes) does not decode as optimiser state: the file is damaged or truncated",
                    file.display(),
                    meta.len()
                ),
            };
            TrainError::Checkpoint { path: dir.to_path_buf(), reason }
        })
}

/// A LoRA config's target modules as the config file writes them: `["q_proj", "v_proj"]`.
fn target_names(lora: &LoraConfig) -> String {
    let names: Vec<String> = lora.target_modules.iter().map(|t| format!("\"{}\"", t.name())).collect();
    format!("[{}]", names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig, LinearRecord};

    /// A truncated `optimizer.bin` is named as damaged, with its size, instead of burn's message
    /// about a changed data format; a missing one is named as missing.
    #[test]
    fn a_truncated_optimizer_file_is_named_as_damaged() {
        let device = Default::default();
        let dir = tempfile::tempdir().unwrap();
        let linear: Linear<Flex> = LinearConfig::new(4, 4).init(&device);
        save_optimizer_record::<Flex, _>(linear.into_record(), dir.path()).unwrap();
        let file = dir.path().join("optimizer.bin");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
        let load = || match load_optimizer_record::<Flex, LinearRecord<Flex>>(dir.path(), &device) {
            Ok(_) => panic!("a damaged optimizer file loaded"),
            Err(e) => e.to_string(),
        };
        let err = load();
        assert!(err.contains("optimizer.bin") && err.contains("damaged or truncated"), "{err}");
        assert!(err.contains(&format!("({} bytes)", bytes.len() / 2)), "{err}");
        std::fs::remove_file(&file).unwrap();
        let err = load();
        assert!(err.contains("optimizer.bin is missing"), "{err}");
    }
}

//! The served policy, owned by the worker thread: the base weights and at most a few named LoRA
//! adapters, each loadable at run time (vLLM's runtime LoRA updating, SGLang's
//! `update_weights_from_disk`). A load that fails leaves the policy as it was. With
//! `--merge-lora` each adapter is also merged into a copy of the weights it adapts, made when it
//! (or a new base) is loaded, and its requests run on that copy.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::backend::Backend;
use model::lora::{is_adapter_dir, load_adapter, merge_adapters};
use model::{load_pretrained, LoadOptions, LoraAdapters, LoraModel, Qwen3Config, Qwen3ForCausalLM};
use serde_json::Value;

use super::error::ApiError;
use super::http::unix_time;

/// What the handlers see of the policy: where its parts were loaded from (`GET /v1/models`)
/// and which adapter names a request may ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Models {
    /// The directory the base weights were last loaded from, as given.
    pub base_root: String,
    /// Each adapter's name, with the directory it was loaded from (as given) and when.
    pub adapters: BTreeMap<String, AdapterCard>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterCard {
    pub root: String,
    pub created: u64,
}

/// A change of the policy, asked for by a handler and applied by the worker between steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// `POST /v1/load_lora_adapter`: `replace` is `load_inplace`.
    LoadAdapter { name: String, path: String, replace: bool },
    /// `POST /v1/unload_lora_adapter`.
    UnloadAdapter { name: String },
    /// `POST /update_weights_from_disk`: new base weights of the same config.
    UpdateWeights { path: String },
}

/// A loaded adapter: its weights, where it came from, and with `--merge-lora` the base with it
/// merged in.
struct Loaded<B: Backend> {
    adapters: LoraAdapters<B>,
    card: AdapterCard,
    merged: Option<Qwen3ForCausalLM<B>>,
}

/// The base model and its adapters, with what loading more needs.
pub struct Policy<B: Backend> {
    /// The served model name (no adapter may take it).
    pub name: String,
    base: Qwen3ForCausalLM<B>,
    base_root: String,
    adapters: BTreeMap<String, Loaded<B>>,
    max_adapters: usize,
    /// Whether each adapter's requests run on a copy of the base with it merged in.
    merge: bool,
    device: B::Device,
    options: LoadOptions,
}

impl<B: Backend> Policy<B> {
    /// `base`, loaded from `root` with `options` onto `device`, without adapters; at most
    /// `max_adapters` may be loaded at once, each merged into a copy of the base if `merge`.
    /// The base is served as prepared for inference on `B` (its projections stacked where a
    /// GPU backend's kernels read them in place, see `Qwen3ForCausalLM::for_inference`).
    pub fn new(
        name: String,
        base: Qwen3ForCausalLM<B>,
        root: String,
        device: B::Device,
        options: LoadOptions,
        max_adapters: usize,
        merge: bool,
    ) -> Self {
        Self {
            name,
            base: base.for_inference(),
            base_root: root,
            adapters: BTreeMap::new(),
            max_adapters,
            merge,
            device,
            options,
        }
    }

    pub fn base(&self) -> &Qwen3ForCausalLM<B> {
        &self.base
    }

    /// The model a request for `adapter` (`None`: the base alone) runs; `None` when no such
    /// adapter is loaded.
    pub fn model(&self, adapter: Option<&str>) -> Option<LoraModel<'_, B>> {
        match adapter {
            None => Some(LoraModel::new(&self.base, None)),
            Some(name) => self.adapters.get(name).map(|loaded| match &loaded.merged {
                Some(merged) => LoraModel::new(merged, None),
                None => LoraModel::new(&self.base, Some(&loaded.adapters)),
            }),
        }
    }

    /// `adapters` merged into a copy of `base` when adapters are served merged (`merge`).
    fn merged(merge: bool, base: &Qwen3ForCausalLM<B>, adapters: &LoraAdapters<B>) -> Option<Qwen3ForCausalLM<B>> {
        merge.then(|| merge_adapters(base.clone(), adapters))
    }

    /// What the handlers see.
    pub fn view(&self) -> Models {
        Models {
            base_root: self.base_root.clone(),
            adapters: self
                .adapters
                .iter()
                .map(|(name, loaded)| (name.clone(), loaded.card.clone()))
                .collect(),
        }
    }

    /// Applies `change`; returns the success message, or the error (the policy unchanged).
    pub fn apply(&mut self, change: Change) -> Result<String, ApiError> {
        match change {
            Change::LoadAdapter {
                name,
                path,
                replace,
            } => self.load_adapter(name, path, replace),
            Change::UnloadAdapter { name } => self.unload_adapter(&name),
            Change::UpdateWeights { path } => self.update_weights(path),
        }
    }

    fn load_adapter(&mut self, name: String, path: String, replace: bool) -> Result<String, ApiError> {
        let bad = |message: String| ApiError::invalid(message, Some("lora_path"));
        if name == self.name {
            return Err(ApiError::invalid_value(
                format!("lora_name '{name}' is the served model's name; give the adapter another one."),
                "lora_name",
            ));
        }
        let loaded = self.adapters.contains_key(&name);
        if loaded && !replace {
            return Err(ApiError::invalid_value(
                format!(
                    "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
                ),
                "lora_name",
            ));
        }
        if !loaded && self.adapters.len() >= self.max_adapters {
            return Err(ApiError::invalid_value(
                format!(
                    "{} LoRA adapters are loaded already ({}), the most this server holds (--max-loras); unload one first.",
                    self.adapters.len(),
                    self.adapters.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
                "lora_name",
            ));
        }
        let dir = Path::new(&path);
        if !dir.is_dir() {
            return Err(bad(format!("lora_path {path} is not a directory.")));
        }
        if !is_adapter_dir(dir) {
            return Err(bad(format!(
                "lora_path {path} is not a PEFT adapter directory: it has no adapter_config.json."
            )));
        }
        let (adapters, _) = load_adapter::<B>(dir, &self.base.config, &self.device).map_err(|err| {
            bad(format!(
                "lora_path {path} is not a LoRA adapter this server can apply to its base model: {err}"
            ))
        })?;
        let card = AdapterCard {
            root: path,
            created: unix_time(),
        };
        let merged = Self::merged(self.merge, &self.base, &adapters);
        self.adapters.insert(name.clone(), Loaded { adapters, card, merged });
        Ok(format!("Success: LoRA adapter '{name}' added successfully."))
    }

    fn unload_adapter(&mut self, name: &str) -> Result<String, ApiError> {
        match self.adapters.remove(name) {
            Some(_) => Ok(format!("Success: LoRA adapter '{name}' removed successfully.")),
            None => Err(ApiError {
                param: Some("lora_name".into()),
                ..ApiError::unknown_model(name)
            }),
        }
    }

    fn update_weights(&mut self, path: String) -> Result<String, ApiError> {
        let bad = |message: String| ApiError::invalid(message, Some("model_path"));
        let dir = Path::new(&path);
        if !dir.is_dir() {
            return Err(bad(format!("model_path {path} is not a directory.")));
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(bad(format!(
                "model_path {path} is not a model directory in Hugging Face layout: it has no config.json."
            )));
        }
        let config = Qwen3Config::from_file(&config_path)
            .map_err(|err| bad(format!("model_path {path}: {err}")))?;
        let differ = config_differences(&self.base.config, &config);
        if !differ.is_empty() {
            return Err(bad(format!(
                "model_path {path} has another config than the served model: {}; new weights must have the same config.",
                differ.join(", ")
            )));
        }
        let model = load_pretrained::<B>(dir, &self.device, self.options)
            .map_err(|err| bad(format!("cannot load the weights in model_path {path}: {err}")))?;
        self.base = model.for_inference();
        self.base_root = path;
        let (merge, base) = (self.merge, &self.base);
        for loaded in self.adapters.values_mut() {
            loaded.merged = Self::merged(merge, base, &loaded.adapters);
        }
        Ok(format!("Succeeded to update model weights from {}.", self.base_root))
    }
}

/// The keys whose values differ between two configs (`dtype` left out: weights are converted
/// to the served dtype when loaded), as `key: served → new`.
fn config_differences(served: &Qwen3Config, new: &Qwen3Config) -> Vec<String> {
    let (Ok(Value::Object(a)), Ok(Value::Object(b))) = (serde_json::to_value(served), serde_json::to_value(new)) else {
        return if served == new { Vec::new() } else { vec!["(unreadable)".into()] };
    };
    a.iter()
        .filter(|(key, _)| key.as_str() != "dtype")
        .filter_map(|(key, value)| {
            let other = b.get(key).unwrap_or(&Value::Null);
            (other != value).then(|| format!("{key} {value} → {other}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{DType, Int, Tensor};
    use model::checkpoint::StorageDtype;
    use model::init::write_random_checkpoint;
    use model::lora::save_adapter;
    use model::{CausalLm, LoraConfig};

    use super::*;

    fn logits(model: LoraModel<'_, Flex>) -> Vec<f32> {
        let device = Default::default();
        let ids = Tensor::<Flex, 2, Int>::from_ints([[1, 5, 9, 200, 7]], &device);
        let positions = Tensor::<Flex, 2, Int>::from_ints([[0, 1, 2, 3, 4]], &device);
        let out = model.base().forward_with_adapters(ids, positions, None, None, model.adapters());
        out.cast(DType::F32).into_data().to_vec().unwrap()
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// With `--merge-lora` an adapter's requests run on the base with it merged in (no adapters
    /// beside it), computing what the adapter beside the base computes (f32: within 1e-5 of the
    /// logits); new base weights are merged again. Without it the adapter goes beside the base.
    #[test]
    fn merged_adapters_compute_what_they_compute_beside_the_base() {
        let dir = tempfile::tempdir().unwrap();
        let config = model::Preset::Tiny.config(300, vec![299]);
        let (base_dir, new_base_dir, adapter_dir) = (dir.path().join("base"), dir.path().join("new"), dir.path().join("adapter"));
        write_random_checkpoint(&config, &base_dir, 3, StorageDtype::F32).unwrap();
        write_random_checkpoint(&config, &new_base_dir, 4, StorageDtype::F32).unwrap();
        let device = Default::default();
        let mut adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &config, 1, &device);
        for layer in &mut adapters.layers {
            for a in [&mut layer.q_proj, &mut layer.o_proj, &mut layer.down_proj].into_iter().flatten() {
                a.lora_B = a.lora_B.clone().map(|b| b.ones_like().mul_scalar(0.05));
            }
        }
        save_adapter(&adapters, &adapter_dir, "base").unwrap();
        let policy = |merge| {
            let base = load_pretrained::<Flex>(&base_dir, &device, LoadOptions::default()).unwrap();
            let mut policy = Policy::new("tiny".into(), base, "base".into(), device, LoadOptions::default(), 2, merge);
            let load = Change::LoadAdapter { name: "policy".into(), path: adapter_dir.display().to_string(), replace: false };
            policy.apply(load).unwrap();
            policy
        };
        let (mut apart, mut merged) = (policy(false), policy(true));
        assert!(apart.model(Some("policy")).unwrap().adapters().is_some());
        assert!(merged.model(Some("policy")).unwrap().adapters().is_none(), "merged: nothing beside the base");
        let adapted = logits(apart.model(Some("policy")).unwrap());
        assert!(worst(&adapted, &logits(apart.model(None).unwrap())) > 1e-2, "the adapter changes the logits");
        assert!(worst(&logits(merged.model(Some("policy")).unwrap()), &adapted) < 1e-5);
        assert_eq!(logits(merged.model(None).unwrap()), logits(apart.model(None).unwrap()), "the base stays as loaded");

        for policy in [&mut apart, &mut merged] {
            policy.apply(Change::UpdateWeights { path: new_base_dir.display().to_string() }).unwrap();
        }
        let adapted = logits(apart.model(Some("policy")).unwrap());
        assert!(worst(&logits(merged.model(Some("policy")).unwrap()), &adapted) < 1e-5, "merged again into the new base");
    }

    #[test]
    fn config_differences_name_the_keys_but_not_the_dtype() {
        let a = model::Preset::Tiny.config(512, vec![2]);
        let mut b = a.clone();
        assert!(config_differences(&a, &b).is_empty());
        b.dtype = Some("bfloat16".into());
        assert!(config_differences(&a, &b).is_empty());
        b.rms_norm_eps *= 2.0;
        b.vocab_size += 1;
        let differ = config_differences(&a, &b);
        assert_eq!(differ.len(), 2, "{differ:?}");
        assert!(differ.iter().any(|d| d.starts_with("rms_norm_eps ")), "{differ:?}");
        assert!(differ.iter().any(|d| d.starts_with("vocab_size 512 → 513")), "{differ:?}");
    }
}

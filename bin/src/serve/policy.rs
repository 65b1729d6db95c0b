//! The served policy, owned by the worker thread: the base weights and at most a few named LoRA
//! adapters, each loadable at run time (vLLM's runtime LoRA updating, SGLang's
//! `update_weights_from_disk`). A load that fails leaves the policy as it was.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::backend::Backend;
use model::lora::{is_adapter_dir, load_adapter};
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

/// The base model and its adapters, with what loading more needs.
pub struct Policy<B: Backend> {
    /// The served model name (no adapter may take it).
    pub name: String,
    base: Qwen3ForCausalLM<B>,
    base_root: String,
    adapters: BTreeMap<String, (LoraAdapters<B>, AdapterCard)>,
    max_adapters: usize,
    device: B::Device,
    options: LoadOptions,
}

impl<B: Backend> Policy<B> {
    /// `base`, loaded from `root` with `options` onto `device`, without adapters; at most
    /// `max_adapters` may be loaded at once.
    pub fn new(
        name: String,
        base: Qwen3ForCausalLM<B>,
        root: String,
        device: B::Device,
        options: LoadOptions,
        max_adapters: usize,
    ) -> Self {
        Self {
            name,
            base,
            base_root: root,
            adapters: BTreeMap::new(),
            max_adapters,
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
            Some(name) => self
                .adapters
                .get(name)
                .map(|(adapters, _)| LoraModel::new(&self.base, Some(adapters))),
        }
    }

    /// What the handlers see.
    pub fn view(&self) -> Models {
        Models {
            base_root: self.base_root.clone(),
            adapters: self
                .adapters
                .iter()
                .map(|(name, (_, card))| (name.clone(), card.clone()))
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
        self.adapters.insert(name.clone(), (adapters, card));
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
        self.base = model;
        self.base_root = path;
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
    use super::*;

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

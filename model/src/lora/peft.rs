//! PEFT's adapter directory, read and written: `adapter_config.json` (`peft_type` LORA, `r`,
//! `lora_alpha`, `lora_dropout`, `target_modules`, `base_model_name_or_path`, `task_type`) and
//! `adapter_model.safetensors` with PEFT's tensor names
//! (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`) in PyTorch's `[out, in]`
//! layout, so `peft.PeftModel.from_pretrained` and vLLM's `--lora-modules` load what we write,
//! and we load what they train.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::TensorData;
use serde::Deserialize;
use serde_json::{json, Value};

use super::adapters::{AdapterWeights, LoraAdapters};
use super::config::{LoraConfig, LoraTarget};
use crate::checkpoint::{write_atomic, write_safetensors_file_with, Checkpoint, StorageDtype};
use crate::config::Qwen3Config;
use crate::error::ModelError;
use crate::weights::{to_hf_layout, ParamKind};

/// The adapter's settings file in a PEFT directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights in a PEFT directory.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

const KEY_PREFIX: &str = "base_model.model.model.layers.";

/// PEFT's name of `lora_A` (`which = 'A'`) or `lora_B` (`'B'`) of `target` in `layer`.
pub fn peft_key(layer: usize, target: LoraTarget, which: char) -> String {
    format!("{KEY_PREFIX}{layer}.{}.lora_{which}.weight", target.path())
}

/// A PEFT adapter directory as read: the settings and the base it was trained on.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    pub lora: LoraConfig,
    /// `base_model_name_or_path`: the base model's directory or hub name, if recorded.
    pub base_model_name_or_path: Option<String>,
}

/// The keys of `adapter_config.json` this reader uses or refuses (others are ignored).
#[derive(Deserialize)]
struct ConfigFile {
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    rank_pattern: Option<BTreeMap<String, Value>>,
    #[serde(default)]
    alpha_pattern: Option<BTreeMap<String, Value>>,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    layers_to_transform: Option<Value>,
}

/// Reads `dir/adapter_config.json`, and the adapted projections from the tensor names of
/// `dir/adapter_model.safetensors`. Features this loader does not implement (DoRA, rsLoRA,
/// per-module ranks, trained biases, extra saved modules, `fan_in_fan_out`) are refused by name.
/// A write of the directory killed between its renames is finished first ([`crate::publish`]).
pub fn read_adapter_config(dir: &Path) -> Result<AdapterConfig, ModelError> {
    crate::publish::finish_interrupted(dir)?;
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    let bad = |reason: String| ModelError::Config {
        path: path.clone(),
        reason,
    };
    let file: ConfigFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if let Some(kind) = file.peft_type.as_deref().filter(|&k| k != "LORA") {
        return Err(bad(format!(
            "peft_type is \"{kind}\"; only LORA adapters are supported"
        )));
    }
    let unsupported = [
        (file.use_dora, "use_dora = true (DoRA)"),
        (file.use_rslora, "use_rslora = true (rsLoRA scaling)"),
        (file.fan_in_fan_out, "fan_in_fan_out = true"),
        (file.lora_bias, "lora_bias = true"),
        (
            file.bias.as_deref().is_some_and(|b| b != "none"),
            "a trained bias (bias ≠ \"none\")",
        ),
        (
            file.rank_pattern.as_ref().is_some_and(|p| !p.is_empty()),
            "a rank_pattern",
        ),
        (
            file.alpha_pattern.as_ref().is_some_and(|p| !p.is_empty()),
            "an alpha_pattern",
        ),
        (
            file.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()),
            "modules_to_save",
        ),
        (
            file.layers_to_transform.as_ref().is_some_and(|l| !l.is_null()),
            "layers_to_transform",
        ),
    ];
    if let Some((_, what)) = unsupported.iter().find(|(on, _)| *on) {
        return Err(bad(format!("{what} is not supported")));
    }
    let weights = dir.join(ADAPTER_WEIGHTS);
    let checkpoint = Checkpoint::open_file(&weights)?;
    let mut targets = BTreeSet::new();
    for name in checkpoint.names() {
        match parse_key(&name) {
            Some((_, target, _)) => {
                targets.insert(target);
            }
            None => {
                return Err(ModelError::Config {
                    path: weights.clone(),
                    reason: format!(
                        "tensor \"{name}\" is not a lora_A/lora_B weight of a q/k/v/o/gate/up/down projection \
                         (named {KEY_PREFIX}N.self_attn.q_proj.lora_A.weight and so on)"
                    ),
                })
            }
        }
    }
    let lora = LoraConfig {
        rank: file.r,
        alpha: file.lora_alpha,
        dropout: file.lora_dropout,
        target_modules: targets.into_iter().collect(),
    };
    lora.validate().map_err(|e| bad(e.0))?;
    Ok(AdapterConfig {
        lora,
        base_model_name_or_path: file.base_model_name_or_path,
    })
}

/// `(layer, target, 'A' | 'B')` of a PEFT tensor name.
fn parse_key(name: &str) -> Option<(usize, LoraTarget, char)> {
    let rest = name.strip_prefix(KEY_PREFIX)?;
    let (layer, rest) = rest.split_once('.')?;
    let (block, rest) = rest.split_once('.')?;
    let (module, rest) = rest.split_once('.')?;
    let which = match rest {
        "lora_A.weight" => 'A',
        "lora_B.weight" => 'B',
        _ => return None,
    };
    let target = LoraTarget::from_name(module)?;
    (target.path() == format!("{block}.{module}")).then_some(())?;
    Some((layer.parse().ok()?, target, which))
}

/// Loads a PEFT adapter directory for a base model of `model`: every layer must carry both
/// weights of every adapted projection, in the shapes `r` and the model give; the weights
/// become f32 whatever their stored dtype. A write of the directory killed between its renames
/// is finished first ([`crate::publish`], by [`read_adapter_config`]).
pub fn load_adapter<B: Backend>(
    dir: &Path,
    model: &Qwen3Config,
    device: &B::Device,
) -> Result<(LoraAdapters<B>, AdapterConfig), ModelError> {
    let config = read_adapter_config(dir)?;
    let weights = dir.join(ADAPTER_WEIGHTS);
    let checkpoint = Checkpoint::open_file(&weights)?;
    if let Some(name) = checkpoint
        .names()
        .iter()
        .find(|n| parse_key(n).is_some_and(|(l, _, _)| l >= model.num_hidden_layers))
    {
        return Err(ModelError::Config {
            path: weights,
            reason: format!(
                "tensor \"{name}\" is beyond the base model's {} layers",
                model.num_hidden_layers
            ),
        });
    }
    let r = config.lora.rank;
    let mut failure = None;
    let adapters = LoraAdapters::from_weights(&config.lora, model, device, |layer, target, (fan_in, fan_out)| {
        let mut read = |which, shape: [usize; 2]| match checkpoint.read(&peft_key(layer, target, which), &shape) {
            // PyTorch's [out, in] to burn's [in, out].
            Ok(t) => TensorData::new(
                crate::weights::transpose_values(&t.values, shape[0], shape[1]),
                [shape[1], shape[0]],
            ),
            Err(e) => {
                failure.get_or_insert(e);
                TensorData::new(vec![0.0f32; shape[0] * shape[1]], [shape[1], shape[0]])
            }
        };
        AdapterWeights {
            lora_A: read('A', [r, fan_in]),
            lora_B: read('B', [fan_out, r]),
        }
    });
    match failure {
        Some(e) => Err(e),
        None => Ok((adapters, config)),
    }
}

/// Writes `adapters` as a PEFT adapter directory (created if needed): `adapter_model.safetensors`
/// (f32, PEFT names, `[out, in]`, `{"format": "pt"}` metadata) and `adapter_config.json`
/// (`task_type` CAUSAL_LM), each written atomically. `base_model_name_or_path` is recorded for
/// the loaders that look the base up.
pub fn save_adapter<B: Backend>(
    adapters: &LoraAdapters<B>,
    dir: &Path,
    base_model_name_or_path: &str,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let r = adapters.config().rank;
    let mut entries = Vec::new();
    for (layer, target, a) in adapters.iter() {
        let (fan_in, fan_out) = (a.lora_A.val().dims()[0], a.lora_B.val().dims()[1]);
        entries.push((peft_key(layer, target, 'A'), vec![r, fan_in]));
        entries.push((peft_key(layer, target, 'B'), vec![fan_out, r]));
    }
    write_safetensors_file_with(&dir.join(ADAPTER_WEIGHTS), &entries, StorageDtype::F32, |name| {
        let (layer, target, which) = parse_key(name).expect("written names parse");
        let a = adapters.layers[layer].get(target).expect("listed above");
        let weight = if which == 'A' { a.lora_A.val() } else { a.lora_B.val() };
        Ok(to_hf_layout(weight, ParamKind::Linear).values)
    })?;
    let json = serde_json::to_string_pretty(&adapter_config_json(adapters.config(), base_model_name_or_path))
        .expect("config serialises");
    write_atomic(&dir.join(ADAPTER_CONFIG), json.as_bytes())
}

/// `adapter_config.json` as PEFT writes it for these settings.
fn adapter_config_json(config: &LoraConfig, base_model_name_or_path: &str) -> Value {
    // An integral alpha is written as an integer, as PEFT's `lora_alpha: int` is.
    let alpha = if config.alpha.fract() == 0.0 && config.alpha.abs() < 1e15 {
        json!(config.alpha as i64)
    } else {
        json!(config.alpha)
    };
    json!({
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": alpha,
        "lora_dropout": config.dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": config.rank,
        "rank_pattern": {},
        "revision": null,
        "target_modules": config.target_modules.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": false,
    })
}

/// Whether `dir` is a PEFT adapter directory (it has `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// The base model directory an adapter names, resolved against the adapter's own folder when
/// relative; `None` when it names none or a path that does not exist (e.g. a hub name).
pub fn base_model_dir(dir: &Path, config: &AdapterConfig) -> Option<PathBuf> {
    let named = Path::new(config.base_model_name_or_path.as_deref()?);
    let path = if named.is_relative() {
        dir.join(named)
    } else {
        named.to_path_buf()
    };
    path.join("config.json").is_file().then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn keys_are_peft_s() {
        assert_eq!(
            peft_key(3, LoraTarget::QProj, 'A'),
            "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(
            peft_key(0, LoraTarget::DownProj, 'B'),
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
        );
        assert_eq!(
            parse_key(&peft_key(12, LoraTarget::UpProj, 'B')),
            Some((12, LoraTarget::UpProj, 'B'))
        );
        assert_eq!(
            parse_key("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight"),
            None
        );
        assert_eq!(
            parse_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"),
            None
        );
        assert_eq!(parse_key("base_model.model.lm_head.lora_A.weight"), None);
    }

    #[test]
    fn a_saved_adapter_loads_back_exactly() {
        let model = crate::config::Preset::Tiny.config(300, vec![299]);
        let config = LoraConfig {
            rank: 3,
            alpha: 6.5,
            target_modules: vec![LoraTarget::KProj, LoraTarget::DownProj],
            ..Default::default()
        };
        let device = Default::default();
        let mut adapters = LoraAdapters::<Flex>::init(&config, &model, 5, &device);
        // Non-zero B, so both matrices are checked.
        for layer in &mut adapters.layers {
            let a = layer.k_proj.as_mut().unwrap();
            a.lora_B = a.lora_B.clone().map(|b| b.add_scalar(0.25));
        }
        let dir = tempfile::tempdir().unwrap();
        save_adapter(&adapters, dir.path(), "/models/base").unwrap();
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG)).unwrap()).unwrap();
        assert_eq!(
            (
                json["peft_type"].as_str(),
                json["r"].as_u64(),
                json["task_type"].as_str()
            ),
            (Some("LORA"), Some(3), Some("CAUSAL_LM"))
        );
        assert_eq!(json["target_modules"], json!(["k_proj", "down_proj"]));
        let file = Checkpoint::open_file(&dir.path().join(ADAPTER_WEIGHTS)).unwrap();
        let kv = model.num_key_value_heads * model.head_dim;
        assert_eq!(file.shape(&peft_key(1, LoraTarget::KProj, 'B')).unwrap(), vec![kv, 3]);
        assert_eq!(
            file.shape(&peft_key(1, LoraTarget::KProj, 'A')).unwrap(),
            vec![3, model.hidden_size]
        );

        let (loaded, read) = load_adapter::<Flex>(dir.path(), &model, &device).unwrap();
        assert_eq!(read.lora, config);
        assert_eq!(read.base_model_name_or_path.as_deref(), Some("/models/base"));
        for ((l, t, a), (l2, t2, b)) in adapters.iter().zip(loaded.iter()) {
            assert_eq!((l, t), (l2, t2));
            assert_eq!(a.lora_A.val().into_data(), b.lora_A.val().into_data());
            assert_eq!(a.lora_B.val().into_data(), b.lora_B.val().into_data());
            assert_eq!(a.lora_A.id, b.lora_A.id, "the same parameter ids");
        }
    }

    #[test]
    fn unsupported_adapters_are_refused_by_name() {
        let model = crate::config::Preset::Tiny.config(300, vec![299]);
        let adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &model, 0, &Default::default());
        let dir = tempfile::tempdir().unwrap();
        save_adapter(&adapters, dir.path(), "base").unwrap();
        let path = dir.path().join(ADAPTER_CONFIG);
        let original = std::fs::read_to_string(&path).unwrap();
        for (key, value, expected) in [
            ("use_dora", json!(true), "DoRA"),
            ("peft_type", json!("IA3"), "IA3"),
            ("rank_pattern", json!({"q_proj": 4}), "rank_pattern"),
            ("r", json!(0), "lora.rank"),
        ] {
            let mut json: Value = serde_json::from_str(&original).unwrap();
            json[key] = value;
            std::fs::write(&path, json.to_string()).unwrap();
            let err = load_adapter::<Flex>(dir.path(), &model, &Default::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected) && err.contains(ADAPTER_CONFIG), "{key}: {err}");
        }
        // A base with fewer layers than the adapter is named.
        std::fs::write(&path, &original).unwrap();
        let mut small = model.clone();
        small.num_hidden_layers = 1;
        let err = load_adapter::<Flex>(dir.path(), &small, &Default::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("beyond the base model's 1 layers"), "{err}");
        // A base whose shapes differ.
        let mut wide = model.clone();
        wide.intermediate_size *= 2;
        let err = load_adapter::<Flex>(dir.path(), &wide, &Default::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("gate_proj.lora_B") && err.contains("shape"), "{err}");
    }
}

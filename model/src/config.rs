//! `config.json` of a Qwen3 checkpoint, in both the transformers-4 key style of real Qwen3
//! checkpoints (`rope_theta`, `torch_dtype`) and the transformers-5 style (`rope_parameters`,
//! `dtype`), plus the named presets that `init-model` writes.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ModelError, SettingError};

/// The architecture hyper-parameters of a Qwen3 decoder, with HF's field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Token ids that end generation (from `eos_token_id`, a number or a list).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// Storage dtype named by the checkpoint (`dtype` or `torch_dtype`), e.g. "bfloat16".
    pub dtype: Option<String>,
}

impl Qwen3Config {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|SettingError(reason)| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        })
    }

    /// Parses the JSON text of a `config.json`; the error is a sentence naming the bad key.
    pub fn from_json_str(text: &str) -> Result<Self, SettingError> {
        let raw: HfConfig = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
            .map_err(describe_json_error)?;
        if let Some(model_type) = raw.model_type.as_deref().filter(|t| *t != "qwen3") {
            return Err(format!("model_type is \"{model_type}\", only \"qwen3\" is supported").into());
        }
        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = match raw.head_dim {
            Some(head_dim) => head_dim,
            None if raw.num_attention_heads == 0 => return Err("num_attention_heads must be positive".into()),
            None => raw.hidden_size / raw.num_attention_heads,
        };
        // transformers 5 nests the RoPE base in `rope_parameters`; 4.x has it at the top level.
        let nested_theta = match raw.rope_parameters {
            Some(params) => match params.rope_type.as_deref() {
                Some("default") | None => params.rope_theta,
                Some(other) => {
                    return Err(format!(
                        "rope_parameters.rope_type \"{other}\" is not supported (only \"default\")"
                    ).into())
                }
            },
            None => None,
        };
        if let Some(scaling) = raw.rope_scaling {
            let kind = scaling.rope_type.or(scaling.kind).unwrap_or_else(|| "unknown".into());
            if kind != "default" {
                return Err(format!("rope_scaling of type \"{kind}\" is not supported").into());
            }
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|&act| act != "silu") {
            return Err(format!("hidden_act \"{act}\" is not supported: Qwen3's MLP is SwiGLU (\"silu\")").into());
        }
        if let (Some(nested), Some(top)) = (nested_theta, raw.rope_theta) {
            if nested != top {
                return Err(format!("rope_theta ({top}) and rope_parameters.rope_theta ({nested}) differ: keep one").into());
            }
        }
        let rope_theta = nested_theta
            .or(raw.rope_theta)
            .ok_or("missing key \"rope_theta\" (or \"rope_parameters.rope_theta\")")?;
        if raw.attention_bias == Some(true) {
            return Err("attention_bias is true: not supported (Qwen3's attention projections have no bias)".into());
        }
        if let Some(kind) = raw.layer_types.iter().flatten().find(|kind| *kind != "full_attention") {
            return Err(format!("layer_types holds \"{kind}\": only \"full_attention\" is supported").into());
        }
        // transformers' Qwen3Config: with use_sliding_window, layers from max_window_layers on
        // attend over the last sliding_window tokens only, unless layer_types says each layer's.
        if let (Some(true), Some(window), None) = (raw.use_sliding_window, raw.sliding_window, &raw.layer_types) {
            if raw.max_window_layers.unwrap_or(28) < raw.num_hidden_layers {
                return Err(format!(
                    "use_sliding_window is true (a window of {window} tokens from layer max_window_layers on): \
                     sliding-window attention is not supported"
                ).into());
            }
        }
        let config = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(40960),
            eos_token_ids: match raw.eos_token_id {
                None => Vec::new(),
                Some(TokenIds::One(id)) => vec![id],
                Some(TokenIds::Many(ids)) => ids,
            },
            bos_token_id: raw.bos_token_id,
            pad_token_id: raw.pad_token_id,
            dtype: raw.dtype.or(raw.torch_dtype),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the relations between fields that the model's shapes rely on.
    pub fn validate(&self) -> Result<(), SettingError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(format!("\"{key}\" must be positive").into());
            }
        }
        // Far beyond any Qwen3, and small enough that the sizes computed from them (parameters,
        // bytes, the memory plan's terms) cannot overflow.
        let most = [
            ("vocab_size", self.vocab_size, 1 << 22),
            ("hidden_size", self.hidden_size, 1 << 16),
            ("intermediate_size", self.intermediate_size, 1 << 18),
            ("num_hidden_layers", self.num_hidden_layers, 1 << 10),
            ("num_attention_heads", self.num_attention_heads, 1 << 10),
            ("num_key_value_heads", self.num_key_value_heads, 1 << 10),
            ("head_dim", self.head_dim, 1 << 10),
            ("max_position_embeddings", self.max_position_embeddings, 1 << 24),
        ];
        for (key, value, most) in most {
            if value > most {
                return Err(format!("\"{key}\" is {value}, beyond any Qwen3 (at most {most} here)").into());
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ).into());
        }
        if self.head_dim % 2 != 0 {
            return Err(format!("head_dim ({}) must be even for RoPE", self.head_dim).into());
        }
        if !(self.rope_theta > 0.0) {
            return Err(format!("rope_theta must be positive, got {}", self.rope_theta).into());
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(format!("rms_norm_eps must be positive, got {}", self.rms_norm_eps).into());
        }
        if self.max_position_embeddings == 0 {
            return Err("\"max_position_embeddings\" must be positive".into());
        }
        let ids = self.eos_token_ids.iter().map(|&id| ("eos_token_id", id)).chain(self.bos_token_id.map(|id| ("bos_token_id", id))).chain(self.pad_token_id.map(|id| ("pad_token_id", id)));
        for (key, id) in ids {
            if id as usize >= self.vocab_size {
                return Err(format!("{key} {id} is outside the vocabulary of {} tokens", self.vocab_size).into());
            }
        }
        Ok(())
    }

    /// Number of scalar parameters (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let q = self.num_attention_heads * hd;
        let kv = self.num_key_value_heads * hd;
        let attention = h * q + 2 * h * kv + q * h + 2 * hd;
        let mlp = 3 * h * i;
        let per_layer = attention + mlp + 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + self.num_hidden_layers * per_layer + h
    }

    /// The `config.json` text in HF layout, carrying both key styles so that transformers 4.51+
    /// and 5.x both read it.
    pub fn to_hf_json(&self) -> Value {
        let eos: Value = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => Value::from(*one),
            many => Value::from(many.to_vec()),
        };
        let dtype = self.dtype.clone().unwrap_or_else(|| "float32".to_owned());
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "use_sliding_window": false,
            "sliding_window": null,
            "use_cache": true,
            "initializer_range": 0.02,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,
            "dtype": dtype,
        })
    }
}

/// `config.json` as transformers 4.x or 5.x writes it, before defaults and checks: the keys this
/// crate reads (others are ignored). A missing optional key and `null` mean the same.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<RopeScaling>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    eos_token_id: Option<TokenIds>,
    bos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    dtype: Option<String>,
    torch_dtype: Option<String>,
    attention_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
}

/// transformers 5's `rope_parameters`.
#[derive(Deserialize)]
struct RopeParameters {
    rope_type: Option<String>,
    rope_theta: Option<f64>,
}

/// `rope_scaling`, whose kind is `rope_type` (or `type` in older files).
#[derive(Deserialize)]
struct RopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// `eos_token_id`: one id or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// A deserialisation error as one sentence that names the key at fault.
fn describe_json_error(e: serde_path_to_error::Error<serde_json::Error>) -> String {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if inner.is_syntax() || inner.is_eof() {
        format!("invalid JSON: {inner}")
    } else if path == "eos_token_id" {
        format!("key \"{path}\" must be a token id or a list of token ids")
    } else if path == "." {
        inner.to_string()
    } else {
        format!("key \"{path}\": {inner}")
    }
}

/// Named architectures that `init-model` can write with random weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// 2 layers, hidden 64, vocab 512: seconds on a laptop, for demos and tests.
    Tiny,
    /// 4 layers, hidden 128, vocab 1024: still tiny, slightly less trivial.
    Small,
    /// The Qwen3-0.6B shape (28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936).
    Qwen3_0_6B,
    /// The Qwen3-1.7B shape.
    Qwen3_1_7B,
    /// The Qwen3-4B shape (36 layers, hidden 2560, 32/8 heads, head_dim 128).
    Qwen3_4B,
    /// The Qwen3-8B shape (36 layers, hidden 4096, 32/8 heads, head_dim 128, untied head).
    Qwen3_8B,
}

impl Preset {
    /// All presets with their CLI names.
    pub const ALL: [(&'static str, Preset); 6] = [
        ("tiny", Preset::Tiny),
        ("small", Preset::Small),
        ("qwen3-0.6b", Preset::Qwen3_0_6B),
        ("qwen3-1.7b", Preset::Qwen3_1_7B),
        ("qwen3-4b", Preset::Qwen3_4B),
        ("qwen3-8b", Preset::Qwen3_8B),
    ];

    /// Looks a preset up by its CLI name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, p)| *p)
    }

    /// The preset's CLI name.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, p)| *p == self).map_or("model", |(n, _)| n)
    }

    /// Whether the preset ships with the project's own small tokenizer (the real Qwen3
    /// vocabulary is only used by the full-size shapes).
    pub fn uses_tiny_tokenizer(self) -> bool {
        matches!(self, Preset::Tiny | Preset::Small)
    }

    /// The configuration of this preset. Small presets take their vocabulary size and special
    /// token ids from the tokenizer that goes with them.
    pub fn config(self, vocab_size: usize, eos_token_ids: Vec<u32>) -> Qwen3Config {
        let real = |layers, hidden, inter, heads, kv, tied| Qwen3Config {
            vocab_size: 151_936,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: 128,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: tied,
            max_position_embeddings: 40_960,
            eos_token_ids: vec![151_645, 151_643],
            bos_token_id: Some(151_643),
            pad_token_id: Some(151_643),
            dtype: Some("bfloat16".to_owned()),
        };
        let small = |layers, hidden, inter, heads, kv, head_dim| Qwen3Config {
            vocab_size,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            max_position_embeddings: 8192,
            eos_token_ids: eos_token_ids.clone(),
            bos_token_id: None,
            pad_token_id: eos_token_ids.last().copied(),
            dtype: Some("float32".to_owned()),
        };
        match self {
            Preset::Tiny => small(2, 64, 128, 4, 2, 16),
            Preset::Small => small(4, 128, 384, 4, 2, 32),
            Preset::Qwen3_0_6B => real(28, 1024, 3072, 16, 8, true),
            Preset::Qwen3_1_7B => real(28, 2048, 6144, 16, 8, true),
            Preset::Qwen3_4B => real(36, 2560, 9728, 32, 8, true),
            Preset::Qwen3_8B => real(36, 4096, 12288, 32, 8, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4_STYLE: &str = r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,
        "num_key_value_heads":1,"head_dim":6,"rope_theta":1000000.0,"rms_norm_eps":1e-6,
        "tie_word_embeddings":true,"torch_dtype":"bfloat16","eos_token_id":[3,4]}"#;

    #[test]
    fn reads_transformers4_keys() {
        let c = Qwen3Config::from_json_str(V4_STYLE).unwrap();
        assert_eq!(c.head_dim, 6);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
        assert_eq!(c.eos_token_ids, vec![3, 4]);
        assert!(c.tie_word_embeddings);
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (2, 1));
    }

    #[test]
    fn reads_transformers5_keys() {
        let text = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":2,
            "rope_parameters":{"rope_theta":5000.0,"rope_type":"default"},"dtype":"float32",
            "eos_token_id":2}"#;
        let c = Qwen3Config::from_json_str(text).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
        assert_eq!(c.head_dim, 4, "head_dim defaults to hidden/heads");
        assert_eq!(c.dtype.as_deref(), Some("float32"));
        assert_eq!(c.eos_token_ids, vec![2]);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn missing_key_is_named() {
        let text = V4_STYLE.replace("\"intermediate_size\":16,", "");
        let err = Qwen3Config::from_json_str(&text).unwrap_err().0;
        assert!(err.contains("intermediate_size"), "{err}");
        let text = V4_STYLE.replace("\"rope_theta\":1000000.0,", "");
        let err = Qwen3Config::from_json_str(&text).unwrap_err().0;
        assert!(err.contains("rope_theta"), "{err}");
    }

    #[test]
    fn rejects_bad_head_grouping_and_types() {
        let text = V4_STYLE.replace("\"num_key_value_heads\":1", "\"num_key_value_heads\":3");
        assert!(Qwen3Config::from_json_str(&text)
            .unwrap_err()
            .0
            .contains("multiple"));
        let text = V4_STYLE.replace("\"hidden_size\":8", "\"hidden_size\":\"eight\"");
        assert!(Qwen3Config::from_json_str(&text)
            .unwrap_err()
            .0
            .contains("hidden_size"));
        let text = V4_STYLE.replace("\"qwen3\"", "\"llama\"");
        assert!(Qwen3Config::from_json_str(&text)
            .unwrap_err()
            .0
            .contains("llama"));
    }

    /// Values a Qwen3 cannot run with are refused with their key, not loaded and ignored.
    #[test]
    fn rejects_values_the_model_cannot_run_with() {
        for (from, to, key) in [
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":-1e-6", "rms_norm_eps"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"hidden_act\":\"gelu\"", "hidden_act"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"max_position_embeddings\":0", "max_position_embeddings"),
            ("[3,4]", "[3,10]", "eos_token_id"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"pad_token_id\":99", "pad_token_id"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"attention_bias\":true", "attention_bias"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"use_sliding_window\":true,\"sliding_window\":4,\"max_window_layers\":0", "use_sliding_window"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"layer_types\":[\"sliding_attention\"]", "layer_types"),
            ("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"rope_parameters\":{\"rope_theta\":5000.0}", "rope_parameters.rope_theta"),
            ("\"num_hidden_layers\":1", "\"num_hidden_layers\":1000000000", "num_hidden_layers"),
            ("\"hidden_size\":8", "\"hidden_size\":4611686018427387904", "hidden_size"),
            ("\"vocab_size\":10", "\"vocab_size\":4611686018427387904", "vocab_size"),
        ] {
            let err = Qwen3Config::from_json_str(&V4_STYLE.replace(from, to)).unwrap_err().0;
            assert!(err.contains(key), "{to}: {err}");
        }
        let silu = V4_STYLE.replace("\"rms_norm_eps\":1e-6", "\"rms_norm_eps\":1e-6,\"hidden_act\":\"silu\"");
        assert!(Qwen3Config::from_json_str(&silu).is_ok());
        // What Qwen3's own config.json files say of these keys loads.
        let qwen3 = V4_STYLE.replace(
            "\"rms_norm_eps\":1e-6",
            "\"rms_norm_eps\":1e-6,\"attention_bias\":false,\"use_sliding_window\":false,\"sliding_window\":null,\
             \"max_window_layers\":28,\"layer_types\":[\"full_attention\"],\"rope_parameters\":{\"rope_theta\":1000000.0}",
        );
        Qwen3Config::from_json_str(&qwen3).unwrap();
        // layer_types, where given, says which layers slide, whatever max_window_layers says.
        let listed = V4_STYLE.replace(
            "\"rms_norm_eps\":1e-6",
            "\"rms_norm_eps\":1e-6,\"use_sliding_window\":true,\"sliding_window\":4,\"max_window_layers\":0,\"layer_types\":[\"full_attention\"]",
        );
        Qwen3Config::from_json_str(&listed).unwrap();
    }

    #[test]
    fn a_bad_value_names_its_key_path() {
        let text = V4_STYLE.replace("\"rope_theta\":1000000.0", "\"rope_parameters\":{\"rope_theta\":\"big\"}");
        let err = Qwen3Config::from_json_str(&text).unwrap_err().0;
        assert!(err.contains("\"rope_parameters.rope_theta\""), "{err}");
        let text = V4_STYLE.replace("[3,4]", "[3,\"four\"]");
        let err = Qwen3Config::from_json_str(&text).unwrap_err().0;
        assert!(err.contains("\"eos_token_id\" must be a token id or a list of token ids"), "{err}");
        let err = Qwen3Config::from_json_str("{\"vocab_size\": 3,").unwrap_err().0;
        assert!(err.starts_with("invalid JSON"), "{err}");
    }

    #[test]
    fn hf_json_round_trips() {
        let c = Qwen3Config::from_json_str(V4_STYLE).unwrap();
        let again = Qwen3Config::from_json_str(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(c, again);
    }

    #[test]
    fn parameter_count_of_qwen3_0_6b() {
        // Qwen3-0.6B has 596M parameters with the tied embedding counted once.
        let n = Preset::Qwen3_0_6B.config(0, vec![]).num_parameters();
        assert!((590_000_000..600_000_000).contains(&n), "{n}");
    }

    #[test]
    fn parameter_count_of_qwen3_8b() {
        // Qwen3-8B has 8.19B parameters (untied head), as its model card says (8.2B).
        let config = Preset::from_name("qwen3-8b").unwrap().config(0, vec![]);
        assert!(!config.tie_word_embeddings);
        let n = config.num_parameters();
        assert!((8_150_000_000..8_250_000_000).contains(&n), "{n}");
    }
}

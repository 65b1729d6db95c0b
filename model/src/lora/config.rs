//! The `[lora]` settings, in PEFT's terms (`r`, `lora_alpha`, `lora_dropout`, `target_modules`).

use serde::{Deserialize, Deserializer, Serialize};

use crate::config::Qwen3Config;

/// A projection of a Qwen3 decoder layer that can carry an adapter, by its PEFT module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
}

impl LoraTarget {
    /// Every projection, in the order of a layer's parameters: what PEFT's `"all-linear"` means
    /// for Qwen3 (every `nn.Linear` but the output head).
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::QProj,
        LoraTarget::KProj,
        LoraTarget::VProj,
        LoraTarget::OProj,
        LoraTarget::GateProj,
        LoraTarget::UpProj,
        LoraTarget::DownProj,
    ];

    /// The module name (`q_proj`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LoraTarget::QProj => "q_proj",
            LoraTarget::KProj => "k_proj",
            LoraTarget::VProj => "v_proj",
            LoraTarget::OProj => "o_proj",
            LoraTarget::GateProj => "gate_proj",
            LoraTarget::UpProj => "up_proj",
            LoraTarget::DownProj => "down_proj",
        }
    }

    /// The module's path inside a decoder layer (`self_attn.q_proj`, `mlp.gate_proj`).
    pub fn path(self) -> String {
        let block = match self {
            LoraTarget::QProj | LoraTarget::KProj | LoraTarget::VProj | LoraTarget::OProj => "self_attn",
            LoraTarget::GateProj | LoraTarget::UpProj | LoraTarget::DownProj => "mlp",
        };
        format!("{block}.{}", self.name())
    }

    /// The projection named `name`, if it is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// `(in_features, out_features)` of this projection for a model of `config`.
    pub fn features(self, config: &Qwen3Config) -> (usize, usize) {
        let (h, i) = (config.hidden_size, config.intermediate_size);
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        match self {
            LoraTarget::QProj => (h, q),
            LoraTarget::KProj | LoraTarget::VProj => (h, kv),
            LoraTarget::OProj => (q, h),
            LoraTarget::GateProj | LoraTarget::UpProj => (h, i),
            LoraTarget::DownProj => (i, h),
        }
    }
}

/// LoRA settings (`[lora]` in `run.toml`): a rank-`rank` update `scaling · A·B` beside each
/// target projection, `scaling = alpha / rank`, as PEFT's `LoraConfig(r, lora_alpha,
/// lora_dropout, target_modules)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// The rank `r` of every adapter.
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// `lora_dropout`: the probability of zeroing an input of the adapter path (training only).
    pub dropout: f64,
    /// The adapted projections: PEFT module names, or `"all-linear"` (every projection of every
    /// layer: q, k, v, o, gate, up and down).
    #[serde(deserialize_with = "target_modules")]
    pub target_modules: Vec<LoraTarget>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: LoraTarget::ALL.to_vec(),
        }
    }
}

impl LoraConfig {
    /// `alpha / rank`, PEFT's `scaling`.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Rank at least 1, alpha positive and finite, dropout in `[0, 1)`, at least one target
    /// and none twice; the message names the key.
    pub fn validate(&self) -> Result<(), crate::SettingError> {
        if self.rank == 0 {
            return Err("lora.rank must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("lora.alpha = {} must be a positive number", self.alpha).into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("lora.dropout = {} must be in [0, 1)", self.dropout).into());
        }
        if self.target_modules.is_empty() {
            return Err("lora.target_modules names no module".into());
        }
        let mut seen = self.target_modules.clone();
        seen.sort();
        if let Some(twice) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("lora.target_modules names {} twice", twice[0].name()).into());
        }
        Ok(())
    }

    /// Whether `target` carries an adapter.
    pub fn targets(&self, target: LoraTarget) -> bool {
        self.target_modules.contains(&target)
    }
}

/// `"all-linear"`, or a list of module names.
fn target_modules<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<LoraTarget>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        One(String),
        List(Vec<String>),
    }
    let names = || LoraTarget::ALL.map(LoraTarget::name).join(", ");
    match Raw::deserialize(deserializer)? {
        Raw::One(s) if s == "all-linear" => Ok(LoraTarget::ALL.to_vec()),
        Raw::One(s) => Err(serde::de::Error::custom(format!(
            "target_modules = \"{s}\": expected \"all-linear\" or a list of module names ({})",
            names()
        ))),
        Raw::List(list) => list
            .iter()
            .map(|name| {
                LoraTarget::from_name(name).ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "target_modules: \"{name}\" is not a Qwen3 projection (one of {}, or \"all-linear\")",
                        names()
                    ))
                })
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_all_linear_rank_8_alpha_16() {
        let c: LoraConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, LoraConfig::default());
        assert_eq!((c.rank, c.alpha, c.dropout, c.scaling()), (8, 16.0, 0.0, 2.0));
        assert_eq!(c.target_modules, LoraTarget::ALL.to_vec());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn target_modules_are_all_linear_or_names() {
        let parse = |json: &str| serde_json::from_str::<LoraConfig>(&format!("{{\"target_modules\": {json}}}"));
        assert_eq!(parse("\"all-linear\"").unwrap().target_modules.len(), 7);
        let c = parse("[\"q_proj\", \"down_proj\"]").unwrap();
        assert_eq!(c.target_modules, vec![LoraTarget::QProj, LoraTarget::DownProj]);
        assert!(c.targets(LoraTarget::DownProj) && !c.targets(LoraTarget::UpProj));
        let err = parse("[\"lm_head\"]").unwrap_err().to_string();
        assert!(err.contains("lm_head") && err.contains("gate_proj"), "{err}");
        let err = parse("\"q_proj\"").unwrap_err().to_string();
        assert!(err.contains("all-linear"), "{err}");
        // What is written back reads again.
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<LoraConfig>(&json).unwrap(), c);
    }

    #[test]
    fn bad_values_are_named() {
        let bad = [
            (
                LoraConfig {
                    rank: 0,
                    ..Default::default()
                },
                "lora.rank",
            ),
            (
                LoraConfig {
                    alpha: f64::NAN,
                    ..Default::default()
                },
                "lora.alpha",
            ),
            (
                LoraConfig {
                    dropout: 1.0,
                    ..Default::default()
                },
                "lora.dropout",
            ),
            (
                LoraConfig {
                    target_modules: vec![],
                    ..Default::default()
                },
                "lora.target_modules",
            ),
            (
                LoraConfig {
                    target_modules: vec![LoraTarget::QProj, LoraTarget::QProj],
                    ..Default::default()
                },
                "q_proj twice",
            ),
        ];
        for (config, key) in bad {
            let err = config.validate().unwrap_err().0;
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn features_follow_the_config() {
        let config = crate::config::Preset::Tiny.config(300, vec![299]);
        let q = config.num_attention_heads * config.head_dim;
        assert_eq!(LoraTarget::QProj.features(&config), (config.hidden_size, q));
        assert_eq!(LoraTarget::OProj.features(&config), (q, config.hidden_size));
        assert_eq!(
            LoraTarget::DownProj.features(&config),
            (config.intermediate_size, config.hidden_size)
        );
        assert_eq!(LoraTarget::GateProj.path(), "mlp.gate_proj");
        assert_eq!(LoraTarget::VProj.path(), "self_attn.v_proj");
    }
}

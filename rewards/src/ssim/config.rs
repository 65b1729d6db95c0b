//! The BERT hyper-parameters read from HF's `config.json`.

use std::path::Path;

use serde::Deserialize;

use super::error::SsimError;

/// The fields of a HF `BertConfig` that the encoder uses.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Vocabulary size (rows of `embeddings.word_embeddings`).
    pub vocab_size: usize,
    /// Width of every hidden state.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Number of attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Activation of the feed-forward layer; only exact (erf) `gelu` is implemented.
    pub hidden_act: String,
    /// Rows of `embeddings.position_embeddings`.
    pub max_position_embeddings: usize,
    /// Rows of `embeddings.token_type_embeddings`.
    pub type_vocab_size: usize,
    /// Epsilon of every LayerNorm.
    pub layer_norm_eps: f64,
    /// Only `absolute` position embeddings are implemented.
    #[serde(default = "absolute")]
    pub position_embedding_type: String,
}

fn absolute() -> String {
    "absolute".to_owned()
}

impl BertConfig {
    /// Reads and validates `config.json`.
    pub fn load(path: &Path) -> Result<Self, SsimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SsimError::Io {
            path: path.to_owned(),
            source,
        })?;
        let config: Self = serde_json::from_str(&text).map_err(|source| SsimError::Config {
            path: path.to_owned(),
            source,
        })?;
        config.validate(path)?;
        Ok(config)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    fn validate(&self, path: &Path) -> Result<(), SsimError> {
        let unsupported = |reason: String| SsimError::UnsupportedConfig {
            path: path.to_owned(),
            reason,
        };
        if self.hidden_act != "gelu" {
            return Err(unsupported(format!(
                "hidden_act {:?} (only \"gelu\")",
                self.hidden_act
            )));
        }
        if self.position_embedding_type != "absolute" {
            return Err(unsupported(format!(
                "position_embedding_type {:?} (only \"absolute\")",
                self.position_embedding_type
            )));
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(unsupported(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        if self.type_vocab_size == 0 || self.max_position_embeddings == 0 {
            return Err(unsupported(
                "type_vocab_size and max_position_embeddings must be positive".to_owned(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINILM: &str = r#"{"hidden_act": "gelu", "hidden_size": 384, "intermediate_size": 1536,
        "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
        "num_attention_heads": 12, "num_hidden_layers": 6, "position_embedding_type": "absolute",
        "type_vocab_size": 2, "vocab_size": 30522}"#;

    fn write(dir: &Path, text: &str) -> std::path::PathBuf {
        let path = dir.join("config.json");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn reads_minilm_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = BertConfig::load(&write(dir.path(), MINILM)).unwrap();
        assert_eq!(config.hidden_size, 384);
        assert_eq!(config.head_dim(), 32);
        assert_eq!(config.num_hidden_layers, 6);
        assert_eq!(config.layer_norm_eps, 1e-12);
    }

    #[test]
    fn rejects_tanh_gelu() {
        let dir = tempfile::tempdir().unwrap();
        let text = MINILM.replace("\"gelu\"", "\"gelu_new\"");
        let err = BertConfig::load(&write(dir.path(), &text)).unwrap_err();
        assert!(err.to_string().contains("gelu_new"), "{err}");
    }

    #[test]
    fn rejects_missing_field() {
        let dir = tempfile::tempdir().unwrap();
        let text = MINILM.replace("\"hidden_size\": 384,", "");
        let err = BertConfig::load(&write(dir.path(), &text)).unwrap_err();
        assert!(matches!(err, SsimError::Config { .. }), "{err}");
        assert!(err.to_string().contains("hidden_size"), "{err}");
    }

    #[test]
    fn rejects_indivisible_heads() {
        let dir = tempfile::tempdir().unwrap();
        let text = MINILM.replace("\"num_attention_heads\": 12", "\"num_attention_heads\": 7");
        let err = BertConfig::load(&write(dir.path(), &text)).unwrap_err();
        assert!(matches!(err, SsimError::UnsupportedConfig { .. }), "{err}");
    }
}

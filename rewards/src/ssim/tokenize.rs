//! The MiniLM WordPiece tokenizer (`tokenizer.json`), producing padded batches.

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationParams};

use super::error::SsimError;

/// Id written at padded positions; any id works, padded positions are masked out.
const PAD_ID: u32 = 0;

/// How many characters of a failing text an error message quotes.
const QUOTED_CHARS: usize = 80;

/// BERT WordPiece tokenizer: lower-casing, `[CLS] ... [SEP]`, truncation to `max_tokens`.
pub struct WordPiece {
    tokenizer: Tokenizer,
}

/// Token ids of several texts padded to the longest, with the attention mask.
#[derive(Debug, Clone, PartialEq)]
pub struct PaddedBatch {
    /// `[batch * seq]` row-major token ids.
    pub input_ids: Vec<i64>,
    /// `[batch * seq]` row-major, 1 for real tokens and 0 for padding.
    pub attention_mask: Vec<i64>,
    /// Number of texts.
    pub batch: usize,
    /// Length of the longest text in tokens (at least 1).
    pub seq: usize,
}

impl WordPiece {
    /// Loads `tokenizer.json`, replacing its own truncation/padding with truncation to
    /// `max_tokens` (special tokens included) and no padding.
    pub fn load(path: &Path, max_tokens: usize) -> Result<Self, SsimError> {
        if !path.is_file() {
            return Err(SsimError::Io {
                path: path.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let error = |reason: String| SsimError::Tokenizer {
            path: PathBuf::from(path),
            reason,
        };
        let mut tokenizer = Tokenizer::from_file(path).map_err(|err| error(err.to_string()))?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                ..TruncationParams::default()
            }))
            .map_err(|err| error(err.to_string()))?;
        tokenizer.with_padding(None);
        Ok(Self { tokenizer })
    }

    /// Token ids of `text`, with `[CLS]`/`[SEP]`, truncated.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, SsimError> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|err| SsimError::Encode {
                text: text.chars().take(QUOTED_CHARS).collect(),
                reason: err.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }
}

impl PaddedBatch {
    /// Right-pads `sequences` to the longest one.
    pub fn new(sequences: &[&[u32]]) -> Self {
        let seq = sequences
            .iter()
            .map(|ids| ids.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut input_ids = Vec::with_capacity(sequences.len() * seq);
        let mut attention_mask = Vec::with_capacity(sequences.len() * seq);
        for ids in sequences {
            input_ids.extend(ids.iter().map(|&id| i64::from(id)));
            input_ids.extend(std::iter::repeat_n(i64::from(PAD_ID), seq - ids.len()));
            attention_mask.extend(std::iter::repeat_n(1, ids.len()));
            attention_mask.extend(std::iter::repeat_n(0, seq - ids.len()));
        }
        Self {
            input_ids,
            attention_mask,
            batch: sequences.len(),
            seq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_to_the_longest_sequence() {
        let batch = PaddedBatch::new(&[&[101, 7, 102], &[101, 102]]);
        assert_eq!((batch.batch, batch.seq), (2, 3));
        assert_eq!(batch.input_ids, vec![101, 7, 102, 101, 102, 0]);
        assert_eq!(batch.attention_mask, vec![1, 1, 1, 1, 1, 0]);
    }

    #[test]
    fn missing_tokenizer_file_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let err = WordPiece::load(&path, 256).err().unwrap();
        assert!(matches!(err, SsimError::Io { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn invalid_tokenizer_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{\"not\": \"a tokenizer\"}").unwrap();
        let err = WordPiece::load(&path, 256).err().unwrap();
        assert!(matches!(err, SsimError::Tokenizer { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }
}

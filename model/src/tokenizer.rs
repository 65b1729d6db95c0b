//! Qwen3 tokenizer: a byte-level BPE `tokenizer.json` loaded with the `tokenizers` crate
//! (built without C code), plus the special-token ids the agent loop needs.

use std::error::Error as StdError;
use std::path::{Path, PathBuf};

/// Text of the ChatML turn opener.
pub const IM_START: &str = "<|im_start|>";
/// Text of the ChatML turn closer (Qwen3's EOS for chat models).
pub const IM_END: &str = "<|im_end|>";
/// Text of the end-of-document token (Qwen3's padding token).
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// Text of the token opening a reasoning block.
pub const THINK: &str = "<think>";
/// Text of the token closing a reasoning block.
pub const END_THINK: &str = "</think>";

/// File name of a Hugging Face tokenizer inside a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

type BoxError = Box<dyn StdError + Send + Sync>;

/// Errors from loading or using a [`Qwen3Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The tokenizer file could not be read.
    #[error("cannot read tokenizer file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The tokenizer file is not a valid `tokenizers` JSON file.
    #[error("cannot parse tokenizer file {path}: {source}")]
    Parse { path: PathBuf, source: BoxError },
    /// A required special token is not in the vocabulary.
    #[error("tokenizer {origin} has no token {token:?}")]
    MissingSpecialToken { origin: String, token: &'static str },
    /// A special token is in the BPE vocabulary but not an added token, so text containing
    /// it would be split into pieces instead of mapping to its id.
    #[error("tokenizer {origin}: {token:?} (id {id}) is not an added token")]
    NotAddedToken {
        origin: String,
        token: &'static str,
        id: u32,
    },
    /// Encoding text failed inside the `tokenizers` crate.
    #[error("cannot encode text: {0}")]
    Encode(BoxError),
    /// Decoding ids failed inside the `tokenizers` crate.
    #[error("cannot decode ids: {0}")]
    Decode(BoxError),
}

/// Bytes of text a token, at most, that [`Qwen3Tokenizer::encode_at_most`] encodes before it
/// can tell a text too long (prose runs about 4).
pub const PREFIX_BYTES_PER_TOKEN: usize = 16;

/// What [`Qwen3Tokenizer::encode_at_most`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Encoded {
    /// The whole text's ids.
    Ids(Vec<u32>),
    /// The text was not encoded whole: a prefix of it alone encodes to this many tokens, more
    /// than were allowed.
    Longer(usize),
}

/// The longest prefix of `text` within `limit` bytes that ends before a whitespace character
/// (not a line break) following a non-whitespace one; `None` when `text` is within `limit` or
/// no such place is.
fn bounded_prefix(text: &str, limit: usize) -> Option<&str> {
    if text.len() <= limit {
        return None;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let head = &text[..end];
    let mut chars = head.char_indices().rev().peekable();
    while let Some((at, c)) = chars.next() {
        // Not before a line break: a run of punctuation takes the breaks after it.
        let space = c.is_whitespace() && c != '\n' && c != '\r';
        if space && chars.peek().is_some_and(|&(_, before)| !before.is_whitespace()) {
            return Some(&text[..at]);
        }
    }
    None
}

/// Ids of the Qwen3 special tokens, resolved when the tokenizer is loaded.
///
/// The three ChatML tokens are required (loading fails without them); the reasoning tokens
/// are optional because pre-Qwen3 ChatML tokenizers (e.g. Qwen2.5) lack them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `<|im_start|>` (151644 in Qwen3).
    pub im_start: u32,
    /// `<|im_end|>` (151645 in Qwen3).
    pub im_end: u32,
    /// `<|endoftext|>` (151643 in Qwen3).
    pub endoftext: u32,
    /// `<think>` (151667 in Qwen3), if the tokenizer has it as an added token.
    pub think: Option<u32>,
    /// `</think>` (151668 in Qwen3), if the tokenizer has it as an added token.
    pub end_think: Option<u32>,
}

/// A Qwen3-style tokenizer: encodes without adding BOS/EOS, maps special-token text in the
/// input (e.g. `<|im_start|>`) to its id, and decodes byte-level BPE back to text.
#[derive(Clone)]
pub struct Qwen3Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
}

impl std::fmt::Debug for Qwen3Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen3Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish()
    }
}

impl Qwen3Tokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|source| TokenizerError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        Self::from_tokenizer(inner, &path.display().to_string())
    }

    /// Loads `tokenizer.json` from a model directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        Self::from_file(dir.as_ref().join(TOKENIZER_FILE))
    }

    /// Wraps an already built tokenizer; `origin` names it in errors.
    pub fn from_tokenizer(
        inner: tokenizers::Tokenizer,
        origin: &str,
    ) -> Result<Self, TokenizerError> {
        let added = inner.get_added_tokens_decoder();
        let added_id = |token: &'static str| -> Result<Option<u32>, TokenizerError> {
            match inner.token_to_id(token) {
                None => Ok(None),
                Some(id) if added.contains_key(&id) => Ok(Some(id)),
                Some(id) => Err(TokenizerError::NotAddedToken {
                    origin: origin.to_string(),
                    token,
                    id,
                }),
            }
        };
        let required = |token: &'static str| -> Result<u32, TokenizerError> {
            added_id(token)?.ok_or_else(|| TokenizerError::MissingSpecialToken {
                origin: origin.to_string(),
                token,
            })
        };
        let special = SpecialTokens {
            im_start: required(IM_START)?,
            im_end: required(IM_END)?,
            endoftext: required(ENDOFTEXT)?,
            think: added_id(THINK)?,
            end_think: added_id(END_THINK)?,
        };
        Ok(Self { inner, special })
    }

    /// Encodes text to ids without adding any BOS/EOS. Added tokens written in the text
    /// (`<|im_start|>`, `<think>`, ...) map to their single ids. The text is NFC-normalised
    /// first, as Qwen3's tokenizer does.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(TokenizerError::Encode)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encodes `text` as [`encode`](Self::encode) does, unless a prefix of it already encodes
    /// to more than `most` tokens (a prompt far too long for a model's context): the prefix is
    /// the first `most` × [`PREFIX_BYTES_PER_TOKEN`] bytes, cut before a whitespace character
    /// other than a line break that follows another kind, so tens of megabytes are refused after a fraction of a
    /// second instead of tokenized whole (a minute and gigabytes). Byte-level BPE's
    /// pre-tokenizer ends a word, number or run of punctuation there and begins the next piece
    /// with the whitespace, and NFC composes nothing across it, so the prefix's ids are the
    /// first ids of the whole text.
    pub fn encode_at_most(&self, text: &str, most: usize) -> Result<Encoded, TokenizerError> {
        if let Some(prefix) = bounded_prefix(text, most.saturating_mul(PREFIX_BYTES_PER_TOKEN)) {
            let ids = self.encode(prefix)?;
            if ids.len() > most {
                return Ok(Encoded::Longer(ids.len()));
            }
        }
        self.encode(text).map(Encoded::Ids)
    }

    /// Decodes ids to text. With `skip_special_tokens`, tokens flagged special (the ChatML
    /// and `<|endoftext|>` tokens, but not `<think>`/`</think>`, as in Qwen3) are dropped.
    /// Ids outside the vocabulary decode to nothing, like Hugging Face's decoder.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(TokenizerError::Decode)
    }

    /// Id of a token given its vocabulary string (byte-level form for BPE pieces).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary string of an id.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The special-token ids resolved at load.
    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// Number of tokens including added tokens (151,669 for Qwen3; the model's embedding
    /// table may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Refuses this tokenizer (read from `dir`) for a model of `vocab_size` embedding rows when
    /// it holds more tokens: the tokenizer of another model, whose ids past the table would fail
    /// at the first prompt.
    pub fn check_fits_vocabulary(&self, dir: &std::path::Path, vocab_size: usize) -> Result<(), crate::ModelError> {
        let tokens = self.vocab_size();
        if tokens > vocab_size {
            return Err(crate::ModelError::TokenizerMismatch { path: dir.join("tokenizer.json"), tokens, vocab_size });
        }
        Ok(())
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Unwraps the `tokenizers` tokenizer.
    pub fn into_inner(self) -> tokenizers::Tokenizer {
        self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer with more tokens than the model's embedding rows is refused, naming its file.
    #[test]
    fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
        let tokenizer = crate::tiny_tokenizer::train_tiny_tokenizer(crate::tiny_tokenizer::TINY_VOCAB_SIZE).unwrap();
        let dir = std::path::Path::new("agent");
        assert!(tokenizer.check_fits_vocabulary(dir, tokenizer.vocab_size()).is_ok());
        let err = tokenizer.check_fits_vocabulary(dir, 100).unwrap_err().to_string();
        assert!(err.contains("agent/tokenizer.json") && err.contains("vocabulary of 100"), "{err}");
    }

    /// The prefix `encode_at_most` encodes gives the first ids of the whole text, so a text
    /// within `most` tokens is never refused and a refused one is longer than `most`.
    #[test]
    fn encode_at_most_refuses_by_a_prefix_that_starts_the_whole() {
        let tokenizer = crate::tiny_tokenizer::train_tiny_tokenizer(crate::tiny_tokenizer::TINY_VOCAB_SIZE).unwrap();
        let pieces = [
            "Hello, world! It's 12 345 fine.\n\nNext  line\tand\ttabs: ",
            "über straße — naïve café e\u{301} 한국어 ",
            "a.\n b;\r\n c  d\u{a0}e <|im_start|>user\n ",
        ];
        for piece in pieces {
            let text = piece.repeat(40);
            let whole = tokenizer.encode(&text).unwrap();
            for most in [1, 5, 20, 60, 200, whole.len()] {
                if let Some(prefix) = bounded_prefix(&text, most * PREFIX_BYTES_PER_TOKEN) {
                    let ids = tokenizer.encode(prefix).unwrap();
                    assert_eq!(ids[..], whole[..ids.len()], "{prefix:?}");
                }
                match tokenizer.encode_at_most(&text, most).unwrap() {
                    Encoded::Ids(ids) => assert_eq!(ids, whole),
                    Encoded::Longer(n) => assert!(n > most && whole.len() >= n, "{n} of {} for {most}", whole.len()),
                }
            }
            assert_eq!(tokenizer.encode_at_most(&text, whole.len()).unwrap(), Encoded::Ids(whole.clone()));
            assert!(matches!(tokenizer.encode_at_most(&text, 2).unwrap(), Encoded::Longer(_)));
        }
        assert_eq!(bounded_prefix("abc def", 100), None);
        assert_eq!(bounded_prefix("abcdef ghi", 5), None, "no place to cut within the limit");
        assert_eq!(bounded_prefix("ab  cd ef", 8), Some("ab  cd"));
        assert_eq!(bounded_prefix("ab.\ncd ef", 5), None, "not before a line break");
    }

    /// A minimal tokenizer.json: byte-level pieces "a", "b", "ab" and the given added tokens.
    fn minimal_json(added: &[(&str, u32, bool)]) -> String {
        let added: Vec<serde_json::Value> = added
            .iter()
            .map(|(content, id, special)| {
                serde_json::json!({"id": id, "content": content, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": special})
            })
            .collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": {"a": 0, "b": 1, "ab": 2, "<|im_end|>": 3}, "merges": [["a", "b"]]}
        })
        .to_string()
    }

    fn load(json: &str) -> Result<Qwen3Tokenizer, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(json.as_bytes()).expect("valid json");
        Qwen3Tokenizer::from_tokenizer(inner, "test")
    }

    #[test]
    fn resolves_required_and_optional_special_tokens() {
        let tok = load(&minimal_json(&[
            (IM_END, 3, true),
            (ENDOFTEXT, 4, true),
            (IM_START, 5, true),
        ]))
        .unwrap();
        let s = tok.special();
        assert_eq!((s.im_start, s.im_end, s.endoftext), (5, 3, 4));
        assert_eq!((s.think, s.end_think), (None, None));
        assert_eq!(tok.encode("ab<|im_start|>ab").unwrap(), vec![2, 5, 2]);
        assert_eq!(tok.decode(&[2, 5, 2], true).unwrap(), "abab");
        assert_eq!(tok.decode(&[2, 5, 99], false).unwrap(), "ab<|im_start|>");
    }

    #[test]
    fn missing_special_token_is_an_error_naming_it() {
        let err = load(&minimal_json(&[(IM_END, 3, true), (ENDOFTEXT, 4, true)])).unwrap_err();
        assert!(matches!(
            err,
            TokenizerError::MissingSpecialToken {
                token: IM_START,
                ..
            }
        ));
        assert!(err.to_string().contains("<|im_start|>"), "{err}");
    }

    #[test]
    fn special_token_only_in_bpe_vocab_is_rejected() {
        let err = load(&minimal_json(&[(ENDOFTEXT, 4, true), (IM_START, 5, true)])).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizerError::NotAddedToken {
                    token: IM_END,
                    id: 3,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn unreadable_and_invalid_files_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Qwen3Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Read { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");

        let bad = dir.path().join(TOKENIZER_FILE);
        std::fs::write(&bad, "{\"model\": 3}").unwrap();
        let err = Qwen3Tokenizer::from_file(&bad).unwrap_err();
        assert!(matches!(err, TokenizerError::Parse { .. }), "{err}");
        assert!(
            err.to_string().contains(&bad.display().to_string()),
            "{err}"
        );
    }
}

//! Incremental detokenization: the text of a growing token sequence, a token at a time, at a
//! cost that does not grow with the sequence (as vLLM and Hugging Face TGI do it). Each token
//! decodes a short window twice: the tokens from the prefix offset on, and those from the
//! prefix offset to the read offset (whose text has been given out). What the first adds to
//! the second is the new text, given out once it does not end in U+FFFD (a character whose
//! bytes have not all been generated); the offsets then move on. Both offsets are where a whole
//! character ended, so the pieces joined are what decoding all the tokens at once gives.

use model::tokenizer::{Qwen3Tokenizer, TokenizerError};

/// What decoding writes for bytes that are not (yet) a whole character.
const REPLACEMENT: char = '\u{FFFD}';

/// The text of a token sequence, given out a token at a time.
#[derive(Debug, Clone)]
pub struct Detokenizer {
    /// The tokens from the prefix offset on (those before it are no longer needed).
    window: Vec<u32>,
    /// How many of `window` have had their text given out (the read offset).
    read: usize,
    skip_special_tokens: bool,
}

impl Detokenizer {
    /// An empty sequence, decoded with or without its special tokens.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            window: Vec::new(),
            read: 0,
            skip_special_tokens,
        }
    }

    /// Adds `token` and returns the text it completes: empty while the text ends in a
    /// character whose bytes are not all there, or when the token adds no text.
    pub fn push(&mut self, tokenizer: &Qwen3Tokenizer, token: u32) -> Result<String, TokenizerError> {
        self.window.push(token);
        let text = self.decode(tokenizer, &self.window)?;
        if text.ends_with(REPLACEMENT) {
            return Ok(String::new());
        }
        self.take_new(tokenizer, &text)
    }

    /// The text held back (an unfinished character at the end, written as U+FFFD): what
    /// decoding all the tokens at once gives past the text already given out.
    pub fn flush(&mut self, tokenizer: &Qwen3Tokenizer) -> Result<String, TokenizerError> {
        if self.read == self.window.len() {
            return Ok(String::new());
        }
        let text = self.decode(tokenizer, &self.window)?;
        self.take_new(tokenizer, &text)
    }

    /// The part of `text` (the window's) past the read offset's text; moves the prefix offset
    /// to the read offset and the read offset to the end. Nothing while the read offset's text
    /// does not start `text` (which byte-level decoding never does).
    fn take_new(&mut self, tokenizer: &Qwen3Tokenizer, text: &str) -> Result<String, TokenizerError> {
        let given = self.decode(tokenizer, &self.window[..self.read])?;
        let Some(new) = text.strip_prefix(given.as_str()) else {
            return Ok(String::new());
        };
        let new = new.to_string();
        self.window.drain(..self.read);
        self.read = self.window.len();
        Ok(new)
    }

    fn decode(&self, tokenizer: &Qwen3Tokenizer, ids: &[u32]) -> Result<String, TokenizerError> {
        if ids.is_empty() {
            return Ok(String::new());
        }
        tokenizer.decode(ids, self.skip_special_tokens)
    }
}

/// Each token's share of the text of `ids` decoded incrementally: the text it completed (empty
/// for a skipped special token, or for the first bytes of a character that a later token
/// finishes), the last one with whatever was held back. Joined, they are the decoded text.
pub fn token_texts(tokenizer: &Qwen3Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Result<Vec<String>, TokenizerError> {
    let mut detokenizer = Detokenizer::new(skip_special_tokens);
    let mut texts = ids
        .iter()
        .map(|&id| detokenizer.push(tokenizer, id))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(last) = texts.last_mut() {
        last.push_str(&detokenizer.flush(tokenizer)?);
    }
    Ok(texts)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The real Qwen3 tokenizer from `shared/tokenizer/qwen3` (`PROMPT_R1_SHARED`, else beside
    /// the workspace); `None`, the reason printed, when it is missing, a failure under `CI=true`.
    fn qwen3() -> Option<Qwen3Tokenizer> {
        let shared = std::env::var_os("PROMPT_R1_SHARED")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
        let dir = shared.join("tokenizer/qwen3");
        if !dir.join("tokenizer.json").is_file() {
            let reason = format!("{} has no tokenizer.json", dir.display());
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {reason}");
            eprintln!("skipping the Qwen3 tokenizer: {reason} (set PROMPT_R1_SHARED to the shared/ folder)");
            return None;
        }
        Some(Qwen3Tokenizer::from_dir(&dir).expect("load the Qwen3 tokenizer.json"))
    }

    /// GPT-2's byte-level alphabet: the vocabulary string of the token of byte `b`.
    fn byte_char(b: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            return char::from(b);
        }
        let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + rank).expect("a char")
    }

    /// The byte tokens of `text`, one a byte, so that each multi-byte character is split.
    fn byte_tokens(tokenizer: &Qwen3Tokenizer, text: &str) -> Vec<u32> {
        text.bytes()
            .map(|b| tokenizer.token_id(&byte_char(b).to_string()).unwrap_or_else(|| panic!("no token for byte {b:#x}")))
            .collect()
    }

    /// Random token sequences: any token of the vocabulary, the special and reasoning tokens,
    /// multi-byte characters split into their bytes, and encoded text.
    fn random_sequences(tokenizer: &Qwen3Tokenizer, count: usize, seed: u64) -> Vec<Vec<u32>> {
        let special = tokenizer.special();
        let marks: Vec<u32> = [special.im_start, special.im_end, special.endoftext]
            .into_iter()
            .chain(special.think)
            .chain(special.end_think)
            .collect();
        let words = ["héllo", "世界", "🎉🙂", "naïve café", " ∑x²", "\n\n", "ok"];
        let vocab = tokenizer.vocab_size() as u32;
        let mut rng = StdRng::seed_from_u64(seed);
        (0..count)
            .map(|_| {
                let mut ids = Vec::new();
                let len = rng.random_range(1..60);
                while ids.len() < len {
                    match rng.random_range(0..4) {
                        0 => ids.push(rng.random_range(0..vocab)),
                        1 => ids.push(marks[rng.random_range(0..marks.len())]),
                        2 => ids.extend(byte_tokens(tokenizer, words[rng.random_range(0..words.len())])),
                        _ => ids.extend(tokenizer.encode(words[rng.random_range(0..words.len())]).unwrap()),
                    }
                }
                ids
            })
            .collect()
    }

    /// Decoding a token at a time gives, joined, what decoding the whole sequence gives, with
    /// special tokens skipped or kept; the text given out never ends in half a character.
    fn matches_full_decoding(tokenizer: &Qwen3Tokenizer, seed: u64) {
        for ids in random_sequences(tokenizer, 300, seed) {
            for skip in [true, false] {
                let mut detokenizer = Detokenizer::new(skip);
                let mut text = String::new();
                for &id in &ids {
                    let piece = detokenizer.push(tokenizer, id).unwrap();
                    assert!(!piece.ends_with(REPLACEMENT), "{ids:?}: {piece:?}");
                    text.push_str(&piece);
                }
                text.push_str(&detokenizer.flush(tokenizer).unwrap());
                let full = tokenizer.decode(&ids, skip).unwrap();
                assert_eq!(text, full, "skip_special_tokens {skip}, ids {ids:?}");
                assert_eq!(token_texts(tokenizer, &ids, skip).unwrap().concat(), full);
            }
        }
    }

    #[test]
    fn incremental_decoding_matches_full_decoding_with_the_tiny_tokenizer() {
        matches_full_decoding(&train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap(), 1);
    }

    #[test]
    fn incremental_decoding_matches_full_decoding_with_the_qwen3_tokenizer() {
        if let Some(tokenizer) = qwen3() {
            matches_full_decoding(&tokenizer, 2);
        }
    }

    /// A character split over tokens comes out whole with its last byte; a skipped special
    /// token adds nothing; the window holds only the tokens since the last text but one.
    #[test]
    fn split_characters_and_special_tokens() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let im_end = tokenizer.special().im_end;
        let mut ids = byte_tokens(&tokenizer, "a🎉");
        ids.insert(2, im_end);
        assert_eq!(token_texts(&tokenizer, &ids, true).unwrap(), ["a", "", "", "", "", "🎉"]);
        let kept = token_texts(&tokenizer, &ids, false).unwrap();
        assert_eq!(kept.concat(), tokenizer.decode(&ids, false).unwrap());
        assert_eq!(kept[..2], ["a".to_string(), String::new()]);
        // Bytes that never make a character are written out at the end.
        let half = &byte_tokens(&tokenizer, "é🎉")[..4];
        assert_eq!(token_texts(&tokenizer, half, true).unwrap().concat(), "é\u{FFFD}");
        let mut detokenizer = Detokenizer::new(true);
        for &id in byte_tokens(&tokenizer, &"ab".repeat(500)).iter() {
            assert_eq!(detokenizer.push(&tokenizer, id).unwrap().len(), 1);
            assert!(detokenizer.window.len() <= 2, "{}", detokenizer.window.len());
        }
    }
}

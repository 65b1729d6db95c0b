//! A small byte-level BPE tokenizer for tiny random models, trained deterministically on a
//! built-in English corpus. It has Qwen3's normaliser (NFC), pre-tokenizer (split regex then
//! byte-level), decoder and all 26 Qwen3 added tokens (same order and `special` flags) at the
//! top of its vocabulary, so [`Qwen3Tokenizer`] and the chat template work on it unchanged.
//!
//! Training is a plain BPE merge loop written here rather than `tokenizers`' `BpeTrainer`,
//! which fills its merge queue in hash-map order and so promises no byte-identical result:
//! here the most frequent pair wins and ties go to the smallest pair of ids, so the same
//! call always gives the same `tokenizer.json`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::chat_template::{QWEN3_CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE};
use crate::tokenizer::{Qwen3Tokenizer, TokenizerError, ENDOFTEXT, IM_END, TOKENIZER_FILE};

/// Default total vocabulary size (256 bytes, 230 merges, 26 added tokens).
pub const TINY_VOCAB_SIZE: usize = 512;

/// Qwen3's added tokens in id order (151643..=151668) with their `special` flag.
pub const QWEN3_ADDED_TOKENS: [(&str, bool); 26] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
];

/// Qwen3's pre-tokenizer split pattern.
const QWEN3_SPLIT_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Number of single-byte tokens every byte-level vocabulary starts with.
const BYTE_TOKENS: usize = 256;

/// Errors from training or saving a tiny tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TinyTokenizerError {
    /// The requested size cannot hold the 256 byte tokens and the added tokens.
    #[error("tiny tokenizer vocab size {requested} is below the minimum {minimum}")]
    VocabTooSmall { requested: usize, minimum: usize },
    /// The corpus has no pair left to merge before reaching the requested size.
    #[error("training corpus supports at most {reached} tokens, {requested} requested")]
    CorpusExhausted { requested: usize, reached: usize },
    /// The `tokenizers` crate rejected the tokenizer built here.
    #[error("cannot build tiny tokenizer: {0}")]
    Build(Box<dyn std::error::Error + Send + Sync>),
    /// The trained tokenizer failed the Qwen3 special-token checks.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Trains a tokenizer of `vocab_size` tokens in total (added tokens included) on the
/// built-in corpus [`TINY_CORPUS`].
pub fn train_tiny_tokenizer(vocab_size: usize) -> Result<Qwen3Tokenizer, TinyTokenizerError> {
    train_byte_level_bpe(TINY_CORPUS, vocab_size)
}

/// Trains a Qwen3-style byte-level BPE tokenizer of `vocab_size` tokens in total on `corpus`.
pub fn train_byte_level_bpe(
    corpus: &str,
    vocab_size: usize,
) -> Result<Qwen3Tokenizer, TinyTokenizerError> {
    let minimum = BYTE_TOKENS + QWEN3_ADDED_TOKENS.len();
    if vocab_size < minimum {
        return Err(TinyTokenizerError::VocabTooSmall {
            requested: vocab_size,
            minimum,
        });
    }
    let mut tokens: Vec<String> = byte_level_alphabet().iter().map(char::to_string).collect();
    let bytes_only = build(&tokens, &[], false)?;
    let mut words = word_counts(&bytes_only, corpus)?;
    let mut ids: HashMap<String, u32> = tokens.iter().cloned().zip(0..).collect();
    let mut merges = Vec::new();
    let bpe_size = vocab_size - QWEN3_ADDED_TOKENS.len();
    while tokens.len() < bpe_size {
        let Some((left, right)) = most_frequent_pair(&words) else {
            return Err(TinyTokenizerError::CorpusExhausted {
                requested: vocab_size,
                reached: tokens.len() + QWEN3_ADDED_TOKENS.len(),
            });
        };
        let merged = format!("{}{}", tokens[left as usize], tokens[right as usize]);
        let merged_id = *ids.entry(merged.clone()).or_insert_with(|| {
            tokens.push(merged);
            tokens.len() as u32 - 1
        });
        merges.push((left, right));
        for (word, _) in &mut words {
            merge_in_word(word, (left, right), merged_id);
        }
    }
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|&(l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let inner = build(&tokens, &merges, true)?;
    Ok(Qwen3Tokenizer::from_tokenizer(inner, "tiny tokenizer")?)
}

/// Writes `tokenizer.json` and a minimal `tokenizer_config.json` (Qwen3's chat template,
/// EOS `<|im_end|>`, pad `<|endoftext|>`, added-token table) into `dir`, creating it.
pub fn write_tokenizer_files(
    tokenizer: &Qwen3Tokenizer,
    dir: impl AsRef<Path>,
) -> Result<(), TinyTokenizerError> {
    let dir = dir.as_ref();
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| TinyTokenizerError::Write { path, source })
    };
    std::fs::create_dir_all(dir).map_err(|source| TinyTokenizerError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let json = tokenizer
        .inner()
        .to_string(true)
        .map_err(TinyTokenizerError::Build)?;
    write(TOKENIZER_FILE, json)?;
    let config = serde_json::to_string_pretty(&tokenizer_config(tokenizer))
        .map_err(|e| TinyTokenizerError::Build(e.into()))?;
    write(TOKENIZER_CONFIG_FILE, config)
}

/// The `tokenizer_config.json` content written by [`write_tokenizer_files`].
fn tokenizer_config(tokenizer: &Qwen3Tokenizer) -> Value {
    let added: BTreeMap<u32, _> = tokenizer
        .inner()
        .get_added_tokens_decoder()
        .into_iter()
        .collect();
    let decoder: serde_json::Map<String, Value> = added
        .into_iter()
        .map(|(id, token)| {
            let entry = json!({
                "content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special,
            });
            (id.to_string(), entry)
        })
        .collect();
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "bos_token": null,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": IM_END,
        "errors": "replace",
        "pad_token": ENDOFTEXT,
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

/// The 256 byte-level characters in GPT-2/Qwen id order: printable Latin-1 bytes map to
/// themselves and come first, the others map to U+0100 onwards.
fn byte_level_alphabet() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut alphabet: Vec<char> = (0..=255u8)
        .filter(|&b| printable(b))
        .map(char::from)
        .collect();
    let unprintable = BYTE_TOKENS - alphabet.len();
    alphabet.extend((256u32..).take(unprintable).filter_map(char::from_u32));
    alphabet
}

/// A tokenizer with Qwen3's pipeline over the given BPE vocabulary (ids in order) and
/// merges, optionally with the Qwen3 added tokens after the vocabulary.
fn build(
    tokens: &[String],
    merges: &[(String, String)],
    with_added_tokens: bool,
) -> Result<tokenizers::Tokenizer, TinyTokenizerError> {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), json!(id)))
        .collect();
    let added: Vec<Value> = if with_added_tokens {
        QWEN3_ADDED_TOKENS
            .iter()
            .zip(tokens.len()..)
            .map(|(&(content, special), id)| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": special})
            })
            .collect()
    } else {
        Vec::new()
    };
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN3_SPLIT_PATTERN}, "behavior": "Isolated", "invert": false},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    });
    tokenizers::Tokenizer::from_bytes(spec.to_string()).map_err(TinyTokenizerError::Build)
}

/// Pre-tokenized words of the corpus (as byte-token ids) with their counts, in a fixed order.
fn word_counts(
    bytes_only: &tokenizers::Tokenizer,
    corpus: &str,
) -> Result<Vec<(Vec<u32>, u64)>, TinyTokenizerError> {
    let encoding = bytes_only
        .encode(corpus, false)
        .map_err(TinyTokenizerError::Build)?;
    let mut counts: BTreeMap<Vec<u32>, u64> = BTreeMap::new();
    let mut word = Vec::new();
    let mut current = None;
    for (&id, &word_id) in encoding.get_ids().iter().zip(encoding.get_word_ids()) {
        if word_id != current && !word.is_empty() {
            *counts.entry(std::mem::take(&mut word)).or_default() += 1;
        }
        current = word_id;
        word.push(id);
    }
    if !word.is_empty() {
        *counts.entry(word).or_default() += 1;
    }
    Ok(counts.into_iter().collect())
}

/// The adjacent pair occurring most often (ties: the smallest pair), if any.
fn most_frequent_pair(words: &[(Vec<u32>, u64)]) -> Option<(u32, u32)> {
    let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
    for (word, count) in words {
        for pair in word.windows(2) {
            *counts.entry((pair[0], pair[1])).or_default() += count;
        }
    }
    counts
        .into_iter()
        .max_by(|(pair_a, count_a), (pair_b, count_b)| {
            count_a.cmp(count_b).then(pair_b.cmp(pair_a))
        })
        .map(|(pair, _)| pair)
}

/// Replaces non-overlapping occurrences of `pair`, left to right, with `merged`.
fn merge_in_word(word: &mut Vec<u32>, pair: (u32, u32), merged: u32) {
    let mut out = Vec::with_capacity(word.len());
    let mut i = 0;
    while i < word.len() {
        if i + 1 < word.len() && (word[i], word[i + 1]) == pair {
            out.push(merged);
            i += 2;
        } else {
            out.push(word[i]);
            i += 1;
        }
    }
    *word = out;
}

/// The built-in training corpus: varied English prose, Prompt-R1-style turns, numbers,
/// code, JSON and a few lines of other scripts.
pub const TINY_CORPUS: &str = r#"The small model reads the question, thinks about it, and writes a short prompt for the large model.
The large model answers the prompt, and the small model reads the answer before it decides what to do next.
When the answer is ready, the small model writes it inside answer tags and the episode ends.
Question: What is the capital of France?
<think>The question asks for a capital city. I should ask the large model and check the reply.</think>
<interaction_prompt>{"name": "prompt", "arguments": {"prompt": "Which city is the capital of France? Explain briefly."}}</interaction_prompt>
<interaction_response>
{"results": ["The capital of France is Paris, which is also its largest city."]}
</interaction_response>
<think>The reply says Paris. That matches what I know, so the answer is Paris.</think>
<answer>Paris</answer>
Question: Who wrote the novel Pride and Prejudice?
<think>This is a question about an English novel from the early nineteenth century.</think>
<interaction_prompt>Please name the author of the novel Pride and Prejudice and the year it was published.</interaction_prompt>
<interaction_response>
{"results": ["Pride and Prejudice was written by Jane Austen and published in 1813."]}
</interaction_response>
<think>The author is Jane Austen.</think>
<answer>Jane Austen</answer>
Question: How many legs does a spider have?
<think>Spiders are arachnids, not insects. I will ask to be sure.</think>
<interaction_prompt>How many legs does a spider have, and how is that different from an insect?</interaction_prompt>
<interaction_response>
{"results": ["A spider has eight legs, while an insect has six legs."]}
</interaction_response>
<answer>8</answer>
A river starts in the mountains and flows down to the sea. Along the way it passes through forests, fields and towns.
People have built bridges, mills and harbours on its banks for thousands of years.
In the morning the market opens early. Farmers bring fresh bread, cheese, apples, pears and vegetables.
Children walk to school while their parents go to work by bus, by train or by bicycle.
The library is quiet in the afternoon. Students read books about history, science, music and art.
A good teacher explains a difficult idea in simple words and then gives an example.
The weather changed quickly: first it was sunny, then the wind grew strong, and finally it started to rain.
She opened the window, looked at the garden, and saw that the flowers were wet but still bright.
He asked a simple question and waited patiently for a clear answer.
They travelled from London to Edinburgh by train; the journey took about four and a half hours.
Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 365, 1000, 2024, 2025, 3.14, 0.5 and 99%.
The meeting starts at 09:30 and ends at 11:45. Room 204 is on the second floor.
If x = 7 and y = 5, then x + y = 12, x - y = 2, x * y = 35 and x / y = 1.4.
The sum of the angles in a triangle is 180 degrees. A square has four equal sides.
Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.
The Earth orbits the Sun once every year, and the Moon orbits the Earth about once every month.
Light travels faster than sound, which is why we see lightning before we hear thunder.
Plants use sunlight, water and carbon dioxide to make sugar and oxygen.
The heart pumps blood through the body, and the lungs take in the air we breathe.
Computers store information as bits, and a group of eight bits is called a byte.
A program is a list of instructions that tells a computer what to do, step by step.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

fn main() {
    let words = vec!["alpha", "beta", "gamma"];
    println!("{}", words.len());
}
{"id": 17, "question": "What is 17 * 23?", "answers": ["391"], "data_source": "math"}
It's a fine day. They're late again, we've seen it before, I'm sure you'll agree, and he'd say so too.
Don't worry: it isn't hard. Isn't it strange? Wasn't it fun? Couldn't we try once more?
Dr. Smith, Mrs. Brown and Mr. Green met on Monday, Tuesday and Friday in March, April and May.
The first answer was wrong, the second answer was close, and the third answer was correct.
Think carefully, check every step, and only then write the final answer.
What is the largest planet in the solar system? Jupiter is the largest planet.
Which ocean is the deepest? The Pacific Ocean is the deepest and the largest ocean.
When did the Second World War end? It ended in 1945.
Where is the Great Barrier Reef? It lies off the coast of Queensland, in Australia.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
Who painted the Mona Lisa? Leonardo da Vinci painted it in the early sixteenth century.
Café, naïve, résumé, jalapeño and façade are words borrowed from other languages.
你好，世界！这是一个测试。 Привет, мир! Γεια σου κόσμε! こんにちは。 🤖🚀✨
Tabs	and spaces    are both whitespace; lines end with a newline.

Short lines.
Long lines keep going and going, with commas, semicolons; colons: dashes - and (parentheses) [brackets] {braces}.
"Quoted text" and 'single quotes' are common in dialogue, e-mail, and source code.
The end of the story is happy: everyone finds their way home before the night falls.
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    #[test]
    fn byte_alphabet_is_the_byte_level_alphabet_in_qwen_order() {
        let alphabet = byte_level_alphabet();
        assert_eq!(alphabet.len(), BYTE_TOKENS);
        let expected = ByteLevel::alphabet();
        assert!(alphabet.iter().all(|c| expected.contains(c)));
        assert_eq!(expected.len(), BYTE_TOKENS);
        assert_eq!((alphabet[0], alphabet[220], alphabet[198]), ('!', 'Ġ', 'Ċ'));
    }

    #[test]
    fn merges_pick_the_most_frequent_then_smallest_pair() {
        let words = vec![(vec![5, 6, 5, 6], 1), (vec![1, 2], 2), (vec![3, 4], 2)];
        assert_eq!(most_frequent_pair(&words), Some((1, 2)));
        assert_eq!(most_frequent_pair(&[(vec![7], 3)]), None);
        let mut word = vec![1, 1, 1, 2, 1, 1];
        merge_in_word(&mut word, (1, 1), 9);
        assert_eq!(word, vec![9, 1, 2, 9]);
    }

    #[test]
    fn learns_frequent_words_of_its_corpus() {
        let tok = train_byte_level_bpe("hello hello hello world", 256 + 26 + 5).unwrap();
        assert_eq!(
            tok.encode(" hello").unwrap(),
            vec![tok.token_id("Ġhello").unwrap()]
        );
        assert_eq!(
            tok.decode(&tok.encode("world!").unwrap(), false).unwrap(),
            "world!"
        );
    }
}

//! SQuAD-style answer normalisation, as the reference's `normalize_answer` in Python.
//!
//! Steps, in order: lower-case (Unicode), drop ASCII punctuation (Python's
//! `string.punctuation`), replace the whole words `a`, `an`, `the` by a space, then split on
//! whitespace and join with single spaces.

/// Whether Python's `str.isspace` holds for `c` (Rust's `White_Space` plus the ASCII
/// information separators U+001C..U+001F, which Python also splits on).
pub(crate) fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s` without leading and trailing whitespace, as Python's `str.strip()`.
pub(crate) fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// Whether `c` is a word character for Python's Unicode `\b` (alphanumeric or `_`).
fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Whether a maximal run of word characters is one of the articles the reference removes.
fn is_article(word: &str) -> bool {
    matches!(word, "a" | "an" | "the")
}

/// The normalised form of an answer: `"The Eiffel-Tower!"` → `"eiffeltower"`.
pub fn normalize_answer(text: &str) -> String {
    let lowered = text.to_lowercase();
    let without_punctuation: String = lowered
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let without_articles = remove_articles(&without_punctuation);
    without_articles
        .split(is_py_space)
        .filter(|token| !token.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The tokens of the normalised answer (what F1 counts).
pub fn answer_tokens(text: &str) -> Vec<String> {
    normalize_answer(text)
        .split(' ')
        .filter(|token| !token.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Replaces every whole word `a`, `an`, `the` by a space (Python `re.sub(r"\b(a|an|the)\b", " ", s)`).
fn remove_articles(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word_start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        if is_word_char(c) {
            word_start.get_or_insert(i);
            continue;
        }
        if let Some(start) = word_start.take() {
            push_word(&mut out, &text[start..i]);
        }
        out.push(c);
    }
    if let Some(start) = word_start {
        push_word(&mut out, &text[start..]);
    }
    out
}

fn push_word(out: &mut String, word: &str) {
    if is_article(word) {
        out.push(' ');
    } else {
        out.push_str(word);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowercases_and_drops_ascii_punctuation() {
        assert_eq!(normalize_answer("Hello, World!"), "hello world");
        assert_eq!(normalize_answer("J. Cole"), "j cole");
        assert_eq!(normalize_answer("27,629"), "27629");
        assert_eq!(
            normalize_answer("Daniel Paul \"Dan\" Futterman"),
            "daniel paul dan futterman"
        );
    }

    #[test]
    fn removes_whole_word_articles_only() {
        assert_eq!(normalize_answer("The Beatles"), "beatles");
        assert_eq!(normalize_answer("a cat and an owl"), "cat and owl");
        assert_eq!(normalize_answer("theatre Anna"), "theatre anna");
        // Punctuation goes first, so "the-end" becomes "theend" and keeps its letters.
        assert_eq!(normalize_answer("the-end"), "theend");
        // "(the)" loses its brackets, then is a whole word.
        assert_eq!(normalize_answer("x (the) y"), "x y");
    }

    #[test]
    fn unicode_letters_are_word_characters() {
        // "é" is a word character, so "theé" is one word and not an article.
        assert_eq!(normalize_answer("theé"), "theé");
        // Non-ASCII punctuation stays (the reference only removes ASCII punctuation).
        assert_eq!(normalize_answer("«Ça va»"), "«ça va»");
        assert_eq!(normalize_answer("ÉCOLE"), "école");
        assert_eq!(normalize_answer("北京 the 大学"), "北京 大学");
    }

    #[test]
    fn collapses_all_whitespace() {
        assert_eq!(normalize_answer("  a\tb \n\n c\u{a0}d\u{1f}e "), "b c d e");
        assert_eq!(normalize_answer(""), "");
        assert_eq!(normalize_answer(" the  a an "), "");
    }

    #[test]
    fn tokens_split_the_normal_form() {
        assert_eq!(
            answer_tokens("The 2010 census: 27,629."),
            vec!["2010", "census", "27629"]
        );
        assert!(answer_tokens(" ... ").is_empty());
    }

    #[test]
    fn strip_matches_python() {
        assert_eq!(py_strip("\u{1c} x y \n"), "x y");
        assert_eq!(py_strip(" \t "), "");
    }
}

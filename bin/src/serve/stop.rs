//! Stop strings and streaming text: where the generated text must be cut, and how much of it
//! can be sent before the next token (never the start of a stop string, never half a
//! character).

/// The stop strings of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStrings(Vec<String>);

impl StopStrings {
    /// Empty strings never match and are dropped.
    pub fn new(stops: Vec<String>) -> Self {
        Self(stops.into_iter().filter(|s| !s.is_empty()).collect())
    }

    /// The earliest stop string in `text` (the first listed among those starting at the same
    /// offset), with its byte offset: the text is cut there.
    pub fn earliest(&self, text: &str) -> Option<(usize, &str)> {
        self.0
            .iter()
            .filter_map(|stop| text.find(stop.as_str()).map(|at| (at, stop.as_str())))
            .min_by_key(|&(at, _)| at)
    }

    /// Length of the prefix of `text` that is safe to send: it leaves out trailing U+FFFD (a
    /// character whose bytes have not all been generated yet), then a trailing part that could
    /// still become a stop string with the characters to come (so a stop string that ends in a
    /// character still being generated holds back its start too).
    pub fn safe_len(&self, text: &str) -> usize {
        let complete = text.trim_end_matches('\u{FFFD}');
        let held = self
            .0
            .iter()
            .map(|stop| partial_stop_len(complete, stop))
            .max()
            .unwrap_or(0);
        complete.len() - held
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_stop_len(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&k| {
            let start = text.len() - k;
            text.is_char_boundary(start) && stop.starts_with(&text[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(items: &[&str]) -> StopStrings {
        StopStrings::new(items.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn earliest_stop_string_wins() {
        let s = stops(&["</answer>", "b", ""]);
        assert_eq!(s.earliest("a b </answer>"), Some((2, "b")));
        assert_eq!(s.earliest("nothing"), None);
        assert_eq!(stops(&[]).earliest("x"), None);
    }

    #[test]
    fn holds_back_a_possible_stop_string_and_partial_characters() {
        let s = stops(&["</answer>"]);
        assert_eq!(s.safe_len("x </ans"), 2);
        assert_eq!(s.safe_len("x <"), 2);
        assert_eq!(s.safe_len("x </b"), 5);
        assert_eq!(s.safe_len("é\u{FFFD}"), "é".len());
        assert_eq!(stops(&[]).safe_len("abc"), 3);
        assert_eq!(stops(&["é!"]).safe_len("aé"), 1);
    }

    #[test]
    fn holds_back_a_stop_string_whose_last_character_is_still_partial() {
        // "rķ" with ķ's bytes not all generated: the text ends "r\u{FFFD}".
        let s = stops(&["rķ"]);
        assert_eq!(s.safe_len("answer\u{FFFD}"), "answe".len());
        assert_eq!(s.safe_len("answer\u{FFFD}\u{FFFD}"), "answe".len());
        assert_eq!(stops(&["x"]).safe_len("ab\u{FFFD}"), 2);
    }
}

//! The tags of the Prompt-R1 protocol that the agent writes in its turns: its reasoning
//! (`<think>`), a call of the large LLM (`<interaction_prompt>`) and the final answer
//! (`<answer>`), and how to read the text between two of them.

/// Opening tag of a call.
pub const CALL_OPEN: &str = "<interaction_prompt>";
/// Closing tag of a call.
pub const CALL_CLOSE: &str = "</interaction_prompt>";
/// Opening tag of the final answer.
pub const ANSWER_OPEN: &str = "<answer>";
/// Closing tag of the final answer.
pub const ANSWER_CLOSE: &str = "</answer>";
/// Opening tag of the agent's reasoning.
pub const THINK_OPEN: &str = "<think>";
/// Closing tag of the agent's reasoning.
pub const THINK_CLOSE: &str = "</think>";

/// The text between the first `open` and the next `close` after it, untrimmed (possibly
/// empty); `None` when `open` is missing or not closed after it.
pub fn tagged<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = text.find(open)? + open.len();
    let length = text[start..].find(close)?;
    Some(&text[start..start + length])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_is_the_first_open_to_the_next_close() {
        let answer = |text| tagged(text, ANSWER_OPEN, ANSWER_CLOSE);
        assert_eq!(answer("a<answer> x </answer><answer>y</answer>"), Some(" x "));
        assert_eq!(answer("<answer></answer>"), Some(""));
        assert_eq!(answer("</answer><answer>x</answer>"), Some("x"));
        assert_eq!(answer("<answer>unclosed"), None);
        assert_eq!(answer("no tags</answer>"), None);
        assert_eq!(answer("<answer>a<answer>b</answer>"), Some("a<answer>b"));
    }
}

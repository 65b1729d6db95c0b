//! The agent's turns of an episode, from a raw decoded text, and the final answer.

use crate::normalize::py_strip;

const ASSISTANT_OPEN: &str = "<|im_start|>assistant\n";
const TURN_END: &str = "<|im_end|>";
const ANSWER_OPEN: &str = "<answer>";
const ANSWER_CLOSE: &str = "</answer>";

/// The agent's turns of a decoded episode: the text of every complete
/// `<|im_start|>assistant\n … <|im_end|>` block, in order.
///
/// This is the reference's `re.findall(r'<\|im_start\|>assistant\n(.*?)<\|im_end\|>', text, re.DOTALL)`:
/// a trailing assistant block without `<|im_end|>` is not a turn, and the environment's
/// replies (user blocks) are skipped. After an environment reply the next turn starts with
/// the `<think>\n` the environment put in the context; it is part of the turn's text.
pub fn agent_turns(episode_text: &str) -> Vec<&str> {
    let mut turns = Vec::new();
    let mut rest = episode_text;
    while let Some(open) = rest.find(ASSISTANT_OPEN) {
        let body = &rest[open + ASSISTANT_OPEN.len()..];
        let Some(end) = body.find(TURN_END) else {
            break;
        };
        turns.push(&body[..end]);
        rest = &body[end + TURN_END.len()..];
    }
    turns
}

/// The content of the first `<answer>…</answer>` in `turn`, unstripped.
pub(crate) fn first_answer_content(turn: &str) -> Option<&str> {
    let open = turn.find(ANSWER_OPEN)?;
    let body = &turn[open + ANSWER_OPEN.len()..];
    let close = body.find(ANSWER_CLOSE)?;
    Some(&body[..close])
}

/// The final answer of a turn: the first `<answer>` content, stripped, when it is not blank.
pub fn extract_answer(turn: &str) -> Option<&str> {
    first_answer_content(turn)
        .map(py_strip)
        .filter(|answer| !answer.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_assistant_blocks_and_skips_user_blocks() {
        let text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n\
            <|im_start|>assistant\n<think>a</think><interaction_prompt>p</interaction_prompt><|im_end|>\n\
            <|im_start|>user\n<interaction_response>\nR\n</interaction_response><|im_end|>\n\
            <|im_start|>assistant\n<think>\nb</think><answer>x</answer><|im_end|>";
        assert_eq!(
            agent_turns(text),
            vec![
                "<think>a</think><interaction_prompt>p</interaction_prompt>",
                "<think>\nb</think><answer>x</answer>",
            ]
        );
    }

    #[test]
    fn an_unterminated_block_is_not_a_turn() {
        let text = "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>assistant\n<think>\ncut off";
        assert_eq!(agent_turns(text), vec!["A"]);
        assert!(agent_turns("no blocks here").is_empty());
        assert!(agent_turns("<|im_start|>assistant no newline<|im_end|>").is_empty());
    }

    #[test]
    fn answer_is_first_tag_stripped() {
        assert_eq!(
            extract_answer("<answer> Paris \n</answer><answer>Rome</answer>"),
            Some("Paris")
        );
        assert_eq!(extract_answer("<answer> \n </answer>"), None);
        assert_eq!(extract_answer("<answer>open only"), None);
        assert_eq!(extract_answer("no tag"), None);
        assert_eq!(first_answer_content("<answer> </answer>"), Some(" "));
    }
}

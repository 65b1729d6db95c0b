//! The agent's turns of an episode, from a raw decoded text, and the final answer.

use chat::tags::{tagged, ANSWER_CLOSE, ANSWER_OPEN};

use crate::normalize::py_strip;

const ASSISTANT_OPEN: &str = "<|im_start|>assistant\n";
const TURN_END: &str = "<|im_end|>";

/// The agent's turns of a decoded episode: the text of every
/// `<|im_start|>assistant\n … <|im_end|>` block, in order, the last one possibly cut short.
///
/// This is what the reference does: it appends `<|im_end|>` to the decoded episode when the
/// text does not end with it, then takes
/// `re.findall(r'<\|im_start\|>assistant\n(.*?)<\|im_end\|>', text, re.DOTALL)`. So a final
/// turn cut by the token limit (no `<|im_end|>`) is still a turn, running to the end of the
/// text, and an episode that stops after an environment reply ends with a turn holding only
/// the `<think>\n` the context opened it with. The environment's replies (user blocks) are
/// skipped. After a reply the next turn starts with that `<think>\n`; it is part of the
/// turn's text.
pub fn agent_turns(episode_text: &str) -> Vec<&str> {
    let mut turns = Vec::new();
    let mut rest = episode_text;
    while let Some(open) = rest.find(ASSISTANT_OPEN) {
        let body = &rest[open + ASSISTANT_OPEN.len()..];
        let Some(end) = body.find(TURN_END) else {
            turns.push(body);
            break;
        };
        turns.push(&body[..end]);
        rest = &body[end + TURN_END.len()..];
    }
    turns
}

/// The final answer of a turn: the first `<answer>` content, stripped, when it is not blank.
pub fn extract_answer(turn: &str) -> Option<&str> {
    tagged(turn, ANSWER_OPEN, ANSWER_CLOSE)
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
    fn an_unterminated_last_block_runs_to_the_end() {
        let text = "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>assistant\n<think>\ncut off";
        assert_eq!(agent_turns(text), vec!["A", "<think>\ncut off"]);
        // Stopped right after a reply: the last turn is the `<think>\n` of the context.
        let text = "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nR<|im_end|>\n<|im_start|>assistant\n<think>\n";
        assert_eq!(agent_turns(text), vec!["A", "<think>\n"]);
        // A closed last block followed by other text gains no turn.
        assert_eq!(
            agent_turns("<|im_start|>assistant\nA<|im_end|>\n"),
            vec!["A"]
        );
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
    }
}

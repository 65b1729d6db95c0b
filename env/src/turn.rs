//! Parsing one agent turn: `<think>`, then either an `<interaction_prompt>` call
//! or an `<answer>`.

use ::chat::tags::tagged;
use serde_json::Value;

pub use ::chat::tags::{ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN};

/// What a turn asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnAction {
    /// Send a prompt to the environment.
    Call(Call),
    /// The final answer (trimmed; may be empty).
    Answer(String),
    /// Neither a complete call nor a complete answer.
    Nothing,
}

/// A call of the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The prompt for the large LLM (trimmed, never empty).
    pub prompt: String,
    /// How the agent wrote it.
    pub format: CallFormat,
}

/// How the content of `<interaction_prompt>` was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallFormat {
    /// `{"name": "prompt", "arguments": {"prompt": "…"}}` (the reference training format).
    Json,
    /// Plain text (the reference inference scripts).
    Text,
}

/// A parsed turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedTurn {
    /// Content of the first complete `<think>…</think>`, trimmed.
    pub think: Option<String>,
    /// The action.
    pub action: TurnAction,
}

/// Parses the full text of one assistant turn.
///
/// A complete `<interaction_prompt>…</interaction_prompt>` makes the turn a call (only the
/// first one runs, as in the reference); otherwise a complete `<answer>…</answer>` makes it the
/// final answer. The call content is read as the JSON call format when it is a JSON object with
/// a string `arguments.prompt`, and as plain text otherwise; an empty prompt is no call.
pub fn parse_turn(text: &str) -> ParsedTurn {
    let think = tagged(text, THINK_OPEN, THINK_CLOSE).map(|t| t.trim().to_string());
    let action = if let Some(content) = tagged(text, CALL_OPEN, CALL_CLOSE) {
        match call_prompt(content) {
            Some(call) => TurnAction::Call(call),
            None => TurnAction::Nothing,
        }
    } else if let Some(answer) = tagged(text, ANSWER_OPEN, ANSWER_CLOSE) {
        TurnAction::Answer(answer.trim().to_string())
    } else {
        TurnAction::Nothing
    };
    ParsedTurn { think, action }
}

fn call_prompt(content: &str) -> Option<Call> {
    let content = content.trim();
    let from_json = serde_json::from_str::<Value>(content)
        .ok()
        .and_then(|value| {
            value
                .get("arguments")
                .and_then(|arguments| arguments.get("prompt"))
                .and_then(Value::as_str)
                .map(str::to_string)
        });
    let (prompt, format) = match from_json {
        Some(prompt) => (prompt, CallFormat::Json),
        None => (content.to_string(), CallFormat::Text),
    };
    let prompt = prompt.trim();
    (!prompt.is_empty()).then(|| Call {
        prompt: prompt.to_string(),
        format,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(prompt: &str, format: CallFormat) -> TurnAction {
        TurnAction::Call(Call {
            prompt: prompt.into(),
            format,
        })
    }

    #[test]
    fn json_call() {
        let turn = parse_turn(
            "<think>\nneed help\n</think>\n<interaction_prompt>\n{\"name\": \"prompt\", \"arguments\": {\"prompt\": \"What is 2+2?\"}}\n</interaction_prompt>",
        );
        assert_eq!(turn.think.as_deref(), Some("need help"));
        assert_eq!(turn.action, call("What is 2+2?", CallFormat::Json));
    }

    #[test]
    fn plain_text_call_and_json_without_a_prompt_field() {
        let turn =
            parse_turn("<think>x</think><interaction_prompt> Explain X. </interaction_prompt>");
        assert_eq!(turn.action, call("Explain X.", CallFormat::Text));
        let turn = parse_turn("<interaction_prompt>{\"q\": 1}</interaction_prompt>");
        assert_eq!(turn.action, call("{\"q\": 1}", CallFormat::Text));
    }

    #[test]
    fn only_the_first_call_counts_and_calls_win_over_answers() {
        let turn = parse_turn(
            "<think>a</think><interaction_prompt>first</interaction_prompt><interaction_prompt>second</interaction_prompt><answer>x</answer>",
        );
        assert_eq!(turn.action, call("first", CallFormat::Text));
    }

    #[test]
    fn answer() {
        let turn = parse_turn("<think>\ndone\n</think>\n<answer> Paris </answer>");
        assert_eq!(turn.action, TurnAction::Answer("Paris".into()));
    }

    #[test]
    fn incomplete_or_empty_tags_are_nothing() {
        assert_eq!(
            parse_turn("<think>hmm</think><interaction_prompt>cut off").action,
            TurnAction::Nothing
        );
        assert_eq!(parse_turn("<answer>cut off").action, TurnAction::Nothing);
        assert_eq!(
            parse_turn("<interaction_prompt>  </interaction_prompt>").action,
            TurnAction::Nothing
        );
        assert_eq!(
            parse_turn(
                "<interaction_prompt>{\"arguments\":{\"prompt\":\" \"}}</interaction_prompt>"
            )
            .action,
            TurnAction::Nothing
        );
        let turn = parse_turn("just text");
        assert_eq!((turn.think, turn.action), (None, TurnAction::Nothing));
    }
}

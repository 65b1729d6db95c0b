//! How the environment's reply enters the agent's context.
//!
//! The reply becomes `REPLY = {"results": ["<reply>"]}`, written as Python's `json.dumps`
//! writes it (the reference code; non-ASCII escaped as `\uXXXX` by default) and, when longer
//! than the limit, cut to that many characters followed by `...` (as the reference does). It
//! is then wrapped as
//! `<|im_end|>\n<|im_start|>user\n<interaction_response>\nREPLY\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n`.
//!
//! **Joining rule.** A turn that ended because the agent sampled `<|im_end|>` already holds that
//! token (loss mask 1: stopping is the agent's action), so the wrapped text then starts after
//! its own leading `<|im_end|>`. A turn that ended any other way (a stop string of a remote
//! agent, a token limit) gets the full wrapped text. Either way the context holds exactly one
//! `<|im_end|>` between the agent's text and `\n<|im_start|>user`, and it decodes to the
//! reference format. (The reference training code keeps both and so doubles the token.)

use std::fmt::Write as _;

/// Qwen3's end-of-turn token (id 151645).
pub const IM_END: &str = "<|im_end|>";
/// Opening tag around the environment's reply.
pub const RESPONSE_OPEN: &str = "<interaction_response>";
/// Closing tag around the environment's reply.
pub const RESPONSE_CLOSE: &str = "</interaction_response>";
/// What follows the reply: the start of the agent's next turn, inside `<think>`.
pub const NEXT_TURN_PREFIX: &str = "<think>\n";

/// How a reply is shown to the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyFormat {
    /// Most characters of the REPLY JSON text kept (2048 in training, 8192 at inference).
    pub max_chars: usize,
    /// Escape non-ASCII characters as `\uXXXX`, as Python's `json.dumps` does by default.
    pub ascii_escape: bool,
}

impl Default for ReplyFormat {
    fn default() -> Self {
        Self {
            max_chars: 2048,
            ascii_escape: true,
        }
    }
}

/// The reply as the agent sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShownReply {
    /// The (possibly cut) REPLY JSON text.
    pub text: String,
    /// Whether it was cut.
    pub truncated: bool,
}

impl ReplyFormat {
    /// REPLY for `reply` (trimmed first, as the reference does), cut to `max_chars` characters.
    pub fn show(&self, reply: &str) -> ShownReply {
        let mut json = String::from("{\"results\": [\"");
        push_json_string_body(&mut json, reply.trim(), self.ascii_escape);
        json.push_str("\"]}");
        match json.char_indices().nth(self.max_chars) {
            Some((cut, _)) => {
                json.truncate(cut);
                json.push_str("...");
                ShownReply {
                    text: json,
                    truncated: true,
                }
            }
            None => ShownReply {
                text: json,
                truncated: false,
            },
        }
    }
}

/// The text the environment appends after a turn (see the module docs for the joining rule).
pub fn environment_text(shown_reply: &str, agent_emitted_im_end: bool) -> String {
    let lead = if agent_emitted_im_end { "" } else { IM_END };
    format!(
        "{lead}\n<|im_start|>user\n{RESPONSE_OPEN}\n{shown_reply}\n{RESPONSE_CLOSE}{IM_END}\n<|im_start|>assistant\n{NEXT_TURN_PREFIX}"
    )
}

/// The user message a chat-API agent gets for a shown reply (the same text without the
/// ChatML framing).
pub fn response_message(shown_reply: &str) -> String {
    format!("{RESPONSE_OPEN}\n{shown_reply}\n{RESPONSE_CLOSE}")
}

/// Appends `text` JSON-escaped like Python's `json.dumps` (with `ensure_ascii` = `ascii`).
fn push_json_string_body(out: &mut String, text: &str, ascii: bool) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_json_matches_python_json_dumps() {
        let format = ReplyFormat {
            max_chars: 10_000,
            ascii_escape: true,
        };
        // json.dumps({"results": ["h\u00e9llo \"w\"\n\\\t\x01\x7f😀"]})
        assert_eq!(
            format.show("  héllo \"w\"\n\\\t\u{1}\u{7f}😀 ").text,
            r#"{"results": ["h\u00e9llo \"w\"\n\\\t\u0001\u007f\ud83d\ude00"]}"#
        );
        let unicode = ReplyFormat {
            ascii_escape: false,
            ..format
        };
        assert_eq!(
            unicode.show("héllo\u{7f}").text,
            "{\"results\": [\"héllo\u{7f}\"]}"
        );
    }

    #[test]
    fn long_replies_are_cut_with_an_ellipsis() {
        let format = ReplyFormat {
            max_chars: 20,
            ascii_escape: true,
        };
        let shown = format.show(&"a".repeat(100));
        assert_eq!(
            shown.text,
            format!("{{\"results\": [\"{}...", "a".repeat(6))
        );
        assert!(shown.truncated);
        let exact = ReplyFormat {
            max_chars: 21,
            ..format
        }
        .show("abcd");
        assert_eq!(
            (exact.text.as_str(), exact.truncated),
            ("{\"results\": [\"abcd\"]}", false)
        );
        let cut_unicode = ReplyFormat {
            max_chars: 15,
            ascii_escape: false,
        }
        .show("éé");
        assert_eq!(cut_unicode.text, "{\"results\": [\"é...");
    }

    #[test]
    fn environment_text_holds_one_im_end_either_way() {
        let reference = "<|im_end|>\n<|im_start|>user\n<interaction_response>\nR\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n";
        assert_eq!(environment_text("R", false), reference);
        assert_eq!(
            format!("{IM_END}{}", environment_text("R", true)),
            reference
        );
        assert_eq!(
            response_message("R"),
            "<interaction_response>\nR\n</interaction_response>"
        );
    }
}

//! The local environment of the rollout workload: [`ScriptedEnvironment`], replying after a
//! fixed latency with texts of about N tokens ([`reply_text`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use env::{ChatMessage, EnvError, Environment, Role};

/// A local environment: each call sleeps `latency`, then returns the reply for its turn
/// (the number of user messages it was sent, less one, picks one of `replies`).
pub struct ScriptedEnvironment {
    latency: Duration,
    replies: Vec<String>,
    calls: AtomicUsize,
}

impl ScriptedEnvironment {
    /// An environment answering call `k` of an episode with `replies[k % replies.len()]`.
    pub fn new(latency: Duration, replies: Vec<String>) -> Self {
        assert!(!replies.is_empty(), "a scripted environment needs a reply");
        Self {
            latency,
            replies,
            calls: AtomicUsize::new(0),
        }
    }

    /// An environment with `turns` replies of about `tokens` tokens each, as `count` counts them.
    pub fn with_reply_tokens(
        latency: Duration,
        tokens: usize,
        turns: usize,
        count: impl Fn(&str) -> usize,
    ) -> Self {
        Self::new(
            latency,
            (0..turns.max(1))
                .map(|k| reply_text(tokens, k, &count))
                .collect(),
        )
    }

    /// Calls answered so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }
}

impl Environment for ScriptedEnvironment {
    fn complete(&self, messages: &[ChatMessage]) -> Result<String, EnvError> {
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let turn = messages
            .iter()
            .filter(|m| m.role == Role::User)
            .count()
            .saturating_sub(1);
        Ok(self.replies[turn % self.replies.len()].clone())
    }
}

/// Deterministic English-like text of at least `tokens` tokens as `count` counts them (the
/// first length reached, growing by one word at the end, so a word or two over at most),
/// distinct for each `variant`.
pub fn reply_text(tokens: usize, variant: usize, count: impl Fn(&str) -> usize) -> String {
    const WORDS: [&str; 24] = [
        "the", "answer", "depends", "on", "which", "record", "you", "read", "first", "and", "how",
        "its", "figures", "were", "measured", "by", "those", "who", "kept", "them", "over", "many",
        "years", "so",
    ];
    let mut text = format!("Reply {variant}:");
    let mut i = variant * 7;
    // Words are added in steps of an eighth of the tokens still missing (a word is at least
    // one token and rarely more than a few), one at a time at the end, so the text is counted
    // O(log n) times and overshoots by a word at most.
    loop {
        let have = count(&text);
        if have >= tokens {
            return text;
        }
        let step = ((tokens - have) / 8).max(1);
        for _ in 0..step {
            text.push(' ');
            text.push_str(WORDS[i % WORDS.len()]);
            i += 1;
            if i % 13 == 0 {
                text.push_str(&format!(" {}.", i / 13));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollout_replies_have_about_the_asked_tokens() {
        let tokenizer =
            model::tiny_tokenizer::train_tiny_tokenizer(model::tiny_tokenizer::TINY_VOCAB_SIZE)
                .unwrap();
        let count = |t: &str| tokenizer.encode(t).unwrap().len();
        for tokens in [1, 100, 300] {
            let env = ScriptedEnvironment::with_reply_tokens(Duration::ZERO, tokens, 3, count);
            for turn in 0..3 {
                let mut messages = vec![ChatMessage::system("s")];
                for _ in 0..=turn {
                    messages.push(ChatMessage::user("p"));
                }
                let reply = env.complete(&messages).unwrap();
                let n = count(&reply);
                assert!(
                    n >= tokens && n <= tokens + 6,
                    "{n} tokens for {tokens} asked"
                );
                assert_eq!(
                    reply,
                    env.complete(&messages).unwrap(),
                    "replies are deterministic"
                );
            }
        }
        let env = ScriptedEnvironment::with_reply_tokens(Duration::ZERO, 50, 2, count);
        let first = env.complete(&[ChatMessage::user("a")]).unwrap();
        let second = env
            .complete(&[ChatMessage::user("a"), ChatMessage::user("b")])
            .unwrap();
        assert_ne!(first, second, "each turn has its own reply");
        assert_eq!(env.calls(), 2);
    }
}

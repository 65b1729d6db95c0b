//! Training rows to token sequences with a loss mask (1 = a token the model is trained to
//! write). A JSONL file may mix three kinds of rows:
//!
//! - a chat transcript `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."},
//!   ...]}` (the TRL / LLaMA-Factory format; other keys of the row are ignored): rendered with
//!   the model's chat template, tokenised as one text, and every token that starts inside an
//!   assistant message's span (its text after `<|im_start|>assistant\n`, through its
//!   `<|im_end|>`; see [`model::chat_template::RenderedChat`]) gets mask 1;
//! - a saved episode, as `prompt-r1 infer --json` prints it (an `env::Trajectory`);
//! - a row of `prompt-r1 eval`'s `predictions.jsonl`, whose `trajectory` is such an episode
//!   (`agent` and `agent-only` rows).
//!
//! Episodes keep the agent's loss mask (see [`super::episode`]). Failed episodes (the
//! environment or the agent broke down) are left out and counted; any other row that cannot be
//! used is an error naming the file and line.

use std::path::{Path, PathBuf};

use model::chat_template::{ChatMessage, ChatTemplate, RenderOptions, Role};
use model::tokenizer::Qwen3Tokenizer;
use serde::Deserialize;
use serde_json::Value;

use super::episode::{episode_sequence, SequenceError};
use crate::run::TrainError;

/// One training sequence: token ids and, aligned with them, the loss mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftSequence {
    pub tokens: Vec<u32>,
    /// 1 where the token is trained on (predicted from the tokens before it), else 0.
    pub loss_mask: Vec<u8>,
}

impl SftSequence {
    /// Tokens with mask 1 after the first position (the first token has nothing to predict it).
    pub fn n_loss_tokens(&self) -> usize {
        self.loss_mask.iter().skip(1).filter(|&&m| m == 1).count()
    }
}

/// What loading found: rows of each kind, and what was left out or cut.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataSummary {
    pub chats: usize,
    pub episodes: usize,
    /// Failed episodes (environment or agent failure), left out.
    pub failed_episodes: usize,
    /// Eval rows that a later row of the same data source and id replaces (a resumed `eval`
    /// appends the questions it runs again), left out.
    pub superseded: usize,
    /// Sequences cut to `data.max_length` or the model's context, whichever is shorter.
    pub truncated: usize,
    /// Sequences left without a trained token by the cut, left out.
    pub empty_after_cut: usize,
    /// Tokens of the kept sequences, and those among them with mask 1.
    pub tokens: usize,
    pub loss_tokens: usize,
}

impl std::fmt::Display for DataSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} sequences ({} chats, {} episodes), {} tokens, {} of them trained on",
            self.chats + self.episodes - self.empty_after_cut,
            self.chats,
            self.episodes,
            self.tokens,
            self.loss_tokens
        )?;
        if self.failed_episodes > 0 {
            write!(f, "; {} failed episodes left out", self.failed_episodes)?;
        }
        if self.superseded > 0 {
            write!(f, "; {} eval rows left out for later rows of the same question", self.superseded)?;
        }
        if self.truncated > 0 {
            write!(f, "; {} cut to data.max_length or the model's context", self.truncated)?;
        }
        if self.empty_after_cut > 0 {
            write!(
                f,
                " ({} of them left without a trained token, left out)",
                self.empty_after_cut
            )?;
        }
        Ok(())
    }
}

/// Turns rows into sequences with one tokenizer and chat template.
pub struct RowEncoder<'a> {
    pub tokenizer: &'a Qwen3Tokenizer,
    pub template: ChatTemplate,
    /// Most tokens per sequence (longer ones are cut).
    pub max_length: Option<usize>,
}

#[derive(Deserialize)]
struct ChatRow {
    messages: Vec<ChatMessage>,
}

impl RowEncoder<'_> {
    /// Reads every file; sequences in file and line order.
    pub fn load_files(&self, files: &[PathBuf]) -> Result<(Vec<SftSequence>, DataSummary), TrainError> {
        let mut out = Vec::new();
        let mut summary = DataSummary::default();
        for file in files {
            self.load_file(file, &mut out, &mut summary)?;
        }
        Ok((out, summary))
    }

    fn load_file(&self, path: &Path, out: &mut Vec<SftSequence>, summary: &mut DataSummary) -> Result<(), TrainError> {
        let text = data::read_text(path)?;
        // A byte-order mark, as some Windows editors write, is no part of the first row.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        let superseded = superseded_eval_rows(text);
        let mut rows = 0;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            rows += 1;
            if superseded.contains(&i) {
                summary.superseded += 1;
                continue;
            }
            let row_error = |reason: String| TrainError::Config {
                path: path.to_path_buf(),
                reason: format!("line {}: {reason}", i + 1),
            };
            let Some(sequence) = self.encode_row(line, summary).map_err(row_error)? else {
                continue;
            };
            match self.cut(sequence, summary) {
                Some(s) => {
                    summary.tokens += s.tokens.len();
                    summary.loss_tokens += s.n_loss_tokens();
                    out.push(s);
                }
                None => summary.empty_after_cut += 1,
            }
        }
        if rows == 0 {
            return Err(TrainError::Config {
                path: path.to_path_buf(),
                reason: "no rows".into(),
            });
        }
        Ok(())
    }

    /// One JSONL row: `None` for a failed episode (counted in `summary`).
    fn encode_row(&self, line: &str, summary: &mut DataSummary) -> Result<Option<SftSequence>, String> {
        let row: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let Some(fields) = row.as_object() else {
            return Err("a row must be a JSON object".into());
        };
        if fields.contains_key("messages") {
            let chat: ChatRow = serde_json::from_value(row).map_err(|e| format!("messages: {e}"))?;
            summary.chats += 1;
            return self.chat_sequence(&chat.messages).map(Some).map_err(|SequenceError(e)| e);
        }
        let episode = if let Some(trajectory) = fields.get("trajectory") {
            if let Some(mode) = fields
                .get("mode")
                .and_then(Value::as_str)
                .filter(|m| !m.starts_with("agent"))
            {
                return Err(format!("an eval row of mode `{mode}` holds no agent episode"));
            }
            trajectory.clone()
        } else if fields.contains_key("prompt_text") {
            row
        } else {
            return Err(
                "neither a chat transcript (`messages`) nor an episode (`prompt_text`, or an eval row's `trajectory`)"
                    .into(),
            );
        };
        let trajectory: env::Trajectory =
            serde_json::from_value(episode).map_err(|e| format!("not an episode: {e}"))?;
        if trajectory.stop_reason.is_failure() {
            summary.failed_episodes += 1;
            return Ok(None);
        }
        summary.episodes += 1;
        episode_sequence(&trajectory, self.tokenizer).map(Some).map_err(|SequenceError(e)| e)
    }

    /// A chat transcript rendered with the template; mask 1 on the assistant spans.
    pub fn chat_sequence(&self, messages: &[ChatMessage]) -> Result<SftSequence, SequenceError> {
        if !messages.iter().any(|m| m.role == Role::Assistant) {
            return Err("messages hold no assistant message to train on".into());
        }
        let rendered = self.template.render_with_spans(messages, RenderOptions::default());
        let encoding = self
            .tokenizer
            .inner()
            .encode(rendered.text.as_str(), false)
            .map_err(|e| format!("cannot tokenise the rendered chat: {e}"))?;
        let loss_mask = encoding
            .get_offsets()
            .iter()
            .map(|&(start, _)| u8::from(rendered.assistant_spans.iter().any(|span| span.contains(&start))))
            .collect();
        Ok(SftSequence {
            tokens: encoding.get_ids().to_vec(),
            loss_mask,
        })
    }

    /// `sequence` cut to `max_length`, or `None` when nothing trained on is left.
    fn cut(&self, mut sequence: SftSequence, summary: &mut DataSummary) -> Option<SftSequence> {
        if let Some(max) = self.max_length.filter(|&m| sequence.tokens.len() > m) {
            sequence.tokens.truncate(max);
            sequence.loss_mask.truncate(max);
            summary.truncated += 1;
        }
        (sequence.n_loss_tokens() > 0).then_some(sequence)
    }
}

/// The (data source, id) of an eval row (one with a `trajectory`), if `line` is one.
fn eval_row_key(line: &str) -> Option<(String, String)> {
    let row: Value = serde_json::from_str(line).ok()?;
    row.get("trajectory")?;
    data::prediction_key(row.get("data_source")?.as_str()?, row.get("id")?)
}

/// The lines (from 0) of the eval rows in `text` that a later row of the same data source and
/// id replaces.
fn superseded_eval_rows(text: &str) -> std::collections::HashSet<usize> {
    data::superseded_rows(text.lines().map(eval_row_key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};

    fn encoder(tokenizer: &Qwen3Tokenizer) -> RowEncoder<'_> {
        RowEncoder {
            tokenizer,
            template: ChatTemplate::Qwen3,
            max_length: None,
        }
    }

    /// The masked tokens decode to exactly the assistant messages' rendered text, and the whole
    /// sequence is the tokenisation of the rendered chat.
    #[test]
    fn chat_mask_covers_exactly_the_assistant_text() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let rows = encoder(&tokenizer);
        let messages = vec![
            ChatMessage::system("You answer."),
            ChatMessage::user("Capital of Norway?"),
            ChatMessage::assistant("Oslo."),
            ChatMessage::user("And of Peru?"),
            ChatMessage::assistant("Lima, it is."),
        ];
        let s = rows.chat_sequence(&messages).unwrap();
        let text = ChatTemplate::Qwen3.render(&messages, RenderOptions::default());
        assert_eq!(s.tokens, tokenizer.encode(&text).unwrap());
        let runs: Vec<String> = s
            .tokens
            .chunk_by_mask(&s.loss_mask)
            .into_iter()
            .map(|ids| tokenizer.decode(&ids, false).unwrap())
            .collect();
        assert_eq!(
            runs,
            ["Oslo.<|im_end|>", "<think>\n\n</think>\n\nLima, it is.<|im_end|>"]
        );
    }

    trait ChunkByMask {
        fn chunk_by_mask(&self, mask: &[u8]) -> Vec<Vec<u32>>;
    }

    impl ChunkByMask for Vec<u32> {
        /// The runs of consecutive mask-1 tokens.
        fn chunk_by_mask(&self, mask: &[u8]) -> Vec<Vec<u32>> {
            let mut runs: Vec<Vec<u32>> = Vec::new();
            let mut previous = 0;
            for (&id, &m) in self.iter().zip(mask) {
                if m == 1 {
                    if previous == 0 {
                        runs.push(Vec::new());
                    }
                    runs.last_mut().unwrap().push(id);
                }
                previous = m;
            }
            runs
        }
    }

    /// Of eval rows with the same data source and id, the last is the one kept; other rows have
    /// no such key.
    #[test]
    fn the_last_eval_row_of_a_question_is_kept() {
        let text = [
            r#"{"id": "1", "data_source": "a", "trajectory": {"old": true}}"#,
            r#"{"id": "1", "data_source": "b", "trajectory": {}}"#,
            r#"{"messages": [], "id": "1", "data_source": "a"}"#,
            r#"{"id": "1", "data_source": "a", "trajectory": {"old": false}}"#,
        ]
        .join("\n");
        assert_eq!(superseded_eval_rows(&text), [0].into());
    }

    #[test]
    fn bad_rows_name_file_and_line() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let rows = encoder(&tokenizer);
        let dir = tempfile::tempdir().unwrap();
        let good = r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#;
        let cases = [
            ("{not json", "line 2: not JSON"),
            ("[1, 2]", "line 2: a row must be a JSON object"),
            (
                r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
                "line 2: messages: unknown variant `tool`",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}]}"#,
                "line 2: messages hold no assistant message",
            ),
            (r#"{"text": "plain"}"#, "line 2: neither a chat transcript"),
            (r#"{"prompt_text": "p"}"#, "line 2: not an episode: missing field"),
            (
                r#"{"mode": "direct", "trajectory": {}}"#,
                "line 2: an eval row of mode `direct`",
            ),
        ];
        for (bad, expected) in cases {
            let path = dir.path().join("rows.jsonl");
            std::fs::write(&path, format!("{good}\n{bad}\n")).unwrap();
            let err = rows.load_files(&[path]).unwrap_err().to_string();
            assert!(
                err.contains("rows.jsonl") && err.contains(expected),
                "{expected}: {err}"
            );
        }
        let path = dir.path().join("empty.jsonl");
        std::fs::write(&path, "\n\n").unwrap();
        let err = rows.load_files(&[path]).unwrap_err().to_string();
        assert!(err.contains("empty.jsonl: no rows"), "{err}");
    }

    /// A file that begins with a byte-order mark reads as the same file without it.
    #[test]
    fn a_byte_order_mark_is_skipped() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let rows = encoder(&tokenizer);
        let dir = tempfile::tempdir().unwrap();
        let good = r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#;
        let plain = dir.path().join("plain.jsonl");
        let marked = dir.path().join("marked.jsonl");
        std::fs::write(&plain, format!("{good}\r\n{good}\r\n")).unwrap();
        std::fs::write(&marked, format!("\u{feff}{good}\r\n{good}\r\n")).unwrap();
        let (expected, _) = rows.load_files(&[plain]).unwrap();
        let (read, _) = rows.load_files(&[marked]).unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read.iter().map(|s| &s.tokens).collect::<Vec<_>>(), expected.iter().map(|s| &s.tokens).collect::<Vec<_>>());
    }

    #[test]
    fn long_sequences_are_cut_and_counted() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let mut rows = encoder(&tokenizer);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.jsonl");
        let row = |answer: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "question"}}, {{"role": "assistant", "content": "{answer}"}}]}}"#
            )
        };
        std::fs::write(
            &path,
            format!("{}\n{}\n", row("short"), row(&"long answer ".repeat(20))),
        )
        .unwrap();
        let (all, summary) = rows.load_files(&[path.clone()]).unwrap();
        assert_eq!((all.len(), summary.chats, summary.truncated), (2, 2, 0));
        let prompt_len = all[0].loss_mask.iter().position(|&m| m == 1).unwrap();
        rows.max_length = Some(prompt_len + 3);
        let (cut, summary) = rows.load_files(&[path.clone()]).unwrap();
        assert_eq!(summary.truncated, 2);
        assert!(cut
            .iter()
            .all(|s| s.tokens.len() == prompt_len + 3 && s.n_loss_tokens() == 3));
        rows.max_length = Some(prompt_len);
        let (kept, summary) = rows.load_files(&[path]).unwrap();
        assert!(kept.is_empty() && summary.empty_after_cut == 2, "{summary:?}");
        assert!(
            summary.to_string().contains("left without a trained token"),
            "{summary}"
        );
    }
}

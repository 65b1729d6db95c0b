//! The agent's first prompt: the reference system message and instruction,
//! bundled from `assets/prompts/` and overridable from files.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::chat::ChatMessage;

/// The reference system message of the agent (`assets/prompts/system.txt`).
pub const REFERENCE_SYSTEM: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../assets/prompts/system.txt"
));

/// The reference instruction appended to every question (`assets/prompts/instruction.txt`).
pub const REFERENCE_INSTRUCTION: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../assets/prompts/instruction.txt"
));

/// A prompt file that could not be read.
#[derive(Debug, Error)]
#[error("cannot read prompt file {}: {source}", path.display())]
pub struct PromptFileError {
    /// The file.
    pub path: PathBuf,
    /// Why it could not be read.
    pub source: std::io::Error,
}

/// The texts the agent's first prompt is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptTexts {
    /// System message of the agent.
    pub system: String,
    /// Instruction that follows `Question: {question}` in the user message.
    pub instruction: String,
}

impl Default for PromptTexts {
    fn default() -> Self {
        Self {
            system: REFERENCE_SYSTEM.to_string(),
            instruction: REFERENCE_INSTRUCTION.to_string(),
        }
    }
}

impl PromptTexts {
    /// The reference texts with either replaced by a file's content (used verbatim).
    pub fn load(
        system: Option<&Path>,
        instruction: Option<&Path>,
    ) -> Result<Self, PromptFileError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| PromptFileError {
                path: path.to_path_buf(),
                source,
            })
        };
        let mut texts = Self::default();
        if let Some(path) = system {
            texts.system = read(path)?;
        }
        if let Some(path) = instruction {
            texts.instruction = read(path)?;
        }
        Ok(texts)
    }

    /// The first prompt for `question`, taken verbatim as the reference does: the reference
    /// datasets' prompts are exactly this text, whitespace around the question included.
    pub fn first_prompt(&self, question: &str) -> FirstPrompt {
        FirstPrompt {
            system: self.system.clone(),
            user: format!("Question: {question}\n{}", self.instruction),
        }
    }
}

/// The system and user message that open an episode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirstPrompt {
    /// System message.
    pub system: String,
    /// User message: `Question: {question}\n{instruction}`.
    pub user: String,
}

impl FirstPrompt {
    /// The two messages, for chat APIs.
    pub fn messages(&self) -> Vec<ChatMessage> {
        vec![
            ChatMessage::system(&self.system),
            ChatMessage::user(&self.user),
        ]
    }

    /// The Qwen3 ChatML rendering with the generation header, exactly what Qwen3's chat
    /// template gives for these two messages with `add_generation_prompt`:
    /// `<|im_start|>system\n…<|im_end|>\n<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n`.
    pub fn chatml(&self) -> String {
        format!(
            "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            self.system, self.user
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_texts_are_the_reference_texts() {
        assert!(REFERENCE_SYSTEM.starts_with("You are Qwen, created by Alibaba Cloud."));
        assert!(REFERENCE_SYSTEM.ends_with("</interaction_prompt>"));
        assert!(REFERENCE_INSTRUCTION.starts_with("First, provide a simple explanation"));
        assert!(REFERENCE_INSTRUCTION.ends_with("<answer>(final answer for the question)</answer>"));
    }

    #[test]
    fn user_message_and_chatml() {
        let texts = PromptTexts {
            system: "SYS".into(),
            instruction: "INSTR".into(),
        };
        let prompt = texts.first_prompt("Who wrote Hamlet?");
        assert_eq!(prompt.user, "Question: Who wrote Hamlet?\nINSTR");
        assert_eq!(
            prompt.chatml(),
            "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nQuestion: Who wrote Hamlet?\nINSTR<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            prompt.messages()[1],
            ChatMessage::user("Question: Who wrote Hamlet?\nINSTR")
        );
    }

    #[test]
    fn the_question_is_taken_verbatim() {
        let texts = PromptTexts { system: "SYS".into(), instruction: "INSTR".into() };
        assert_eq!(texts.first_prompt("Who wrote Hamlet? ").user, "Question: Who wrote Hamlet? \nINSTR");
    }

    #[test]
    fn files_override_and_missing_files_are_named() {
        let dir =
            std::env::temp_dir().join(format!("prompt-r1-env-prompts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("instruction.txt");
        std::fs::write(&file, "Answer briefly.").unwrap();
        let texts = PromptTexts::load(None, Some(&file)).unwrap();
        assert_eq!(texts.instruction, "Answer briefly.");
        assert_eq!(texts.system, REFERENCE_SYSTEM);
        let missing = dir.join("missing.txt");
        let err = PromptTexts::load(Some(&missing), None).unwrap_err();
        assert!(err.to_string().contains("missing.txt"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

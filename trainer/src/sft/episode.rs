//! A saved episode as a training sequence, with the same loss mask as the episode's own: the
//! agent's turns (each with the `<|im_end|>` that ends it) count, the prompt and the
//! environment's texts (the `<think>\n` that opens the next turn included) do not.
//!
//! An episode of a local agent holds its tokens and loss mask: they are used as they are, after
//! checking that its prompt tokens decode to its prompt text with this tokenizer. An episode of
//! a chat-API agent holds only text; it is tokenised as the local agent builds its context
//! (`trainer::rollout::LocalAgent`): the prompt once, each turn's text on its own, each
//! environment text on its own. Every turn that the token limit did not cut ends with an
//! `<|im_end|>` of the agent's, as a local agent samples it: the one the agent or the
//! environment text wrote, or, after a final turn that a stop string ended, one added.

use env::{Trajectory, TurnEnd, IM_END, NEXT_TURN_PREFIX};
use model::tokenizer::Qwen3Tokenizer;

use super::data::SftSequence;

/// What the environment text ends with: the opening of the agent's next turn.
fn next_turn_opening() -> String {
    format!("<|im_start|>assistant\n{NEXT_TURN_PREFIX}")
}

/// An episode or a chat transcript that cannot be made a training sequence; the message says
/// what in it is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SequenceError(pub String);

impl From<&str> for SequenceError {
    fn from(message: &str) -> Self {
        Self(message.to_owned())
    }
}

impl From<String> for SequenceError {
    fn from(message: String) -> Self {
        Self(message)
    }
}

/// The training sequence of a (not failed) episode.
pub fn episode_sequence(episode: &Trajectory, tokenizer: &Qwen3Tokenizer) -> Result<SftSequence, SequenceError> {
    let sequence = if episode.token_ids.is_empty() {
        from_text(episode, tokenizer)?
    } else {
        from_tokens(episode, tokenizer)?
    };
    if sequence.n_loss_tokens() == 0 {
        return Err("the episode holds no agent token to train on".into());
    }
    Ok(sequence)
}

/// A local agent's episode: its own tokens and mask.
fn from_tokens(episode: &Trajectory, tokenizer: &Qwen3Tokenizer) -> Result<SftSequence, SequenceError> {
    let (ids, mask) = (&episode.token_ids, &episode.loss_mask);
    if mask.len() != ids.len() {
        return Err(format!("{} token_ids but {} loss_mask entries", ids.len(), mask.len()).into());
    }
    if let Some(bad) = mask.iter().find(|&&m| m > 1) {
        return Err(format!("loss_mask holds {bad}; only 0 and 1 are allowed").into());
    }
    let vocab = tokenizer.vocab_size();
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(format!(
            "token id {bad} is outside this tokenizer's vocabulary of {vocab}"
        ).into());
    }
    let prompt = ids.get(..episode.prompt_len).ok_or_else(|| {
        format!(
            "prompt_len {} is longer than the {} token_ids",
            episode.prompt_len,
            ids.len()
        )
    })?;
    let decoded = tokenizer.decode(prompt, false).map_err(|e| e.to_string())?;
    if decoded != episode.prompt_text {
        return Err(
            "the episode's tokens are not this tokenizer's: its prompt tokens decode to another text than prompt_text"
                .into(),
        );
    }
    Ok(SftSequence {
        tokens: ids.clone(),
        loss_mask: mask.clone(),
    })
}

/// A chat-API agent's episode: its text, split into prompt, turns and environment texts.
fn from_text(episode: &Trajectory, tokenizer: &Qwen3Tokenizer) -> Result<SftSequence, SequenceError> {
    let mut sequence = SftSequence {
        tokens: Vec::new(),
        loss_mask: Vec::new(),
    };
    let mut push = |text: &str, mask: u8| -> Result<(), String> {
        let ids = tokenizer.encode(text).map_err(|e| e.to_string())?;
        sequence.loss_mask.extend(std::iter::repeat_n(mask, ids.len()));
        sequence.tokens.extend(ids);
        Ok(())
    };
    push(&episode.prompt_text, 0)?;
    let opening = next_turn_opening();
    let mut rest = episode.response_text.as_str();
    for (k, turn) in episode.turns.iter().enumerate() {
        let body = if k == 0 {
            Some(turn.text.as_str())
        } else {
            turn.text.strip_prefix(NEXT_TURN_PREFIX)
        };
        let unexpected = || format!("response_text does not hold turn {} where it should", k + 1);
        let body = body.ok_or_else(unexpected)?;
        rest = rest.strip_prefix(body).ok_or_else(unexpected)?;
        push(body, 1)?;
        if let Some(after) = rest.strip_prefix(IM_END) {
            push(IM_END, 1)?;
            rest = after;
        } else if turn.end != TurnEnd::Length {
            push(IM_END, 1)?;
        }
        if k + 1 < episode.turns.len() {
            let end = rest.find(&opening).ok_or_else(|| {
                format!(
                    "response_text has no environment text after turn {} that opens the next turn",
                    k + 1
                )
            })? + opening.len();
            push(&rest[..end], 0)?;
            rest = &rest[end..];
        }
    }
    // The reply to a call in the last round is context the agent never answered.
    push(rest, 0)?;
    Ok(sequence)
}

#[cfg(test)]
mod tests {
    use super::*;
    use env::{
        Agent, AgentContext, AgentError, ChatMessage, EnvError, Environment, EnvironmentTokens, EpisodeConfig, PromptTexts,
        TurnText,
    };
    use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};

    /// Writes fixed turns: as a local agent (recording its text's tokens and `<|im_end|>` as
    /// sampled, the environment's as context), or as a chat-API agent (no tokens).
    struct Scripted<'a> {
        turns: &'a [&'a str],
        tokenizer: Option<&'a Qwen3Tokenizer>,
        next: Vec<usize>,
    }

    impl Agent for Scripted<'_> {
        fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
            if let Some(t) = self.tokenizer {
                ctx.record_context_tokens(&t.encode(&ctx.prompt().chatml()).unwrap());
            }
            self.next.resize(ctx.index() + 1, 0);
            Ok(())
        }

        fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<TurnText, AgentError>> {
            episodes
                .iter_mut()
                .map(|ctx| {
                    let text = self.turns[self.next[ctx.index()]].to_string();
                    self.next[ctx.index()] += 1;
                    let end = match self.tokenizer {
                        Some(t) => {
                            for id in t.encode(&text).unwrap() {
                                ctx.record_agent_token(id, 0.0);
                            }
                            ctx.record_agent_token(t.special().im_end, 0.0);
                            TurnEnd::ImEnd
                        }
                        None => TurnEnd::StopString,
                    };
                    Ok(TurnText { text, tokens: 1, end })
                })
                .collect()
        }

        fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
            Ok(match self.tokenizer {
                Some(t) => EnvironmentTokens::Ids(t.encode(text).unwrap()),
                None => EnvironmentTokens::Estimated(1),
            })
        }
    }

    struct Answers;

    impl Environment for Answers {
        fn complete(&self, _messages: &[ChatMessage]) -> Result<String, EnvError> {
            Ok("Oslo".into())
        }
    }

    fn episode(turns: &[&str], tokenizer: Option<&Qwen3Tokenizer>, max_turns: usize) -> Trajectory {
        let mut agent = Scripted {
            turns,
            tokenizer,
            next: Vec::new(),
        };
        let config = EpisodeConfig {
            max_turns,
            prompts: PromptTexts {
                system: "Ask, then answer.".into(),
                instruction: "Answer.".into(),
            },
            ..EpisodeConfig::default()
        };
        env::run_episodes(&mut agent, &Answers, &["Capital of Norway?"], &config).remove(0)
    }

    const TURNS: [&str; 2] = [
        "<think>\nask\n</think>\n<interaction_prompt>Capital of Norway?</interaction_prompt>",
        "copy\n</think>\n<answer>Oslo</answer>",
    ];

    /// A chat-API agent's episode becomes exactly the sequence a local agent writing the same
    /// text records, and its trained tokens are the two turns with their `<|im_end|>`.
    #[test]
    fn text_episodes_tokenise_as_the_local_agent_builds_its_context() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let chat = episode(&TURNS, None, 5);
        assert!(chat.token_ids.is_empty() && chat.answer.as_deref() == Some("Oslo"));
        let local = episode(&TURNS, Some(&tokenizer), 5);
        let from_text = episode_sequence(&chat, &tokenizer).unwrap();
        let from_tokens = episode_sequence(&local, &tokenizer).unwrap();
        assert_eq!(from_text, from_tokens);
        assert_eq!(
            (from_tokens.tokens.as_slice(), from_tokens.loss_mask.as_slice()),
            (&local.token_ids[..], &local.loss_mask[..])
        );
        let trained: Vec<u32> = from_text
            .tokens
            .iter()
            .zip(&from_text.loss_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&id, _)| id)
            .collect();
        let expected = format!("{}{IM_END}{}{IM_END}", TURNS[0], TURNS[1]);
        assert_eq!(tokenizer.decode(&trained, false).unwrap(), expected);
        assert_eq!(
            tokenizer.decode(&from_text.tokens, false).unwrap(),
            local.context_text()
        );
    }

    /// A call in the last round gets its reply appended after it, with mask 0.
    #[test]
    fn a_reply_after_the_last_round_is_context() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let chat = episode(&TURNS[..1], None, 1);
        assert!(chat.response_text.ends_with(NEXT_TURN_PREFIX));
        let s = episode_sequence(&chat, &tokenizer).unwrap();
        assert_eq!(
            s,
            episode_sequence(&episode(&TURNS[..1], Some(&tokenizer), 1), &tokenizer).unwrap()
        );
        assert_eq!(s.loss_mask.last(), Some(&0));
    }

    #[test]
    fn inconsistent_episodes_are_errors() {
        let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
        let mut chat = episode(&TURNS, None, 5);
        chat.response_text = chat.response_text.replace("Capital", "Kapital");
        let err = episode_sequence(&chat, &tokenizer).unwrap_err();
        assert!(err.0.contains("turn 1"), "{err}");

        let local = episode(&TURNS, Some(&tokenizer), 5);
        let mut short_mask = local.clone();
        short_mask.loss_mask.pop();
        assert!(episode_sequence(&short_mask, &tokenizer)
            .unwrap_err()
            .0.contains("loss_mask"));
        let mut other_tokenizer = local.clone();
        other_tokenizer.prompt_text = other_tokenizer.prompt_text.replace("Ask", "Tell");
        assert!(episode_sequence(&other_tokenizer, &tokenizer)
            .unwrap_err()
            .0.contains("not this tokenizer's"));
        let mut outside = local;
        outside.token_ids[3] = 100_000;
        assert!(episode_sequence(&outside, &tokenizer).unwrap_err().0.contains("100000"));
    }
}

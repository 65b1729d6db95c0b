//! The author of the demo's protocol demonstrations: a scripted agent that writes each
//! episode's turns as a chat-API agent would (text only, no tokens), through the real episode
//! loop, so its call reaches the served large LLM and its answer copies the real reply. Some
//! demonstrations are deliberately imperfect, so that the cold-started agent has room to improve.

use env::{estimate_tokens, Agent, AgentContext, AgentError, EnvironmentTokens, TurnEnd, TurnText};

/// How one demonstration goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demonstration {
    /// Asks the large LLM the question, then answers with its reply (what the reward wants).
    Good,
    /// Asks, then answers "I do not know" (well-formed, no answer: reward 0).
    Unsure,
    /// Answers "I do not know" without asking (no call fails the format gate: reward −0.4).
    Alone,
    /// Asks without closing `<think>` (the call turn loses its format score: reward −0.4),
    /// then answers with the reply.
    Malformed,
    /// Neither asks nor answers (no format term at all: reward −1).
    Ramble,
}

impl Demonstration {
    /// The kinds of the three demonstrations of question `i`: one good and two imperfect ones,
    /// the imperfect kinds taken in turn, so that a third of them are good.
    pub fn for_question(i: usize) -> [Demonstration; 3] {
        const IMPERFECT: [Demonstration; 4] = [
            Demonstration::Unsure,
            Demonstration::Alone,
            Demonstration::Malformed,
            Demonstration::Ramble,
        ];
        let n = IMPERFECT.len();
        [Demonstration::Good, IMPERFECT[i % n], IMPERFECT[(i + 1) % n]]
    }

    /// The text of the turn after `replies` (the large LLM's replies so far).
    fn turn(self, question: &str, replies: &[&str]) -> String {
        let call = |think_close: &str| {
            format!("<think>\nI ask.\n{think_close}<interaction_prompt>\n{question}\n</interaction_prompt>")
        };
        let answer = |thought: &str, answer: &str| format!("{thought}\n</think>\n<answer>\n{answer}\n</answer>");
        match (self, replies.last()) {
            (Demonstration::Alone, _) => {
                "<think>\nI answer alone.\n</think>\n<answer>\nI do not know\n</answer>".to_owned()
            }
            (Demonstration::Ramble, _) => "<think>\nI am not sure what to do.\n</think>".to_owned(),
            (Demonstration::Malformed, None) => call(""),
            (_, None) => call("</think>\n"),
            (Demonstration::Unsure, Some(_)) => answer("I doubt it.", "I do not know"),
            (_, Some(reply)) => answer("It says so.", reply),
        }
    }
}

/// Writes the turns of episode `i` as `script[i]` says.
pub struct Teacher {
    pub script: Vec<Demonstration>,
}

impl Agent for Teacher {
    fn begin_episode(&mut self, ctx: &mut AgentContext) -> Result<(), AgentError> {
        if ctx.index() >= self.script.len() {
            return Err(AgentError::Model(format!(
                "no demonstration scripted for episode {}",
                ctx.index()
            )));
        }
        Ok(())
    }

    fn generate_turns(&mut self, episodes: &mut [&mut AgentContext]) -> Vec<Result<TurnText, AgentError>> {
        episodes
            .iter()
            .map(|ctx| {
                let replies: Vec<&str> = ctx.exchanges().iter().map(|e| e.reply.as_str()).collect();
                let text = self.script[ctx.index()].turn(ctx.question(), &replies);
                Ok(TurnText {
                    tokens: estimate_tokens(&text),
                    text,
                    end: TurnEnd::StopString,
                })
            })
            .collect()
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        Ok(EnvironmentTokens::Estimated(estimate_tokens(text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use env::{ChatMessage, EnvError, Environment, EpisodeConfig, StopReason};
    use rewards::{RewardBreakdown, RewardConfig};

    struct Oslo;

    impl Environment for Oslo {
        fn complete(&self, _messages: &[ChatMessage]) -> Result<String, EnvError> {
            Ok("Oslo".into())
        }
    }

    /// Each kind of demonstration gets the reward it is meant to get, through the real loop
    /// and the real reward: 1, 0, −0.4, −0.4 and −1.
    #[test]
    fn demonstrations_score_as_intended() {
        let kinds = [
            Demonstration::Good,
            Demonstration::Unsure,
            Demonstration::Alone,
            Demonstration::Malformed,
            Demonstration::Ramble,
        ];
        let mut teacher = Teacher { script: kinds.to_vec() };
        let questions = ["Capital of Norway?"; 5];
        let episodes = env::run_episodes(&mut teacher, &Oslo, &questions, &EpisodeConfig::default());
        let stops: Vec<StopReason> = episodes.iter().map(|e| e.stop_reason).collect();
        assert_eq!(
            stops,
            [[StopReason::Answer; 4].as_slice(), &[StopReason::NoCall]].concat()
        );
        let rewards: Vec<f32> = episodes
            .iter()
            .map(|e| {
                RewardBreakdown::from_text(&e.context_text(), &["Oslo".to_owned()], &RewardConfig::default()).reward
                    as f32
            })
            .collect();
        let expected = [1.0, 0.0, -0.4, -0.4, -1.0];
        assert!(
            rewards.iter().zip(expected).all(|(r, e)| (r - e).abs() < 1e-6),
            "{rewards:?}"
        );
        assert_eq!(episodes[0].turns[0].prompt.as_deref(), Some("Capital of Norway?"));
        assert_eq!(episodes[0].answer.as_deref(), Some("Oslo"));
        let third = [Demonstration::Good, Demonstration::Ramble, Demonstration::Unsure];
        assert_eq!(Demonstration::for_question(7), third);
    }
}

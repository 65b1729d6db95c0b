//! An agent served behind an OpenAI-compatible API (e.g. the trained agent on vLLM or
//! `prompt-r1 serve`), driven with text only.

use crate::agent::{estimate_tokens, Agent, AgentContext, AgentError, EnvironmentTokens, TurnEnd, TurnText};
use crate::chat::{ChatMessage, ChatReply, SamplingParams};
use crate::client::OpenAiClient;
use crate::parallel::ParallelRunner;
use crate::reply::{environment_text, response_message, NEXT_TURN_PREFIX};
use crate::turn::{ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE, CALL_OPEN, THINK_OPEN};

/// Which endpoint a [`RemoteAgent`] is driven through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AgentApi {
    /// `…/completions` with the raw ChatML context the agent was trained on: the first prompt,
    /// every earlier turn whole (its `<think>` included) and every reply, exactly as the local
    /// agent's tokens read (see [`RemoteAgent::completion_prompt`]).
    #[default]
    Completions,
    /// `…/chat/completions` with the context as messages. The server's chat template decides
    /// what the agent sees: Qwen3's stock template drops the `<think>` of earlier turns, so the
    /// agent then sees another context than in training.
    Chat,
}

/// Drives a remote agent through a completions or chat API.
///
/// With [`AgentApi::Completions`] each turn sends the context as one raw text. With
/// [`AgentApi::Chat`] it sends the first prompt, then for every earlier call the agent's turn
/// as an assistant message and `<interaction_response>\nREPLY\n</interaction_response>` as a
/// user message. Generation stops after `</interaction_prompt>` or `</answer>` (the stop string,
/// which servers leave out, is put back). Reasoning returned apart from the content is put
/// back into `<think>…</think>`. A leading `<think>` is folded into the turn prefix the local
/// model would have been given, so trajectories read the same for both kinds of agent.
#[derive(Debug)]
pub struct RemoteAgent {
    client: OpenAiClient,
    sampling: SamplingParams,
    api: AgentApi,
}

impl RemoteAgent {
    /// An agent behind `client`'s chat endpoint, sampled with `sampling` (its `max_tokens` is
    /// replaced by each turn's budget and its stop strings by the turn-ending tags).
    pub fn new(client: OpenAiClient, sampling: SamplingParams) -> Self {
        Self {
            client,
            sampling,
            api: AgentApi::Chat,
        }
    }

    /// The same agent, driven through `api`.
    pub fn with_api(self, api: AgentApi) -> Self {
        Self { api, ..self }
    }

    /// The raw text of the coming turn's context, as the local agent's tokens decode: the
    /// first prompt in ChatML, each earlier turn whole followed by the environment's text, and
    /// the turn prefix (`<think>\n` after a reply).
    pub fn completion_prompt(ctx: &AgentContext) -> String {
        let mut text = ctx.prompt().chatml();
        for exchange in ctx.exchanges() {
            text.push_str(&exchange.turn_text);
            let reply = environment_text(&exchange.shown_reply, false);
            text.push_str(reply.strip_suffix(NEXT_TURN_PREFIX).unwrap_or(&reply));
        }
        text.push_str(ctx.turn_prefix());
        text
    }

    /// The client (for its counters).
    pub fn client(&self) -> &OpenAiClient {
        &self.client
    }

    /// The chat messages for the coming turn of `ctx`.
    pub fn messages(ctx: &AgentContext) -> Vec<ChatMessage> {
        let mut messages = ctx.prompt().messages();
        for exchange in ctx.exchanges() {
            messages.push(ChatMessage::assistant(&exchange.turn_text));
            messages.push(ChatMessage::user(response_message(&exchange.shown_reply)));
        }
        messages
    }
}

impl Agent for RemoteAgent {
    fn begin_episode(&mut self, _ctx: &mut AgentContext) -> Result<(), AgentError> {
        Ok(())
    }

    fn generate_turns(
        &mut self,
        episodes: &mut [&mut AgentContext],
    ) -> Vec<Result<TurnText, AgentError>> {
        let requests: Vec<(Request, SamplingParams, &'static str)> = episodes
            .iter()
            .map(|ctx| {
                let params = SamplingParams {
                    max_tokens: Some(u32::try_from(ctx.turn_budget()).unwrap_or(u32::MAX)),
                    stop: vec![CALL_CLOSE.to_string(), ANSWER_CLOSE.to_string()],
                    ..self.sampling.clone()
                };
                let request = match self.api {
                    AgentApi::Completions => Request::Text(Self::completion_prompt(ctx)),
                    AgentApi::Chat => Request::Messages(Self::messages(ctx)),
                };
                (request, params, ctx.turn_prefix())
            })
            .collect();
        let client = &self.client;
        ParallelRunner::new(client.config().max_concurrency).map(
            &requests,
            |_, (request, params, prefix)| {
                let reply = match request {
                    Request::Text(prompt) => client.complete_text(prompt, params)?,
                    Request::Messages(messages) => client.chat(messages, params)?,
                };
                Ok(turn_from_reply(reply, prefix))
            },
        )
    }

    fn environment_tokens(&mut self, text: &str) -> Result<EnvironmentTokens, AgentError> {
        Ok(EnvironmentTokens::Estimated(estimate_tokens(text)))
    }
}

/// What one turn sends.
enum Request {
    Text(String),
    Messages(Vec<ChatMessage>),
}

/// Turns a chat reply into the generated text after `prefix`.
fn turn_from_reply(reply: ChatReply, prefix: &str) -> TurnText {
    let mut text = match reply
        .reasoning
        .as_deref()
        .map(str::trim)
        .filter(|r| !r.is_empty())
    {
        Some(reasoning) => format!(
            "<think>\n{reasoning}\n</think>\n\n{}",
            reply.content.trim_start_matches('\n')
        ),
        None => reply.content,
    };
    let end = if reply.finish_reason.as_deref() == Some("length") {
        TurnEnd::Length
    } else if close_open_tag(&mut text) || ends_with_closing_tag(&text) {
        TurnEnd::StopString
    } else {
        TurnEnd::ImEnd
    };
    let tokens = reply
        .usage
        .and_then(|usage| usize::try_from(usage.completion_tokens).ok())
        .unwrap_or_else(|| estimate_tokens(&text));
    let text = strip_prefix(text, prefix);
    TurnText { text, tokens, end }
}

/// Puts back a closing tag the server removed as a stop string; says whether it did.
fn close_open_tag(text: &mut String) -> bool {
    let open_call = text
        .rfind(CALL_OPEN)
        .filter(|&at| !text[at..].contains(CALL_CLOSE));
    let open_answer = text
        .rfind(ANSWER_OPEN)
        .filter(|&at| !text[at..].contains(ANSWER_CLOSE));
    let close = match (open_call, open_answer) {
        (Some(call), Some(answer)) => Some(if call > answer {
            CALL_CLOSE
        } else {
            ANSWER_CLOSE
        }),
        (Some(_), None) => Some(CALL_CLOSE),
        (None, Some(_)) => Some(ANSWER_CLOSE),
        (None, None) => None,
    };
    match close {
        Some(tag) => {
            text.push_str(tag);
            true
        }
        None => false,
    }
}

fn ends_with_closing_tag(text: &str) -> bool {
    let text = text.trim_end();
    text.ends_with(CALL_CLOSE) || text.ends_with(ANSWER_CLOSE)
}

/// The part of a full turn text after the context's turn prefix: with the prefix `<think>\n`,
/// a reply that opens with `<think>` itself continues after it.
fn strip_prefix(text: String, prefix: &str) -> String {
    if prefix.is_empty() {
        return text;
    }
    match text.strip_prefix(THINK_OPEN) {
        Some(rest) if prefix.trim_end() == THINK_OPEN => {
            rest.strip_prefix('\n').unwrap_or(rest).to_string()
        }
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::Exchange;
    use crate::chat::Usage;
    use crate::prompts::FirstPrompt;

    fn reply(content: &str, reasoning: Option<&str>, finish: &str) -> ChatReply {
        ChatReply {
            content: content.into(),
            reasoning: reasoning.map(str::to_string),
            finish_reason: Some(finish.into()),
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 7,
            }),
            model: None,
        }
    }

    #[test]
    fn stop_string_is_put_back() {
        let turn = turn_from_reply(
            reply("<think>a</think>\n<interaction_prompt>q", None, "stop"),
            "",
        );
        assert_eq!(
            turn.text,
            "<think>a</think>\n<interaction_prompt>q</interaction_prompt>"
        );
        assert_eq!((turn.end, turn.tokens), (TurnEnd::StopString, 7));
        let turn = turn_from_reply(reply("<think>a</think><answer>x", None, "stop"), "");
        assert!(turn.text.ends_with("<answer>x</answer>"));
    }

    #[test]
    fn natural_end_and_length() {
        let turn = turn_from_reply(reply("<think>a</think> nothing", None, "stop"), "");
        assert_eq!(turn.end, TurnEnd::ImEnd);
        let turn = turn_from_reply(reply("<think>a", None, "length"), "");
        assert_eq!(turn.end, TurnEnd::Length);
        let turn = turn_from_reply(reply("<answer>x</answer>", None, "stop"), "");
        assert_eq!(turn.end, TurnEnd::StopString);
    }

    #[test]
    fn reasoning_is_folded_back_and_prefix_removed() {
        let turn = turn_from_reply(reply("\n<answer>4", Some("\n2+2\n"), "stop"), "<think>\n");
        assert_eq!(turn.text, "2+2\n</think>\n\n<answer>4</answer>");
        let turn = turn_from_reply(reply("<think>\nx</think>", None, "stop"), "<think>\n");
        assert_eq!(turn.text, "x</think>");
        let turn = turn_from_reply(reply("no think", None, "stop"), "<think>\n");
        assert_eq!(turn.text, "no think");
    }

    #[test]
    fn the_completion_prompt_is_the_training_context() {
        let prompt = FirstPrompt {
            system: "S".into(),
            user: "U".into(),
        };
        let mut ctx = AgentContext::new(0, "q", prompt);
        assert_eq!(
            RemoteAgent::completion_prompt(&ctx),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        );
        ctx.push_exchange(
            Exchange {
                turn_text: "<think>t</think><interaction_prompt>p</interaction_prompt>".into(),
                prompt: "p".into(),
                reply: "r".into(),
                shown_reply: "{\"results\": [\"r\"]}".into(),
            },
            "<think>\n",
        );
        ctx.push_exchange(
            Exchange {
                turn_text: "<think>\nu</think><interaction_prompt>p2</interaction_prompt>".into(),
                prompt: "p2".into(),
                reply: "r2".into(),
                shown_reply: "{\"results\": [\"r2\"]}".into(),
            },
            "<think>\n",
        );
        // Earlier turns whole, `<think>` included (Qwen3's chat template would drop it), each
        // reply framed as the local agent's context holds it, and the open `<think>\n`.
        assert_eq!(
            RemoteAgent::completion_prompt(&ctx),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n\
             <think>t</think><interaction_prompt>p</interaction_prompt><|im_end|>\n\
             <|im_start|>user\n<interaction_response>\n{\"results\": [\"r\"]}\n</interaction_response><|im_end|>\n\
             <|im_start|>assistant\n<think>\nu</think><interaction_prompt>p2</interaction_prompt><|im_end|>\n\
             <|im_start|>user\n<interaction_response>\n{\"results\": [\"r2\"]}\n</interaction_response><|im_end|>\n\
             <|im_start|>assistant\n<think>\n"
        );
    }

    #[test]
    fn messages_replay_earlier_turns() {
        let prompt = FirstPrompt {
            system: "S".into(),
            user: "U".into(),
        };
        let mut ctx = AgentContext::new(0, "q", prompt);
        ctx.push_exchange(
            Exchange {
                turn_text: "<think>t</think><interaction_prompt>p</interaction_prompt>".into(),
                prompt: "p".into(),
                reply: "r".into(),
                shown_reply: "{\"results\": [\"r\"]}".into(),
            },
            "<think>\n",
        );
        let messages = RemoteAgent::messages(&ctx);
        assert_eq!(
            messages,
            vec![
                ChatMessage::system("S"),
                ChatMessage::user("U"),
                ChatMessage::assistant(
                    "<think>t</think><interaction_prompt>p</interaction_prompt>"
                ),
                ChatMessage::user(
                    "<interaction_response>\n{\"results\": [\"r\"]}\n</interaction_response>"
                ),
            ]
        );
    }
}

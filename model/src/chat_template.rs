//! The Qwen3 chat template (ChatML with hybrid thinking), implemented in Rust.
//!
//! [`render_qwen3`] produces exactly what the Jinja template in Qwen3's
//! `tokenizer_config.json` ([`QWEN3_CHAT_TEMPLATE`]) renders through Hugging Face's
//! `apply_chat_template` for `system`/`user`/`assistant` messages:
//! - a leading system message, then each message as `<|im_start|>role\n…<|im_end|>\n`;
//! - `add_generation_prompt` appends `<|im_start|>assistant\n`, and with
//!   `enable_thinking = false` also an empty `<think>\n\n</think>\n\n`;
//! - an assistant message's reasoning comes from `reasoning_content`, or else is split out of
//!   `<think>…</think>` in its content. Reasoning is shown only for assistant messages after
//!   the last user query (the last user message that is not a `<tool_response>…</tool_response>`):
//!   the final message always gets a `<think>` block (empty if it has no reasoning), earlier
//!   ones only when their reasoning is non-empty. Older assistant turns lose their reasoning.
//!
//! Not supported: tools (the `tools` argument, `tool` messages and `tool_calls`), which
//! Prompt-R1 does not use; its environment replies are plain text inside the agent's context.
//! An empty message list renders only the generation prompt (the Jinja template errors).

use std::ops::Range;
use std::path::{Path, PathBuf};

pub use chat::{ChatMessage, Role};

use crate::tokenizer::{Qwen3Tokenizer, TokenizerError};

/// The chat template text of Qwen3's `tokenizer_config.json` (hybrid thinking, with tools).
pub const QWEN3_CHAT_TEMPLATE: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"##;

/// File holding the chat template under the key `chat_template`.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// File in which newer `transformers` versions save the chat template instead.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// Errors from loading a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The file could not be read.
    #[error("cannot read chat template file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("cannot parse {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// `tokenizer_config.json` has no key `chat_template`.
    #[error("{path} has no key \"chat_template\"")]
    MissingTemplate { path: PathBuf },
    /// `tokenizer_config.json` has `chat_template`, but not as text (a number, a list, ...).
    #[error("{path}: \"chat_template\" is {found}, not the template's text")]
    NotText { path: PathBuf, found: &'static str },
    /// The template is not one this crate implements.
    #[error("chat template in {path} is not the Qwen3 hybrid-thinking ChatML template")]
    Unsupported { path: PathBuf },
}

/// Template switches; the default matches `apply_chat_template`'s defaults
/// (no generation prompt, thinking enabled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderOptions {
    /// Append the header of a new assistant turn.
    pub add_generation_prompt: bool,
    /// With `false` (and a generation prompt), pre-fill an empty reasoning block.
    pub enable_thinking: bool,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: false,
            enable_thinking: true,
        }
    }
}

impl RenderOptions {
    /// Options for prompting the model: a generation prompt, thinking on or off.
    pub fn generation(enable_thinking: bool) -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking,
        }
    }
}

/// A chat template this crate can render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTemplate {
    /// Qwen3 hybrid-thinking ChatML (see the module docs).
    Qwen3,
}

impl ChatTemplate {
    /// Recognises a Jinja template text by the markers of the Qwen3 hybrid-thinking
    /// template: ChatML tokens, `</think>`, `enable_thinking` and `last_query_index`
    /// ([`QWEN3_CHAT_TEMPLATE`] and its later revisions, which differ in tool handling).
    pub fn recognise(template: &str) -> Option<Self> {
        let qwen3_markers = [
            "<|im_start|>",
            "<|im_end|>",
            "</think>",
            "enable_thinking",
            "last_query_index",
        ];
        qwen3_markers
            .iter()
            .all(|m| template.contains(m))
            .then_some(ChatTemplate::Qwen3)
    }

    /// Reads the template of a model directory: `chat_template.jinja` if present (newer
    /// `transformers`), else `chat_template` in `tokenizer_config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ChatTemplateError> {
        let jinja = dir.as_ref().join(CHAT_TEMPLATE_FILE);
        if jinja.is_file() {
            let text = read(&jinja)?;
            return Self::recognise(&text).ok_or(ChatTemplateError::Unsupported { path: jinja });
        }
        Self::from_tokenizer_config(dir.as_ref().join(TOKENIZER_CONFIG_FILE))
    }

    /// Reads `chat_template` from a `tokenizer_config.json` file.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, ChatTemplateError> {
        let path = path.as_ref().to_path_buf();
        let config: serde_json::Value =
            serde_json::from_str(&read(&path)?).map_err(|source| ChatTemplateError::Parse {
                path: path.clone(),
                source,
            })?;
        let text = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => {
                return Err(ChatTemplateError::MissingTemplate { path })
            }
            Some(serde_json::Value::String(text)) => text,
            Some(other) => {
                let found = match other {
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    serde_json::Value::Array(_) => "a list",
                    _ => "an object",
                };
                return Err(ChatTemplateError::NotText { path, found });
            }
        };
        Self::recognise(text).ok_or(ChatTemplateError::Unsupported { path })
    }

    /// Renders messages to the prompt text.
    pub fn render(&self, messages: &[ChatMessage], options: RenderOptions) -> String {
        match self {
            ChatTemplate::Qwen3 => render_qwen3(messages, options),
        }
    }

    /// Renders messages and says where the assistant messages' text lies in the result (see
    /// [`RenderedChat`]).
    pub fn render_with_spans(
        &self,
        messages: &[ChatMessage],
        options: RenderOptions,
    ) -> RenderedChat {
        match self {
            ChatTemplate::Qwen3 => render_qwen3_with_spans(messages, options),
        }
    }

    /// Renders messages and encodes the text (special tokens map to their ids).
    pub fn encode(
        &self,
        tokenizer: &Qwen3Tokenizer,
        messages: &[ChatMessage],
        options: RenderOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        tokenizer.encode(&self.render(messages, options))
    }
}

fn read(path: &Path) -> Result<String, ChatTemplateError> {
    std::fs::read_to_string(path).map_err(|source| ChatTemplateError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A rendered conversation with the byte ranges of what its assistant messages contribute: each
/// span runs from just after `<|im_start|>assistant\n` to just after the message's `<|im_end|>`
/// (the text a model writes for that turn, its reasoning block included, and the token that ends
/// it), in message order. Fine-tuning on assistant tokens only marks the tokens inside them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    /// The rendered text.
    pub text: String,
    /// Byte ranges of `text`, one per assistant message.
    pub assistant_spans: Vec<Range<usize>>,
}

/// Renders messages with the Qwen3 chat template (see the module docs for the rules).
pub fn render_qwen3(messages: &[ChatMessage], options: RenderOptions) -> String {
    render_qwen3_with_spans(messages, options).text
}

/// [`render_qwen3`], with the assistant messages' spans.
pub fn render_qwen3_with_spans(messages: &[ChatMessage], options: RenderOptions) -> RenderedChat {
    let mut out = String::new();
    let mut spans = Vec::new();
    let mut push_turn = |out: &mut String, role: Role, body: &str| {
        out.push_str("<|im_start|>");
        out.push_str(role.as_str());
        out.push('\n');
        let start = out.len();
        out.push_str(body);
        out.push_str("<|im_end|>");
        if role == Role::Assistant {
            spans.push(start..out.len());
        }
        out.push('\n');
    };
    if let Some(first) = messages.first().filter(|m| m.role == Role::System) {
        push_turn(&mut out, Role::System, &first.content);
    }
    let last_query_index = messages
        .iter()
        .rposition(|m| m.role == Role::User && !is_tool_response(&m.content))
        .unwrap_or(messages.len().saturating_sub(1));
    let last = messages.len().saturating_sub(1);
    for (index, message) in messages.iter().enumerate() {
        match message.role {
            Role::System if index == 0 => {}
            Role::System | Role::User => push_turn(&mut out, message.role, &message.content),
            Role::Assistant => {
                let (content, reasoning) = split_reasoning(message);
                let show_reasoning =
                    index > last_query_index && (index == last || !reasoning.is_empty());
                let body = if show_reasoning {
                    format!(
                        "<think>\n{}\n</think>\n\n{}",
                        reasoning.trim_matches('\n'),
                        content.trim_start_matches('\n')
                    )
                } else {
                    content.to_string()
                };
                push_turn(&mut out, Role::Assistant, &body);
            }
        }
    }
    if options.add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
        if !options.enable_thinking {
            out.push_str("<think>\n\n</think>\n\n");
        }
    }
    RenderedChat {
        text: out,
        assistant_spans: spans,
    }
}

/// A user message the template treats as a tool result rather than a query.
fn is_tool_response(content: &str) -> bool {
    content.starts_with("<tool_response>") && content.ends_with("</tool_response>")
}

/// An assistant message's (content, reasoning), following the template's string rules.
fn split_reasoning(message: &ChatMessage) -> (&str, &str) {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    let content = message.content.as_str();
    if let Some(reasoning) = &message.reasoning_content {
        return (content, reasoning);
    }
    let (Some(first_close), Some(last_close)) = (content.find(CLOSE), content.rfind(CLOSE)) else {
        return (content, "");
    };
    let answer = content[last_close + CLOSE.len()..].trim_start_matches('\n');
    let before = content[..first_close].trim_end_matches('\n');
    let reasoning = before
        .rfind(OPEN)
        .map_or(before, |i| &before[i + OPEN.len()..])
        .trim_start_matches('\n');
    (answer, reasoning)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_is_split_out_of_content() {
        let split = |c: &str| {
            let message = ChatMessage::assistant(c);
            let (content, reasoning) = split_reasoning(&message);
            (content.to_string(), reasoning.to_string())
        };
        assert_eq!(
            split("<think>\nabc\n</think>\n\nanswer"),
            ("answer".into(), "abc".into())
        );
        assert_eq!(split("no tags"), ("no tags".into(), "".into()));
        assert_eq!(split("r\n</think>a</think>\nb"), ("b".into(), "r".into()));
        assert_eq!(
            split("x<think>y<think>\nz</think>w"),
            ("w".into(), "z".into())
        );
        let given = ChatMessage::assistant_with_reasoning("<think>t</think>c", "r");
        assert_eq!(split_reasoning(&given), ("<think>t</think>c", "r"));
    }

    #[test]
    fn prompt_r1_context_renders_as_chatml() {
        let messages = [ChatMessage::system("S"), ChatMessage::user("Question: q")];
        assert_eq!(
            render_qwen3(&messages, RenderOptions::generation(true)),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQuestion: q<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(render_qwen3(&messages, RenderOptions::generation(false))
            .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert_eq!(render_qwen3(&[], RenderOptions::default()), "");
    }

    #[test]
    fn spans_cover_each_assistant_body_and_its_im_end() {
        let messages = [
            ChatMessage::system("S"),
            ChatMessage::user("q1"),
            ChatMessage::assistant("<think>\nr1\n</think>\n\na1"),
            ChatMessage::user("q2"),
            ChatMessage::assistant("a2"),
        ];
        let rendered = render_qwen3_with_spans(&messages, RenderOptions::default());
        assert_eq!(
            rendered.text,
            render_qwen3(&messages, RenderOptions::default())
        );
        let pieces: Vec<&str> = rendered
            .assistant_spans
            .iter()
            .map(|r| &rendered.text[r.clone()])
            .collect();
        // The earlier turn loses its reasoning (it precedes the last query); the last one shows
        // an empty reasoning block, as Qwen3's template renders them.
        assert_eq!(
            pieces,
            ["a1<|im_end|>", "<think>\n\n</think>\n\na2<|im_end|>"]
        );
        let prompt_only = render_qwen3_with_spans(&messages[..2], RenderOptions::generation(true));
        assert!(prompt_only.assistant_spans.is_empty());
    }

    #[test]
    fn recognises_only_qwen3_templates() {
        assert_eq!(
            ChatTemplate::recognise(QWEN3_CHAT_TEMPLATE),
            Some(ChatTemplate::Qwen3)
        );
        let chatml_without_thinking = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        assert_eq!(ChatTemplate::recognise(chatml_without_thinking), None);
    }

    #[test]
    fn loads_from_config_or_jinja_file_with_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join(TOKENIZER_CONFIG_FILE);
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Read { .. }), "{err}");
        assert!(err.to_string().contains(TOKENIZER_CONFIG_FILE), "{err}");

        std::fs::write(&config, "{\"eos_token\": \"<|im_end|>\"}").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(err, ChatTemplateError::MissingTemplate { .. }),
            "{err}"
        );

        std::fs::write(&config, "{\"chat_template\": 5}").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(err, ChatTemplateError::NotText { found: "a number", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("is a number, not the template's text"), "{err}");

        std::fs::write(&config, "{\"chat_template\": \"{{ messages }}\"}").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(err, ChatTemplateError::Unsupported { .. }),
            "{err}"
        );

        std::fs::write(&config, "{\"chat_template\": ").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Parse { .. }), "{err}");

        std::fs::write(dir.path().join(CHAT_TEMPLATE_FILE), QWEN3_CHAT_TEMPLATE).unwrap();
        assert_eq!(
            ChatTemplate::from_dir(dir.path()).unwrap(),
            ChatTemplate::Qwen3
        );
    }
}

//! Tokenizer, chat template and tiny tokenizer checks. The Qwen3 checks compare against
//! `../shared/tokenizer/qwen3/reference_encodings.json` (Hugging Face outputs); they are
//! skipped with a message when `shared/` is absent, except under `CI=true` where that fails.

use std::path::PathBuf;
use std::sync::OnceLock;

use prompt_r1_model::chat_template::{
    render_qwen3, ChatMessage, ChatTemplate, RenderOptions, Role, QWEN3_CHAT_TEMPLATE,
};
use prompt_r1_model::tiny_tokenizer::{
    train_tiny_tokenizer, write_tokenizer_files, TinyTokenizerError, QWEN3_ADDED_TOKENS,
    TINY_VOCAB_SIZE,
};
use prompt_r1_model::tokenizer::{Encoded, Qwen3Tokenizer, PREFIX_BYTES_PER_TOKEN};
use serde_json::Value;

/// `shared/tokenizer/qwen3`: from `PROMPT_R1_SHARED`, else `<workspace root>/../shared`.
fn qwen3_dir() -> Option<PathBuf> {
    let shared = std::env::var_os("PROMPT_R1_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let dir = shared.join("tokenizer/qwen3");
    if dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    let reason = format!("{} has no tokenizer.json", dir.display());
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI=true but {reason}");
    }
    eprintln!("skipping: {reason} (set PROMPT_R1_SHARED to the shared/ folder)");
    None
}

/// The real Qwen3 tokenizer and the reference file, loaded once for all tests.
fn qwen3() -> Option<&'static (Qwen3Tokenizer, Value)> {
    static LOADED: OnceLock<Option<(Qwen3Tokenizer, Value)>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let dir = qwen3_dir()?;
            let tokenizer = Qwen3Tokenizer::from_dir(&dir).expect("load Qwen3 tokenizer.json");
            let text = std::fs::read_to_string(dir.join("reference_encodings.json"))
                .expect("read reference_encodings.json");
            Some((
                tokenizer,
                serde_json::from_str(&text).expect("parse reference"),
            ))
        })
        .as_ref()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("id list")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn qwen3_encodings_match_reference() {
    let Some((tok, reference)) = qwen3() else {
        return;
    };
    let encodings = reference["encodings"].as_array().expect("encodings");
    assert_eq!(encodings.len(), 10);
    for case in encodings {
        let text = case["text"].as_str().expect("text");
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&case["ids"]), "ids of {text:?}");
        let pieces: Vec<String> = got.iter().map(|&id| tok.token(id).unwrap()).collect();
        let expected: Vec<&str> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(pieces, expected, "tokens of {text:?}");
        assert_eq!(
            tok.decode(&got, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
}

#[test]
fn qwen3_special_token_ids() {
    let Some((tok, reference)) = qwen3() else {
        return;
    };
    let s = tok.special();
    assert_eq!(s.endoftext, 151643);
    assert_eq!(s.im_start, 151644);
    assert_eq!(s.im_end, 151645);
    assert_eq!(s.think, Some(151667));
    assert_eq!(s.end_think, Some(151668));
    let info = &reference["info"];
    assert_eq!(
        tok.vocab_size() as u64,
        info["vocab_size_with_added"].as_u64().unwrap()
    );
    for (token, id) in info["special_ids"].as_object().unwrap() {
        assert_eq!(
            tok.token_id(token),
            Some(id.as_u64().unwrap() as u32),
            "{token}"
        );
        assert_eq!(
            tok.encode(token).unwrap(),
            vec![id.as_u64().unwrap() as u32],
            "{token}"
        );
    }
    for entry in info["added_tokens"].as_array().unwrap() {
        let (id, content) = (
            entry[0].as_u64().unwrap() as u32,
            entry[1].as_str().unwrap(),
        );
        assert_eq!(tok.token(id).as_deref(), Some(content));
    }
}

#[test]
fn qwen3_decode_skips_only_special_tokens() {
    let Some((tok, _)) = qwen3() else { return };
    let text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n4<|im_end|>";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "assistant\n<think>\nhm\n</think>\n\n4"
    );
}

/// The messages behind the reference renderings (system + user; the multi-turn case adds
/// an assistant reply with reasoning and a follow-up, and its reasoning must disappear).
fn reference_conversation(name: &str) -> (Vec<ChatMessage>, RenderOptions) {
    let mut messages = vec![
        ChatMessage::system("You are a helpful assistant."),
        ChatMessage::user("What is 17 * 23? Answer with a number."),
    ];
    let options = match name {
        "enable_thinking=True" => RenderOptions::generation(true),
        "enable_thinking=False" => RenderOptions::generation(false),
        "multi_turn_history_strips_old_think" => {
            messages.push(ChatMessage::assistant(
                "<think>\n17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391.\n</think>\n\n391",
            ));
            messages.push(ChatMessage::user("Thanks"));
            RenderOptions::generation(true)
        }
        other => panic!("reference rendering {other:?} has no known conversation"),
    };
    (messages, options)
}

#[test]
fn qwen3_chat_renderings_match_reference() {
    let Some((tok, reference)) = qwen3() else {
        return;
    };
    let renderings = reference["chat_template_renderings"].as_object().unwrap();
    assert_eq!(renderings.len(), 3);
    for (name, expected) in renderings {
        let (messages, options) = reference_conversation(name);
        let text = render_qwen3(&messages, options);
        assert_eq!(text, expected["text"].as_str().unwrap(), "{name}");
        let got = ChatTemplate::Qwen3.encode(tok, &messages, options).unwrap();
        assert_eq!(got, ids(&expected["ids"]), "{name}");
    }
}

#[test]
fn qwen3_template_text_is_the_shared_one() {
    let Some(dir) = qwen3_dir() else { return };
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["chat_template"].as_str(), Some(QWEN3_CHAT_TEMPLATE));
    assert_eq!(ChatTemplate::from_dir(&dir).unwrap(), ChatTemplate::Qwen3);
}

/// A conversation rendered by jinja2 3.1.6 from Qwen3's template with the environment
/// `apply_chat_template` uses (sandboxed, `trim_blocks`, `lstrip_blocks`).
struct JinjaCase {
    name: &'static str,
    messages: Vec<ChatMessage>,
    options: RenderOptions,
    expected: &'static str,
}

fn jinja_cases() -> Vec<JinjaCase> {
    vec![
        JinjaCase {
            name: "no_system_thinking_default",
            messages: vec![
                ChatMessage::new(Role::User, "Hi"),
            ],
            options: RenderOptions {
                add_generation_prompt: true,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        },
        JinjaCase {
            name: "no_generation_prompt_thinking_off",
            messages: vec![
                ChatMessage::new(Role::User, "Hi"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: false,
            },
            expected: "<|im_start|>user\nHi<|im_end|>\n",
        },
        JinjaCase {
            name: "current_turn_assistant_keeps_think",
            messages: vec![
                ChatMessage::new(Role::System, "Sys"),
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::Assistant, "<think>\nreason here\n</think>\n\nfinal"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nreason here\n</think>\n\nfinal<|im_end|>\n",
        },
        JinjaCase {
            name: "last_assistant_without_think_gets_empty_block",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::Assistant, "plain answer"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nplain answer<|im_end|>\n",
        },
        JinjaCase {
            name: "multi_step_after_last_query",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::Assistant, "<think>step one</think>call A"),
                ChatMessage::new(Role::Assistant, "no think"),
                ChatMessage::new(Role::Assistant, "last one"),
            ],
            options: RenderOptions {
                add_generation_prompt: true,
                enable_thinking: false,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nstep one\n</think>\n\ncall A<|im_end|>\n<|im_start|>assistant\nno think<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nlast one<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        },
        JinjaCase {
            name: "explicit_reasoning_content",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::assistant_with_reasoning("\n\nanswer text", "\nthought\n"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nthought\n</think>\n\nanswer text<|im_end|>\n",
        },
        JinjaCase {
            name: "explicit_reasoning_content_keeps_think_tags_in_content",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::assistant_with_reasoning("<think>x</think>y", "r"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\n<think>x</think>y<|im_end|>\n",
        },
        JinjaCase {
            name: "explicit_empty_reasoning_in_history",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::assistant_with_reasoning("<think>x</think>y", ""),
                ChatMessage::new(Role::Assistant, "z"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>x</think>y<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nz<|im_end|>\n",
        },
        JinjaCase {
            name: "several_end_think_tags",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::Assistant, "pre<think>\n\na\n\n</think>mid</think>\n\n\nc"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\na\n</think>\n\nc<|im_end|>\n",
        },
        JinjaCase {
            name: "end_think_without_start",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::Assistant, "reasoning only\n</think>\nans"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nreasoning only\n</think>\n\nans<|im_end|>\n",
        },
        JinjaCase {
            name: "system_not_first",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::System, "late system"),
                ChatMessage::new(Role::User, "Q2"),
            ],
            options: RenderOptions {
                add_generation_prompt: true,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>system\nlate system<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n",
        },
        JinjaCase {
            name: "tool_response_user_not_a_query",
            messages: vec![
                ChatMessage::new(Role::User, "Q"),
                ChatMessage::new(Role::Assistant, "<think>a</think>b"),
                ChatMessage::new(Role::User, "<tool_response>r</tool_response>"),
                ChatMessage::new(Role::Assistant, "<think>c</think>d"),
            ],
            options: RenderOptions {
                add_generation_prompt: true,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\na\n</think>\n\nb<|im_end|>\n<|im_start|>user\n<tool_response>r</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nc\n</think>\n\nd<|im_end|>\n<|im_start|>assistant\n",
        },
        JinjaCase {
            name: "history_with_thinking_off",
            messages: vec![
                ChatMessage::new(Role::System, "S"),
                ChatMessage::new(Role::User, "Q1"),
                ChatMessage::new(Role::Assistant, "<think>old</think>A1"),
                ChatMessage::new(Role::User, "Q2"),
                ChatMessage::new(Role::Assistant, "<think>new</think>A2"),
                ChatMessage::new(Role::User, "Q3"),
            ],
            options: RenderOptions {
                add_generation_prompt: true,
                enable_thinking: false,
            },
            expected: "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        },
        JinjaCase {
            name: "unicode_and_newlines",
            messages: vec![
                ChatMessage::new(Role::System, "\nSys\n"),
                ChatMessage::new(Role::User, "你好 café 🤖\n"),
                ChatMessage::new(Role::Assistant, "<think>\n\n</think>\n\nbonjour"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>system\n\nSys\n<|im_end|>\n<|im_start|>user\n你好 café 🤖\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nbonjour<|im_end|>\n",
        },
        JinjaCase {
            name: "only_system",
            messages: vec![
                ChatMessage::new(Role::System, "S"),
            ],
            options: RenderOptions {
                add_generation_prompt: true,
                enable_thinking: true,
            },
            expected: "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\n",
        },
        JinjaCase {
            name: "no_user_at_all",
            messages: vec![
                ChatMessage::new(Role::System, "S"),
                ChatMessage::new(Role::Assistant, "<think>t</think>a"),
                ChatMessage::new(Role::Assistant, "<think>u</think>b"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n",
        },
        JinjaCase {
            name: "only_tool_response_users",
            messages: vec![
                ChatMessage::new(Role::User, "<tool_response>x</tool_response>"),
                ChatMessage::new(Role::Assistant, "<think>a</think>b"),
                ChatMessage::new(Role::Assistant, "c"),
            ],
            options: RenderOptions {
                add_generation_prompt: false,
                enable_thinking: true,
            },
            expected: "<|im_start|>user\n<tool_response>x</tool_response><|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n",
        },
    ]
}

#[test]
fn chat_template_matches_jinja_renderings() {
    let cases = jinja_cases();
    assert_eq!(cases.len(), 17);
    for case in cases {
        let got = ChatTemplate::Qwen3.render(&case.messages, case.options);
        assert_eq!(got, case.expected, "case {}", case.name);
    }
}

#[test]
fn chat_messages_use_hugging_face_json_shape() {
    let messages: Vec<ChatMessage> = serde_json::from_str(
        r#"[{"role": "system", "content": "S"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"}]"#,
    )
    .unwrap();
    assert_eq!(messages[0], ChatMessage::system("S"));
    assert_eq!(messages[1], ChatMessage::assistant_with_reasoning("a", "r"));
    let err = serde_json::from_str::<ChatMessage>(r#"{"role": "tool", "content": "x"}"#);
    assert!(err.is_err(), "tool messages are not supported");
}

fn tiny() -> &'static Qwen3Tokenizer {
    static TINY: OnceLock<Qwen3Tokenizer> = OnceLock::new();
    TINY.get_or_init(|| train_tiny_tokenizer(TINY_VOCAB_SIZE).expect("train tiny tokenizer"))
}

#[test]
fn tiny_tokenizer_is_deterministic() {
    let again = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    let json = |t: &Qwen3Tokenizer| t.inner().to_string(false).unwrap();
    assert_eq!(json(tiny()), json(&again));

    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_tokenizer_files(tiny(), a.path()).unwrap();
    write_tokenizer_files(&again, b.path()).unwrap();
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        let read = |dir: &tempfile::TempDir| std::fs::read(dir.path().join(name)).unwrap();
        assert_eq!(read(&a), read(&b), "{name}");
    }
}

#[test]
fn tiny_tokenizer_round_trips_text() {
    let tok = tiny();
    let texts = [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "  leading spaces, trailing   \n\ttabs\r\nCRLF\n\n\nnewlines",
        "Numbers: 12345 and 3.14159; {\"json\": [1, 2]} fn f(x: u8) -> u8 { x }",
        "你好，世界！ Привет 🤖🚀 café naïve résumé ÿ \u{7f}\u{1}",
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nA<|im_end|>",
    ];
    for text in texts {
        let ids = tok.encode(text).unwrap();
        assert!(ids.iter().all(|&id| (id as usize) < TINY_VOCAB_SIZE));
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    let common = tok.encode("The question and the answer").unwrap();
    assert!(
        common.len() < "The question and the answer".len() / 2,
        "{common:?}"
    );
}

#[test]
fn tiny_tokenizer_has_qwen3_added_tokens_at_the_top() {
    let tok = tiny();
    assert_eq!(tok.vocab_size(), TINY_VOCAB_SIZE);
    let first = TINY_VOCAB_SIZE - QWEN3_ADDED_TOKENS.len();
    let added = tok.inner().get_added_tokens_decoder();
    for (offset, (content, special)) in QWEN3_ADDED_TOKENS.iter().enumerate() {
        let id = (first + offset) as u32;
        assert_eq!(tok.token_id(content), Some(id), "{content}");
        assert_eq!(added[&id].special, *special, "{content}");
        assert_eq!(tok.encode(content).unwrap(), vec![id], "{content}");
    }
    let s = tok.special();
    assert_eq!(
        (s.endoftext, s.im_start, s.im_end),
        (first as u32, first as u32 + 1, first as u32 + 2)
    );
    assert_eq!(s.think, Some(TINY_VOCAB_SIZE as u32 - 2));
    assert_eq!(s.end_think, Some(TINY_VOCAB_SIZE as u32 - 1));
    assert_eq!(
        tok.token_id("Ġ"),
        Some(220),
        "byte tokens in GPT-2/Qwen order"
    );
}

#[test]
fn tiny_tokenizer_files_load_back_with_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    write_tokenizer_files(tiny(), dir.path()).unwrap();
    let loaded = Qwen3Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(loaded.special(), tiny().special());
    assert_eq!(
        ChatTemplate::from_dir(dir.path()).unwrap(),
        ChatTemplate::Qwen3
    );

    let messages = [ChatMessage::system("S"), ChatMessage::user("What is 2+2?")];
    let ids = ChatTemplate::Qwen3
        .encode(&loaded, &messages, RenderOptions::generation(false))
        .unwrap();
    let s = loaded.special();
    assert_eq!(ids[0], s.im_start);
    assert_eq!(ids.iter().filter(|&&id| id == s.im_end).count(), 2);
    assert_eq!(ids.iter().filter(|&&id| Some(id) == s.end_think).count(), 1);
    assert_eq!(
        loaded.decode(&ids, false).unwrap(),
        render_qwen3(&messages, RenderOptions::generation(false))
    );
}

#[test]
fn tiny_tokenizer_rejects_impossible_sizes() {
    assert!(matches!(
        train_tiny_tokenizer(281),
        Err(TinyTokenizerError::VocabTooSmall { minimum: 282, .. })
    ));
    let tok = train_tiny_tokenizer(282).unwrap();
    assert_eq!(tok.vocab_size(), 282);
    let err = train_tiny_tokenizer(100_000).unwrap_err();
    assert!(
        matches!(err, TinyTokenizerError::CorpusExhausted { .. }),
        "{err}"
    );
}

/// The real Qwen3 tokenizer on the reference texts, repeated past the bound: a prefix that
/// `encode_at_most` refuses by is never longer than the whole text, and a text within the
/// bound is encoded whole.
#[test]
fn encode_at_most_refuses_only_texts_longer_than_allowed() {
    let Some((tokenizer, reference)) = qwen3() else { return };
    let mut refused = 0;
    for encoding in reference["encodings"].as_array().expect("encodings") {
        let text = encoding["text"].as_str().expect("text").repeat(60);
        let whole = tokenizer.encode(&text).unwrap();
        for most in [1, 4, 16, 64, whole.len() / 2, whole.len()] {
            match tokenizer.encode_at_most(&text, most).unwrap() {
                Encoded::Ids(ids) => assert_eq!(ids, whole),
                Encoded::Longer(n) => {
                    assert!(n > most && n <= whole.len(), "{n} for {most} of {}: {text:?}", whole.len());
                    refused += 1;
                }
            }
        }
        assert_eq!(tokenizer.encode_at_most(&text, whole.len()).unwrap(), Encoded::Ids(whole.clone()));
    }
    assert!(refused > 10, "only {refused} texts were refused by a prefix (of {PREFIX_BYTES_PER_TOKEN} bytes a token)");
}

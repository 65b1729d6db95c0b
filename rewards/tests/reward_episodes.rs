//! The double-constrained reward on hand-built episodes. Expected numbers are derived by hand
//! from SPEC.md §3 with the default constants: 0.4 per well-formed call turn (all turns but
//! the last), on the last turn 0.25 (non-empty `<answer>`) + 0.25 (answer non-blank) + 0.1
//! (exact `<think>…</think>…<answer>…</answer>`), cap 1.0, and R = F1 when the capped format
//! equals 1.0, else R = format − 1.

use prompt_r1_rewards::{FormatTerm, RewardBreakdown, RewardConfig};

const CALL: &str = "<think>The question asks for a capital.</think>\n<interaction_prompt>{\"name\": \"prompt\", \"arguments\": {\"prompt\": \"What is the capital of France?\"}}</interaction_prompt>";
const SYSTEM: &str = "<|im_start|>system\nYou are Qwen.<|im_end|>\n";
const QUESTION: &str =
    "<|im_start|>user\nQuestion: What is the capital of France?\n(instruction)<|im_end|>\n";

/// A decoded episode as the environment builds it (SPEC §2 step 5): after each call the
/// reply goes in a user turn, and the next assistant turn starts with `<think>\n`, which is
/// part of that turn's text. `turns[0]` is the first turn; later turns are given without the
/// `<think>\n` the environment adds. With `finished == false` the text stops after the last
/// reply, as when the turn limit ends an episode.
fn episode(turns: &[&str], finished: bool) -> (String, Vec<String>) {
    const REPLY: &str = "<|im_end|>\n<|im_start|>user\n<interaction_response>\n{\"results\": [\"Paris.\"]}\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n";
    let mut text = format!("{SYSTEM}{QUESTION}<|im_start|>assistant\n");
    let mut agent_turns = Vec::new();
    for (i, generated) in turns.iter().enumerate() {
        text.push_str(generated);
        let context_prefix = if i == 0 { "" } else { "<think>\n" };
        agent_turns.push(format!("{context_prefix}{generated}"));
        let last = i + 1 == turns.len();
        text.push_str(if last && finished {
            "<|im_end|>\n"
        } else {
            REPLY
        });
    }
    (text, agent_turns)
}

/// Scores the raw text and the structured turns and checks that they agree.
fn score(turns: &[&str], finished: bool, references: &[&str]) -> RewardBreakdown {
    let (text, agent_turns) = episode(turns, finished);
    let config = RewardConfig::default();
    let from_text = RewardBreakdown::from_text(&text, references, &config);
    let from_turns = RewardBreakdown::from_turns(&agent_turns, references, &config);
    assert_eq!(
        from_text, from_turns,
        "raw text and turns disagree on {text}"
    );
    from_text
}

fn close(actual: f64, expected: f64) {
    assert!((actual - expected).abs() < 1e-12, "{actual} != {expected}");
}

#[test]
fn correct_call_then_answer() {
    let b = score(
        &[
            CALL,
            "The model says Paris.</think>\n<answer>Paris</answer>",
        ],
        true,
        &["Paris"],
    );
    // 0.4 + 0.25 + 0.25 + 0.1 = 1.0 → gate passed → R = F1 = 1.
    assert_eq!(b.turns[0].terms, [FormatTerm::WellFormedCall]);
    assert_eq!(
        b.turns[1].terms,
        [
            FormatTerm::AnswerTag,
            FormatTerm::AnswerNonEmpty,
            FormatTerm::ThinkAnswerLayout
        ]
    );
    assert_eq!((b.format_raw, b.format), (1.0, 1.0));
    assert!(b.gate_passed);
    assert_eq!((b.f1, b.em, b.reward), (1.0, 1.0, 1.0));
}

#[test]
fn direct_answer_without_a_call() {
    let b = score(
        &["<think>Easy.</think>\n<answer>Paris</answer>"],
        true,
        &["Paris"],
    );
    // Only the final-turn terms: 0.25 + 0.25 + 0.1 = 0.6 < 1 → R = 0.6 − 1 = −0.4, although
    // the answer is right (F1 = 1 is reported but gated out).
    close(b.format_raw, 0.6);
    assert!(!b.gate_passed);
    assert_eq!(b.f1, 1.0);
    close(b.reward, -0.4);
}

#[test]
fn missing_close_think_in_the_call() {
    let call = "<think>The question asks for a capital.\n<interaction_prompt>What is the capital of France?</interaction_prompt>";
    let b = score(
        &[call, "Paris.</think><answer>Paris</answer>"],
        true,
        &["Paris"],
    );
    // Call turn: no `</think>` → 0. Final: 0.6. Format 0.6 → R = −0.4.
    assert!(b.turns[0].terms.is_empty());
    close(b.format_raw, 0.6);
    close(b.reward, -0.4);
}

#[test]
fn missing_close_think_in_the_answer() {
    let b = score(&[CALL, "Paris. <answer>Paris</answer>"], true, &["Paris"]);
    // Call 0.4; final: answer terms 0.25 + 0.25 but no layout (no `</think>`):
    // 0.4 + 0.5 = 0.9 < 1 → R = 0.9 − 1 = −0.1.
    assert_eq!(
        b.turns[1].terms,
        [FormatTerm::AnswerTag, FormatTerm::AnswerNonEmpty]
    );
    close(b.format_raw, 0.9);
    close(b.reward, -0.1);
}

#[test]
fn text_outside_the_tags() {
    let call = "<think>Ask it.</think>\nLet me ask.\n<interaction_prompt>Capital of France?</interaction_prompt>";
    let b = score(
        &[
            call,
            "Done.</think><answer>Paris</answer>\nHope this helps.",
        ],
        true,
        &["Paris"],
    );
    // Text between `</think>` and `<interaction_prompt>` breaks the call (0); text after
    // `</answer>` breaks the layout: 0.25 + 0.25 = 0.5 → R = −0.5.
    assert!(b.turns[0].terms.is_empty());
    close(b.format_raw, 0.5);
    close(b.reward, -0.5);

    // Text between `</think>` and `<answer>` is allowed by the reference pattern.
    let b = score(
        &[
            CALL,
            "Done.</think>\nSo the answer is:\n<answer>Paris</answer>",
        ],
        true,
        &["Paris"],
    );
    assert_eq!(b.format, 1.0);
    assert_eq!(b.reward, 1.0);
}

#[test]
fn empty_answer() {
    let b = score(
        &[CALL, "No idea.</think>\n<answer>   </answer>"],
        true,
        &["Paris"],
    );
    // Blank answer: none of the final terms fire. Format 0.4 → R = 0.4 − 1 = −0.6.
    assert!(b.turns[1].terms.is_empty());
    assert_eq!(b.answer, None);
    close(b.format_raw, 0.4);
    assert_eq!(b.f1, 0.0);
    close(b.reward, -0.6);
}

#[test]
fn five_calls_and_no_answer() {
    let later = &CALL["<think>".len()..];
    let b = score(&[CALL, later, later, later, later], false, &["Paris"]);
    // The episode stops after the fifth reply, inside an unterminated assistant turn, which
    // is not a turn. The fifth call is the last turn, so it is scored as the final turn
    // (no answer: 0); the first four calls give 4 × 0.4 = 1.6, capped at 1.0 → the gate
    // passes and R = F1 of no answer = 0. (The reference code gives this 0 too.)
    assert_eq!(b.turns.len(), 5);
    assert!(b.turns[4].terms.is_empty());
    close(b.format_raw, 1.6);
    assert_eq!(b.format, 1.0);
    assert!(b.gate_passed);
    assert_eq!(b.reward, 0.0);
}

#[test]
fn two_calls_then_a_wrong_answer() {
    let second = &CALL["<think>".len()..];
    let b = score(
        &[CALL, second, "It is Lyon.</think><answer>Lyon</answer>"],
        true,
        &["Paris"],
    );
    // 0.4 + 0.4 + 0.25 + 0.25 + 0.1 = 1.4 → capped 1.0 → gate passed → R = F1 = 0.
    close(b.format_raw, 1.4);
    assert_eq!(b.format, 1.0);
    assert_eq!((b.f1, b.em, b.reward), (0.0, 0.0, 0.0));

    // A partly right answer: [paris, texas] vs [paris]: P = 1/2, R = 1, F1 = 2/3.
    let b = score(
        &[CALL, second, "Hmm.</think><answer>Paris, Texas</answer>"],
        true,
        &["Paris"],
    );
    close(b.reward, 2.0 / 3.0);
    assert_eq!(b.em, 0.0);
}

#[test]
fn constants_are_configurable() {
    let (text, _) = episode(&[CALL, "Paris. <answer>Paris</answer>"], true);
    let config = RewardConfig {
        call_turn: 0.5,
        ..RewardConfig::default()
    };
    // 0.5 + 0.25 + 0.25 = 1.0 now reaches the gate → R = F1 = 1.
    let b = RewardBreakdown::from_text(&text, &["Paris"], &config);
    assert_eq!((b.format, b.reward), (1.0, 1.0));
}

#[test]
fn breakdown_serialises_with_every_part() {
    let b = score(
        &[CALL, "Ok.</think><answer>Paris</answer>"],
        true,
        &["Paris"],
    );
    let json = serde_json::to_value(&b).unwrap();
    assert_eq!(json["turns"][0]["role"], "call");
    assert_eq!(json["turns"][0]["terms"][0], "well_formed_call");
    assert_eq!(json["turns"][1]["role"], "final");
    assert_eq!(json["format_raw"], 1.0);
    assert_eq!(json["answer"], "Paris");
    assert_eq!(json["reward"], 1.0);
}

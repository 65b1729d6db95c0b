//! The double-constrained reward on hand-built episodes. Expected numbers are derived by hand
//! from the reward's definition (rewards/README.md) with the default constants: 0.4 per
//! well-formed call turn (all turns but the last), on the last turn 0.25 (non-empty
//! `<answer>`) + 0.25 (answer non-blank) + 0.1 (exact `<think>…</think>…<answer>…</answer>`),
//! cap 1.0, and R = F1 when the capped format equals 1.0, else R = format − 1.

use prompt_r1_rewards::{FormatTerm, RewardBreakdown, RewardConfig};

const CALL: &str = "<think>The question asks for a capital.</think>\n<interaction_prompt>{\"name\": \"prompt\", \"arguments\": {\"prompt\": \"What is the capital of France?\"}}</interaction_prompt>";
const SYSTEM: &str = "<|im_start|>system\nYou are Qwen.<|im_end|>\n";
const QUESTION: &str =
    "<|im_start|>user\nQuestion: What is the capital of France?\n(instruction)<|im_end|>\n";

/// How a hand-built episode ends.
#[derive(Clone, Copy, PartialEq)]
enum End {
    /// The last turn closes with `<|im_end|>` (an answer, or a turn with neither tag).
    Closed,
    /// The episode stops right after the environment's reply to the last turn, as when the
    /// round limit ends it: the text ends with the `<think>\n` that opens the next turn.
    AfterReply,
    /// The last turn was cut by the per-turn token limit: no `<|im_end|>` after it.
    Cut,
}

/// A decoded episode as the environment builds it (env/README.md), and its agent turns as
/// the reference reads them. After each call the reply goes in a user turn, and the next
/// assistant turn starts with `<think>\n`, which is part of that turn's text. `turns[0]` is the
/// first turn; later turns are given without the `<think>\n` the environment adds.
fn episode(turns: &[&str], end: End) -> (String, Vec<String>) {
    const REPLY: &str = "<|im_end|>\n<|im_start|>user\n<interaction_response>\n{\"results\": [\"Paris.\"]}\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n";
    let mut text = format!("{SYSTEM}{QUESTION}<|im_start|>assistant\n");
    let mut agent_turns = Vec::new();
    for (i, generated) in turns.iter().enumerate() {
        text.push_str(generated);
        let context_prefix = if i == 0 { "" } else { "<think>\n" };
        agent_turns.push(format!("{context_prefix}{generated}"));
        let last = i + 1 == turns.len();
        text.push_str(match (last, end) {
            (true, End::Closed) => "<|im_end|>\n",
            (true, End::Cut) => "",
            _ => REPLY,
        });
    }
    if end == End::AfterReply {
        // The reference appends `<|im_end|>` to the text and so reads one more turn: the
        // `<think>\n` the context holds.
        agent_turns.push("<think>\n".to_string());
    }
    (text, agent_turns)
}

/// Scores the raw text and the structured turns and checks that they agree.
fn score_ending(turns: &[&str], end: End, references: &[&str]) -> RewardBreakdown {
    let (text, agent_turns) = episode(turns, end);
    let config = RewardConfig::default();
    let from_text = RewardBreakdown::from_text(&text, references, &config);
    let from_turns = RewardBreakdown::from_turns(&agent_turns, references, &config);
    assert_eq!(
        from_text, from_turns,
        "raw text and turns disagree on {text}"
    );
    from_text
}

/// [`score_ending`] of an episode whose last turn closes (`finished`) or that stops after
/// the last reply.
fn score(turns: &[&str], finished: bool, references: &[&str]) -> RewardBreakdown {
    score_ending(
        turns,
        if finished {
            End::Closed
        } else {
            End::AfterReply
        },
        references,
    )
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
    // Five rounds, all calls: the episode stops after the fifth reply. The reference appends
    // `<|im_end|>` to the text, so the `<think>\n` after that reply is a sixth, final turn (no
    // answer: 0) and all five calls count: 5 × 0.4 = 2.0, capped at 1.0 → the gate passes and
    // R = F1 of no answer = 0.
    assert_eq!(b.turns.len(), 6);
    assert!(b.turns[..5]
        .iter()
        .all(|t| t.terms == [FormatTerm::WellFormedCall]));
    assert!(b.turns[5].terms.is_empty());
    close(b.format_raw, 2.0);
    assert_eq!(b.format, 1.0);
    assert!(b.gate_passed);
    assert_eq!(b.reward, 0.0);
}

#[test]
fn round_limit_after_two_calls() {
    let later = &CALL["<think>".len()..];
    let b = score(&[CALL, later], false, &["Paris"]);
    // max_turns = 2, both rounds calls: two calls (0.8) and the empty final turn (0):
    // format 0.8 < 1 → R = 0.8 − 1 = −0.2.
    assert_eq!(b.turns.len(), 3);
    close(b.format_raw, 0.8);
    assert!(!b.gate_passed);
    close(b.reward, -0.2);
}

#[test]
fn a_cut_final_turn_is_still_a_turn() {
    let b = score_ending(
        &[CALL, "The model says Paris, so the answer"],
        End::Cut,
        &["Paris"],
    );
    // A well-formed call (0.4), then a final turn cut by the token limit, without an answer
    // (0): the reference closes the cut turn and scores it as the final turn, so the call
    // counts: format 0.4 → R = 0.4 − 1 = −0.6 (not −1: the call is not the last turn).
    assert_eq!(b.turns.len(), 2);
    assert_eq!(b.turns[0].terms, [FormatTerm::WellFormedCall]);
    assert!(b.turns[1].terms.is_empty());
    assert_eq!(b.answer, None);
    close(b.format_raw, 0.4);
    close(b.reward, -0.6);
}

#[test]
fn a_cut_turn_keeps_a_complete_answer() {
    let b = score_ending(
        &[CALL, "Paris.</think><answer>Paris</answer> I could add tha"],
        End::Cut,
        &["Paris"],
    );
    // Cut after a complete answer: the answer terms fire (0.25 + 0.25) but the layout does not
    // (the turn does not end with `</answer>`): 0.4 + 0.5 = 0.9 → R = 0.9 − 1 = −0.1.
    assert_eq!(
        b.turns[1].terms,
        [FormatTerm::AnswerTag, FormatTerm::AnswerNonEmpty]
    );
    assert_eq!(b.answer.as_deref(), Some("Paris"));
    close(b.format_raw, 0.9);
    close(b.reward, -0.1);
}

#[test]
fn a_cut_first_turn_scores_minus_one() {
    let b = score_ending(
        &["<think>A long plan that never ends"],
        End::Cut,
        &["Paris"],
    );
    // One turn, the final one, with no answer: format 0 → R = −1.
    assert_eq!(b.turns.len(), 1);
    assert_eq!((b.format_raw, b.reward), (0.0, -1.0));
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
    let (text, _) = episode(&[CALL, "Paris. <answer>Paris</answer>"], End::Closed);
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

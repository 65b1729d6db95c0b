// The parity cases, included by `tests/integration/parity.rs` (fused CPU kernels) and by the
// workspace's `tests/gpu_path/parity.rs` (burn's portable ops, the path the CUDA backend takes;
// burn's wgpu backend: the CUDA backend's CubeCL kernels) in modules that define the backend
// `B`, `PORTABLE` and the tolerance `ATOL` of logits and log-probs, and bring `common` (this
// folder's `mod.rs`) into scope.

use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};
use common::*;
use prompt_r1_model::{
    completion_logprobs, generate, load_pretrained, Decoder, DecoderLimits, DecoderStats, LoadOptions, Padding,
    Qwen3ForCausalLM, Sampling, SamplingConfig, TokenBatch,
};

/// The fixture; `None` (the test skipped) when the fixtures or the backend are missing here.
fn fixture(name: &str) -> Option<Fixture> {
    if !backend_ready::<B>() {
        return None;
    }
    common::fixture(name)
}

/// Whether `B` computes in bf16; the test is skipped (with the reason) where it does not.
fn has_bf16() -> bool {
    let device = Default::default();
    let supported = B::supports_dtype(&device, DType::BF16);
    if !supported {
        eprintln!("skipped: the {} backend has no bf16", B::name(&device));
    }
    supported
}

fn load(dir: &std::path::Path) -> Qwen3ForCausalLM<B> {
    load_pretrained::<B>(dir, &Default::default(), common::load_options(PORTABLE)).expect("fixture loads")
}

/// The fixture with a context of 512 positions in place of its 128 (the decoder refuses
/// sequences past a model's context): for the cases that measure memory over sequences longer
/// than the fixture's context. RoPE's tables cover the positions in use, so recomputation still
/// gives the reference for each step.
fn load_with_a_longer_context(dir: &std::path::Path) -> Qwen3ForCausalLM<B> {
    let mut model = load(dir);
    model.config.max_position_embeddings = 512;
    model
}

fn logits_of(model: &Qwen3ForCausalLM<B>, ids: &[u32]) -> Vec<f32> {
    let batch = TokenBatch::<B>::new(&[ids.to_vec()], Padding::Right, 0, &Default::default()).unwrap();
    model
        .forward(batch.input_ids, batch.position_ids, None, None)
        .into_data()
        .to_vec()
        .unwrap()
}

/// Logits at every position of both reference sequences, for one checkpoint layout.
fn check_sequences(fixture: &Fixture, model_dir: &std::path::Path) -> f32 {
    let model = load(model_dir);
    let mut worst = 0.0f32;
    for seq in fixture.json["sequences"].as_array().unwrap() {
        let got = logits_of(&model, &ids(&seq["input_ids"]));
        worst = worst.max(max_abs_diff(&got, &flat(&seq["logits"])));
    }
    worst
}

#[test]
fn logits_match_transformers_single_sharded_and_untied() {
    let Some(tiny) = fixture("tiny") else { return };
    let single = check_sequences(&tiny, &tiny.dir);
    let sharded = check_sequences(&tiny, &tiny.dir.join("sharded"));
    let Some(untied) = fixture("tiny-untied") else { return };
    let untied_diff = check_sequences(&untied, &untied.dir);
    println!("max |logit diff|: tiny {single:.2e}, tiny sharded {sharded:.2e}, tiny-untied {untied_diff:.2e}");
    assert!(single < ATOL, "tiny: {single}");
    assert!(sharded < ATOL, "tiny sharded: {sharded}");
    assert!(untied_diff < ATOL, "tiny-untied: {untied_diff}");
}

#[test]
fn hidden_states_match_per_layer() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let model = load(&fx.dir);
        let seq = ids(&fx.json["sequences"][0]["input_ids"]);
        let batch = TokenBatch::<B>::new(&[seq], Padding::Right, 0, &Default::default()).unwrap();
        let out = model
            .model
            .forward(batch.input_ids, batch.position_ids, None, None, true);
        let hidden = out.hidden_states.unwrap();
        let reference = &fx.json["hidden_states_seq0"];
        let embed: Vec<f32> = hidden[0].to_data().to_vec().unwrap();
        assert!(max_abs_diff(&embed, &flat(&reference["embed"])) < 1e-6, "{name} embed");
        for layer in 0..hidden.len() - 1 {
            let got: Vec<f32> = hidden[layer + 1].to_data().to_vec().unwrap();
            let diff = max_abs_diff(&got, &flat(&reference[format!("layer{layer}")]));
            assert!(diff < ATOL, "{name} layer {layer}: {diff}");
        }
        let normed: Vec<f32> = out.last_hidden_state.into_data().to_vec().unwrap();
        let diff = max_abs_diff(&normed, &flat(&reference["final_norm"]));
        assert!(diff < ATOL, "{name} final norm: {diff}");
    }
}

/// Runs a padded batch exactly as the fixture gives it (ids, mask, positions).
fn padded_logits(model: &Qwen3ForCausalLM<B>, spec: &serde_json::Value) -> (Vec<f32>, usize) {
    let device = Default::default();
    let rows = spec["input_ids"].as_array().unwrap().len();
    let tensor = |key: &str| {
        let v: Vec<i64> = flat(&spec[key]).iter().map(|&x| x as i64).collect();
        let len = v.len() / rows;
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [rows, len]), &device)
    };
    let mask = tensor("attention_mask");
    let logits = model.forward(tensor("input_ids"), tensor("position_ids"), Some(&mask), None);
    let len = logits.dims()[1];
    (logits.into_data().to_vec().unwrap(), len)
}

#[test]
fn right_and_left_padded_batches_match_unpadded_runs() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let model = load(&fx.dir);
        let vocab = model.config.vocab_size;
        for side in ["right", "left"] {
            let spec = &fx.json["padded_batches"][side];
            let (logits, len) = padded_logits(&model, spec);
            assert!(logits.iter().all(|x| x.is_finite()), "{name} {side}: non-finite logits");
            for (row, mask) in spec["attention_mask"].as_array().unwrap().iter().enumerate() {
                let mask = flat(mask);
                let reference = flat(&fx.json["sequences"][row]["logits"]);
                let real: Vec<usize> = (0..len).filter(|&j| mask[j] == 1.0).collect();
                let got: Vec<f32> = real
                    .iter()
                    .flat_map(|&j| logits[(row * len + j) * vocab..(row * len + j + 1) * vocab].to_vec())
                    .collect();
                let diff = max_abs_diff(&got, &reference);
                assert!(diff < ATOL, "{name} {side}-padded row {row}: {diff}");
            }
        }
    }
}

/// Greedy decoding of as many tokens as the fixture's greedy reference has.
fn greedy_config(fx: &Fixture) -> SamplingConfig {
    SamplingConfig {
        max_new_tokens: fx.json["greedy"]["max_new_tokens"].as_u64().unwrap() as usize,
        sampling: Sampling::greedy(),
        ..Default::default()
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let model = load(&fx.dir);
        let greedy = &fx.json["greedy"];
        let config = greedy_config(&fx);
        let out = generate(&model, &[ids(&greedy["prompt"])], &config).unwrap();
        assert_eq!(out[0].tokens, ids(&greedy["tokens"]), "{name}: greedy tokens");
        // The log-prob of each chosen token equals log_softmax of the reference step logits.
        let vocab = model.config.vocab_size;
        let steps = flat(&greedy["step_logits"]);
        for (k, (&tok, &lp)) in out[0].tokens.iter().zip(&out[0].logprobs).enumerate() {
            let row = &steps[k * vocab..(k + 1) * vocab];
            let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
            let expected = row[tok as usize] as f64 - lse;
            assert!((lp as f64 - expected).abs() < ATOL as f64, "{name} step {k}: {lp} vs {expected}");
        }

        let batched = &fx.json["greedy_batch_left_padded"];
        let prompts: Vec<Vec<u32>> = batched["prompts"].as_array().unwrap().iter().map(ids).collect();
        let config = SamplingConfig {
            max_new_tokens: 16,
            ..config
        };
        let out = generate(&model, &prompts, &config).unwrap();
        for (i, expected) in batched["new_tokens"].as_array().unwrap().iter().enumerate() {
            assert_eq!(out[i].tokens, ids(expected), "{name}: batched row {i}");
        }
    }
}

/// Sampled tokens depend only on the seeds, not on where they are chosen: on the portable path
/// `generate` samples on the device, and `top_k = vocab` (the same distribution) keeps the
/// choice on the host. Rows stop at different steps, so the device-side key mask loses rows.
/// (A draw within f32 rounding of a boundary between two tokens could pick either; the unit
/// tests of `device_sampling` measure that on 256 draws: none here.)
#[test]
fn sampled_generation_is_the_same_wherever_tokens_are_chosen() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    let prompts: Vec<Vec<u32>> = fx.json["greedy_batch_left_padded"]["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let vocab = model.config.vocab_size;
    for temperature in [1.0, 0.7] {
        let sampling = Sampling { temperature, seed: 11, ..Sampling::default() };
        let config = SamplingConfig { max_new_tokens: 12, sampling, ..Default::default() };
        let first = generate(&model, &prompts, &config).unwrap();
        let config = SamplingConfig { stop_token_ids: vec![first[0].tokens[3]], ..config };
        let device = generate(&model, &prompts, &config).unwrap();
        let host_sampling = Sampling { top_k: Some(vocab), ..config.sampling.clone() };
        let host = generate(&model, &prompts, &SamplingConfig { sampling: host_sampling, ..config.clone() }).unwrap();
        assert!(device[0].tokens.len() <= 4, "row 0 stops early");
        for (row, (d, h)) in device.iter().zip(&host).enumerate() {
            assert_eq!(d.tokens, h.tokens, "T {temperature}, row {row}: tokens");
            assert_eq!(d.finish_reason, h.finish_reason, "T {temperature}, row {row}");
            assert!(max_abs_diff(&d.logprobs, &h.logprobs) < ATOL, "T {temperature}, row {row}: log-probs");
        }
    }
}

#[test]
fn completion_logprobs_match_transformers() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let model = load(&fx.dir);
        let spec = &fx.json["completion_logprobs"];
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = spec["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .zip(spec["completions"].as_array().unwrap())
            .map(|(p, c)| (ids(p), ids(c)))
            .collect();
        let got = completion_logprobs(&model, &pairs, 0).unwrap();
        for (i, expected) in spec["token_logprobs"].as_array().unwrap().iter().enumerate() {
            let diff = max_abs_diff(&got[i], &floats(expected));
            assert!(diff < ATOL, "{name} pair {i}: {diff}");
            let sum: f32 = got[i].iter().sum();
            let expected_sum = spec["sum_logprobs"][i].as_f64().unwrap() as f32;
            assert!((sum - expected_sum).abs() < 1e-3, "{name} pair {i} sum");
        }
    }
}

#[test]
fn bf16_checkpoint_matches_bf16_reference() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir.join("bf16"));
    let reference = fx.json["bf16_weights"]["logits"].as_array().unwrap();
    let mut worst = 0.0f32;
    for (seq, expected) in fx.json["sequences"].as_array().unwrap().iter().zip(reference) {
        let got = logits_of(&model, &ids(&seq["input_ids"]));
        worst = worst.max(max_abs_diff(&got, &flat(expected)));
    }
    println!("bf16 checkpoint upcast to f32: max |logit diff| {worst:.2e}");
    assert!(worst < ATOL, "{worst}");
}

/// Weights kept in bf16 on the device and bf16 activations (norms and softmax in f32, as HF):
/// the fixture measured PyTorch's pure-bf16 compute at 0.20 from the f32-compute reference; we
/// allow 0.5 and require the same argmax wherever the reference's top-2 margin exceeds 0.5.
#[test]
fn bf16_compute_stays_close_to_the_reference() {
    let Some(fx) = fixture("tiny") else { return };
    if !has_bf16() {
        return;
    }
    let model = load_pretrained::<B>(
        &fx.dir.join("bf16"),
        &Default::default(),
        LoadOptions { dtype: DType::BF16, ..common::load_options(PORTABLE) },
    )
    .unwrap();
    let vocab = model.config.vocab_size;
    let reference = fx.json["bf16_weights"]["logits"].as_array().unwrap();
    let mut worst = 0.0f32;
    for (seq, expected) in fx.json["sequences"].as_array().unwrap().iter().zip(reference) {
        let batch = TokenBatch::<B>::new(&[ids(&seq["input_ids"])], Padding::Right, 0, &Default::default()).unwrap();
        let logits = model.forward(batch.input_ids, batch.position_ids, None, None);
        assert_eq!(logits.dtype(), DType::BF16);
        let got: Vec<f32> = logits.into_data().convert::<f32>().to_vec().unwrap();
        let expected = flat(expected);
        worst = worst.max(max_abs_diff(&got, &expected));
        for (g, e) in got.chunks(vocab).zip(expected.chunks(vocab)) {
            let mut sorted = e.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 0.5 {
                let argmax = |r: &[f32]| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap();
                assert_eq!(argmax(g), argmax(e));
            }
        }
    }
    println!("bf16 compute: max |logit diff| {worst:.3}");
    assert!(worst < 0.5, "{worst}");
}

/// One decoder step, each returned row's logits checked against a forward over its sequence's
/// whole history from scratch (the largest difference kept in `worst`); returns each row's
/// argmax.
fn checked_step(model: &Qwen3ForCausalLM<B>, decoder: &mut Decoder<B>, worst: &mut f32) -> Vec<(u64, u32)> {
    let vocab = model.config.vocab_size;
    let Some(out) = decoder.step(model).unwrap() else { return Vec::new() };
    let logits: Vec<f32> = out.logits.into_data().convert::<f32>().to_vec().unwrap();
    out.ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let full = logits_of(model, decoder.tokens(id).unwrap());
            *worst = worst.max(max_abs_diff(row, &full[full.len() - vocab..]));
            (id, (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32)
        })
        .collect()
}

/// Drives a [`Decoder`] through joins, leaves, a parked sequence extended and rejoining, and
/// chunked prefills, checking at every step that each returned row's logits equal a forward
/// over that sequence's whole history from scratch (no cache, no padding). Tokens are the
/// decoder's own argmax, so each sequence goes on from what it computed.
fn decode_against_recomputation(model: &Qwen3ForCausalLM<B>, limits: DecoderLimits, name: &str) -> DecoderStats {
    let vocab = model.config.vocab_size;
    let mut decoder = Decoder::<B>::new(limits);
    let mut worst = 0.0f32;
    let step = |decoder: &mut Decoder<B>, worst: &mut f32| checked_step(model, decoder, worst);
    let prompt = |seed: u32, len: u32| synthetic_prompt(vocab as u32, seed, len);
    decoder.add(model, 0, prompt(1, 5)).unwrap();
    decoder.add(model, 1, prompt(2, 11)).unwrap();
    // Tokens each sequence has generated, and the step sequence 0 was parked at.
    let mut generated = [0usize; 3];
    let (mut steps, mut parked_at) = (0, None);
    while !decoder.is_idle() || parked_at.is_some() {
        let chosen = step(&mut decoder, &mut worst);
        steps += 1;
        for (id, token) in chosen {
            decoder.accept(id, token).unwrap();
            generated[id as usize] += 1;
            match (id, generated[id as usize]) {
                // Sequence 0 leaves for an "environment call" and comes back with 6 more tokens.
                (0, 3) => {
                    decoder.park(0).unwrap();
                    parked_at = Some(steps);
                }
                (1, 30) | (2, 12) | (0, 20) => drop(decoder.finish(id)),
                _ => {}
            }
        }
        if steps == 4 {
            // Sequence 2 joins beside the others.
            decoder.add(model, 2, prompt(3, 3)).unwrap();
        }
        if parked_at.is_some_and(|at| steps >= at + 2) {
            decoder.extend(model, 0, &prompt(4, 6)).unwrap();
            parked_at = None;
        }
        assert!(steps < 200, "{name}: the decoder did not finish");
    }
    assert!(worst < ATOL, "{name}: kept-cache logits differ from recomputation by {worst}");
    decoder.stats()
}

/// With the projections stacked (`qkv_proj`, `gate_up_proj`: one product where there were
/// five), the model still gives transformers' logits and greedy tokens, and its kept-cache
/// decoding still equals recomputation, across rows leaving, parking and joining.
#[test]
fn stacked_projections_give_the_same_results() {
    for name in ["tiny", "tiny-untied"] {
        let Some(fx) = fixture(name) else { return };
        let model = load(&fx.dir).with_stacked_projections();
        assert!(model.model.layers.iter().all(|l| l.self_attn.qkv_proj.is_some() && l.mlp.gate_up_proj.is_some()));
        let mut worst = 0.0f32;
        for seq in fx.json["sequences"].as_array().unwrap() {
            worst = worst.max(max_abs_diff(&logits_of(&model, &ids(&seq["input_ids"])), &flat(&seq["logits"])));
        }
        println!("{name}, stacked projections: max |logit diff| {worst:.2e}");
        assert!(worst < ATOL, "{name}, stacked: {worst}");
        let greedy = &fx.json["greedy"];
        let out = generate(&model, &[ids(&greedy["prompt"])], &greedy_config(&fx)).unwrap();
        assert_eq!(out[0].tokens, ids(&greedy["tokens"]), "{name}, stacked: greedy tokens");
        decode_against_recomputation(&model, DecoderLimits::default(), "stacked projections");
    }
}

#[test]
fn kept_cache_decoding_equals_recomputation() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    let whole = decode_against_recomputation(&model, DecoderLimits::default(), "whole prefills");
    // Each token enters the cache once: 5 + 11 + 3 prompt tokens, sequence 0's 6-token reply
    // and the token it had accepted before parking; every other token through a decode step.
    assert_eq!(whole.prefill_tokens, 5 + 11 + 3 + 6 + 1);
    assert_eq!(whole.preemptions, 0);
    let chunked = decode_against_recomputation(&model, DecoderLimits { max_batched_tokens: 4, ..DecoderLimits::default() }, "chunked prefills");
    assert_eq!(chunked.prefill_tokens, whole.prefill_tokens);
    assert_eq!(chunked.decode_tokens, whole.decode_tokens);
    // Prefills in passes of their own: where the model takes ragged passes (a GPU kernel that
    // takes prefills), the runs above joined sequences beside the decoding rows in one pass.
    let separate = decode_against_recomputation(&model, DecoderLimits { ragged_passes: false, ..DecoderLimits::default() }, "separate prefills");
    assert_eq!((separate.prefill_tokens, separate.decode_tokens), (whole.prefill_tokens, whole.decode_tokens));
    println!("forward passes: {} ragged where taken, {} separate (ragged passes taken: {})", whole.passes, separate.passes, model.takes_ragged_passes());
    match model.takes_ragged_passes() {
        true => assert!(whole.passes < separate.passes, "{} ragged passes, {} separate", whole.passes, separate.passes),
        false => assert_eq!(whole.passes, separate.passes),
    }
}

/// `max_batched_tokens` bounds every pass, even below the rows that would run: at most that
/// many sequences run at once (a decoding pass runs a token a row), prefills run in chunks that
/// fit, and every row still equals recomputation.
#[test]
fn the_token_bound_holds_for_every_pass() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    for ragged_passes in [true, false] {
        let limits = DecoderLimits { max_rows: 8, max_batched_tokens: 2, ragged_passes, ..DecoderLimits::default() };
        assert_eq!(limits.rows(), 2);
        let stats = decode_against_recomputation(&model, limits, "two tokens a pass");
        assert!(stats.largest_pass <= 2, "ragged passes {ragged_passes}: a pass ran {} positions", stats.largest_pass);
        assert_eq!(stats.prefill_tokens, 5 + 11 + 3 + 6 + 1, "ragged passes {ragged_passes}");
    }
    let unbounded = decode_against_recomputation(&model, DecoderLimits::default(), "unbounded");
    // Unbounded, the first prompts (5 and 11 tokens) join in one pass.
    assert!(unbounded.largest_pass >= 16, "{}", unbounded.largest_pass);
}

/// A prefill longer than a step's `max_batched_tokens` goes on over several steps (vLLM's
/// chunked prefill) while the running rows decode a token at every one of them, and each step
/// runs at most that many tokens; every returned row still equals recomputation. With no row
/// running, a step goes on until a prefill is done (a step returns something while any
/// sequence is in the decoder).
#[test]
fn a_long_prefill_goes_on_over_steps_while_rows_decode() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    let prompt = |seed: u32, len: u32| synthetic_prompt(model.config.vocab_size as u32, seed, len);
    for ragged_passes in [true, false] {
        let name = format!("ragged passes {ragged_passes}");
        let mut decoder = Decoder::<B>::new(DecoderLimits { max_batched_tokens: 8, ragged_passes, ..DecoderLimits::default() });
        let mut worst = 0.0f32;
        // Alone, a 20-token prompt takes three passes of at most 8 tokens, in one step.
        decoder.add(&model, 0, prompt(1, 20)).unwrap();
        let first = checked_step(&model, &mut decoder, &mut worst);
        assert_eq!(first.iter().map(|c| c.0).collect::<Vec<_>>(), [0], "{name}");
        assert_eq!(decoder.stats().passes, 3, "{name}");
        decoder.accept(0, first[0].1).unwrap();
        // A 40-token prompt joins beside it: 7 of its tokens a step beside row 0's one.
        decoder.add(&model, 1, prompt(2, 40)).unwrap();
        let mut steps_before_joining = 0;
        loop {
            let chosen = checked_step(&model, &mut decoder, &mut worst);
            assert_eq!(chosen.first().map(|c| c.0), Some(0), "{name}: row 0 decodes at every step");
            for &(id, token) in &chosen {
                decoder.accept(id, token).unwrap();
            }
            if chosen.iter().any(|c| c.0 == 1) {
                break;
            }
            steps_before_joining += 1;
            assert!(decoder.waiting() == 1 && steps_before_joining < 10, "{name}");
        }
        assert_eq!(steps_before_joining, 40usize.div_ceil(7) - 1, "{name}");
        let stats = decoder.stats();
        assert!(stats.largest_pass <= 8, "{name}: a pass ran {} positions", stats.largest_pass);
        assert_eq!(stats.prefill_tokens, 60, "{name}");
        assert!(worst < ATOL, "{name}: kept-cache logits differ from recomputation by {worst}");
    }
}

/// Sequences waiting while a long prefill fills every step's tokens take no KV blocks: a
/// sequence takes its blocks when it joins, so it joins only where some of its tokens run in
/// that step. Checked against a decoder without the waiting ones, step for step: the positions
/// held are the same until the prefill is done. (Outside ragged passes nothing joins during a
/// prefill; in a ragged pass the waiting ones used to join, holding their whole prompts' blocks
/// while none of their tokens ran.)
#[test]
fn waiting_sequences_take_no_blocks_while_a_prefill_fills_the_steps() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    let prompt = |seed: u32, len: u32| synthetic_prompt(model.config.vocab_size as u32, seed, len);
    for ragged_passes in [true, false] {
        let name = format!("ragged passes {ragged_passes} (taken: {})", model.takes_ragged_passes());
        let limits = DecoderLimits { max_batched_tokens: 8, ragged_passes, ..DecoderLimits::default() };
        let (mut with_waiting, mut alone) = (Decoder::<B>::new(limits.clone()), Decoder::<B>::new(limits));
        let mut worst = 0.0f32;
        for decoder in [&mut with_waiting, &mut alone] {
            decoder.add(&model, 0, prompt(1, 5)).unwrap();
            let first = checked_step(&model, decoder, &mut worst);
            decoder.accept(0, first[0].1).unwrap();
            decoder.add(&model, 1, prompt(2, 40)).unwrap();
            // Sequence 1 takes its first 7 tokens beside row 0's one.
            let chosen = checked_step(&model, decoder, &mut worst);
            assert_eq!(chosen.iter().map(|c| c.0).collect::<Vec<_>>(), [0], "{name}");
            decoder.accept(0, chosen[0].1).unwrap();
        }
        for id in 2..6 {
            with_waiting.add(&model, id, prompt(id as u32 + 2, 30)).unwrap();
        }
        let mut prefill_steps = 1;
        loop {
            let chosen = checked_step(&model, &mut with_waiting, &mut worst);
            let reference = checked_step(&model, &mut alone, &mut worst);
            if chosen.iter().any(|c| c.0 == 1) {
                break;
            }
            prefill_steps += 1;
            assert!(prefill_steps < 10, "{name}: the 40-token prefill did not end");
            assert_eq!(chosen, reference, "{name}: only row 0 decodes while sequence 1 prefills");
            assert_eq!(with_waiting.waiting(), 5, "{name}: sequence 1 prefilling and four waiting");
            assert_eq!(
                with_waiting.kv_positions_in_use(),
                alone.kv_positions_in_use(),
                "{name}, step {prefill_steps}: the waiting sequences hold KV blocks while none of their tokens run"
            );
            for decoder in [&mut with_waiting, &mut alone] {
                decoder.accept(0, chosen[0].1).unwrap();
            }
        }
        assert_eq!(prefill_steps, 40usize.div_ceil(7) - 1, "{name}");
        assert!(with_waiting.stats().largest_pass <= 8, "{name}: a pass ran {} positions", with_waiting.stats().largest_pass);
        assert!(worst < ATOL, "{name}: kept-cache logits differ from recomputation by {worst}");
    }
}

/// Nine sequences of different lengths that leave (finished or parked) one at a time and one
/// that joins: a parked sequence keeps its blocks (nothing copied, nothing held twice) until it
/// rejoins with a reply, and every returned row still equals recomputation.
#[test]
fn sequences_leave_and_join_by_their_blocks() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    let vocab = model.config.vocab_size as u32;
    let mut decoder = Decoder::<B>::new(DecoderLimits::default());
    for id in 0..9u64 {
        let len = 3 + (id as u32 * 5) % 7;
        decoder.add(&model, id, (0..len).map(|i| (id as u32 * 37 + i * 11) % vocab).collect()).unwrap();
    }
    let (mut worst, mut generated, mut steps) = (0.0f32, [0usize; 10], 0);
    let mut parked = None;
    while !decoder.is_idle() || parked.is_some() {
        let chosen = checked_step(&model, &mut decoder, &mut worst);
        steps += 1;
        assert!(chosen.iter().all(|&(id, _)| decoder.contains(id)), "a row that left was returned");
        for (id, token) in chosen {
            generated[id as usize] += 1;
            match (id, generated[id as usize]) {
                (3, 2) => {
                    decoder.accept(id, token).unwrap();
                    let held = (decoder.kv_positions(), decoder.kv_positions_in_use());
                    decoder.park(id).unwrap();
                    assert_eq!((decoder.kv_positions(), decoder.kv_positions_in_use()), held, "parking copies or frees nothing");
                    parked = Some(steps);
                }
                (id, n) if n == 3 + id as usize => drop(decoder.finish(id)),
                _ => decoder.accept(id, token).unwrap(),
            }
        }
        if steps == 5 {
            decoder.add(&model, 9, vec![5, 6, 7]).unwrap();
        }
        if parked.is_some_and(|at| steps >= at + 3) {
            decoder.extend(&model, 3, &[9, 8, 7, 6]).unwrap();
            parked = None;
        }
        assert!(steps < 100, "the decoder did not finish");
    }
    assert!(worst < ATOL, "logits differ from recomputation by {worst} after rows left and joined");
    assert_eq!(decoder.kv_positions(), 0, "the pool is freed once every sequence has finished");
}

/// Memory follows the positions in use, not the longest row: one long sequence beside short
/// ones holds about its own blocks and theirs (a batch padded to the longest row would hold
/// 8 × 200 positions), blocks a finished sequence gave back are taken again without the pool
/// growing, and a sequence rejoining with a long reply beside short rows still equals
/// recomputation.
#[test]
fn memory_follows_the_positions_in_use() {
    use prompt_r1_model::qwen3::BLOCK_SIZE;
    let Some(fx) = fixture("tiny") else { return };
    let model = load_with_a_longer_context(&fx.dir);
    let mut decoder = Decoder::<B>::new(DecoderLimits::default());
    decoder.add(&model, 0, (0..200).map(|i| 1 + i % 50).collect()).unwrap();
    for id in 1..8u64 {
        decoder.add(&model, id, vec![2 + id as u32; 5]).unwrap();
    }
    let mut worst = 0.0f32;
    for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
        decoder.accept(id, token).unwrap();
    }
    // Sequence 0's 201 positions take 13 blocks, each short one 1, plus the scratch block.
    let in_use = (13 + 7 + 1) * BLOCK_SIZE;
    assert_eq!(decoder.kv_positions_in_use(), in_use);
    // One prefill pass, its rows' newest positions lined up: 8 rows × 200 columns attended
    // (what burn's ops gather on a GPU).
    assert_eq!(decoder.stats().attention_columns, 8 * 200);
    assert!(decoder.kv_positions() <= prompt_r1_model::qwen3::grown_capacity(in_use), "{} held for {in_use} in use", decoder.kv_positions());
    let held = decoder.kv_positions();
    // A short sequence ends and another takes its block: nothing grows.
    decoder.finish(3);
    decoder.add(&model, 8, vec![9; 6]).unwrap();
    for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
        decoder.accept(id, token).unwrap();
    }
    assert_eq!((decoder.kv_positions(), decoder.kv_positions_in_use()), (held, in_use), "the freed block was taken again");
    // Sequence 1 leaves and comes back with a reply of 60 tokens.
    decoder.park(1).unwrap();
    decoder.extend(&model, 1, &[3; 60]).unwrap();
    for _ in 0..6 {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            decoder.accept(id, token).unwrap();
        }
    }
    assert!(worst < ATOL, "logits differ from recomputation by {worst}");
    // Sequence 0 (207 positions) still fits its 13 blocks; they are free once it ends.
    let before = decoder.kv_positions_in_use();
    decoder.finish(0);
    assert_eq!(decoder.kv_positions_in_use(), before - 13 * BLOCK_SIZE);
    // Once nothing runs or waits (a server's cached prefixes, all parked), the pool shrinks to
    // the blocks still held, and a parked sequence that comes back computes as before.
    let held = decoder.kv_positions();
    let in_use = decoder.kv_positions_in_use();
    assert!(in_use * 2 <= held, "{in_use} of {held} in use");
    assert_eq!(decoder.kv_positions_evictable(), 0, "every sequence runs");
    for id in [1, 2, 4, 5, 6, 7, 8] {
        decoder.park(id).unwrap();
    }
    assert_eq!(decoder.kv_positions(), in_use, "the pool of {held} positions shrinks to the {in_use} in use");
    assert_eq!(decoder.kv_positions_evictable(), in_use - BLOCK_SIZE, "all parked: every block but the scratch block could go");
    decoder.extend(&model, 6, &[4, 5]).unwrap();
    decoder.extend(&model, 1, &[7]).unwrap();
    for _ in 0..4 {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            decoder.accept(id, token).unwrap();
        }
    }
    assert!(worst < ATOL, "after the pool shrank, logits differ from recomputation by {worst}");
}

/// Within a KV budget too small for every sequence at once, sequences wait and running ones are
/// preempted (prefilled again later); what each computes is unchanged and the positions held
/// never pass the budget.
#[test]
fn a_kv_budget_is_respected_by_waiting_and_preempting() {
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    use prompt_r1_model::qwen3::BLOCK_SIZE;
    // The script above, with room for the scratch block and three of the sequences' blocks:
    // sequences wait, and running ones are preempted and prefilled again.
    let budget = 4 * BLOCK_SIZE;
    let stats = decode_against_recomputation(&model, DecoderLimits { kv_budget: Some(budget), ..DecoderLimits::default() }, "budget");
    assert!(stats.peak_kv_positions <= budget, "peak {} over the budget {budget}", stats.peak_kv_positions);
    assert!(stats.preemptions >= 1 && stats.prefill_tokens > 5 + 11 + 3 + 6 + 1, "{stats:?}");

    // A parked cache is dropped before any running row is preempted: A (20 tokens, two blocks)
    // parks, B (10 tokens) needs its second block with the budget full, so A's blocks go; A's
    // reply then waits for B to end and A is prefilled again from its first token.
    let mut decoder = Decoder::<B>::new(DecoderLimits { kv_budget: Some(budget), ..DecoderLimits::default() });
    decoder.add(&model, 0, (1..21).collect()).unwrap();
    decoder.add(&model, 1, (30..40).collect()).unwrap();
    let (mut worst, mut generated) = (0.0f32, [0usize; 2]);
    while !decoder.is_idle() || decoder.contains(0) {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            generated[id as usize] += 1;
            decoder.accept(id, token).unwrap();
            match (id, generated[id as usize]) {
                (0, 1) => decoder.park(0).unwrap(),
                // B has taken its second block (at 16 positions): A's reply comes back.
                (1, 8) => decoder.extend(&model, 0, &[4, 5, 6]).unwrap(),
                (1, 10) | (0, 3) => drop(decoder.finish(id)),
                _ => {}
            }
        }
        assert!(decoder.kv_positions() <= budget, "{} held over {budget}", decoder.kv_positions());
    }
    let stats = decoder.stats();
    assert!(worst < ATOL, "evicted: logits differ from recomputation by {worst}");
    assert_eq!((stats.evictions, stats.preemptions), (1, 0), "{stats:?}");
    assert_eq!(stats.prefill_tokens, 20 + 10 + 24, "A is prefilled again whole: {stats:?}");

    // Two rows of 20 tokens (two blocks each) fit side by side with the scratch block in six
    // blocks, but not once both pass 32 positions: the newer is preempted, waits for the older
    // to end at 40, and is prefilled again.
    let (small, budget) = (20, 6 * BLOCK_SIZE);
    let mut decoder = Decoder::<B>::new(DecoderLimits { kv_budget: Some(budget), ..DecoderLimits::default() });
    decoder.add(&model, 0, (1..21).collect()).unwrap();
    decoder.add(&model, 1, (40..60).collect()).unwrap();
    let (mut worst, mut generated) = (0.0f32, [0usize; 2]);
    while !decoder.is_idle() {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            generated[id as usize] += 1;
            if generated[id as usize] == small {
                decoder.finish(id);
            } else {
                decoder.accept(id, token).unwrap();
            }
        }
        assert!(decoder.stats().peak_kv_positions <= budget, "{:?} over {budget}", decoder.stats());
    }
    let stats = decoder.stats();
    assert!(worst < ATOL, "preempted: logits differ from recomputation by {worst}");
    assert_eq!(stats.preemptions, 1, "{stats:?}");
    assert!(stats.prefill_tokens > 40, "the preempted row is prefilled again: {stats:?}");
    let too_small = DecoderLimits { kv_budget: Some(8), ..DecoderLimits::default() };
    let mut decoder = Decoder::<B>::new(too_small);
    decoder.add(&model, 7, vec![1; 20]).unwrap();
    let err = decoder.step(&model).unwrap_err().to_string();
    assert!(err.contains("KV budget of 8 positions") && err.contains("sequence 7"), "{err}");
}

/// Sequences whose tokens begin alike share the blocks of their common prefix
/// (`share_prefixes`): of four sequences joining together over the same 40 tokens, the first
/// joins alone and the other three take its two full blocks at the next step (32 positions
/// each, not prefilled); a sequence of exactly two blocks takes one (a token is left to
/// prefill); a sequence with other tokens takes none. Shared blocks are held once, outlive
/// the sequence that computed them, survive the pool shrinking, and every returned row equals
/// recomputation throughout.
#[test]
fn sequences_share_the_blocks_of_equal_prefixes() {
    use prompt_r1_model::qwen3::BLOCK_SIZE;
    let Some(fx) = fixture("tiny") else { return };
    let model = load_with_a_longer_context(&fx.dir);
    let vocab = model.config.vocab_size as u32;
    let common: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % vocab).collect();
    let with_tail = |tail: &[u32]| -> Vec<u32> { common.iter().chain(tail).copied().collect() };
    let limits = DecoderLimits { share_prefixes: true, ..DecoderLimits::default() };
    let mut decoder = Decoder::<B>::new(limits);
    for id in 0..4u64 {
        decoder.add(&model, id, with_tail(&[1 + id as u32, 2, 3])).unwrap();
    }
    let worst = std::cell::Cell::new(0.0f32);
    let step = |decoder: &mut Decoder<B>| {
        let mut w = worst.get();
        let chosen = checked_step(&model, decoder, &mut w);
        worst.set(w);
        let ids: Vec<u64> = chosen.iter().map(|&(id, _)| id).collect();
        for (id, token) in chosen {
            decoder.accept(id, token).unwrap();
        }
        ids
    };
    assert_eq!(step(&mut decoder), [0], "the first of an uncached prefix joins alone");
    assert_eq!(decoder.stats().shared_prefix_tokens, 0);
    assert_eq!(step(&mut decoder), [0, 1, 2, 3], "the others join over its blocks");
    let shared = 3 * 2 * BLOCK_SIZE as u64;
    assert_eq!(decoder.stats().shared_prefix_tokens, shared);
    assert_eq!(decoder.stats().prefill_tokens, 43 + 3 * (43 - 32), "only the tails are prefilled");
    // Sequence 0's 3 blocks (44 positions), the others' third blocks, the scratch block.
    assert_eq!(decoder.kv_positions_in_use(), (3 + 3 + 1) * BLOCK_SIZE, "shared blocks are held once");

    // Exactly two full blocks: one is taken, the last token's block prefilled. Other tokens:
    // nothing taken.
    decoder.add(&model, 4, common[..2 * BLOCK_SIZE].to_vec()).unwrap();
    decoder.add(&model, 5, (0..40).map(|i| (i * 17 + 3) % vocab).collect()).unwrap();
    // A long sequence grows the pool for a while.
    decoder.add(&model, 9, (0..300).map(|i| (i * 7 + 1) % vocab).collect()).unwrap();
    // The leader ends; its blocks stay with the sequences that share them.
    decoder.finish(0);
    for _ in 0..3 {
        step(&mut decoder);
    }
    decoder.finish(9);
    assert_eq!(decoder.stats().shared_prefix_tokens, shared + BLOCK_SIZE as u64);
    // Parked, the sequences' shared blocks move once when the pool shrinks; they come back
    // and go on as before.
    for id in 1..6u64 {
        decoder.park(id).unwrap();
    }
    let in_use = decoder.kv_positions_in_use();
    assert_eq!(decoder.kv_positions(), in_use, "the pool shrinks to the blocks in use, shared ones once");
    decoder.extend(&model, 2, &[7, 8]).unwrap();
    decoder.extend(&model, 4, &[9]).unwrap();
    // A new sequence still finds the prefix its parked holders keep.
    decoder.add(&model, 6, with_tail(&[4])).unwrap();
    for _ in 0..4 {
        step(&mut decoder);
    }
    assert_eq!(decoder.stats().shared_prefix_tokens, shared + 3 * BLOCK_SIZE as u64);
    assert!(worst.get() < ATOL, "with shared prefixes, logits differ from recomputation by {}", worst.get());
    for id in 1..7u64 {
        decoder.finish(id);
    }
    assert_eq!(decoder.kv_positions(), 0, "the pool is freed once every sequence has finished");

    // Without sharing, the same four sequences join together and prefill everything.
    let mut decoder = Decoder::<B>::new(DecoderLimits::default());
    for id in 0..4u64 {
        decoder.add(&model, id, with_tail(&[1 + id as u32, 2, 3])).unwrap();
    }
    assert_eq!(step(&mut decoder), [0, 1, 2, 3]);
    assert_eq!((decoder.stats().shared_prefix_tokens, decoder.stats().prefill_tokens), (0, 4 * 43));
}

/// Within a KV budget, blocks that parked sequences share count as room: dropping every
/// holder's cache frees them. Two parked sequences share a 32-position prefix (held once); a new
/// 60-token sequence needs four blocks where one is free, so both parked caches are dropped
/// (their own blocks and the shared ones) rather than the new sequence refused as too large for
/// the budget; the parked two come back, share again, and every row equals recomputation.
#[test]
fn a_kv_budget_counts_shared_blocks_as_room() {
    use prompt_r1_model::qwen3::BLOCK_SIZE;
    let Some(fx) = fixture("tiny") else { return };
    let model = load(&fx.dir);
    let vocab = model.config.vocab_size as u32;
    let common: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % vocab).collect();
    let budget = 6 * BLOCK_SIZE;
    let mut decoder = Decoder::<B>::new(DecoderLimits { kv_budget: Some(budget), share_prefixes: true, ..DecoderLimits::default() });
    for id in 0..2u64 {
        decoder.add(&model, id, common.iter().chain(&[1 + id as u32, 2, 3]).copied().collect()).unwrap();
    }
    let mut worst = 0.0f32;
    while decoder.stats().prefill_tokens < 43 + 11 {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            decoder.accept(id, token).unwrap();
            decoder.park(id).unwrap();
        }
    }
    // Two shared blocks, each sequence's third, the scratch block.
    assert_eq!(decoder.kv_positions_in_use(), 5 * BLOCK_SIZE);
    decoder.add(&model, 2, (0..60).map(|i| (i * 17 + 3) % vocab).collect()).unwrap();
    for _ in 0..3 {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            decoder.accept(id, token).unwrap();
        }
        assert!(decoder.kv_positions() <= budget, "{} held over {budget}", decoder.kv_positions());
    }
    assert_eq!(decoder.stats().evictions, 2, "{:?}", decoder.stats());
    decoder.finish(2);
    decoder.extend(&model, 0, &[4]).unwrap();
    decoder.extend(&model, 1, &[5]).unwrap();
    for _ in 0..3 {
        for (id, token) in checked_step(&model, &mut decoder, &mut worst) {
            decoder.accept(id, token).unwrap();
        }
        assert!(decoder.kv_positions() <= budget, "{} held over {budget}", decoder.kv_positions());
    }
    assert_eq!(decoder.stats().shared_prefix_tokens, 2 * 2 * BLOCK_SIZE as u64, "shared before and after the evictions");
    assert!(worst < ATOL, "logits differ from recomputation by {worst}");
}

//! The server agent and engine against fake workers (see `fake`): the request's fields, the
//! recording of what comes back, episode affinity, failover, and the policy pushes.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::Flex;
use env::{EpisodeConfig, StopReason, Trajectory, TurnEnd};
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::tiny_tokenizer::{train_tiny_tokenizer, TINY_VOCAB_SIZE};
use model::tokenizer::Qwen3Tokenizer;
use model::{load_pretrained, LoadOptions, LoraAdapters, LoraConfig, LoraModel, Preset, Qwen3ForCausalLM, Sampling};
use serde_json::{json, Value};

use super::fake::{Answer, FakeWorker, Received};
use super::http::parse_completion;
use super::{ServerAgent, ServerEngine, ServerPool, ServerSettings};
use crate::rollout::{turn_seed, LocalAgent, RolloutBatch, RolloutEngine};
use crate::run::TrainError;

fn tokenizer() -> &'static Qwen3Tokenizer {
    static TOKENIZER: OnceLock<Qwen3Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap())
}

/// A random tiny model over the tiny tokenizer, in `dir`.
fn tiny_model(dir: &Path) -> Qwen3ForCausalLM<Flex> {
    let special = *tokenizer().special();
    let config = Preset::Tiny.config(tokenizer().vocab_size(), vec![special.im_end]);
    write_random_checkpoint(&config, dir, 5, StorageDtype::F32).unwrap();
    load_pretrained::<Flex>(dir, &Default::default(), LoadOptions::default()).unwrap()
}

fn settings(urls: &[&str]) -> ServerSettings {
    ServerSettings {
        urls: urls.iter().map(|u| u.to_string()).collect(),
        request_timeout_secs: 30,
        sync_timeout_secs: 30,
        model_name: Some("tiny".into()),
        ..Default::default()
    }
}

fn pool(urls: &[&str]) -> ServerPool {
    ServerPool::new(&settings(urls), false).unwrap()
}

struct Echo;
impl env::Environment for Echo {
    fn complete(&self, messages: &[env::ChatMessage]) -> Result<String, env::EnvError> {
        Ok(format!("echo of {} messages", messages.len()))
    }
}

fn episode_config(max_turn_tokens: usize) -> EpisodeConfig {
    EpisodeConfig { max_turn_tokens, ..EpisodeConfig::training() }
}

/// A completion reply in vLLM's shape with these ids and log-probs.
fn completion_json(body: &Value, ids: &[u32], logprobs: &[f64]) -> String {
    let finish = if ids.last() == Some(&tokenizer().special().im_end) { "stop" } else { "length" };
    json!({
        "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body["model"],
        "choices": [{
            "index": 0, "text": "",
            "logprobs": {"tokens": ids.iter().map(|_| "").collect::<Vec<_>>(), "token_logprobs": logprobs, "top_logprobs": null, "text_offset": []},
            "finish_reason": finish, "stop_reason": null,
            "prompt_token_ids": body["prompt"], "token_ids": ids,
        }],
        "usage": {"prompt_tokens": 0, "completion_tokens": ids.len(), "total_tokens": ids.len()},
    })
    .to_string()
}

fn prompt_text(body: &Value) -> String {
    let ids: Vec<u32> = body["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    tokenizer().decode(&ids, false).unwrap()
}

/// A scripted worker's turn: a call first, an answer once the context holds a reply; its
/// log-probs follow from the seed, so a turn sent twice comes back the same.
fn scripted_reply(body: &Value) -> String {
    let text = if prompt_text(body).contains("echo of") {
        "<think>done</think>\n<answer>42</answer>"
    } else {
        "<think>ask</think>\n<interaction_prompt>what is it</interaction_prompt>"
    };
    let mut ids = tokenizer().encode(text).unwrap();
    ids.push(tokenizer().special().im_end);
    ids.truncate(body["max_tokens"].as_u64().unwrap() as usize);
    let seed = body["seed"].as_u64().unwrap();
    let logprobs: Vec<f64> = (0..ids.len()).map(|k| -(((seed % 89) + k as u64) as f64) / 64.0).collect();
    completion_json(body, &ids, &logprobs)
}

fn scripted(request: &Received) -> Answer {
    match request.path.as_str() {
        "/v1/completions" => Answer::Json(200, scripted_reply(&request.json())),
        _ => Answer::Json(404, r#"{"error": {"message": "no such route"}}"#.into()),
    }
}

/// Runs `questions` through a [`ServerAgent`] on `pool` (batch stream 7).
fn run(pool: &mut ServerPool, questions: &[&str], sampling: Sampling, episode: &EpisodeConfig) -> Vec<Trajectory> {
    let mut agent = ServerAgent::new(pool, tokenizer(), sampling, tokenizer().vocab_size());
    agent.set_batch_stream(7);
    env::run_episodes(&mut agent, &Echo, questions, episode)
}

fn content(ts: &[Trajectory]) -> Vec<(Vec<u32>, Vec<u8>, Vec<f32>)> {
    ts.iter().map(|t| (t.token_ids.clone(), t.loss_mask.clone(), t.logprobs.clone())).collect()
}

#[test]
fn requests_carry_the_documented_fields() {
    let worker = FakeWorker::start(scripted);
    let mut pool = pool(&[&format!("{}/v1/", worker.url)]);
    let sampling = Sampling { temperature: 0.7, top_p: Some(0.9), top_k: Some(5), seed: 3 };
    let t = run(&mut pool, &["Who wrote Hamlet?"], sampling, &episode_config(64)).remove(0);
    assert_eq!(t.stop_reason, StopReason::Answer, "{t:?}");
    let bodies = worker.bodies("/v1/completions");
    assert_eq!(bodies.len(), 2, "a call, then an answer");
    let special = *tokenizer().special();
    for (turn, body) in bodies.iter().enumerate() {
        assert_eq!(body["model"], "tiny");
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["temperature"].as_f64(), Some(0.7));
        assert_eq!(body["top_p"].as_f64(), Some(0.9));
        assert_eq!(body["top_k"], 5);
        assert_eq!(body["seed"].as_u64(), Some(turn_seed(3, 7, 0, turn as u64)));
        assert_eq!(body["logprobs"], 0);
        assert_eq!(body["return_token_ids"], true);
        assert_eq!(body["skip_special_tokens"], false);
        assert_eq!(body["stop_token_ids"], json!([special.im_end, special.endoftext]));
        // The prompt is the episode's whole context so far, as token ids.
        let prompt: Vec<u32> = body["prompt"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert!(t.token_ids.starts_with(&prompt));
        assert_eq!(prompt.len() == t.prompt_len, turn == 0);
        assert!(t.loss_mask[prompt.len() - 1] == 0, "a turn starts after a context token");
    }
    let received = worker.received();
    assert!(received.iter().all(|r| r.method == "POST" && r.authorization.is_none()));
    // Unset sampling keys are left out (the worker's defaults: no truncation).
    let plain = FakeWorker::start(scripted);
    run(&mut pool_for(&plain), &["q"], Sampling { temperature: 1.0, seed: 1, ..Default::default() }, &episode_config(64));
    let body = &plain.bodies("/v1/completions")[0];
    assert!(body.get("top_p").is_none() && body.get("top_k").is_none(), "{body}");
}

fn pool_for(worker: &FakeWorker) -> ServerPool {
    pool(&[&worker.url])
}

#[test]
fn sampled_ids_and_logprobs_are_recorded_as_they_came() {
    let worker = FakeWorker::start(scripted);
    let sampling = Sampling { temperature: 1.0, seed: 9, ..Default::default() };
    let t = run(&mut pool_for(&worker), &["Who wrote Hamlet?"], sampling.clone(), &episode_config(64)).remove(0);
    let bodies = worker.bodies("/v1/completions");
    let special = *tokenizer().special();
    let mut at = 0;
    for (turn, body) in bodies.iter().enumerate() {
        let reply: Value = serde_json::from_str(&scripted_reply(body)).unwrap();
        let ids: Vec<u32> = serde_json::from_value(reply["choices"][0]["token_ids"].clone()).unwrap();
        let lps: Vec<f64> = serde_json::from_value(reply["choices"][0]["logprobs"]["token_logprobs"].clone()).unwrap();
        let start = body["prompt"].as_array().unwrap().len();
        assert_eq!(&t.token_ids[start..start + ids.len()], &ids[..]);
        assert!(t.loss_mask[start..start + ids.len()].iter().all(|&m| m == 1));
        let recorded: Vec<f32> = lps.iter().map(|&lp| lp as f32).collect();
        assert_eq!(&t.logprobs[start..start + ids.len()], &recorded[..]);
        // The turn ended on <|im_end|>: recorded, but not part of the turn's text.
        assert_eq!(t.turns[turn].end, TurnEnd::ImEnd);
        assert_eq!(*ids.last().unwrap(), special.im_end);
        assert_eq!(t.turns[turn].tokens, ids.len());
        let text = tokenizer().decode(&ids[..ids.len() - 1], false).unwrap();
        assert!(t.turns[turn].text.ends_with(&text), "{:?} vs {text:?}", t.turns[turn].text);
        at = start + ids.len();
    }
    assert_eq!(at, t.token_ids.len(), "nothing after the answer");
    assert_eq!(t.answer.as_deref(), Some("42"));
    assert_eq!(t.loss_mask.iter().filter(|&&m| m == 1).count(), t.logprobs.iter().filter(|&&lp| lp != 0.0).count());

    // A turn cut by its budget ends with `Length`, its tokens all recorded.
    let short = run(&mut pool_for(&worker), &["q"], sampling, &episode_config(3)).remove(0);
    assert_eq!(short.turns.len(), 1);
    assert_eq!((short.turns[0].end, short.turns[0].tokens), (TurnEnd::Length, 3));
    assert_eq!(short.loss_mask.iter().filter(|&&m| m == 1).count(), 3);
    assert_eq!(short.stop_reason, StopReason::TokenLimit);
}

#[test]
fn the_reply_vllm_documents_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm_completion_response.json");
    let body = std::fs::read_to_string(path).unwrap();
    let stops = [151645, 151643];
    let completion = parse_completion(&body, 16, 151_936, &stops).unwrap();
    assert_eq!(completion.ids, [27, 26865, 29, 151645]);
    assert_eq!(completion.logprobs, [-0.0123, -1.5, -0.25, -0.03125]);
    // No `prompt_tokens_details` (vLLM without --enable-prompt-tokens-details): the whole prompt
    // counts as prefilled.
    assert_eq!(completion.prefilled, 9);

    // The prefill a reply's usage reports: its prompt less the prefix cache's tokens; none without usage.
    let choice = json!([{"index": 0, "text": "", "token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}}]);
    for (usage, prefilled) in [
        (json!({"prompt_tokens": 20, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 15}}), 5),
        (json!({"prompt_tokens": 20, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": null}}), 20),
        (json!(null), 0),
    ] {
        let body = json!({"choices": choice, "usage": usage}).to_string();
        assert_eq!(parse_completion(&body, 4, 512, &[7]).unwrap().prefilled, prefilled, "{body}");
    }

    // What is checked, each with a message saying what is wrong.
    let reply = |ids: Value, lps: Value| {
        json!({"choices": [{"index": 0, "text": "", "token_ids": ids, "logprobs": {"token_logprobs": lps}}]}).to_string()
    };
    for (body, max_tokens, needle) in [
        (reply(json!([1, 2]), json!([-0.5])), 4, "2 token ids but 1 log-probs"),
        (reply(json!([1, 900]), json!([-0.5, -0.5])), 4, "outside the vocabulary"),
        (reply(json!([]), json!([])), 4, "no token"),
        (reply(json!([1, 2, 3]), json!([-0.5, -0.5, -0.5])), 2, "over max_tokens"),
        (reply(json!([1, 7, 3]), json!([-0.5, -0.5, -0.5])), 4, "not the last"),
        (reply(json!([1]), json!([null])), 4, "null"),
        (json!({"choices": [{"text": "x", "logprobs": null}]}).to_string(), 4, "token_ids"),
        (json!({"choices": [{"text": "x", "token_ids": [1], "logprobs": null}]}).to_string(), 4, "logprobs"),
        ("Internal error".to_string(), 4, "not a completion reply"),
    ] {
        let err = parse_completion(&body, max_tokens, 512, &[7]).unwrap_err();
        assert!(err.contains(needle), "{body}: {err}");
    }
}

/// The question a completion request belongs to (the prompt names it).
fn question_of(body: &Value, questions: &[&str]) -> usize {
    let text = prompt_text(body);
    questions.iter().position(|q| text.contains(q)).unwrap()
}

#[test]
fn an_episode_stays_on_one_worker_and_episodes_spread() {
    let (a, b) = (FakeWorker::start(scripted), FakeWorker::start(scripted));
    let questions = ["first question", "second question", "third question", "fourth question"];
    let mut pool = pool(&[&a.url, &b.url]);
    let sampling = Sampling { temperature: 1.0, seed: 2, ..Default::default() };
    let ts = run(&mut pool, &questions, sampling.clone(), &episode_config(64));
    assert!(ts.iter().all(|t| t.stop_reason == StopReason::Answer && t.turns.len() == 2), "{ts:?}");
    let on = |w: &FakeWorker| -> Vec<usize> {
        let mut qs: Vec<usize> = w.bodies("/v1/completions").iter().map(|b| question_of(b, &questions)).collect();
        qs.sort_unstable();
        qs
    };
    // Assigned in index order to the worker with fewer episodes: 0 and 2 on a, 1 and 3 on b,
    // every turn of each on its worker.
    assert_eq!(on(&a), [0, 0, 2, 2]);
    assert_eq!(on(&b), [1, 1, 3, 3]);
    assert_eq!(pool.retries(), 0);
    // One worker or two: the same episodes.
    let single = FakeWorker::start(scripted);
    assert!(content(&run(&mut pool_for(&single), &questions, sampling, &episode_config(64))) == content(&ts));
}

#[test]
fn a_failed_worker_s_turns_are_sent_again_elsewhere() {
    // `a` answers first turns and drops the connection on every later one.
    let a = FakeWorker::start(|r: &Received| if prompt_text(&r.json()).contains("echo of") { Answer::Drop } else { scripted(r) });
    let b = FakeWorker::start(scripted);
    let questions = ["first question", "second question", "third question", "fourth question"];
    let sampling = Sampling { temperature: 1.0, seed: 2, ..Default::default() };
    let mut pool = pool(&[&a.url, &b.url]);
    let ts = run(&mut pool, &questions, sampling.clone(), &episode_config(64));
    // Every episode finished once, as it would have on healthy workers.
    assert_eq!(ts.len(), 4);
    assert!(ts.iter().all(|t| t.stop_reason == StopReason::Answer && t.turns.len() == 2), "{ts:?}");
    let healthy = FakeWorker::start(scripted);
    assert!(content(&run(&mut pool_for(&healthy), &questions, sampling, &episode_config(64))) == content(&ts));
    // Each dropped turn was sent again once, to b; a is left out.
    let dropped = a.bodies("/v1/completions").iter().filter(|b| prompt_text(b).contains("echo of")).count();
    assert!(dropped >= 1);
    assert_eq!(pool.retries(), dropped as u64);
    assert_eq!(pool.live(), 1);
    let second_turns_on_b: Vec<usize> = b
        .bodies("/v1/completions")
        .iter()
        .filter(|body| prompt_text(body).contains("echo of"))
        .map(|body| question_of(body, &questions))
        .collect();
    assert_eq!(second_turns_on_b.len(), 4, "every second turn was answered by b: {second_turns_on_b:?}");
}

#[test]
fn client_errors_are_not_sent_elsewhere() {
    let a = FakeWorker::start(|_: &Received| Answer::Json(400, r#"{"error": {"message": "the prompt is too long", "type": "BadRequestError", "param": null, "code": 400}}"#.into()));
    let b = FakeWorker::start(scripted);
    let mut pool = pool(&[&a.url, &b.url]);
    let t = run(&mut pool, &["q"], Sampling::default(), &episode_config(64)).remove(0);
    assert_eq!(t.stop_reason, StopReason::AgentFailure);
    let error = t.error.unwrap();
    assert!(error.contains("the prompt is too long") && error.contains(&a.url) && error.contains("400"), "{error}");
    assert!(b.received().is_empty());
    assert_eq!((pool.retries(), pool.live()), (0, 2));
}

#[test]
fn with_no_worker_left_the_turn_fails_naming_every_worker() {
    let a = FakeWorker::start(|_: &Received| Answer::Drop);
    let b = FakeWorker::start(|_: &Received| Answer::Json(503, r#"{"message": "overloaded"}"#.into()));
    let mut pool = pool(&[&a.url, &b.url]);
    let t = run(&mut pool, &["q"], Sampling::default(), &episode_config(64)).remove(0);
    assert_eq!(t.stop_reason, StopReason::AgentFailure);
    let error = t.error.unwrap();
    assert!(error.contains("no rollout worker is left") && error.contains(&a.url) && error.contains(&b.url), "{error}");
    assert!(error.contains("overloaded"), "{error}");
    assert_eq!((pool.retries(), pool.live()), (1, 0));
    assert!(t.token_ids.len() == t.prompt_len, "nothing recorded from a failed turn");
}

/// A worker that loads what it is told and lists it under `/v1/models`; with `stale`, it
/// accepts loads but keeps listing its first roots.
fn loading_worker(stale: bool) -> FakeWorker {
    loading_worker_on(stale, "/models/initial")
}

/// [`loading_worker`], started on the base model at `base` (its base entry's root until full
/// weights are loaded).
fn loading_worker_on(stale: bool, base: &str) -> FakeWorker {
    let roots = Arc::new(Mutex::new((base.to_string(), "/models/initial".to_string())));
    FakeWorker::start(move |r: &Received| {
        let body = r.json();
        let mut roots = roots.lock().unwrap();
        match (r.method.as_str(), r.path.as_str()) {
            ("POST", "/v1/load_lora_adapter") => {
                if !stale {
                    roots.1 = body["lora_path"].as_str().unwrap().to_string();
                }
                Answer::Text(200, "Success: LoRA adapter 'policy' added successfully.".into())
            }
            ("POST", "/update_weights_from_disk") => {
                if !stale {
                    roots.0 = body["model_path"].as_str().unwrap().to_string();
                }
                Answer::Json(200, r#"{"success": true, "message": "loaded"}"#.into())
            }
            ("GET", "/v1/models") => Answer::Json(
                200,
                json!({"object": "list", "data": [
                    {"id": "served-tiny", "object": "model", "created": 0, "owned_by": "prompt-r1", "root": roots.0.as_str(), "parent": null, "max_model_len": 256},
                    {"id": "policy", "object": "model", "created": 0, "owned_by": "prompt-r1", "root": roots.1.as_str(), "parent": "served-tiny"},
                ]})
                .to_string(),
            ),
            ("POST", "/v1/completions") => Answer::Json(200, scripted_reply(&body)),
            _ => Answer::Json(404, r#"{"error": {"message": "no such route"}}"#.into()),
        }
    })
}

fn policy_steps(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn lora_policies_are_loaded_on_every_worker_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(&dir.path().join("model"));
    let adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &model.config, 1, &Default::default());
    let (a, b) = (loading_worker(false), loading_worker(false));
    let pool = ServerPool::new(&settings(&[&a.url, &b.url]), true).unwrap();
    let root = dir.path().join("policy");
    let mut engine = ServerEngine::new(pool, root.clone(), dir.path().join("model"), StorageDtype::F32, 8);
    for step in 0..3 {
        RolloutEngine::<Flex>::policy_changed(&mut engine, step, LoraModel::new(&model, Some(&adapters))).unwrap();
    }
    let root = root.canonicalize().unwrap();
    for worker in [&a, &b] {
        let loads = worker.bodies("/v1/load_lora_adapter");
        assert_eq!(loads.len(), 3);
        for (step, load) in loads.iter().enumerate() {
            let path = root.join(crate::run::checkpoint::checkpoint_name(step as u64));
            assert_eq!(load, &json!({"lora_name": "policy", "lora_path": path.to_string_lossy(), "load_inplace": true}));
        }
        assert_eq!(worker.bodies("/v1/models").len(), 3, "each load is checked");
    }
    // The newest two are kept, each a PEFT adapter directory.
    let name = crate::run::checkpoint::checkpoint_name;
    assert_eq!(policy_steps(&root), [name(1), name(2)]);
    assert!(model::lora::is_adapter_dir(&root.join(name(2))));
    assert!(root.join(name(2)).join("adapter_model.safetensors").is_file());
    assert_eq!(engine.pool().live(), 2);

    // Requests then ask for the adapter.
    let questions = ["q"];
    let batch = RolloutBatch {
        policy: LoraModel::new(&model, Some(&adapters)),
        tokenizer: tokenizer(),
        env: &Echo,
        questions: &questions,
        episode: &episode_config(64),
        stream: 1,
        sampling: &Sampling::default(),
        longest_prompt: 0,
    };
    let (ts, stats) = engine.rollouts(batch).unwrap();
    assert_eq!((ts[0].stop_reason, stats.server_retries), (StopReason::Answer, 0));
    let asked: Vec<Value> = [&a, &b].iter().flat_map(|w| w.bodies("/v1/completions")).map(|b| b["model"].clone()).collect();
    assert_eq!(asked, ["policy", "policy"]);
}

/// A LoRA run's adapters apply to the worker's base: a worker whose base a full fine-tuning
/// run's push replaced with its policy (a `step-N` directory, gone or not) is left out, naming
/// both; one on the run's model, on a hub id, on a path of its own host or started with a
/// relative `--model` takes the adapters.
#[test]
fn adapters_are_pushed_only_to_workers_on_the_runs_base_model() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("model");
    let model = tiny_model(&base);
    let old_policy = dir.path().join("old-run").join("policy").join(crate::run::checkpoint::checkpoint_name(200));
    let adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &model.config, 1, &Default::default());
    let taken = [base.to_str().unwrap(), "Qwen/Qwen3-0.6B", "/models/Qwen3-0.6B", "."].map(|root| loading_worker_on(false, root));
    let on_old_policy = loading_worker_on(false, old_policy.to_str().unwrap());
    let urls: Vec<&str> = taken.iter().chain([&on_old_policy]).map(|w| w.url.as_str()).collect();
    let pool = ServerPool::new(&settings(&urls), true).unwrap();
    let mut engine = ServerEngine::new(pool, dir.path().join("policy"), base.clone(), StorageDtype::F32, 8);
    RolloutEngine::<Flex>::policy_changed(&mut engine, 0, LoraModel::new(&model, Some(&adapters))).unwrap();
    assert_eq!(engine.pool().live(), 4);
    let left_out = engine.pool().left_out();
    assert!(left_out.len() == 1 && left_out[0].starts_with(&on_old_policy.url), "{left_out:?}");
    let only_old = ServerPool::new(&settings(&[&on_old_policy.url]), true).unwrap();
    let mut engine = ServerEngine::new(only_old, dir.path().join("policy2"), base.clone(), StorageDtype::F32, 8);
    let err = RolloutEngine::<Flex>::policy_changed(&mut engine, 0, LoraModel::new(&model, Some(&adapters))).unwrap_err().to_string();
    assert!(err.contains(&on_old_policy.url) && err.contains("step-0000200") && err.contains("not on the run's model"), "{err}");
}

#[test]
fn a_worker_that_does_not_serve_the_pushed_policy_is_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(&dir.path().join("model"));
    let adapters = LoraAdapters::<Flex>::init(&LoraConfig::default(), &model.config, 1, &Default::default());
    let (good, stale) = (loading_worker(false), loading_worker(true));
    let pool = ServerPool::new(&settings(&[&stale.url, &good.url]), true).unwrap();
    let mut engine = ServerEngine::new(pool, dir.path().join("policy"), dir.path().join("model"), StorageDtype::F32, 8);
    RolloutEngine::<Flex>::policy_changed(&mut engine, 0, LoraModel::new(&model, Some(&adapters))).unwrap();
    assert_eq!(engine.pool().live(), 1);
    // Its episodes go to the worker that has the policy.
    let questions = ["first question", "second question"];
    let batch = RolloutBatch {
        policy: LoraModel::new(&model, Some(&adapters)),
        tokenizer: tokenizer(),
        env: &Echo,
        questions: &questions,
        episode: &episode_config(64),
        stream: 1,
        sampling: &Sampling::default(),
        longest_prompt: 0,
    };
    let (ts, stats) = engine.rollouts(batch).unwrap();
    assert!(ts.iter().all(|t| t.stop_reason == StopReason::Answer));
    // The step reports it left out, and why.
    assert_eq!(stats.workers_left_out.len(), 1, "{:?}", stats.workers_left_out);
    assert!(stats.workers_left_out[0].starts_with(&stale.url) && stats.workers_left_out[0].contains("did not take the policy"));
    assert!(stale.bodies("/v1/completions").is_empty());
    assert_eq!(good.bodies("/v1/completions").len(), 4);

    // With no worker serving it, the step fails naming the worker and what it serves.
    let only_stale = ServerPool::new(&settings(&[&stale.url]), true).unwrap();
    let mut engine = ServerEngine::new(only_stale, dir.path().join("policy2"), dir.path().join("model"), StorageDtype::F32, 8);
    let err = RolloutEngine::<Flex>::policy_changed(&mut engine, 0, LoraModel::new(&model, Some(&adapters))).unwrap_err();
    assert!(matches!(err, TrainError::Servers(_)), "{err}");
    let err = err.to_string();
    assert!(err.contains(&stale.url) && err.contains("/models/initial") && err.contains("not the policy just pushed"), "{err}");
}

#[test]
fn full_weights_are_written_and_reloaded_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let initial = dir.path().join("model");
    let model = tiny_model(&initial);
    std::fs::write(initial.join("tokenizer.json"), "{}").unwrap();
    let worker = loading_worker(false);
    // No model name configured: the worker's base entry names it.
    let settings = ServerSettings { model_name: None, ..settings(&[&worker.url]) };
    let pool = ServerPool::new(&settings, false).unwrap();
    let mut engine = ServerEngine::new(pool, dir.path().join("policy"), initial, StorageDtype::BF16, 8);
    RolloutEngine::<Flex>::policy_changed(&mut engine, 4, LoraModel::new(&model, None)).unwrap();
    let path = dir.path().join("policy").canonicalize().unwrap().join(crate::run::checkpoint::checkpoint_name(4));
    assert_eq!(worker.bodies("/update_weights_from_disk"), [json!({"model_path": path.to_string_lossy()})]);
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(path.join(file).is_file(), "{file}");
    }
    let written = model::checkpoint::Checkpoint::open(&path).unwrap();
    assert_eq!(written.dtype("model.embed_tokens.weight").unwrap(), StorageDtype::BF16);
    assert_eq!(policy_steps(&dir.path().join("policy")), [crate::run::checkpoint::checkpoint_name(4)], "no staging folder is left");

    let questions = ["q"];
    let batch = RolloutBatch {
        policy: LoraModel::new(&model, None),
        tokenizer: tokenizer(),
        env: &Echo,
        questions: &questions,
        episode: &episode_config(64),
        stream: 1,
        sampling: &Sampling::default(),
        longest_prompt: 0,
    };
    engine.rollouts(batch).unwrap();
    assert_eq!(worker.bodies("/v1/completions")[0]["model"], "served-tiny");
}

#[test]
fn a_rollout_with_every_worker_gone_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(&dir.path().join("model"));
    let a = FakeWorker::start(|_: &Received| Answer::Drop);
    let b = FakeWorker::start(|_: &Received| Answer::Drop);
    let mut engine = ServerEngine::new(pool(&[&a.url, &b.url]), dir.path().join("policy"), dir.path().join("model"), StorageDtype::F32, 8);
    let questions = ["first question", "second question"];
    let batch = RolloutBatch {
        policy: LoraModel::new(&model, None),
        tokenizer: tokenizer(),
        env: &Echo,
        questions: &questions,
        episode: &episode_config(64),
        stream: 1,
        sampling: &Sampling::default(),
        longest_prompt: 0,
    };
    let err = engine.rollouts(batch).unwrap_err().to_string();
    assert!(err.contains("every rollout worker failed") && err.contains(&a.url) && err.contains(&b.url), "{err}");
}

#[test]
fn the_api_key_is_sent_as_a_bearer_token() {
    let worker = FakeWorker::start(scripted);
    let var = "PROMPT_R1_TEST_ROLLOUT_WORKER_KEY";
    std::env::set_var(var, " sk-rollout \n");
    let settings = ServerSettings { api_key_env: Some(var.into()), ..settings(&[&worker.url]) };
    let mut pool = ServerPool::new(&settings, false).unwrap();
    assert!(!format!("{pool:?}").contains("sk-rollout"), "the key is not shown");
    run(&mut pool, &["q"], Sampling::default(), &episode_config(64));
    assert!(worker.received().iter().all(|r| r.authorization.as_deref() == Some("Bearer sk-rollout")));
    let unset = ServerSettings { api_key_env: Some("PROMPT_R1_TEST_SURELY_UNSET_VARIABLE".into()), ..settings };
    let err = ServerPool::new(&unset, false).unwrap_err();
    assert!(err.0.contains("rollout.servers.api_key_env") && err.0.contains("PROMPT_R1_TEST_SURELY_UNSET_VARIABLE"), "{err}");
}

/// A worker that samples with the model as `prompt-r1 serve` does: the request's row seeded
/// with `row_seed(seed, 0)` (`model::generate`'s first row).
fn model_worker(model: Qwen3ForCausalLM<Flex>) -> FakeWorker {
    let model = Mutex::new(model);
    FakeWorker::start(move |r: &Received| {
        let body = r.json();
        let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
        let stops: Vec<u32> = serde_json::from_value(body["stop_token_ids"].clone()).unwrap();
        let sampling = Sampling {
            temperature: body["temperature"].as_f64().unwrap() as f32,
            top_p: body["top_p"].as_f64().map(|p| p as f32),
            top_k: body["top_k"].as_u64().map(|k| k as usize),
            seed: body["seed"].as_u64().unwrap(),
        };
        let config = model::SamplingConfig { sampling, max_new_tokens: body["max_tokens"].as_u64().unwrap() as usize, stop_token_ids: stops };
        let out = model::generate(&*model.lock().unwrap(), &[prompt], &config).unwrap().remove(0);
        let logprobs: Vec<f64> = out.logprobs.iter().map(|&lp| f64::from(lp)).collect();
        Answer::Json(200, completion_json(&body, &out.tokens, &logprobs))
    })
}

/// Workers holding the policy sample what the local agent samples: the same turn seeds, and
/// the worker's row generator seeded as the local agent's turn generator.
#[test]
fn workers_with_the_policy_sample_what_the_local_agent_samples() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (a, b) = (model_worker(model.clone()), model_worker(model.clone()));
    let questions = ["What is 2 + 2?", "Who wrote Hamlet?", "Name a river."];
    let episode = episode_config(12);
    let sampling = Sampling { temperature: 1.0, seed: 3, ..Default::default() };
    let remote = run(&mut pool(&[&a.url, &b.url]), &questions, sampling.clone(), &episode);
    let mut local_agent = LocalAgent::new(&model, tokenizer(), sampling);
    local_agent.set_batch_stream(7);
    let local = env::run_episodes(&mut local_agent, &Echo, &questions, &episode);
    assert!(a.received().len() + b.received().len() >= questions.len());
    for (r, l) in remote.iter().zip(&local) {
        assert_eq!(r.token_ids, l.token_ids);
        assert_eq!(r.loss_mask, l.loss_mask);
        assert_eq!(r.turns.len(), l.turns.len());
        for (x, y) in r.logprobs.iter().zip(&l.logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
}

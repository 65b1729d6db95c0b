//! `[rollout] engine = "servers"` through whole training steps: workers that hold the policy
//! (fakes sampling with the model as `prompt-r1 serve` does, loading each pushed adapter from
//! disk) give the run exactly what local rollouts give it.

use std::sync::Mutex;

use burn::backend::Flex;
use model::lora::load_adapter;
use model::{load_pretrained, LoadOptions, LoraAdapters, LoraModel, Qwen3ForCausalLM, Sampling, SamplingConfig};
use serde_json::{json, Value};
use prompt_r1_trainer::rollout::servers::fake::{Answer, FakeWorker, Received};
use prompt_r1_trainer::rollout::ServerSettings;
use prompt_r1_trainer::run::RolloutEngineKind;

use crate::common::*;

/// A LoRA worker over `base`: `/v1/load_lora_adapter` loads the PEFT directory it is given,
/// `/v1/models` lists it (`root` = its path), and completions sample with the base and the
/// adapter, the row seeded as `serve` seeds it (`model::generate`'s first row).
fn lora_worker(base: Qwen3ForCausalLM<Flex>) -> FakeWorker {
    let state: Mutex<(Option<LoraAdapters<Flex>>, String)> = Mutex::new((None, String::new()));
    FakeWorker::start(move |r: &Received| {
        let body = r.json();
        let mut state = state.lock().unwrap();
        match r.path.as_str() {
            "/v1/load_lora_adapter" => {
                let path = body["lora_path"].as_str().unwrap().to_string();
                let (adapters, _) = load_adapter::<Flex>(std::path::Path::new(&path), &base.config, &Default::default()).unwrap();
                *state = (Some(adapters), path);
                Answer::Text(200, "Success: LoRA adapter 'policy' added successfully.".into())
            }
            "/v1/models" => Answer::Json(
                200,
                json!({"object": "list", "data": [
                    {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": null},
                    {"id": "policy", "object": "model", "root": state.1, "parent": "tiny"},
                ]})
                .to_string(),
            ),
            "/v1/completions" => {
                assert_eq!(body["model"], "policy");
                let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
                let sampling = Sampling {
                    temperature: body["temperature"].as_f64().unwrap() as f32,
                    top_p: body["top_p"].as_f64().map(|p| p as f32),
                    top_k: body["top_k"].as_u64().map(|k| k as usize),
                    seed: body["seed"].as_u64().unwrap(),
                };
                let config = SamplingConfig {
                    sampling,
                    max_new_tokens: body["max_tokens"].as_u64().unwrap() as usize,
                    stop_token_ids: serde_json::from_value(body["stop_token_ids"].clone()).unwrap(),
                };
                let policy = LoraModel::new(&base, state.0.as_ref());
                let out = model::generate(&policy, std::slice::from_ref(&prompt), &config).unwrap().remove(0);
                let reply = json!({
                    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "policy",
                    "choices": [{"index": 0, "text": "", "finish_reason": "length", "stop_reason": null,
                                 "logprobs": {"tokens": [], "token_logprobs": out.logprobs, "top_logprobs": null, "text_offset": []},
                                 "prompt_token_ids": prompt, "token_ids": out.tokens}],
                });
                Answer::Json(200, reply.to_string())
            }
            _ => Answer::Json(404, r#"{"error": {"message": "no such route"}}"#.into()),
        }
    })
}

#[test]
fn rollouts_on_workers_train_as_local_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    let (local_dir, remote_dir) = (dir.path().join("local"), dir.path().join("servers"));
    std::fs::create_dir_all(&local_dir).unwrap();
    std::fs::create_dir_all(&remote_dir).unwrap();
    let mut local = with_lora(setup(&local_dir));
    // The workers run the adapters beside the base; so does the local engine here, so that both
    // compute alike to the last bit (merged, the logits move by rounding: merge_lora's own test).
    local.rollout.merge_lora = false;
    let mut remote = with_lora(setup(&remote_dir));
    let base = load_pretrained::<Flex>(&remote.model, &Default::default(), LoadOptions::default()).unwrap();
    let workers = [lora_worker(base.clone()), lora_worker(base)];
    remote.rollout.engine = RolloutEngineKind::Servers;
    remote.rollout.servers = Some(ServerSettings { urls: workers.iter().map(|w| w.url.clone()).collect(), ..Default::default() });
    assert!(remote.validate().is_ok());

    let (local_trainer, local_records) = train(local, 3, false);
    let (remote_trainer, remote_records) = train(remote.clone(), 3, false);
    for (l, r) in local_records.iter().zip(&remote_records) {
        assert_eq!((l.reward_mean, l.agent_tokens, l.context_tokens), (r.reward_mean, r.agent_tokens, r.context_tokens), "step {}", l.step);
        assert_eq!((l.loss, l.pg_loss), (r.loss, r.pg_loss), "step {}", l.step);
        assert_eq!(r.server_retries, 0);
        assert_eq!((r.prefill_tokens, r.kv_peak_positions), (0, 0), "no local decoder ran");
    }
    assert!(local_records[0].prefill_tokens > 0);
    assert_eq!(
        adapter_values(local_trainer.adapters().unwrap()),
        adapter_values(remote_trainer.adapters().unwrap()),
        "the same episodes, the same updates"
    );
    // The policy before each rollout (steps 0, 1, 2) reached both workers; the newest two are kept.
    for worker in &workers {
        let loads: Vec<Value> = worker.bodies("/v1/load_lora_adapter");
        assert_eq!(loads.len(), 3);
        assert!(loads.iter().all(|l| l["lora_name"] == "policy" && l["load_inplace"] == true));
        assert!(loads[2]["lora_path"].as_str().unwrap().ends_with("step-0000002"), "{}", loads[2]);
        assert!(!worker.bodies("/v1/completions").is_empty(), "both workers sampled");
    }
    let mut kept: Vec<String> = std::fs::read_dir(remote.run.out_dir.join("policy"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-0000001", "step-0000002"]);
}

/// The tiny dataset's questions (see `setup`) and the city each names.
const CITIES: [(&str, &str); 6] =
    [("Paris?", "Paris"), ("Rome?", "Rome"), ("Oslo?", "Oslo"), ("Lima?", "Lima"), ("Bern?", "Bern"), ("Kyiv?", "Kyiv")];

/// A full-weights worker whose agent is scripted: the first turn of an episode calls the
/// environment about the episode's question (found by decoding the prompt's ids), a turn whose
/// context holds the environment's reply answers. Even seeds answer with the city, odd ones
/// with "Atlantis", so each group's rewards differ. Policy pushes are taken and listed.
fn scripted_agent_worker() -> FakeWorker {
    scripted_agent_worker_refusing(None)
}

/// [`scripted_agent_worker`], refusing with a 400 (not retried elsewhere) the turn after the
/// environment's reply of episodes about `refused`.
fn scripted_agent_worker_refusing(refused: Option<&'static str>) -> FakeWorker {
    let tokenizer = model::tiny_tokenizer::train_tiny_tokenizer(model::tiny_tokenizer::TINY_VOCAB_SIZE).unwrap();
    let served = Mutex::new(String::new());
    FakeWorker::start(move |r: &Received| {
        let body = r.json();
        match r.path.as_str() {
            "/update_weights_from_disk" => {
                *served.lock().unwrap() = body["model_path"].as_str().unwrap().to_string();
                Answer::Json(200, r#"{"success": true, "message": "loaded"}"#.into())
            }
            "/v1/models" => Answer::Json(
                200,
                json!({"object": "list", "data": [
                    {"id": "tiny", "object": "model", "root": *served.lock().unwrap(), "parent": null},
                ]})
                .to_string(),
            ),
            "/v1/completions" => {
                let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
                let context = tokenizer.decode(&prompt, false).unwrap();
                let (question, city) = CITIES.iter().find(|(q, _)| context.contains(q)).expect("a question in the prompt");
                let seed = body["seed"].as_u64().unwrap();
                if refused == Some(*question) && context.contains("<interaction_response>") {
                    return Answer::Json(400, r#"{"error": {"message": "refused", "type": "BadRequestError", "param": null, "code": 400}}"#.into());
                }
                let text = if context.contains("<interaction_response>") {
                    let said = if seed % 2 == 0 { city } else { "Atlantis" };
                    format!("<think>the reply says</think>\n<answer>{said}</answer>")
                } else {
                    format!("<think>ask</think>\n<interaction_prompt>Which city does {question} name</interaction_prompt>")
                };
                let mut ids = tokenizer.encode(&text).unwrap();
                ids.push(tokenizer.special().im_end);
                assert!(ids.len() <= body["max_tokens"].as_u64().unwrap() as usize, "the turn fits its budget");
                let logprobs: Vec<f64> = (0..ids.len()).map(|k| -(((seed % 89) + k as u64) as f64) / 64.0).collect();
                let reply = json!({
                    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop", "stop_reason": null,
                                 "logprobs": {"tokens": ids.iter().map(|_| "").collect::<Vec<_>>(), "token_logprobs": logprobs,
                                              "top_logprobs": null, "text_offset": []},
                                 "prompt_token_ids": prompt, "token_ids": ids}],
                    "usage": {"prompt_tokens": prompt.len(), "completion_tokens": ids.len(), "total_tokens": prompt.len() + ids.len()},
                });
                Answer::Json(200, reply.to_string())
            }
            _ => Answer::Json(404, r#"{"error": {"message": "no such route"}}"#.into()),
        }
    })
}

/// Fails every call about Rome (a 503 after its retries); names the city of the others.
#[derive(Default)]
struct NoRome {
    calls: Mutex<Vec<String>>,
}

impl env::Environment for NoRome {
    fn complete(&self, messages: &[env::ChatMessage]) -> Result<String, env::EnvError> {
        let prompt = &messages.last().unwrap().content;
        let (question, city) = CITIES.iter().find(|(q, _)| prompt.contains(q)).expect("the call names its question");
        self.calls.lock().unwrap().push(question.to_string());
        if *question == "Rome?" {
            return Err(env::EnvError::Http {
                url: "http://env/v1/chat/completions".into(),
                status: 503,
                message: "overloaded".into(),
                attempts: 3,
            });
        }
        Ok(format!("It names {city}."))
    }
}

/// 1 for the question's city, 0 otherwise; keeps what it scored.
#[derive(Default)]
struct CityAnswer {
    seen: Mutex<Vec<(String, Option<String>, usize)>>,
}

impl prompt_r1_trainer::run::EpisodeScorer for CityAnswer {
    fn score(&self, t: &env::Trajectory, _answers: &[String]) -> prompt_r1_trainer::run::EpisodeScore {
        self.seen.lock().unwrap().push((t.question.clone(), t.answer.clone(), t.turns.len()));
        let city = CITIES.iter().find(|(q, _)| *q == t.question).unwrap().1;
        let reward = if t.answer.as_deref().map(str::trim) == Some(city) { 1.0 } else { 0.0 };
        prompt_r1_trainer::run::EpisodeScore { reward, format: None, f1: None }
    }
}

/// Issue 32: during `train`, an environment failure drops only its episode and counts it
/// (`rollout/env_failures`); the batch's other episodes reach the environment, are scored and
/// learnt from, and the step goes on.
#[test]
fn an_environment_failure_drops_only_its_episode_during_training() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = every_question_each_step(setup(dir.path()));
    config.episode.max_turns = 3;
    config.episode.max_turn_tokens = 160;
    config.episode.max_response_tokens = 512;
    let worker = scripted_agent_worker();
    config.rollout.engine = RolloutEngineKind::Servers;
    config.rollout.servers = Some(ServerSettings { urls: vec![worker.url.clone()], ..Default::default() });
    assert!(config.validate().is_ok());
    let (questions, n) = (config.rollout.batch_size, config.rollout.n);
    assert_eq!(questions, CITIES.len(), "every question, Rome included, in every batch");

    let (env, scorer) = (NoRome::default(), CityAnswer::default());
    let mut trainer = prompt_r1_trainer::run::Trainer::<B>::start(config.clone(), Default::default(), false).unwrap();
    let steps = 3;
    let records: Vec<_> = (0..steps).map(|_| trainer.train_step(&env, &scorer).expect("the step goes on")).collect();

    let calls = env.calls.lock().unwrap().clone();
    let seen = scorer.seen.lock().unwrap().clone();
    for (k, r) in records.iter().enumerate() {
        assert_eq!(r.episodes, questions * n, "step {}", r.step);
        assert_eq!(r.env_failures, n, "step {}: exactly the Rome episodes failed", r.step);
        let why = r.env_failure_why.as_deref().unwrap_or_default();
        assert!(why.contains("503") && why.contains("overloaded"), "step {}: the cause is kept for the console: {why}", r.step);
        assert_eq!(r.agent_failure_why, None);
        // Kept episodes: a call and an answer; failed ones: the call alone.
        let turns = ((questions - 1) * n * 2 + n) as f32 / (questions * n) as f32;
        assert!((r.mean_turns - turns).abs() < 1e-5, "step {}: {} turns on average, not {turns}", r.step, r.mean_turns);
        assert!(r.reward_mean > 0.0 && r.reward_mean < 1.0, "step {}: {}", r.step, r.reward_mean);
        assert_eq!(r.optimizer_steps, 1, "step {}: the kept episodes were learnt from", r.step);
        assert!(r.loss.is_finite());
        // Every episode called the environment once; the scorer saw all but Rome's, each answered.
        let step_calls = &calls[k * questions * n..(k + 1) * questions * n];
        assert_eq!(step_calls.iter().filter(|q| *q == "Rome?").count(), n);
        let step_seen = &seen[k * (questions - 1) * n..(k + 1) * (questions - 1) * n];
        assert!(step_seen.iter().all(|(q, answer, turns)| q != "Rome?" && answer.is_some() && *turns == 2), "{step_seen:?}");
    }
    assert_eq!(calls.len(), steps * questions * n);
    assert_eq!(seen.len(), steps * (questions - 1) * n);

    // The metrics lines count them under `rollout/env_failures`.
    let text = std::fs::read_to_string(config.run.out_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), steps);
    assert!(lines.iter().all(|l| l["rollout/env_failures"] == n), "{text}");
    let read = prompt_r1_trainer::run::read_metrics(&config.run.out_dir).unwrap();
    assert_eq!(read.iter().map(|r| r.env_failures).collect::<Vec<_>>(), vec![n; steps]);
}

/// Names the city of every question.
#[derive(Default)]
struct EveryCity;

impl env::Environment for EveryCity {
    fn complete(&self, messages: &[env::ChatMessage]) -> Result<String, env::EnvError> {
        let prompt = &messages.last().unwrap().content;
        let (_, city) = CITIES.iter().find(|(q, _)| prompt.contains(q)).expect("the call names its question");
        Ok(format!("It names {city}."))
    }
}

/// An episode whose agent turn fails (a worker refuses it) is dropped and counted
/// (`rollout/agent_failures`), not scored and learnt from as if the policy had earned it.
#[test]
fn an_agent_failure_drops_only_its_episode_during_training() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = every_question_each_step(setup(dir.path()));
    config.episode.max_turns = 3;
    config.episode.max_turn_tokens = 160;
    config.episode.max_response_tokens = 512;
    let worker = scripted_agent_worker_refusing(Some("Rome?"));
    config.rollout.engine = RolloutEngineKind::Servers;
    config.rollout.servers = Some(ServerSettings { urls: vec![worker.url.clone()], ..Default::default() });
    let (questions, n) = (config.rollout.batch_size, config.rollout.n);
    let scorer = CityAnswer::default();
    let mut trainer = prompt_r1_trainer::run::Trainer::<B>::start(config.clone(), Default::default(), false).unwrap();
    let record = trainer.train_step(&EveryCity, &scorer).expect("the step goes on");
    assert_eq!((record.episodes, record.agent_failures, record.env_failures), (questions * n, n, 0));
    assert!(record.agent_failure_why.is_some() && record.env_failure_why.is_none(), "{record:?}");
    assert_eq!(record.optimizer_steps, 1, "the kept episodes were learnt from");
    let seen = scorer.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), (questions - 1) * n);
    assert!(seen.iter().all(|(q, _, _)| q != "Rome?"), "{seen:?}");
    let text = std::fs::read_to_string(config.run.out_dir.join("metrics.jsonl")).unwrap();
    let line: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(line["rollout/agent_failures"], n, "{text}");
}

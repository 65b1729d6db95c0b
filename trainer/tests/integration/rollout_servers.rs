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
    let local = with_lora(setup(&local_dir));
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

//! `[rollout] engine = "servers"`: GRPO runs whose rollouts go to two `prompt-r1 serve` workers
//! on loopback. The workers receive token-id prompts with each turn's seed, so with the policy
//! pushed to them after every step they sample exactly the tokens the trainer's own decoder
//! samples: the runs must equal local runs step for step (same episodes and tokens, rewards
//! equal; the loss, computed by the trainer from those tokens, within 1e-4 because a worker's
//! batch rounds its products differently from the trainer's). A worker killed in the middle of a
//! step loses no episode and doubles none: its turns are sent again to the other worker, whose
//! same seed gives the same tokens.

mod serve_harness;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use env::{ChatMessage, EnvError, Environment, Trajectory};
use model::checkpoint::StorageDtype;
use model::init::write_random_checkpoint;
use model::tiny_tokenizer::{train_tiny_tokenizer, write_tokenizer_files, TINY_VOCAB_SIZE};
use model::Preset;
use trainer::rollout::ServerSettings;
use trainer::run::{EpisodeScore, EpisodeScorer, RolloutEngineKind, StepRecord, TrainConfig, Trainer};
use serve_harness::Server;

type B = Autodiff<Flex>;

/// Steps per run: enough for the policy to move between syncs.
const STEPS: u64 = 4;

/// Replies with a fixed sentence (a random agent rarely calls it).
struct Scripted;

impl Environment for Scripted {
    fn complete(&self, _messages: &[ChatMessage]) -> Result<String, EnvError> {
        Ok("The answer is Paris.".into())
    }
}

/// Rewards the share of the agent's tokens below id 256, so that rewards vary within a group
/// and every step moves the policy.
struct ByteTokens;

impl EpisodeScorer for ByteTokens {
    fn score(&self, t: &Trajectory, _answers: &[String]) -> EpisodeScore {
        let agent: Vec<u32> = t.token_ids.iter().zip(&t.loss_mask).filter(|(_, &m)| m == 1).map(|(&id, _)| id).collect();
        let bytes = agent.iter().filter(|&&id| id < 256).count();
        EpisodeScore { reward: bytes as f32 / agent.len().max(1) as f32, format: None, f1: None }
    }
}

/// A tiny random model with its tokenizer in `dir/model`, six questions, one 8-token turn per
/// episode, 12 episodes a step, and a learning rate that moves the policy visibly.
fn setup(dir: &Path, lora: bool) -> TrainConfig {
    let model_dir = dir.join("model");
    let tokenizer = train_tiny_tokenizer(TINY_VOCAB_SIZE).unwrap();
    write_tokenizer_files(&tokenizer, &model_dir).unwrap();
    let special = *tokenizer.special();
    let config = Preset::Tiny.config(tokenizer.vocab_size(), vec![special.im_end, special.endoftext]);
    write_random_checkpoint(&config, &model_dir, 1, StorageDtype::F32).unwrap();
    if lora {
        // Without a trained model's spread of embeddings no hidden state moves the tied head's
        // logits far from uniform, and adapters have nothing to learn (see the trainer's tests).
        model::checkpoint::scale_tensors(&model_dir, |name| name == "model.embed_tokens.weight", 6.5).unwrap();
    }
    let rows: String = ["Paris?", "Rome?", "Oslo?", "Lima?", "Bern?", "Kyiv?"]
        .iter()
        .enumerate()
        .map(|(i, q)| format!("{{\"id\":\"q{i}\",\"data_source\":\"toy\",\"question\":\"{q}\",\"answers\":[\"x\"]}}\n"))
        .collect();
    std::fs::write(dir.join("train.jsonl"), rows).unwrap();
    std::fs::write(dir.join("system.txt"), "You help.").unwrap();
    std::fs::write(dir.join("instruction.txt"), "Answer.").unwrap();
    let lora_section = if lora { "[lora]\nrank = 8\nalpha = 16\n" } else { "" };
    let lr = if lora { 0.01 } else { 0.003 };
    let toml = format!(
        "model = \"model\"\n[data]\ntrain = [\"train.jsonl\"]\n\
         [episode]\nmax_turns = 1\nmax_turn_tokens = 8\nmax_response_tokens = 64\n\
         system_prompt = \"system.txt\"\ninstruction = \"instruction.txt\"\n\
         [rollout]\nbatch_size = 3\nn = 4\ngeneration_batch = 12\n[rollout.sampling]\nseed = 7\n\
         [grpo]\nmini_batch_size = 12\nmicro_batch_size = 6\n[grpo.loss]\nkl_coef = 0.0\n\
         [grpo.optimizer]\nlr = {lr}\n{lora_section}\
         [run]\nout_dir = \"run\"\nsteps = {STEPS}\nsave_every = 100\nvalidate_every = 0\n"
    );
    std::fs::write(dir.join("run.toml"), toml).unwrap();
    let config = TrainConfig::from_toml_file(&dir.join("run.toml")).unwrap();
    assert_eq!(config.lora.is_some(), lora);
    config
}

/// `config` with its rollouts on `workers`.
fn on_servers(mut config: TrainConfig, workers: &[&str]) -> TrainConfig {
    config.rollout.engine = RolloutEngineKind::Servers;
    config.rollout.servers = Some(ServerSettings {
        urls: workers.iter().map(|w| w.to_string()).collect(),
        request_timeout_secs: 60,
        ..ServerSettings::default()
    });
    config.run.out_dir = config.run.out_dir.with_file_name("run-servers");
    config
}

fn train(config: TrainConfig) -> Vec<StepRecord> {
    let mut trainer = Trainer::<B>::start(config, Default::default(), false).unwrap();
    (0..STEPS).map(|_| trainer.train_step(&Scripted, &ByteTokens).unwrap()).collect()
}

/// The two runs took the same steps: the same episodes and tokens, equal rewards, losses
/// within 1e-4 (see the module docs).
fn assert_same_run(local: &[StepRecord], remote: &[StepRecord]) {
    assert_eq!(local.len(), remote.len());
    for (l, r) in local.iter().zip(remote) {
        let step = l.step;
        assert_eq!((l.episodes, l.agent_tokens, l.env_failures), (r.episodes, r.agent_tokens, r.env_failures), "step {step}");
        assert!((l.reward_mean - r.reward_mean).abs() < 1e-6, "step {step}: reward {} vs {}", l.reward_mean, r.reward_mean);
        assert!((l.pg_loss - r.pg_loss).abs() < 1e-4, "step {step}: pg_loss {} vs {}", l.pg_loss, r.pg_loss);
        // One turn an episode: the workers prefill each prompt whole (their prefix cache serves
        // an episode's later turns), where the local decoder shares a group's common prompt.
        assert_eq!(r.prefill_tokens, l.prefill_tokens + l.shared_prefix_tokens, "step {step}: prefill tokens");
    }
    let rewards: Vec<f32> = local.iter().map(|r| r.reward_mean).collect();
    println!("rewards, local and on the workers: {rewards:.3?}");
}

/// Each worker holds the policy of the last step: `GET /v1/models` names its directory.
fn assert_workers_hold(workers: &[&Server], name: &str, policy: &Path) {
    for worker in workers {
        let models = worker.get("/v1/models").json();
        let entry = models["data"].as_array().unwrap().iter().find(|m| m["id"] == name).unwrap_or_else(|| panic!("{name} in {models}"));
        let root = Path::new(entry["root"].as_str().unwrap());
        assert_eq!(root.canonicalize().unwrap(), policy.canonicalize().unwrap(), "{models}");
    }
}

/// The policy the last step's rollouts ran on: the one after step `STEPS - 1`, pushed before
/// them (the last step's own update is pushed only before a next rollout). It is the newest of
/// the two policy directories kept.
fn last_pushed_policy(run: &Path) -> std::path::PathBuf {
    let mut dirs: Vec<_> = std::fs::read_dir(run.join("policy")).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    let names: Vec<_> = dirs.iter().map(|d| d.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, [format!("step-{:07}", STEPS - 2), format!("step-{:07}", STEPS - 1)], "the newest two are kept");
    dirs.pop().unwrap()
}

#[test]
fn full_fine_tuning_on_two_workers_equals_local_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path(), false);
    let local = train(config.clone());
    let (a, b) = (Server::start(&dir.path().join("model"), &[]), Server::start(&dir.path().join("model"), &[]));
    let remote = train(on_servers(config, &[&a.base_url, &b.base_url]));
    assert_same_run(&local, &remote);
    assert!(remote.iter().all(|r| r.server_retries == 0));
    // Workers left on the first policy would have sampled other tokens: a run whose policy
    // barely moves (learning rate 1e-12) differs from these after its first step.
    std::fs::create_dir(dir.path().join("frozen")).unwrap();
    let mut frozen = setup(&dir.path().join("frozen"), false);
    frozen.grpo.optimizer.lr = 1e-12;
    let frozen = train(frozen);
    assert!(frozen[1..].iter().zip(&local[1..]).any(|(f, l)| f.reward_mean != l.reward_mean), "the policy moved");
    let policy = last_pushed_policy(&dir.path().join("run-servers"));
    assert_workers_hold(&[&a, &b], "tiny", &policy);
}

#[test]
fn lora_on_two_workers_equals_local_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path(), true);
    // `serve` runs the adapters beside the base; so do the local rollouts here, so that both
    // compute alike to the last bit (merged, the logits move by rounding).
    config.rollout.merge_lora = false;
    let local = train(config.clone());
    let (a, b) = (Server::start(&dir.path().join("model"), &[]), Server::start(&dir.path().join("model"), &[]));
    let remote = train(on_servers(config, &[&a.base_url, &b.base_url]));
    assert_same_run(&local, &remote);
    let policy = last_pushed_policy(&dir.path().join("run-servers"));
    assert!(policy.join("adapter_config.json").is_file(), "{policy:?} is a PEFT adapter directory");
    assert_workers_hold(&[&a, &b], "policy", &policy);
}

/// A proxy in front of a worker that kills the worker's process as the `kill_at`-th completion
/// request passes through it, and cuts that connection: a worker dying in the middle of a step.
struct KillingProxy {
    pub url: String,
    pub requests: Arc<AtomicUsize>,
}

impl KillingProxy {
    fn start(target: &str, pid: u32, kill_at: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicUsize::new(0));
        let target = target.to_string();
        let counter = requests.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&target) else { continue };
                let (counter, client_in, server_out) = (counter.clone(), client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || pipe(server, client, None));
                std::thread::spawn(move || pipe(client_in, server_out, Some((counter, pid, kill_at))));
            }
        });
        Self { url, requests }
    }
}

/// Copies `from` to `to`; with a counter, counts the completion requests going through and, at
/// the `kill_at`-th, kills the worker and cuts both ends.
fn pipe(mut from: TcpStream, mut to: TcpStream, count: Option<(Arc<AtomicUsize>, u32, usize)>) {
    const REQUEST: &[u8] = b"POST /v1/completions";
    let mut buf = vec![0u8; 64 << 10];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((counter, pid, kill_at)) = &count {
            // The last bytes of the previous read, so that a request line split between two
            // reads is still seen (once: the kept bytes are shorter than the line).
            let mut scan = std::mem::take(&mut tail);
            scan.extend_from_slice(&buf[..n]);
            let seen = scan.windows(REQUEST.len()).filter(|w| *w == REQUEST).count();
            tail = scan[scan.len().saturating_sub(REQUEST.len() - 1)..].to_vec();
            if seen > 0 && counter.fetch_add(seen, Ordering::SeqCst) + seen >= *kill_at {
                let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
                let _ = from.shutdown(Shutdown::Both);
                let _ = to.shutdown(Shutdown::Both);
                return;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn a_worker_killed_mid_step_loses_no_episode() {
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path(), false);
    let local = train(config.clone());
    let a = Server::start(&dir.path().join("model"), &[]);
    let mut b = Server::start(&dir.path().join("model"), &[]);
    // 12 episodes of one turn a step, spread over the two workers: the second step's requests
    // pass the proxy from its 7th on, so the 9th is in the middle of step 2.
    let proxy = KillingProxy::start(&b.addr, b.pid(), 9);
    let remote = train(on_servers(config, &[&a.base_url, &proxy.url]));
    assert!(!b.is_running(), "the worker was killed");
    assert!(proxy.requests.load(Ordering::SeqCst) >= 9);
    assert_same_run(&local, &remote);
    let retries: Vec<u64> = remote.iter().map(|r| r.server_retries).collect();
    assert!(retries[1] > 0 && retries[0] == 0, "the dead worker's turns of step 2 were sent again: {retries:?}");
    let policy = last_pushed_policy(&dir.path().join("run-servers"));
    assert_workers_hold(&[&a], "tiny", &policy);
}

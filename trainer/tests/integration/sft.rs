//! Supervised fine-tuning of a tiny random Qwen3 (Autodiff<Flex>) on chat transcripts: the loss
//! falls, tokens outside the assistant messages contribute nothing, micro-batching is exact,
//! and a resumed run equals one that never stopped.

use crate::common;

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::SgdConfig;
use model::chat_template::ChatTemplate;
use model::tokenizer::Qwen3Tokenizer;
use model::{load_pretrained, LoadOptions, Qwen3ForCausalLM};
use prompt_r1_trainer::run::{latest_checkpoint, list_checkpoints, run_to_end, Resume};
use prompt_r1_trainer::sft::{
    read_sft_metrics, sft_step, RowEncoder, SftConfig, SftRecord, SftRun, SftSequence, SFT_CONFIG_FILE,
};

type B = Autodiff<Flex>;

const CAPITALS: [(&str, &str); 12] = [
    ("Norway", "Oslo"),
    ("Peru", "Lima"),
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Chile", "Santiago"),
    ("Spain", "Madrid"),
    ("Cuba", "Havana"),
    ("Nepal", "Kathmandu"),
    ("Ghana", "Accra"),
];

/// A tiny random model with the project's tokenizer, 12 chats, and an SFT config over them.
fn setup(dir: &Path) -> SftConfig {
    let model_dir = dir.join("model");
    common::tiny_model(&model_dir, 5);
    let rows: String = CAPITALS
        .iter()
        .map(|(country, city)| {
            format!(
                "{{\"messages\": [{{\"role\": \"system\", \"content\": \"Answer briefly.\"}}, \
                 {{\"role\": \"user\", \"content\": \"Capital of {country}?\"}}, \
                 {{\"role\": \"assistant\", \"content\": \"{city}.\"}}]}}\n"
            )
        })
        .collect();
    std::fs::write(dir.join("chats.jsonl"), rows).unwrap();
    let toml = r#"
model = "model"
[data]
train = ["chats.jsonl"]
validation = ["chats.jsonl"]
[train]
steps = 30
batch_size = 4
micro_batch_size = 2
seed = 3
[optimizer]
lr = 0.003
[run]
out_dir = "run"
save_every = 100
validate_every = 10
"#;
    std::fs::write(dir.join("sft.toml"), toml).unwrap();
    SftConfig::from_toml_file(&dir.join("sft.toml")).unwrap()
}

fn sequences(dir: &Path) -> Vec<SftSequence> {
    let tokenizer = Qwen3Tokenizer::from_dir(dir.join("model")).unwrap();
    let rows = RowEncoder {
        tokenizer: &tokenizer,
        template: ChatTemplate::Qwen3,
        max_length: None,
    };
    rows.load_files(&[dir.join("chats.jsonl")]).unwrap().0
}

fn load(dir: &Path) -> Qwen3ForCausalLM<B> {
    load_pretrained::<B>(
        &dir.join("model"),
        &Default::default(),
        LoadOptions::default(),
    )
    .unwrap()
}

/// One SGD step with lr 1 and no clipping from the initial model: the loss and, per parameter,
/// the change, which is minus the accumulated gradient.
fn sgd_update(
    dir: &Path,
    batch: &[SftSequence],
    micro_batch_size: usize,
) -> (f32, Vec<(String, Vec<f32>)>) {
    let model = load(dir);
    let before = common::named_weights(&model.valid());
    let mut optim = SgdConfig::new().init::<B, Qwen3ForCausalLM<B>>();
    let (model, stats) = sft_step(
        model,
        &(),
        &mut optim,
        batch,
        micro_batch_size,
        1.0,
        f32::INFINITY,
    )
    .unwrap();
    let after = common::named_weights(&model.valid());
    let deltas = before
        .into_iter()
        .zip(after)
        .map(|((name, b), (_, a))| (name, a.iter().zip(&b).map(|(x, y)| x - y).collect()))
        .collect();
    (stats.loss, deltas)
}

/// The largest difference between two updates, relative to the largest change.
fn relative_difference(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let flat =
        |u: &[(String, Vec<f32>)]| u.iter().flat_map(|(_, v)| v.clone()).collect::<Vec<f32>>();
    let (a, b) = (flat(a), flat(b));
    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0, "the update moved the weights");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
        / scale
}

/// 30 steps (10 epochs of the 12 chats): the training loss of the last 3 steps is below half
/// of the first step's, and the held-out loss (the same chats, measured at steps 10, 20, 30)
/// falls every time. A random 512-token model starts near ln 512 ≈ 6.2 nats per token and the
/// answers are memorised, so both margins leave room for noise in the data order.
#[test]
fn the_loss_falls_on_a_tiny_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let mut run = SftRun::<B>::start(config.clone(), Default::default(), false).unwrap();
    let (train, _) = run.data_summaries();
    assert_eq!((train.chats, train.episodes), (12, 0));
    let records: Vec<_> = (0..30).map(|_| run.train_step().unwrap()).collect();
    let first = records[0].loss;
    let last = records[27..].iter().map(|r| r.loss).sum::<f32>() / 3.0;
    println!("loss: step 1 {first:.3}, last 3 steps {last:.3}");
    assert!(
        first > 5.0 && last < 0.5 * first,
        "first {first}, last {last}"
    );
    let validation: Vec<f32> = records.iter().filter_map(|r| r.validation_loss).collect();
    println!("validation loss: {validation:?}");
    assert_eq!(validation.len(), 3);
    assert!(validation.windows(2).all(|w| w[1] < w[0]), "{validation:?}");
    assert!(records
        .iter()
        .all(|r| r.skipped_steps == 0 && r.grad_norm.is_some_and(f32::is_finite)));
    assert_eq!(read_sft_metrics(&config.run.out_dir).unwrap(), records);
    let settings: serde_json::Value = serde_json::from_slice(&std::fs::read(config.run.out_dir.join(SFT_CONFIG_FILE)).unwrap()).unwrap();
    assert!(settings["kernels"]["cpu"]["level"].is_string() && settings["kernels"]["gpu"].is_null(), "the kernels beside the settings: {settings}");
    // Without a checkpoint there is nothing to resume: a new start drops the old lines.
    drop(run);
    SftRun::<B>::start(config.clone(), Default::default(), false).unwrap();
    assert!(read_sft_metrics(&config.run.out_dir).unwrap().is_empty());
}

/// Each step reads the device's memory pool once as it ends, its validation included, into
/// `perf/max_memory_reserved_gb`; without a probe (the CPU) the key is null.
#[test]
fn each_step_reads_the_device_memory_pool_as_it_ends() {
    use prompt_r1_trainer::run::DeviceMemory;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let mut run = SftRun::<B>::start(config.clone(), Default::default(), false).unwrap();
    let plain = run.train_step().unwrap();
    assert_eq!(plain.max_memory_reserved_gb, None);
    // The n-th reading reserves n GiB.
    let readings = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&readings);
    run.watch_device_memory(Arc::new(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        Some(DeviceMemory { in_use: 0, reserved: n << 30 })
    }));
    let probed: Vec<Option<f32>> = (0..2).map(|_| run.train_step().unwrap().max_memory_reserved_gb).collect();
    assert_eq!(probed, [Some(1.0), Some(2.0)]);
    assert_eq!(readings.load(Ordering::SeqCst), 2);
    let written = read_sft_metrics(&config.run.out_dir).unwrap();
    assert_eq!(written.iter().map(|r| r.max_memory_reserved_gb).collect::<Vec<_>>(), [None, Some(1.0), Some(2.0)]);
}

/// Tokens outside the assistant messages contribute nothing: changing the last token of every
/// chat (the `\n` after the final `<|im_end|>`, mask 0, whose own prediction is its only use)
/// leaves the loss and every gradient as they were. The two updates run the same operations on
/// the same shapes, so they agree to rounding (1e-6 of the largest change; measured: equal).
#[test]
fn masked_tokens_contribute_nothing() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let batch: Vec<SftSequence> = sequences(dir.path()).into_iter().take(4).collect();
    let mut changed = batch.clone();
    for s in &mut changed {
        let last = s.tokens.len() - 1;
        assert_eq!(
            s.loss_mask[last], 0,
            "the rendered chat ends with a token outside the assistant span"
        );
        s.tokens[last] = 77;
    }
    assert_ne!(batch, changed);
    let (loss, update) = sgd_update(dir.path(), &batch, 4);
    let (changed_loss, changed_update) = sgd_update(dir.path(), &changed, 4);
    assert!(
        (loss - changed_loss).abs() <= 1e-6 * loss,
        "{loss} vs {changed_loss}"
    );
    let diff = relative_difference(&update, &changed_update);
    println!("masked token changed: loss {loss} vs {changed_loss}, update difference {diff:e}");
    assert!(diff <= 1e-6, "{diff}");

    // Marking a token trained changes both: the test can fail.
    let mut unmasked = batch.clone();
    let last = unmasked[0].tokens.len() - 1;
    unmasked[0].loss_mask[last] = 1;
    let (other_loss, other_update) = sgd_update(dir.path(), &unmasked, 4);
    assert!((loss - other_loss).abs() > 1e-4, "{loss} vs {other_loss}");
    assert!(relative_difference(&update, &other_update) > 1e-3);
}

/// Micro-batches of 1 (no padding) and one micro-batch of 4 (padded) give the same step: the
/// same loss and the same gradient, up to the order of the float sums (1e-5 relative).
#[test]
fn micro_batches_give_the_batch_gradient() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let batch: Vec<SftSequence> = sequences(dir.path()).into_iter().take(4).collect();
    assert!(
        batch
            .windows(2)
            .any(|w| w[0].tokens.len() != w[1].tokens.len()),
        "rows of different lengths"
    );
    let (whole_loss, whole) = sgd_update(dir.path(), &batch, 4);
    let (micro_loss, micro) = sgd_update(dir.path(), &batch, 1);
    assert!(
        (whole_loss - micro_loss).abs() <= 1e-5 * whole_loss,
        "{whole_loss} vs {micro_loss}"
    );
    let diff = relative_difference(&whole, &micro);
    println!("micro-batches of 1 vs 4: update difference {diff:e}");
    assert!(diff <= 1e-5, "{diff}");
}

/// The two records of one step have the same loss (1e-6: both runs compute it from the same
/// values in the same order).
fn assert_same_loss(a: &SftRecord, b: &SftRecord) {
    assert!((a.loss - b.loss).abs() <= 1e-6, "step {}: {} vs {}", a.step, a.loss, b.loss);
}

/// `steps` steps of `config`'s run written to `out` (continuing its checkpoint with `resume`).
fn run_steps(config: &SftConfig, out: PathBuf, resume: bool, steps: usize) -> (SftRun<B>, Vec<SftRecord>) {
    let mut config = config.clone();
    config.run.out_dir = out;
    let mut run = SftRun::<B>::start(config, Default::default(), resume).unwrap();
    let records: Vec<_> = (0..steps).map(|_| run.train_step().unwrap()).collect();
    (run, records)
}

/// 6 steps straight equal 3 steps, a checkpoint, a new run resumed from it and 3 more steps:
/// the same batches, losses and weights. Both runs execute the same operations in the same
/// order from the same f32 values (weights and AdamW moments are saved in f32 and reload
/// exactly), so the results are expected to be bit-identical; the comparison allows 1e-6 of
/// absolute difference so that it does not depend on that (measured: 0).
#[test]
fn resuming_equals_never_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.train.steps = Some(6);
    config.run.validate_every = 0;
    let run_to = |out: PathBuf, resume: bool, steps: usize| run_steps(&config, out, resume, steps);
    let (straight, all) = run_to(dir.path().join("straight"), false, 6);
    let (head_run, head) = run_to(dir.path().join("split"), false, 3);
    let saved = head_run.save_checkpoint().unwrap();
    drop(head_run);
    assert_eq!(
        latest_checkpoint(&dir.path().join("split")).unwrap(),
        Some(saved)
    );
    let (resumed, tail) = run_to(dir.path().join("split"), true, 3);
    assert_eq!(resumed.step_count(), 6);
    for (a, b) in all.iter().zip(head.iter().chain(&tail)) {
        assert_eq!(
            (a.step, a.epoch, a.tokens, a.lr),
            (b.step, b.epoch, b.tokens, b.lr),
            "step {}",
            a.step
        );
        assert_same_loss(a, b);
    }
    let (expected, got) = (
        common::named_weights(&straight.model().valid()),
        common::named_weights(&resumed.model().valid()),
    );
    let mut largest = 0.0f32;
    for ((name, e), (_, g)) in expected.iter().zip(&got) {
        let diff = e
            .iter()
            .zip(g)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        largest = largest.max(diff);
        assert!(diff <= 1e-6, "{name}: {diff}");
    }
    println!("resumed vs straight: largest weight difference {largest:e}");
    let steps: Vec<u64> = read_sft_metrics(&dir.path().join("split"))
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    // While the run lives, another one cannot write its directory.
    let mut again = config.clone();
    again.run.out_dir = dir.path().join("split");
    let err = SftRun::<B>::start(again, Default::default(), true).err().unwrap().to_string();
    assert!(err.contains("another run is writing"), "{err}");
    drop(resumed);
    // A fresh start refuses to overwrite a run with checkpoints.
    let mut again = config.clone();
    again.run.out_dir = dir.path().join("split");
    let err = SftRun::<B>::start(again, Default::default(), false)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("--resume"), "{err}");
}

/// The session's cadence (a checkpoint every 2 of 4 steps and at the last), then a damaged newest
/// checkpoint: `--resume` stops with an error naming `--resume-from` and the checkpoint left;
/// resuming from that one drops the later metrics and continues exactly, after which the
/// newest checkpoint is whole again.
#[test]
fn a_damaged_checkpoint_names_resume_from_and_an_earlier_one_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    config.train.steps = Some(4);
    config.run.validate_every = 0;
    config.run.save_every = 2;
    config.run.out_dir = dir.path().join("run");
    let out = config.run.out_dir.clone();
    let mut run = SftRun::<B>::start(config.clone(), Default::default(), false).unwrap();
    let mut saved = Vec::new();
    let all = run_to_end(&mut run, |r| r.train_step(), |_, record, dir| {
        saved.push((record.step, dir.map(Path::to_path_buf)))
    })
    .unwrap();
    drop(run);
    let checkpoint = |step: u64| out.join(format!("checkpoints/step-{step:07}"));
    assert_eq!(
        saved,
        [(1, None), (2, Some(checkpoint(2))), (3, None), (4, Some(checkpoint(4)))]
    );
    assert_eq!(list_checkpoints(&out).unwrap(), [2, 4]);

    std::fs::write(checkpoint(4).join("model.safetensors"), b"damaged").unwrap();
    let err = SftRun::<B>::start(config.clone(), Default::default(), true)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("step-0000004") && err.contains("--resume-from STEP"), "{err}");
    assert!(err.contains("checkpoints: step 2"), "{err}");
    let err = SftRun::<B>::start(config.clone(), Default::default(), Resume::From(3))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("step-0000003") && err.contains("steps 2, 4"), "{err}");

    let mut resumed = SftRun::<B>::start(config.clone(), Default::default(), Resume::From(2)).unwrap();
    assert_eq!(resumed.step_count(), 2);
    let steps = |out: &Path| -> Vec<u64> { read_sft_metrics(out).unwrap().iter().map(|r| r.step).collect() };
    assert_eq!(steps(&out), [1, 2]);
    let tail = run_to_end(&mut resumed, |r| r.train_step(), |_, _, _| {}).unwrap();
    for (a, b) in all[2..].iter().zip(&tail) {
        assert_same_loss(a, b);
    }
    drop(resumed);
    assert_eq!(steps(&out), [1, 2, 3, 4]);
    assert_eq!(latest_checkpoint(&out).unwrap(), Some(checkpoint(4)));
    assert_eq!(SftRun::<B>::start(config, Default::default(), true).unwrap().step_count(), 4);
}

/// Every adapter matrix of a LoRA run, in order.
fn adapter_values(run: &SftRun<B>) -> Vec<Vec<f32>> {
    common::adapter_values(run.adapters().expect("a LoRA run has adapters"))
}

/// SFT with `[lora]` (rank 8 on every projection, a bf16 base): only the adapters move, the
/// loss falls (the last 3 of 20 steps below 0.75 of the first, measured 6.74 -> 3.04, on the tiny model with its
/// embeddings scaled as in the GRPO LoRA tests: with the random init's, adapters cannot move
/// any logit far, and the loss only went 6.00 -> 5.54 in 12 steps), the
/// checkpoint is a PEFT adapter directory without the base, and resuming from it equals never
/// stopping (same code on the same f32 adapter values and AdamW state; allowed 1e-6,
/// measured 0).
#[test]
fn lora_sft_trains_the_adapters_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = setup(dir.path());
    // Logits able to move, as in the GRPO LoRA tests (see `common::with_lora`).
    common::scale_embeddings(&config.model, common::LORA_EMBEDDING_SCALE);
    config.lora = Some(model::LoraConfig::default());
    config.model_dtype = prompt_r1_trainer::run::ModelDtype::Bf16;
    config.optimizer.lr = common::LORA_LR;
    config.train.steps = Some(20);
    config.run.validate_every = 0;
    let run_to = |out: PathBuf, resume: bool, steps: usize| run_steps(&config, out, resume, steps);
    let (straight, all) = run_to(dir.path().join("straight"), false, 20);
    let first = all[0].loss;
    let last = all[17..].iter().map(|r| r.loss).sum::<f32>() / 3.0;
    println!("LoRA SFT loss: step 1 {first:.3}, last 3 steps {last:.3}");
    assert!(last < 0.75 * first, "first {first}, last {last}");
    let bf16 = LoadOptions { dtype: config.model_dtype.dtype(), ..Default::default() };
    let initial = load_pretrained::<Flex>(&config.model, &Default::default(), bf16).unwrap();
    let base_moved = common::named_weights(&initial)
        .iter()
        .zip(&common::named_weights(&straight.model().valid()))
        .map(|((_, a), (_, b))| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max)
        })
        .fold(0.0f32, f32::max);
    assert!(base_moved <= 1e-6, "the frozen base moved by {base_moved}");

    let (head_run, _) = run_to(dir.path().join("split"), false, 10);
    let saved = head_run.save_checkpoint().unwrap();
    assert!(
        saved.join("adapter_model.safetensors").is_file()
            && !saved.join("model.safetensors").exists()
    );
    drop(head_run);
    let (resumed, tail) = run_to(dir.path().join("split"), true, 10);
    for (a, b) in all[10..].iter().zip(&tail) {
        assert_same_loss(a, b);
    }
    let largest = adapter_values(&straight)
        .iter()
        .zip(&adapter_values(&resumed))
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0f32, f32::max);
    println!("resumed vs straight: largest adapter difference {largest:e}");
    assert!(largest <= 1e-6, "{largest}");
}

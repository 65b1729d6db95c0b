//! Bad checkpoints give one clear error naming the file and the tensor or key, never a panic.
//! Each case starts from a valid random checkpoint written by `init`, then breaks one thing.

use std::path::Path;

use burn::backend::Flex;
use prompt_r1_model::checkpoint::{write_safetensors, Checkpoint, StorageDtype, TensorToWrite};
use prompt_r1_model::init::write_random_checkpoint;
use prompt_r1_model::{load_pretrained, LoadOptions, Preset};

fn valid_checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(&Preset::Tiny.config(300, vec![1]), dir.path(), 0, StorageDtype::F32).unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match load_pretrained::<Flex>(dir, &Default::default(), LoadOptions::default()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Rewrites the checkpoint with `edit` applied to its tensors.
fn rewrite(dir: &Path, edit: impl FnOnce(&mut Vec<TensorToWrite>)) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut tensors: Vec<TensorToWrite> = ckpt
        .names()
        .into_iter()
        .map(|name| {
            let shape = ckpt.shape(&name).unwrap();
            let values = ckpt.read(&name, &shape).unwrap().values;
            TensorToWrite { name, shape, values }
        })
        .collect();
    drop(ckpt);
    edit(&mut tensors);
    write_safetensors(dir, &tensors, StorageDtype::F32).unwrap();
}

#[test]
fn valid_checkpoint_loads() {
    let dir = valid_checkpoint();
    let model = load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();
    assert_eq!(model.config.vocab_size, 300);
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = valid_checkpoint();
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");
}

#[test]
fn corrupted_header_names_the_file() {
    let dir = valid_checkpoint();
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8] = b'#';
    std::fs::write(&file, &bytes).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors") && err.contains("not a valid safetensors"), "{err}");
}

#[test]
fn config_with_a_missing_key_names_the_key_and_file() {
    let dir = valid_checkpoint();
    let path = dir.path().join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(&path, json.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json") && err.contains("num_hidden_layers"), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = valid_checkpoint();
    rewrite(dir.path(), |t| t.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight"));
    let err = load_error(dir.path());
    assert!(err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing"), "{err}");
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let dir = valid_checkpoint();
    rewrite(dir.path(), |tensors| {
        let t = tensors.iter_mut().find(|t| t.name == "model.layers.0.self_attn.k_proj.weight").unwrap();
        t.shape = vec![t.shape[1], t.shape[0]];
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("model.layers.0.self_attn.k_proj.weight") && err.contains("[64, 32]") && err.contains("[32, 64]"),
        "{err}"
    );
}

/// Weights the config does not use (here: a config of fewer layers than the weights) are
/// refused, not left out unseen; a tied config's `lm_head.weight` and RoPE buffers are no
/// weights and load.
#[test]
fn tensors_the_config_does_not_use_are_refused() {
    let dir = valid_checkpoint();
    let path = dir.path().join("config.json");
    let config = std::fs::read_to_string(&path).unwrap();
    let layers: serde_json::Value = serde_json::from_str(&config).unwrap();
    let layers = layers["num_hidden_layers"].as_u64().unwrap();
    assert!(layers >= 2);
    let fewer = config.replace(&format!("\"num_hidden_layers\": {layers}"), &format!("\"num_hidden_layers\": {}", layers - 1));
    assert_ne!(fewer, config);
    std::fs::write(&path, fewer).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains(&format!("\"model.layers.{}.", layers - 1)) && err.contains("belong together"), "{err}");

    let dir = valid_checkpoint();
    rewrite(dir.path(), |tensors| {
        let embed = tensors.iter().find(|t| t.name == "model.embed_tokens.weight").unwrap();
        let (shape, values) = (embed.shape.clone(), embed.values.clone());
        tensors.push(TensorToWrite { name: "lm_head.weight".into(), shape, values });
        tensors.push(TensorToWrite { name: "model.layers.0.self_attn.rotary_emb.inv_freq".into(), shape: vec![4], values: vec![1.0; 4] });
    });
    load_pretrained::<Flex>(dir.path(), &Default::default(), LoadOptions::default()).unwrap();
}

#[test]
fn untied_config_requires_lm_head() {
    let dir = valid_checkpoint();
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false");
    std::fs::write(&path, text).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("lm_head.weight"), "{err}");
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = valid_checkpoint();
    // Hand-write a one-tensor file with an I32 tensor.
    let header = r#"{"model.norm.weight":{"dtype":"I32","shape":[64],"data_offsets":[0,256]}}"#;
    let mut header = header.to_string();
    while (8 + header.len()) % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(vec![0u8; 256]);
    let single = dir.path().join("model.safetensors");
    std::fs::write(&single, &bytes).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = ckpt.read("model.norm.weight", &[64]).unwrap_err().to_string();
    assert!(err.contains("model.norm.weight") && err.contains("I32"), "{err}");
}

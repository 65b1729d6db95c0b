//! SSim encoder: parity with `../shared/minilm/reference.json` (sentence-transformers),
//! tokenizer parity, batching, truncation and load errors.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use prompt_r1_rewards::metrics::Similarity;
use model::ModelError;
use prompt_r1_rewards::ssim::{cosine, SentenceEncoder, SsimError, MAX_TOKENS};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde::Deserialize;

type B = Flex;

/// Tolerance of the parity with sentence-transformers (per component and per cosine).
const PARITY_TOLERANCE: f32 = 1e-4;

/// `../shared/minilm`, or `None` (with the reason printed) when it is absent outside CI.
fn minilm_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/minilm");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{} is missing (required when CI=true)", dir.display());
    }
    eprintln!("skipping: {} is missing", dir.display());
    None
}

#[derive(Deserialize)]
struct Reference {
    embedding_dim: usize,
    pairs: Vec<Pair>,
}

#[derive(Deserialize)]
struct Pair {
    a: String,
    b: String,
    cosine: f32,
    token_ids_a: Vec<u32>,
    token_ids_b: Vec<u32>,
    embedding_a_first8: Vec<f32>,
    embedding_b_first8: Vec<f32>,
}

fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f32::max)
}

#[test]
fn wordpiece_ids_match_reference() {
    let Some(dir) = minilm_dir() else { return };
    let encoder = SentenceEncoder::<B>::load(&dir, &Default::default()).unwrap();
    let reference = reference(&dir);
    assert!(!reference.pairs.is_empty());
    for pair in &reference.pairs {
        assert_eq!(
            encoder.token_ids(&pair.a).unwrap(),
            pair.token_ids_a,
            "{:?}",
            pair.a
        );
        assert_eq!(
            encoder.token_ids(&pair.b).unwrap(),
            pair.token_ids_b,
            "{:?}",
            pair.b
        );
    }
}

#[test]
fn embeddings_and_cosines_match_reference() {
    let Some(dir) = minilm_dir() else { return };
    let encoder = SentenceEncoder::<B>::load(&dir, &Default::default()).unwrap();
    let reference = reference(&dir);
    assert_eq!(encoder.dim(), reference.embedding_dim);
    let texts: Vec<&str> = reference
        .pairs
        .iter()
        .flat_map(|pair| [pair.a.as_str(), pair.b.as_str()])
        .collect();
    let embeddings = encoder.embed(&texts).unwrap();
    let (mut component_diff, mut cosine_diff) = (0.0f32, 0.0f32);
    for (pair, both) in reference.pairs.iter().zip(embeddings.chunks_exact(2)) {
        let (a, b) = (&both[0], &both[1]);
        for embedding in [a, b] {
            assert_eq!(embedding.len(), reference.embedding_dim);
            let norm = embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
        }
        component_diff = component_diff
            .max(max_abs_diff(&a[..8], &pair.embedding_a_first8))
            .max(max_abs_diff(&b[..8], &pair.embedding_b_first8));
        cosine_diff = cosine_diff.max((cosine(a, b) - pair.cosine).abs());
    }
    eprintln!("max abs diff: components {component_diff:e}, cosines {cosine_diff:e}");
    assert!(
        component_diff < PARITY_TOLERANCE,
        "component diff {component_diff}"
    );
    assert!(cosine_diff < PARITY_TOLERANCE, "cosine diff {cosine_diff}");
}

#[test]
fn similarity_of_texts_matches_reference() {
    let Some(dir) = minilm_dir() else { return };
    let encoder = SentenceEncoder::<B>::load(&dir, &Default::default()).unwrap();
    let pair = &reference(&dir).pairs[0];
    let similarity = encoder.similarity(&pair.a, &pair.b).unwrap();
    assert!(
        (similarity - pair.cosine).abs() < PARITY_TOLERANCE,
        "{similarity}"
    );
}

#[test]
fn max_similarity_is_the_best_reference_cosine() {
    let Some(dir) = minilm_dir() else { return };
    let encoder = SentenceEncoder::<B>::load(&dir, &Default::default()).unwrap();
    let reference = reference(&dir);
    let (related, unrelated) = (&reference.pairs[0], &reference.pairs[1]);
    let references = vec![unrelated.b.clone(), related.b.clone()];
    let best = encoder.max_similarity(&related.a, &references).unwrap();
    assert!((best - related.cosine).abs() < PARITY_TOLERANCE, "{best}");
}

#[test]
fn batching_and_padding_do_not_change_embeddings() {
    let Some(dir) = minilm_dir() else { return };
    let encoder = SentenceEncoder::<B>::load(&dir, &Default::default()).unwrap();
    let texts = [
        "Paris.",
        "The Eiffel Tower was completed in 1889 for the World's Fair in Paris, France.",
        "",
        "Who wrote Hamlet?",
    ];
    let batched = encoder.embed(&texts).unwrap();
    for (text, embedding) in texts.iter().zip(&batched) {
        let alone = &encoder.embed(&[text]).unwrap()[0];
        let diff = max_abs_diff(embedding, alone);
        assert!(diff < 1e-5, "{text:?}: {diff}");
    }
    assert!(encoder.embed(&[]).unwrap().is_empty());
}

#[test]
fn long_texts_are_truncated_to_max_tokens() {
    let Some(dir) = minilm_dir() else { return };
    let encoder = SentenceEncoder::<B>::load(&dir, &Default::default()).unwrap();
    let long = "the quick brown fox jumps over the lazy dog ".repeat(60);
    let ids = encoder.token_ids(&long).unwrap();
    assert_eq!(ids.len(), MAX_TOKENS);
    assert_eq!((ids[0], ids[MAX_TOKENS - 1]), (101, 102));
    let longer = format!("{long} and then it ran away");
    let embeddings = encoder.embed(&[&long, &longer]).unwrap();
    assert!(max_abs_diff(&embeddings[0], &embeddings[1]) < 1e-5);
}

/// A tiny BERT (hidden 4, 2 heads, 1 layer, vocab 6, 16 positions) written to a temp dir,
/// with a hand-written WordPiece tokenizer, so the load paths run without `../shared`.
mod tiny {
    use super::*;

    pub const HIDDEN: usize = 4;
    const INTERMEDIATE: usize = 8;
    pub const MAX_POSITIONS: usize = 16;

    pub const CONFIG: &str = r#"{"hidden_act": "gelu", "hidden_size": 4, "intermediate_size": 8,
        "layer_norm_eps": 1e-12, "max_position_embeddings": 16, "num_attention_heads": 2,
        "num_hidden_layers": 1, "type_vocab_size": 2, "vocab_size": 6}"#;

    pub const TOKENIZER: &str = r###"{"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [], "normalizer": {"type": "BertNormalizer", "clean_text": true,
        "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
          "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
          "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                             "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
          "max_input_chars_per_word": 100,
          "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5}}}"###;

    /// Every tensor of the tiny model: name and shape.
    pub fn tensor_shapes() -> Vec<(String, Vec<usize>)> {
        let mut shapes = vec![
            (
                "embeddings.word_embeddings.weight".to_owned(),
                vec![6, HIDDEN],
            ),
            (
                "embeddings.position_embeddings.weight".to_owned(),
                vec![MAX_POSITIONS, HIDDEN],
            ),
            (
                "embeddings.token_type_embeddings.weight".to_owned(),
                vec![2, HIDDEN],
            ),
            ("embeddings.LayerNorm.weight".to_owned(), vec![HIDDEN]),
            ("embeddings.LayerNorm.bias".to_owned(), vec![HIDDEN]),
        ];
        let layer = "encoder.layer.0";
        for name in ["query", "key", "value"] {
            shapes.push((
                format!("{layer}.attention.self.{name}.weight"),
                vec![HIDDEN, HIDDEN],
            ));
            shapes.push((format!("{layer}.attention.self.{name}.bias"), vec![HIDDEN]));
        }
        for (name, shape) in [
            ("attention.output.dense.weight", vec![HIDDEN, HIDDEN]),
            ("attention.output.dense.bias", vec![HIDDEN]),
            ("attention.output.LayerNorm.weight", vec![HIDDEN]),
            ("attention.output.LayerNorm.bias", vec![HIDDEN]),
            ("intermediate.dense.weight", vec![INTERMEDIATE, HIDDEN]),
            ("intermediate.dense.bias", vec![INTERMEDIATE]),
            ("output.dense.weight", vec![HIDDEN, INTERMEDIATE]),
            ("output.dense.bias", vec![HIDDEN]),
            ("output.LayerNorm.weight", vec![HIDDEN]),
            ("output.LayerNorm.bias", vec![HIDDEN]),
        ] {
            shapes.push((format!("{layer}.{name}"), shape));
        }
        shapes
    }

    /// Deterministic values, multiples of 1/16 in [-0.5, 0.5]: exact in bf16 and f16.
    fn values(count: usize, seed: usize) -> Vec<f32> {
        (0..count)
            .map(|i| ((i * 7 + seed * 3) % 17) as f32 / 16.0 - 0.5)
            .collect()
    }

    /// Little-endian bytes of `values` in `dtype` (F32, F16 or BF16).
    fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
        match dtype {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            other => panic!("no encoder for {other}"),
        }
    }

    /// Writes the model folder; `tensors` are (name, shape) in `dtype`.
    pub fn write(dir: &Path, tensors: &[(String, Vec<usize>)], dtype: Dtype) {
        std::fs::write(dir.join("config.json"), CONFIG).unwrap();
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .enumerate()
            .map(|(seed, (_, shape))| encode(&values(shape.iter().product(), seed), dtype))
            .collect();
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape), bytes)| {
                (
                    name.as_str(),
                    TensorView::new(dtype, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        let file = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
    }
}

fn load(dir: &Path) -> Result<SentenceEncoder<B>, SsimError> {
    SentenceEncoder::<B>::load(dir, &Default::default())
}

#[test]
fn tiny_model_embeds_and_truncates_to_its_positions() {
    let dir = tempfile::tempdir().unwrap();
    tiny::write(dir.path(), &tiny::tensor_shapes(), Dtype::F32);
    let encoder = load(dir.path()).unwrap();
    assert_eq!(encoder.token_ids("Hello WORLD").unwrap(), vec![2, 4, 5, 3]);
    let long = "hello world ".repeat(20);
    assert_eq!(encoder.token_ids(&long).unwrap().len(), tiny::MAX_POSITIONS);
    let embeddings = encoder.embed(&["hello", &long]).unwrap();
    for embedding in &embeddings {
        assert_eq!(embedding.len(), tiny::HIDDEN);
        let norm = embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    }
}

#[test]
fn blank_prediction_or_no_reference_scores_zero() {
    let dir = tempfile::tempdir().unwrap();
    tiny::write(dir.path(), &tiny::tensor_shapes(), Dtype::F32);
    let encoder = load(dir.path()).unwrap();
    let references = vec!["hello".to_owned()];
    assert_eq!(encoder.max_similarity("", &references).unwrap(), 0.0);
    assert_eq!(encoder.max_similarity(" \n\t", &references).unwrap(), 0.0);
    assert_eq!(encoder.max_similarity("hello", &[]).unwrap(), 0.0);
    let same = encoder.max_similarity("hello", &references).unwrap();
    assert!((same - 1.0).abs() < 1e-5, "{same}");
}

#[test]
fn half_precision_checkpoints_give_the_f32_embeddings() {
    let shapes = tiny::tensor_shapes();
    let mut embeddings = Vec::new();
    for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
        let dir = tempfile::tempdir().unwrap();
        tiny::write(dir.path(), &shapes, dtype);
        embeddings.push(
            load(dir.path())
                .unwrap()
                .embed(&["hello world"])
                .unwrap()
                .remove(0),
        );
    }
    assert_eq!(embeddings[0], embeddings[1]);
    assert_eq!(embeddings[0], embeddings[2]);
}

#[test]
fn missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = load(dir.path()).err().unwrap();
    assert!(matches!(err, SsimError::Io { .. }), "{err}");
    assert!(err.to_string().contains("config.json"), "{err}");

    tiny::write(dir.path(), &tiny::tensor_shapes(), Dtype::F32);
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load(dir.path()).err().unwrap();
    assert!(matches!(err, SsimError::Weights(ModelError::NoWeights { .. })), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    tiny::write(dir.path(), &tiny::tensor_shapes(), Dtype::F32);
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = load(dir.path()).err().unwrap();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = "encoder.layer.0.attention.self.key.bias";
    let tensors: Vec<_> = tiny::tensor_shapes()
        .into_iter()
        .filter(|(name, _)| name != missing)
        .collect();
    tiny::write(dir.path(), &tensors, Dtype::F32);
    let err = load(dir.path()).err().unwrap();
    assert!(
        matches!(&err, SsimError::Weights(ModelError::MissingTensor { name, .. }) if name == missing),
        "{err}"
    );
    assert!(err.to_string().contains(missing), "{err}");
}

#[test]
fn wrong_shape_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let misshapen = "encoder.layer.0.intermediate.dense.weight";
    let tensors: Vec<_> = tiny::tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let shape = if name == misshapen {
                vec![tiny::HIDDEN, 8]
            } else {
                shape
            };
            (name, shape)
        })
        .collect();
    tiny::write(dir.path(), &tensors, Dtype::F32);
    let err = load(dir.path()).err().unwrap();
    match &err {
        SsimError::Weights(ModelError::ShapeMismatch {
            name,
            expected,
            found,
            ..
        }) => {
            assert_eq!(name, misshapen);
            assert_eq!(expected, &[8, tiny::HIDDEN]);
            assert_eq!(found, &[tiny::HIDDEN, 8]);
        }
        other => panic!("expected WrongShape, got {other}"),
    }
}

#[test]
fn invalid_config_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    tiny::write(dir.path(), &tiny::tensor_shapes(), Dtype::F32);
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = load(dir.path()).err().unwrap();
    assert!(matches!(err, SsimError::Config { .. }), "{err}");
    assert!(err.to_string().contains("config.json"), "{err}");
}

#[test]
fn encoder_can_be_shared_across_threads() {
    fn shareable<T: Send + Sync>(_: &T) -> bool {
        true
    }
    let dir = tempfile::tempdir().unwrap();
    tiny::write(dir.path(), &tiny::tensor_shapes(), Dtype::F32);
    let encoder = load(dir.path()).unwrap();
    assert!(shareable(&encoder));
    let from_thread = std::thread::scope(|scope| {
        scope
            .spawn(|| encoder.embed(&["hello world"]).unwrap())
            .join()
            .unwrap()
    });
    assert_eq!(from_thread, encoder.embed(&["hello world"]).unwrap());
}

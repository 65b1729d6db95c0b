//! Old/reference log-probs, chunked entropy and the global gradient norm on a tiny random Qwen3,
//! each against an independent computation.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::{backend::Backend, Tensor};
use model::weights::{named_parameters, to_hf_layout, NamedParam, ParamKind};
use model::{
    completion_logprobs, load_pretrained, token_logprobs, LoadOptions, Padding,
    Qwen3ForCausalLM, TokenBatch,
};
use prompt_r1_trainer::grpo::{
    entropy_from_logits, sequence_logprobs, token_logprobs_and_entropy, EntropyGrad,
};
use prompt_r1_trainer::optim::{clip_grad_norm_global, global_grad_norm};

fn load<K: Backend>(dir: &Path) -> Qwen3ForCausalLM<K> {
    load_pretrained::<K>(dir, &Default::default(), LoadOptions::default()).unwrap()
}

fn host<K: Backend, const D: usize>(t: Tensor<K, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn assert_close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{a:?}\nvs\n{b:?}");
    }
}

#[test]
fn sequence_logprobs_are_aligned_with_tokens() {
    let dir = crate::common::tiny_checkpoint(5);
    let model = load::<Flex>(dir.path());
    let pairs = vec![
        (vec![5, 6, 7], vec![8, 9]),
        (vec![40], vec![41, 42, 43, 44]),
        (vec![300, 301], vec![302]),
    ];
    let sequences: Vec<Vec<u32>> = pairs
        .iter()
        .map(|(p, c)| p.iter().chain(c).copied().collect())
        .collect();
    let expected = completion_logprobs(&model, &pairs, 0).unwrap();
    for batch_size in [1, 2, 3] {
        let got = sequence_logprobs(&model, &sequences, 0, batch_size).unwrap();
        for ((row, (p, _)), want) in got.iter().zip(&pairs).zip(&expected) {
            assert_eq!(row.len(), p.len() + want.len());
            assert_eq!(row[0], 0.0);
            assert_close(&row[p.len()..], want, 1e-5);
        }
    }
    assert_eq!(
        sequence_logprobs(&model, &[vec![7]], 0, 4).unwrap(),
        vec![vec![0.0]]
    );
    assert!(sequence_logprobs(&model, &[vec![7, 600]], 0, 4).is_err());
    assert!(sequence_logprobs(&model, &[vec![]], 0, 4).is_err());
    assert!(sequence_logprobs(&model, &sequences, 0, 0).is_err());
}

#[test]
fn chunked_entropy_matches_full_logits() {
    let dir = crate::common::tiny_checkpoint(5);
    let model = load::<Flex>(dir.path());
    let sequences = vec![vec![3, 9, 27, 81, 243, 200], vec![10, 20, 30]];
    let batch =
        TokenBatch::<Flex>::new(&sequences, Padding::Right, 0, &Default::default()).unwrap();
    let (logp, entropy) =
        token_logprobs_and_entropy(&model, &batch, 2, EntropyGrad::Detached).unwrap();
    let full = model.forward(
        batch.input_ids.clone(),
        batch.position_ids.clone(),
        batch.mask(),
        None,
    );
    // Column j scores token 2 + j, drawn from the distribution at position 1 + j.
    let expected_entropy = entropy_from_logits(full.narrow(1, 1, 4));
    assert_close(&host(entropy.clone()), &host(expected_entropy), 1e-5);
    assert_close(
        &host(logp),
        &host(token_logprobs(&model, &batch, 2).unwrap()),
        1e-6,
    );
    // A random tiny model is close to uniform over 512 tokens: H ≈ ln 512 = 6.238.
    assert!(host(entropy).iter().all(|h| (h - 512f32.ln()).abs() < 0.05));
}

#[test]
fn global_norm_matches_an_independent_sum_over_parameters() {
    let _autodiff = prompt_r1_trainer::autodiff_lock::exclusive_autodiff();
    type B = Autodiff<Flex>;
    let dir = crate::common::tiny_checkpoint(5);
    let model = load::<B>(dir.path());
    let batch = TokenBatch::<B>::new(
        &[vec![1, 50, 99, 300, 7], vec![4, 8, 15]],
        Padding::Right,
        0,
        &Default::default(),
    )
    .unwrap();
    let loss = token_logprobs(&model, &batch, 1).unwrap().sum().neg();
    let grads = loss.backward();
    let independent: Vec<Vec<f32>> = named_parameters(&model)
        .into_iter()
        .map(|(_, p)| match p {
            NamedParam::Matrix(p, kind) => to_hf_layout(p.val().grad(&grads).unwrap(), kind).values,
            NamedParam::Vector(p) => {
                to_hf_layout(p.val().grad(&grads).unwrap(), ParamKind::Norm).values
            }
        })
        .collect();
    let expected = independent
        .iter()
        .flatten()
        .map(|&g| f64::from(g).powi(2))
        .sum::<f64>()
        .sqrt() as f32;

    let mut params = GradientsParams::from_grads(grads, &model);
    let norm = global_grad_norm::<B, _>(&params, &model);
    println!(
        "global grad norm {norm} (independent {expected}), {} tensors",
        independent.len()
    );
    assert!(
        (norm - expected).abs() <= 1e-5 * expected,
        "{norm} vs {expected}"
    );

    // Clip to a quarter: every gradient scaled by the same factor.
    let max_norm = expected / 4.0;
    assert_eq!(
        clip_grad_norm_global::<B, _>(&mut params, &model, max_norm),
        norm
    );
    let coef = max_norm / (norm + 1e-6);
    for ((name, p), before) in named_parameters(&model).into_iter().zip(&independent) {
        let after = match p {
            NamedParam::Matrix(p, kind) => {
                to_hf_layout(params.get::<Flex, 2>(p.id).unwrap(), kind).values
            }
            NamedParam::Vector(p) => {
                to_hf_layout(params.get::<Flex, 1>(p.id).unwrap(), ParamKind::Norm).values
            }
        };
        for (a, b) in after.iter().zip(before) {
            assert!(
                (a - b * coef).abs() <= 1e-6 + 1e-5 * (b * coef).abs(),
                "{name}: {a} vs {}",
                b * coef
            );
        }
    }
    assert!((global_grad_norm::<B, _>(&params, &model) - max_norm).abs() <= 1e-4 * max_norm);
}

//! Batched generation on the [`Decoder`]: greedy or sampled decoding (temperature, top-k,
//! top-p), seeded per-row RNGs, stop tokens and a token budget; each row leaves the batch as
//! it ends.
//! Off the CPU kernels' backend (a GPU, or the portable ops) greedy and plain-temperature
//! tokens are chosen on the device from the same per-row draws (`device_sampling`), so a step
//! reads back a token and a log-prob per row rather than a row of logits.

use burn::tensor::{backend::Backend, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

use crate::decode::{Decoder, DecoderLimits, SequenceId};
use crate::device_sampling;
use crate::error::ModelError;
use crate::lora::CausalLm;
use chat::Sampling;
use crate::qwen3::Compute;

/// What [`generate`] does: how tokens are chosen ([`Sampling`]), how many, and where a
/// sequence stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Temperature, top-k, top-p and the base seed (`sampling.seed`; see [`generate`]).
    pub sampling: Sampling,
    /// Maximum number of new tokens per sequence.
    pub max_new_tokens: usize,
    /// A sequence ends after emitting any of these (the stop token is included in the output).
    pub stop_token_ids: Vec<u32>,
}

impl Default for SamplingConfig {
    /// Greedy, 64 new tokens, no stop token.
    fn default() -> Self {
        Self {
            sampling: Sampling::greedy(),
            max_new_tokens: 64,
            stop_token_ids: Vec::new(),
        }
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// It emitted a stop token.
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

/// The new tokens of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedSequence {
    pub tokens: Vec<u32>,
    /// Log-probability of each new token under the distribution it was drawn from before top-k /
    /// top-p truncation: `log_softmax(logits / T)`, or `log_softmax(logits)` when greedy.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
}

/// Generates continuations of every prompt, batched together. Row `i` samples from a
/// generator seeded by `config.sampling.seed` and `i`. `model` is a Qwen3 model, or a base with
/// LoRA adapters ([`crate::LoraModel`]).
pub fn generate<B: Backend>(
    model: &impl CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &SamplingConfig,
) -> Result<Vec<GeneratedSequence>, ModelError> {
    generate_observed(model, prompts, config, |_| {})
}

/// [`generate`], calling `after_step(n)` once the `n`-th step's tokens are on the host (from 1;
/// the first step is the prompts' prefill, each later one a decoding step): a benchmark times
/// the decoding steps from there, apart from the prefill, in one run.
pub fn generate_observed<B: Backend>(
    model: &impl CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &SamplingConfig,
    after_step: impl FnMut(usize),
) -> Result<Vec<GeneratedSequence>, ModelError> {
    let seeds: Vec<u64> = (0..prompts.len()).map(|i| row_seed(config.sampling.seed, i as u64)).collect();
    run(model, prompts, config, &seeds, after_step)
}

/// [`generate`] with an explicit seed per row (`config.sampling.seed` is ignored), so that a sequence's
/// samples do not depend on which other sequences share its batch (to float rounding: see
/// [`crate::decode`]).
pub fn generate_seeded<B: Backend>(
    model: &impl CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &SamplingConfig,
    seeds: &[u64],
) -> Result<Vec<GeneratedSequence>, ModelError> {
    run(model, prompts, config, seeds, |_| {})
}

/// [`generate_seeded`], calling `after_step` as [`generate_observed`] says.
fn run<B: Backend>(
    model: &impl CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &SamplingConfig,
    seeds: &[u64],
    mut after_step: impl FnMut(usize),
) -> Result<Vec<GeneratedSequence>, ModelError> {
    config.sampling.validate().map_err(|e| ModelError::Input(e.to_string()))?;
    if seeds.len() != prompts.len() {
        return Err(ModelError::Input(format!(
            "{} seeds for {} prompts",
            seeds.len(),
            prompts.len()
        )));
    }
    if prompts.is_empty() {
        return Err(ModelError::Input("an empty batch".into()));
    }
    let mut decoder = Decoder::new(DecoderLimits::default());
    for (i, prompt) in prompts.iter().enumerate() {
        decoder.add(model, i as SequenceId, prompt.clone())?;
    }
    let mut outputs: Vec<GeneratedSequence> = (0..prompts.len())
        .map(|_| GeneratedSequence {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
        })
        .collect();
    if config.max_new_tokens == 0 {
        return Ok(outputs);
    }
    let mut rngs: Vec<StdRng> = seeds.iter().map(|&s| StdRng::seed_from_u64(s)).collect();
    let mut steps = 0;
    while let Some(step) = decoder.step(model)? {
        // The rows come back in ascending order (all join at once, in order), so the generators
        // of the running rows come out in theirs.
        let mut rows: Vec<RowSampling<'_>> = rngs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| step.ids.binary_search(&(*i as SequenceId)).is_ok())
            .map(|(_, rng)| RowSampling { sampling: &config.sampling, rng })
            .collect();
        let choices = choose_row_tokens(model.base().compute(), step.logits, &mut rows)?;
        for (&id, (token, logprob)) in step.ids.iter().zip(choices) {
            let out = &mut outputs[id as usize];
            out.tokens.push(token);
            out.logprobs.push(logprob);
            if config.stop_token_ids.contains(&token) {
                out.finish_reason = FinishReason::Stop;
                decoder.finish(id);
            } else if out.tokens.len() == config.max_new_tokens {
                decoder.finish(id);
            } else {
                decoder.accept(id, token)?;
            }
        }
        steps += 1;
        after_step(steps);
    }
    Ok(outputs)
}

/// One row's sampling settings and its generator.
pub struct RowSampling<'a> {
    pub sampling: &'a Sampling,
    pub rng: &'a mut StdRng,
}

/// The next token of every row of `logits` (`[rows, vocab]`, one [`RowSampling`] per row), with
/// its log-probability (see [`GeneratedSequence::logprobs`]), for a model computing as `compute`
/// says. Where its CPU kernels do not run on `B` (a GPU, or the kernels off), when no row needs
/// top-k or top-p, the tokens are chosen on the device from one draw per sampled row
/// ([`device_sampling`], by a GPU backend's kernel where `compute` runs it), so only a token and
/// a log-prob per row come back; otherwise each row is chosen on the host ([`choose_token`]).
/// Both draw the same numbers from each row's generator.
pub fn choose_row_tokens<B: Backend>(compute: &Compute, logits: Tensor<B, 2>, rows: &mut [RowSampling<'_>]) -> Result<Vec<(u32, f32)>, ModelError> {
    let [n, vocab] = logits.dims();
    if n != rows.len() {
        return Err(ModelError::Input(format!("{} samplers for {n} rows of logits", rows.len())));
    }
    if !compute.cpu_kernels.run_on::<B>() && rows.iter().all(|r| device_sampling::supported(r.sampling)) {
        let temperatures: Vec<f32> = rows.iter().map(|r| if r.sampling.is_greedy() { 0.0 } else { r.sampling.temperature }).collect();
        let uniforms: Vec<f64> = if temperatures.iter().all(|&t| t == 0.0) {
            Vec::new()
        } else {
            rows.iter_mut()
                .map(|r| if r.sampling.is_greedy() { 0.0 } else { r.rng.random::<f64>() })
                .collect()
        };
        return device_sampling::choose_tokens(compute.device_kernels, logits, &temperatures, &uniforms);
    }
    let values: Vec<f32> = logits
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| ModelError::Input(format!("reading logits: {e:?}")))?;
    Ok(values
        .par_chunks(vocab)
        .zip(rows.par_iter_mut())
        .map(|(row_logits, row)| choose_token(row_logits, row.sampling, &mut *row.rng))
        .collect())
}

/// Mixes a base seed with a stream number (splitmix64), giving independent, reproducible seeds
/// for batch rows, episodes or turns.
pub fn row_seed(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Picks the next token from one row of logits; returns it with its log-probability.
pub fn choose_token(logits: &[f32], config: &Sampling, rng: &mut impl Rng) -> (u32, f32) {
    if config.is_greedy() {
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |acc, (i, &x)| if x > acc.1 { (i, x) } else { acc });
        return (best as u32, log_softmax_at(logits, best, 1.0));
    }
    let t = config.temperature;
    let mut support: Vec<usize> = (0..logits.len()).collect();
    if let Some(k) = config.top_k.filter(|&k| k > 0 && k < logits.len()) {
        support.select_nth_unstable_by(k - 1, |&a, &b| descending(logits, a, b));
        support.truncate(k);
    }
    let max = support.iter().fold(f32::NEG_INFINITY, |m, &i| m.max(logits[i])) / t;
    let weight = |i: usize| f64::from(logits[i] / t - max).exp();
    if let Some(p) = config.top_p.filter(|&p| p < 1.0) {
        support = nucleus(support, logits, weight, f64::from(p));
    }
    let weights: Vec<f64> = support.iter().map(|&i| weight(i)).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.random::<f64>() * total;
    let mut picked = support.len() - 1;
    for (j, &w) in weights.iter().enumerate() {
        if u < w {
            picked = j;
            break;
        }
        u -= w;
    }
    let pick = support[picked];
    // Over the whole vocabulary the normaliser is already summed: log p = log w - log Σw.
    let logprob = if support.len() == logits.len() {
        (weights[picked].ln() - total.ln()) as f32
    } else {
        log_softmax_at(logits, pick, t)
    };
    (pick as u32, logprob)
}

/// Higher logit first, then lower index: the order of a stable descending sort.
fn descending(logits: &[f32], a: usize, b: usize) -> std::cmp::Ordering {
    logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
}

/// Top-p: the fewest highest-probability tokens of `support` whose probability mass (under the
/// unnormalised `weight`) reaches `p`, in descending order. Only as much of the support is sorted
/// as the nucleus needs (the top 64 first, then four times more each round): sorting all 151,936
/// candidates for every sampled token cost more than a decode step's matmuls at batch 8.
fn nucleus(mut support: Vec<usize>, logits: &[f32], weight: impl Fn(usize) -> f64, p: f64) -> Vec<usize> {
    let total: f64 = support.iter().map(|&i| weight(i)).sum();
    let (mut sorted, mut mass) = (0, 0.0);
    while sorted < support.len() {
        let next = (sorted.max(16) * 4).min(support.len());
        let rest = &mut support[sorted..];
        if next < sorted + rest.len() {
            rest.select_nth_unstable_by(next - sorted - 1, |&a, &b| descending(logits, a, b));
        }
        support[sorted..next].sort_unstable_by(|&a, &b| descending(logits, a, b));
        for j in sorted..next {
            mass += weight(support[j]) / total;
            if mass >= p {
                support.truncate(j + 1);
                return support;
            }
        }
        sorted = next;
    }
    support
}

/// `log_softmax(logits / t)[i]`, computed in f64.
fn log_softmax_at(logits: &[f32], i: usize, t: f32) -> f32 {
    let t = f64::from(t);
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64 / t;
    let lse = logits.iter().map(|&x| (f64::from(x) / t - max).exp()).sum::<f64>().ln() + max;
    (f64::from(logits[i]) / t - lse) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed: 0,
        }
    }

    #[test]
    fn greedy_takes_argmax_with_its_logprob() {
        let mut rng = StdRng::seed_from_u64(row_seed(0, 0));
        let (tok, lp) = choose_token(&[0.0, 2.0, 1.0], &cfg(0.0, None, None), &mut rng);
        assert_eq!(tok, 1);
        let expected = 2.0 - (1.0f64 + 2f64.exp() + 1f64.exp()).ln();
        assert!((f64::from(lp) - expected).abs() < 1e-6);
    }

    /// A temperature so small that dividing by it overflows f32 is greedy, with and without
    /// top-k / top-p (a NaN weight everywhere used to pick the last token).
    #[test]
    fn a_vanishing_temperature_is_greedy() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        for t in [1e-39, 1e-45, 1e-6] {
            for (k, p) in [(None, None), (Some(2), None), (None, Some(0.9))] {
                let mut rng = StdRng::seed_from_u64(row_seed(3, 0));
                let (tok, lp) = choose_token(&logits, &cfg(t, k, p), &mut rng);
                assert_eq!(tok, 1, "temperature {t}, top-k {k:?}, top-p {p:?}");
                assert!(lp.is_finite() && lp < 0.0);
            }
        }
        assert!(!cfg(1e-4, None, None).is_greedy());
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_small_keeps_the_best() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        for seed in 0..20 {
            let mut rng = StdRng::seed_from_u64(row_seed(seed, 0));
            assert_eq!(choose_token(&logits, &cfg(1.0, Some(1), None), &mut rng).0, 1);
            assert_eq!(choose_token(&logits, &cfg(1.0, None, Some(0.01)), &mut rng).0, 1);
        }
    }

    #[test]
    fn top_k_restricts_the_support() {
        let logits = [0.0, 1.0, 1.0, 1.0, 5.0];
        let mut rng = StdRng::seed_from_u64(row_seed(7, 0));
        for _ in 0..200 {
            let (tok, _) = choose_token(&logits, &cfg(5.0, Some(2), None), &mut rng);
            assert!(tok == 4 || (1..=3).contains(&tok), "{tok}");
        }
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75].
        let logits = [0.0, 3f32.ln()];
        let mut rng = StdRng::seed_from_u64(row_seed(1, 0));
        let n = 4000;
        let ones = (0..n)
            .filter(|_| choose_token(&logits, &cfg(1.0, None, None), &mut rng).0 == 1)
            .count();
        let freq = ones as f64 / n as f64;
        assert!((freq - 0.75).abs() < 0.03, "{freq}");
    }

    /// The log-probability returned with a sample is `log_softmax(logits / t)` at the token,
    /// whether it comes from the sampling weights (full support) or a separate pass (truncated).
    #[test]
    fn sampled_logprob_is_the_log_softmax() {
        let logits: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
        let mut rng = StdRng::seed_from_u64(7);
        for config in [cfg(0.7, None, None), cfg(1.3, Some(50), None), cfg(1.0, None, Some(0.9))] {
            for _ in 0..20 {
                let (token, logprob) = choose_token(&logits, &config, &mut rng);
                let want = log_softmax_at(&logits, token as usize, config.temperature);
                assert!((logprob - want).abs() < 1e-5, "{config:?}: {logprob} vs {want}");
            }
        }
    }

    /// `generate_observed` reports each step once its tokens are chosen, 1 to the longest row's
    /// tokens (the first step the prefill), and generates what `generate` does.
    #[test]
    fn observed_generation_reports_each_step() {
        use crate::checkpoint::StorageDtype;
        use crate::{load_pretrained, LoadOptions, Preset, Qwen3ForCausalLM};
        use burn::backend::Flex;
        let config = Preset::Tiny.config(300, vec![299]);
        let dir = tempfile::tempdir().unwrap();
        crate::init::write_random_checkpoint(&config, dir.path(), 5, StorageDtype::F32).unwrap();
        let model: Qwen3ForCausalLM<Flex> = load_pretrained(dir.path(), &Default::default(), LoadOptions::default()).unwrap();
        let prompts = vec![vec![1, 5, 9], vec![3, 3, 8, 1, 0]];
        let config = SamplingConfig { sampling: cfg(1.0, None, None), max_new_tokens: 6, stop_token_ids: Vec::new() };
        let mut steps = Vec::new();
        let observed = generate_observed(&model, &prompts, &config, |step| steps.push(step)).unwrap();
        assert_eq!(steps, (1..=6).collect::<Vec<_>>());
        assert_eq!(observed, generate(&model, &prompts, &config).unwrap());
    }

    /// The lazily sorted nucleus equals the one from sorting everything, across sizes that need
    /// one, several or all sorting rounds, with ties.
    #[test]
    fn nucleus_matches_a_full_sort() {
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
        let weight = |i: usize| f64::from(logits[i] - 9.99).exp();
        let mut full: Vec<usize> = (0..logits.len()).collect();
        full.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let total: f64 = full.iter().map(|&i| weight(i)).sum();
        for p in [0.001, 0.05, 0.3, 0.9, 0.999_999] {
            let mut mass = 0.0;
            let n = full.iter().position(|&i| {
                mass += weight(i) / total;
                mass >= p
            });
            let want = &full[..n.map_or(full.len(), |n| n + 1)];
            assert_eq!(nucleus((0..logits.len()).collect(), &logits, weight, p), want, "p = {p}");
        }
    }
}

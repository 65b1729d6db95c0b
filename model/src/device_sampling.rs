//! Token choice on the model's device, so that a decode step sends the host only each row's
//! chosen token and its log-probability, in one transfer, instead of a `[rows, vocab]` row of
//! logits (39 MB a step at batch 64 for Qwen3's 151,936 tokens).
//!
//! It draws what [`choose_token`](crate::generation::choose_token) draws: greedy takes the argmax;
//! sampling turns one uniform number per row, drawn on the host from that row's generator,
//! into a token by inverse transform over `exp(logits / T - max)` in vocabulary order. So both
//! paths give the same tokens for the same seeds, except where a uniform falls within f32
//! rounding of a boundary between two tokens' cumulative weights (the host sums in f64). The
//! search is two-level, over block sums and then within one block, because burn's portable
//! cumulative sum costs a number of additions quadratic in the row length.
//!
//! Each row has its own temperature (0: greedy). Top-k and top-p are not done here: they need a
//! sort of the row.
//!
//! A GPU backend may lend one kernel for all of it
//! ([`crate::device_kernels::ChooseTokensFn`], taken where the model's
//! [`DeviceKernelChoice`] runs the lent kernels), which sums in an order of its own: the same
//! tokens but within f32 rounding of a boundary, as between this path and the host's.

use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor, TensorData};

use crate::device_kernels::DeviceKernelChoice;
use crate::error::ModelError;
use chat::Sampling;

/// Width of the blocks of the two-level search; Qwen3's vocabulary is 1,187 blocks.
const BLOCK: usize = 128;

/// Token ids travel back as f32 beside their log-probabilities: exact below 2^24.
const MAX_VOCAB: usize = 1 << 24;

/// Whether `config` can be sampled on the device: greedy, or a temperature over the whole
/// vocabulary.
pub fn supported(config: &Sampling) -> bool {
    config.top_k.is_none_or(|k| k == 0) && config.top_p.is_none_or(|p| p >= 1.0)
}

/// Chooses a token for every row of `logits` (`[rows, vocab]`): the argmax where
/// `temperatures[row]` is 0, otherwise the token whose cumulative weight first exceeds
/// `uniforms[row]` (in `[0, 1)`) of the row's total. Returns each token with its
/// log-probability under `log_softmax(logits / temperature)` (temperature 1 when greedy).
/// `uniforms` may be empty when every row is greedy. By the kernel a GPU backend lends where
/// `kernels` runs it, else by burn's ops ([`choose_tokens_with_ops`]).
pub fn choose_tokens<B: Backend>(
    kernels: DeviceKernelChoice,
    logits: Tensor<B, 2>,
    temperatures: &[f32],
    uniforms: &[f64],
) -> Result<Vec<(u32, f32)>, ModelError> {
    let Some(kernel) = kernels.token_choice::<B>() else {
        return choose_tokens_with_ops(logits, temperatures, uniforms);
    };
    check_operands(&logits, temperatures, uniforms)?;
    let [rows, _] = logits.dims();
    let device = logits.device();
    let row = |values: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(values, [rows]), (&device, DType::F32));
    let uniforms = match uniforms.len() == rows {
        true => uniforms.iter().map(|&u| below_one(u)).collect(),
        false => vec![0.0; rows],
    };
    read_packed(kernel(logits, row(temperatures.to_vec()), row(uniforms)))
}

/// A temperature a row, a uniform a row unless every row is greedy, and token ids exact in f32.
fn check_operands<B: Backend>(logits: &Tensor<B, 2>, temperatures: &[f32], uniforms: &[f64]) -> Result<(), ModelError> {
    let [rows, vocab] = logits.dims();
    if temperatures.len() != rows {
        return Err(ModelError::Input(format!("{} temperatures for {rows} rows", temperatures.len())));
    }
    if vocab > MAX_VOCAB {
        return Err(ModelError::Input(format!("a vocabulary of {vocab} tokens is too large to sample on the device")));
    }
    if uniforms.len() != rows && temperatures.iter().any(|&t| t != 0.0) {
        return Err(ModelError::Input(format!("{} uniforms for {rows} rows", uniforms.len())));
    }
    Ok(())
}

/// A uniform draw in `[0, 1)` as f32, still below 1 (a draw within 2⁻²⁵ of 1 would round to 1,
/// a target at the total, which picks the last column: a padding token of Qwen3's vocabulary).
fn below_one(u: f64) -> f32 {
    (u as f32).min(1.0 - f32::EPSILON / 2.0)
}

/// [`choose_tokens`] through burn's ops, whatever kernel the backend lends (for comparisons).
pub fn choose_tokens_with_ops<B: Backend>(
    logits: Tensor<B, 2>,
    temperatures: &[f32],
    uniforms: &[f64],
) -> Result<Vec<(u32, f32)>, ModelError> {
    check_operands(&logits, temperatures, uniforms)?;
    let [rows, _] = logits.dims();
    let device = logits.device();
    let logits = if logits.dtype() == DType::F32 {
        logits
    } else {
        logits.cast(DType::F32)
    };
    let column = |values: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(values, [rows, 1]), (&device, DType::F32));
    let scaled = if temperatures.iter().all(|&t| t == 0.0 || t == 1.0) {
        logits
    } else {
        logits / column(temperatures.iter().map(|&t| if t == 0.0 { 1.0 } else { t }).collect())
    };
    let max = scaled.clone().max_dim(1);
    let weights = (scaled.clone() - max.clone()).exp();
    let total = weights.clone().sum_dim(1);
    let log_normaliser = total.clone().log() + max;
    let greedy = || scaled.clone().argmax(1);
    let tokens = if temperatures.iter().all(|&t| t == 0.0) {
        greedy()
    } else {
        let drawn = inverse_transform(weights, column(uniforms.iter().map(|&u| below_one(u)).collect()) * total);
        if temperatures.iter().all(|&t| t > 0.0) {
            drawn
        } else {
            let is_greedy = temperatures.iter().map(|&t| t == 0.0).collect::<Vec<_>>();
            let is_greedy = Tensor::<B, 2, Bool>::from_data(TensorData::new(is_greedy, [rows, 1]), &device);
            drawn.mask_where(is_greedy, greedy())
        }
    };
    let logprobs = scaled.gather(1, tokens.clone()) - log_normaliser;
    read_packed(Tensor::cat(vec![tokens.float().cast(DType::F32), logprobs], 1))
}

/// Each row's (token, log-probability) from `packed` (`[rows, 2]` f32), in one transfer.
fn read_packed<B: Backend>(packed: Tensor<B, 2>) -> Result<Vec<(u32, f32)>, ModelError> {
    let values: Vec<f32> = packed
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| ModelError::Input(format!("reading the chosen tokens: {e:?}")))?;
    Ok(values.chunks_exact(2).map(|pair| (pair[0] as u32, pair[1])).collect())
}

/// For every row, the first column whose running sum of `weights` (`[rows, vocab]`, not
/// negative) exceeds `target[row]`, or the last column when none does; `[rows, 1]`.
fn inverse_transform<B: Backend>(weights: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 2, Int> {
    let [rows, vocab] = weights.dims();
    let device = weights.device();
    let blocks = vocab.div_ceil(BLOCK);
    let weights = if blocks * BLOCK == vocab {
        weights
    } else {
        let padding = Tensor::<B, 2>::zeros([rows, blocks * BLOCK - vocab], (&device, DType::F32));
        Tensor::cat(vec![weights, padding], 1)
    }
    .reshape([rows, blocks, BLOCK]);
    let block_sums = weights.clone().sum_dim(2).reshape([rows, blocks]);
    let (block, before) = first_exceeding(block_sums, target);
    let within = weights
        .gather(1, block.clone().reshape([rows, 1, 1]).expand([rows, 1, BLOCK]))
        .reshape([rows, BLOCK]);
    let (column, _) = first_exceeding(within, before);
    (block.mul_scalar(BLOCK as i64) + column).clamp_max(vocab as i64 - 1)
}

/// The first column `c` of each row of `values` (`[rows, n]`, not negative) whose running sum
/// exceeds `target[row]` (`n - 1` when none does), and `target[row]` less the running sum
/// before `c`: `([rows, 1], [rows, 1])`.
fn first_exceeding<B: Backend>(values: Tensor<B, 2>, target: Tensor<B, 2>) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let [rows, n] = values.dims();
    let running = values.clone().cumsum(1);
    let reached = running.clone().lower_equal(target.clone().expand([rows, n]));
    let column = reached.int().sum_dim(1).clamp_max(n as i64 - 1);
    let before = (running - values).gather(1, column.clone());
    (column, target - before)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::choose_token;
    use burn::backend::Flex;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn config(temperature: f32) -> Sampling {
        Sampling { temperature, ..Sampling::default() }
    }

    /// Seeded normal logits; row 0 has a dominant token.
    fn logits(rows: usize, vocab: usize, seed: u64) -> (Tensor<Flex, 2>, Vec<f32>) {
        let mut values = crate::init::normal_values(&mut StdRng::seed_from_u64(seed), rows * vocab, 2.0);
        values[3] = 12.0;
        let t = Tensor::from_data(TensorData::new(values.clone(), [rows, vocab]), &Default::default());
        (t, values)
    }

    /// Where the host's cumulative probability (in f64) reaches token `t`'s start.
    fn cdf_before(row: &[f32], temperature: f32, t: usize) -> f64 {
        let z: Vec<f64> = row.iter().map(|&x| f64::from(x) / f64::from(temperature)).collect();
        let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = z.iter().map(|&x| (x - max).exp()).collect();
        w[..t].iter().sum::<f64>() / w.iter().sum::<f64>()
    }

    /// Same draws, same tokens, except where a draw lies within f32 rounding of the boundary
    /// between two tokens (the host sums in f64): then the two picks are neighbours across it.
    #[test]
    fn device_choices_match_the_host_sampler() {
        let mut boundary_cases = 0;
        // Vocabularies below, at and across block boundaries; greedy last.
        for (vocab, temperature) in [(50, 1.0), (128, 0.7), (1000, 1.0), (1000, 1.6), (300, 0.0)] {
            let rows = 64;
            let (logits, values) = logits(rows, vocab, vocab as u64);
            let mut uniforms = Vec::new();
            let host: Vec<(u32, f32)> = (0..rows)
                .map(|r| {
                    let seed = r as u64 * 7919 + vocab as u64;
                    // The host draws one uniform per sampled token: record it for the device.
                    uniforms.push(StdRng::seed_from_u64(seed).random::<f64>());
                    let row = &values[r * vocab..(r + 1) * vocab];
                    choose_token(row, &config(temperature), &mut StdRng::seed_from_u64(seed))
                })
                .collect();
            let device = choose_tokens(DeviceKernelChoice::OFF, logits, &vec![temperature; rows], &uniforms).unwrap();
            for (r, (h, d)) in host.iter().zip(&device).enumerate() {
                let row = &values[r * vocab..(r + 1) * vocab];
                if h.0 != d.0 {
                    let later = h.0.max(d.0) as usize;
                    let gap = (cdf_before(row, temperature, later) - uniforms[r]).abs();
                    assert!(temperature > 0.0 && gap < 1e-5, "vocab {vocab}, T {temperature}, row {r}: {h:?} vs {d:?}");
                    boundary_cases += 1;
                    continue;
                }
                assert!((h.1 - d.1).abs() < 1e-4, "vocab {vocab}, row {r}: log-prob {} vs {}", h.1, d.1);
            }
        }
        assert!(boundary_cases <= 1, "{boundary_cases} of 256 sampled tokens differ");
    }

    #[test]
    fn inverse_transform_finds_the_boundaries() {
        let device = Default::default();
        // Weights 0, 1, 0, 2, 1 (total 4) across more than one block.
        let mut w = vec![0f32; 300];
        w[1] = 1.0;
        w[129] = 2.0;
        w[299] = 1.0;
        let weights = Tensor::<Flex, 2>::from_data(TensorData::new(w, [1, 300]), &device);
        let pick = |target: f32| {
            let t = Tensor::<Flex, 2>::from_data(TensorData::new(vec![target], [1, 1]), &device);
            inverse_transform(weights.clone(), t).into_data().convert::<i64>().to_vec::<i64>().unwrap()[0]
        };
        // A zero-weight column is never picked: the first whose running sum exceeds the target.
        assert_eq!(pick(0.0), 1);
        assert_eq!(pick(0.999), 1);
        assert_eq!(pick(1.0), 129);
        assert_eq!(pick(2.999), 129);
        assert_eq!(pick(3.0), 299);
        // At or past the total (rounding): the last column, as the host does.
        assert_eq!(pick(4.0), 299);
        assert_eq!(pick(9.0), 299);
    }

    #[test]
    fn top_k_and_top_p_stay_on_the_host() {
        assert!(supported(&config(1.0)));
        assert!(supported(&Sampling { top_p: Some(1.0), top_k: Some(0), ..config(1.0) }));
        assert!(!supported(&Sampling { top_p: Some(0.9), ..config(1.0) }));
        assert!(!supported(&Sampling { top_k: Some(5), ..config(1.0) }));
    }

    #[test]
    fn a_wrong_number_of_uniforms_or_temperatures_is_an_error() {
        let err = choose_tokens(DeviceKernelChoice::OFF, logits(3, 40, 0).0, &[1.0; 3], &[0.5]).unwrap_err();
        assert!(err.to_string().contains("1 uniforms for 3 rows"), "{err}");
        let err = choose_tokens(DeviceKernelChoice::OFF, logits(3, 40, 0).0, &[1.0; 2], &[0.5; 3]).unwrap_err();
        assert!(err.to_string().contains("2 temperatures for 3 rows"), "{err}");
    }

    /// Rows with their own temperatures, greedy ones among them, choose what each would alone.
    #[test]
    fn every_row_keeps_its_own_temperature() {
        let (rows, vocab) = (4, 300);
        let (all, values) = logits(rows, vocab, 5);
        let temperatures = [0.0, 0.7, 1.3, 0.0];
        let uniforms = [0.0, 0.25, 0.6, 0.0];
        let mixed = choose_tokens(DeviceKernelChoice::OFF, all, &temperatures, &uniforms).unwrap();
        for (r, &t) in temperatures.iter().enumerate() {
            let row = Tensor::<Flex, 2>::from_data(TensorData::new(values[r * vocab..(r + 1) * vocab].to_vec(), [1, vocab]), &Default::default());
            let alone = choose_tokens(DeviceKernelChoice::OFF, row, &[t], &uniforms[r..=r]).unwrap();
            assert_eq!(mixed[r].0, alone[0].0, "row {r}");
            assert!((mixed[r].1 - alone[0].1).abs() < 1e-5, "row {r}: {} vs {}", mixed[r].1, alone[0].1);
        }
    }
}

//! The PPO clipped surrogate with dual clipping, per token (verl's `compute_policy_loss`,
//! "vanilla" mode).

use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

use super::aggregate::masked;

/// The log-ratio `logπ − logπ_old` is clamped to `±LOG_RATIO_CLAMP` before `exp`.
pub const LOG_RATIO_CLAMP: f32 = 20.0;

/// The clip range `[1 − low, 1 + high]` of the ratio and the dual-clip bound `dual` (> 1) on the
/// loss of tokens with a negative advantage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoClip {
    pub low: f32,
    pub high: f32,
    pub dual: f32,
}

impl Default for PpoClip {
    fn default() -> Self {
        Self {
            low: 0.2,
            high: 0.2,
            dual: 3.0,
        }
    }
}

/// Per-token policy loss and what the clipping did, over the mask-1 tokens.
#[derive(Debug, Clone)]
pub struct PolicyLoss<B: Backend> {
    /// `[b, t]`, not yet masked or aggregated.
    pub per_token: Tensor<B, 2>,
    pub stats: PolicyLossStats,
    /// Number of mask-1 tokens (the weight of `stats` in a [`TokenWeighted`] sum).
    pub n_tokens: usize,
}

/// Token means over the mask-1 tokens of one call, under the metric names verl logs. The same
/// struct goes, unchanged, into [`super::LossStats`], [`super::StepStats`] (summed over
/// micro-batches by [`TokenWeighted`]) and each line of `metrics.jsonl` (flattened into
/// `StepRecord`), so a new per-token statistic is one field here, its entry in
/// `Self::fields_mut` and its computation in [`policy_loss`]; a plot panel is optional.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyLossStats {
    /// Fraction of tokens where the clipped term won (`−A·clip(r) > −A·r`).
    #[serde(rename = "actor/pg_clipfrac", deserialize_with = "crate::run::metrics_log::null_as_nan")]
    pub clip_frac: f32,
    /// Fraction of tokens with `A < 0` whose loss was capped at `−A·c`.
    #[serde(rename = "actor/pg_clipfrac_lower", deserialize_with = "crate::run::metrics_log::null_as_nan")]
    pub dual_clip_frac: f32,
    /// `mean(logπ_old − logπ)` with the clamped log-ratio: a k1 estimate of KL(π_old ‖ π).
    #[serde(rename = "actor/ppo_kl", deserialize_with = "crate::run::metrics_log::null_as_nan")]
    pub approx_kl: f32,
}

impl PolicyLossStats {
    /// How many statistics there are.
    pub const COUNT: usize = 3;

    /// Every statistic, for [`TokenWeighted`] to sum and average them alike.
    fn fields_mut(&mut self) -> [&mut f32; Self::COUNT] {
        [&mut self.clip_frac, &mut self.dual_clip_frac, &mut self.approx_kl]
    }
}

/// Token-weighted sums of [`PolicyLossStats`] over calls (micro-batches), in f64: their
/// [`mean`](Self::mean) is each statistic's mean over all the calls' tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenWeighted {
    sums: [f64; PolicyLossStats::COUNT],
    tokens: usize,
}

impl TokenWeighted {
    /// Adds the means `stats` of `tokens` tokens.
    pub fn add(&mut self, stats: &PolicyLossStats, tokens: usize) {
        let n = tokens as f64;
        self.tokens += tokens;
        let mut stats = *stats;
        for (sum, value) in self.sums.iter_mut().zip(stats.fields_mut()) {
            *sum += n * f64::from(*value);
        }
    }

    /// The means over every token added (0 when there were none).
    pub fn mean(&self) -> PolicyLossStats {
        let mut mean = PolicyLossStats::default();
        if self.tokens > 0 {
            for (value, sum) in mean.fields_mut().into_iter().zip(self.sums) {
                *value = (sum / self.tokens as f64) as f32;
            }
        }
        mean
    }
}

/// `r = exp(clamp(logπ − logπ_old, −20, 20))`.
pub fn ratio<B: Backend>(logp: Tensor<B, 2>, old_logp: Tensor<B, 2>) -> Tensor<B, 2> {
    clamped_log_ratio(logp, old_logp).exp()
}

fn clamped_log_ratio<B: Backend>(logp: Tensor<B, 2>, old_logp: Tensor<B, 2>) -> Tensor<B, 2> {
    (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
}

/// Per-token PPO loss with dual clipping, all inputs `[b, t]` (`advantages` broadcast to every
/// token of its sequence):
///
/// - `l = max(−A·r, −A·clip(r, 1 − low, 1 + high))` (the clipped surrogate, negated);
/// - for `A < 0`: `l = min(l, −A·c)`, so a token whose ratio exploded cannot dominate the loss.
///
/// The statistics are taken over `mask` = 1 tokens; the loss itself is returned unmasked (see
/// [`super::aggregate::agg_loss`]).
pub fn policy_loss<B: Backend>(
    logp: Tensor<B, 2>,
    old_logp: Tensor<B, 2>,
    advantages: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    clip: PpoClip,
) -> PolicyLoss<B> {
    let log_ratio = clamped_log_ratio(logp, old_logp);
    let ratio = log_ratio.clone().exp();
    let neg_adv = advantages.clone().neg();
    let unclipped = neg_adv.clone() * ratio.clone();
    let clipped = neg_adv.clone() * ratio.clamp(1.0 - clip.low, 1.0 + clip.high);
    let surrogate = unclipped.clone().max_pair(clipped.clone());
    let dual_bound = neg_adv.mul_scalar(clip.dual);
    let dual_clipped = surrogate.clone().min_pair(dual_bound.clone());
    let negative = advantages.lower_elem(0.0);
    let per_token = surrogate.clone().mask_where(negative.clone(), dual_clipped);

    let clip_hit = clipped.detach().greater(unclipped.detach()).float();
    let dual_hit = surrogate
        .detach()
        .greater(dual_bound.detach())
        .bool_and(negative)
        .float();
    let stats = masked_means([clip_hit, dual_hit, log_ratio.detach().neg()], mask);
    PolicyLoss {
        per_token,
        stats: PolicyLossStats {
            clip_frac: stats.means[0],
            dual_clip_frac: stats.means[1],
            approx_kl: stats.means[2],
        },
        n_tokens: stats.n_tokens,
    }
}

struct MaskedMeans<const N: usize> {
    means: [f32; N],
    n_tokens: usize,
}

/// Means of each `[b, t]` tensor over the mask-1 tokens, read back in one transfer (0 when the
/// mask is empty).
fn masked_means<B: Backend, const N: usize>(
    values: [Tensor<B, 2>; N],
    mask: Tensor<B, 2>,
) -> MaskedMeans<N> {
    let mask = mask.detach();
    let mut sums: Vec<Tensor<B, 1>> = values
        .into_iter()
        .map(|v| masked(v, mask.clone()).sum())
        .collect();
    sums.push(mask.sum());
    let host: Vec<f32> = Tensor::cat(sums, 0)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap_or_else(|_| vec![0.0; N + 1]);
    let n_tokens = host[N].round() as usize;
    let mut means = [0.0; N];
    if n_tokens > 0 {
        for (mean, sum) in means.iter_mut().zip(&host) {
            *mean = sum / n_tokens as f32;
        }
    }
    MaskedMeans { means, n_tokens }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpo::aggregate::{agg_loss, AggMode};
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    fn row(values: &[f32]) -> Tensor<B, 2> {
        Tensor::from_data(
            TensorData::new(values.to_vec(), [1, values.len()]),
            &Default::default(),
        )
    }

    fn values<K: Backend>(t: Tensor<K, 2>) -> Vec<f32> {
        t.into_data().convert::<f32>().into_vec().unwrap()
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "got {got:?}, want {want:?}");
        }
    }

    /// Six tokens, the last one masked out (with an absurd log-ratio of 30):
    ///
    /// | t | A  | r   | −A·r | −A·clip(r) | max  | −A·3 | loss | clipped | dual |
    /// |---|----|-----|------|------------|------|------|------|---------|------|
    /// | 0 | 1  | 1.5 | −1.5 | −1.2       | −1.2 |      | −1.2 | yes     |      |
    /// | 1 | 1  | 0.5 | −0.5 | −0.8       | −0.5 |      | −0.5 |         |      |
    /// | 2 | −2 | 0.5 | 1.0  | 1.6        | 1.6  | 6    | 1.6  | yes     |      |
    /// | 3 | −2 | 5   | 10   | 2.4        | 10   | 6    | 6    |         | yes  |
    /// | 4 | −2 | 1.1 | 2.2  | 2.2        | 2.2  | 6    | 2.2  |         |      |
    #[test]
    fn clip_and_dual_clip_values_and_gradients() {
        let _autodiff = crate::autodiff_lock::exclusive_autodiff();
        let r: [f32; 6] = [1.5, 0.5, 0.5, 5.0, 1.1, 30f32.exp()];
        let old = [-1.0, -2.0, -0.5, -3.0, -1.0, -40.0];
        let logp_values: Vec<f32> = r.iter().zip(old).map(|(r, o)| o + r.ln()).collect();
        let logp = row(&logp_values).require_grad();
        let adv = row(&[1.0, 1.0, -2.0, -2.0, -2.0, 1.0]);
        let mask = row(&[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]);
        let out = policy_loss(
            logp.clone(),
            row(&old),
            adv,
            mask.clone(),
            PpoClip::default(),
        );

        let loss = values(out.per_token.clone());
        assert_close(&loss[..5], &[-1.2, -0.5, 1.6, 6.0, 2.2]);
        // clip: tokens 0 and 2 of 5; dual: token 3 of 5;
        // approx_kl = −(ln 1.5 + ln 0.5 + ln 0.5 + ln 5 + ln 1.1)/5 = −0.723919/5 = −0.144784.
        assert_eq!(out.n_tokens, 5);
        assert!((out.stats.clip_frac - 0.4).abs() < 1e-6, "{:?}", out.stats);
        assert!(
            (out.stats.dual_clip_frac - 0.2).abs() < 1e-6,
            "{:?}",
            out.stats
        );
        assert!(
            (out.stats.approx_kl + 0.144784).abs() < 1e-5,
            "{:?}",
            out.stats
        );

        // Token-mean = (−1.2 − 0.5 + 1.6 + 6 + 2.2)/5 = 1.62. Only unclipped tokens pass a
        // gradient: d(−A·r)/dlogπ = −A·r, /5 → token 1: −0.5/5 = −0.1, token 4: 2.2/5 = 0.44.
        let total = agg_loss(out.per_token, mask, AggMode::TokenMean);
        assert!((total.clone().into_scalar() - 1.62).abs() < 1e-5);
        let grads = total.backward();
        let g = values(logp.grad(&grads).unwrap());
        assert_close(&g, &[0.0, -0.1, 0.0, 0.0, 0.44, 0.0]);
    }

    #[test]
    fn log_ratio_is_clamped_at_20() {
        // A = −1, logπ − logπ_old = 30 → clamped to 20: r = e^20, −A·r = 4.85e8, −A·clip = 1.2,
        // dual bound −A·3 = 3 → loss 3; approx_kl = −20 (not −30).
        let out = policy_loss(
            row(&[-1.0]),
            row(&[-31.0]),
            row(&[-1.0]),
            row(&[1.0]),
            PpoClip::default(),
        );
        assert_close(&values(out.per_token), &[3.0]);
        assert_eq!(out.stats.approx_kl, -20.0);
        assert_eq!(out.stats.dual_clip_frac, 1.0);
        // e^20 = 485165195.4, not e^30.
        let r = values(ratio(row(&[0.0]), row(&[-30.0])))[0];
        assert!((r / 485_165_195.4 - 1.0).abs() < 1e-5, "{r}");
    }

    /// Each statistic is weighted by its call's tokens; nothing added reads as zeros.
    #[test]
    fn token_weighted_means() {
        let mut sum = TokenWeighted::default();
        assert_eq!(sum.mean(), PolicyLossStats::default());
        let stats = |v: f32| PolicyLossStats { clip_frac: v, dual_clip_frac: 2.0 * v, approx_kl: -v };
        sum.add(&stats(0.5), 1);
        sum.add(&stats(0.25), 3);
        sum.add(&stats(100.0), 0);
        // (0.5·1 + 0.25·3)/4 = 0.3125.
        assert_eq!(sum.mean(), stats(0.3125));
    }

    #[test]
    fn asymmetric_clip_range() {
        // low 0.1, high 0.3, A = 1: r = 1.25 is inside [0.9, 1.3] → −1.25, not clipped;
        // r = 1.5 → −1.3, clipped.
        let clip = PpoClip {
            low: 0.1,
            high: 0.3,
            dual: 3.0,
        };
        let out = policy_loss(
            row(&[1.25f32.ln(), 1.5f32.ln()]),
            row(&[0.0, 0.0]),
            row(&[1.0, 1.0]),
            row(&[1.0, 1.0]),
            clip,
        );
        assert_close(&values(out.per_token), &[-1.25, -1.3]);
        assert_eq!(out.stats.clip_frac, 0.5);
    }
}
